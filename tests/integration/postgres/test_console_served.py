"""The console served by uvicorn on a loopback port, as ``rselection web`` serves it:
what only a real HTTP server shows (a body refused before it is read, cookies shared by
the ports of a host, a database that stops answering while the pages keep answering).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest

pytest.importorskip("starlette")

from rselection.postgres import migrate
from rselection.web import create_app
from tests.support.console import serve

TOKEN = "served-op-token"
ANSWER_WITHIN = 10.0  # an answer takes milliseconds; the bound is for a busy machine


@pytest.fixture
def console(pg_dsn: str) -> Iterator[str]:
    """The console with the operator token on a loopback port; its base URL."""
    with serve(create_app(conninfo=pg_dsn, token=TOKEN)) as url:
        yield url


def status_line(base: str, head: bytes, body: Iterator[bytes]) -> bytes:
    """Send a request's ``head``, then ``body`` piece by piece while the server reads;
    return the status line of its answer, which must come within ANSWER_WITHIN."""
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=ANSWER_WITHIN) as sock:
        sock.sendall(head)
        try:
            for piece in body:
                sock.sendall(piece)
        except OSError:
            pass  # the server answered and closed the connection while we sent
        answer = sock.recv(4096)
    return answer.split(b"\r\n", 1)[0]


def head_of(base: str, path: str, **headers: str) -> bytes:
    host = urlsplit(base).netloc
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Origin: {base}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunks(count: int, size: int = 16 * 1024) -> Iterator[bytes]:
    """``count`` chunks of a chunked body, and never its last (empty) chunk."""
    for _ in range(count):
        yield f"{size:x}\r\n".encode() + b"a" * size + b"\r\n"


@pytest.mark.parametrize(
    "path,auth",
    [("/login", {}), ("/api/leases/x/step-down", {"authorization": f"Bearer {TOKEN}"})],
)
def test_a_body_over_the_limit_is_refused_before_it_is_read(
    console: str, path: str, auth: dict[str, str]
) -> None:
    form = {"content_type": "application/x-www-form-urlencoded", **auth}
    # announced: refused on its Content-Length, with 300 MB still to come
    declared = head_of(console, path, content_length=str(300 * 1024 * 1024), **form)
    assert b" 413 " in status_line(console, declared, iter([b"a" * 128 * 1024]))
    # chunked: refused once 64 KiB are read, its end never sent
    streamed = head_of(console, path, transfer_encoding="chunked", **form)
    assert b" 413 " in status_line(console, streamed, chunks(8))


def test_two_consoles_on_two_ports_keep_their_own_logins(pg_dsn: str) -> None:
    """A browser sends a host's cookies to each of its ports: each console's login
    cookie is its own, and logging in on one leaves the other's alone."""
    first = create_app(conninfo=pg_dsn, token="first-token")
    second = create_app(conninfo=pg_dsn, token="second-token")
    with serve(first) as one, serve(second) as two, httpx.Client(timeout=10) as browser:
        for base, token in ((one, "first-token"), (two, "second-token")):
            answer = browser.post(f"{base}/login", data={"token": token}, headers={"origin": base})
            assert answer.status_code == 303, answer.text
        for base in (one, two):
            assert "log out" in browser.get(f"{base}/login").text, base
        names = {cookie.name for cookie in browser.cookies.jar}
        assert len({n for n in names if n.startswith("rselection_console")}) == 2


def test_a_database_that_stops_answering_leaves_the_console_answering(pg_dsn: str) -> None:
    """Reads the database does not answer get a quick 503; they keep the console's few
    slots for admin calls until they return, so the next read is refused at once; the
    pages that need no database (the login form, the static files) keep answering."""
    migrate(pg_dsn)
    app = create_app(conninfo=pg_dsn, token=TOKEN)
    calls = app.state.calls
    calls.read_timeout = 1.0  # 10 s by default: less waiting for the test
    with serve(app) as base, psycopg.connect(pg_dsn) as locker:
        # the lease table locked in an open transaction: every read of it waits
        locker.execute("LOCK TABLE rselection_leases IN ACCESS EXCLUSIVE MODE")
        began = time.monotonic()
        with ThreadPoolExecutor(calls.slots) as pool:
            slow = list(
                pool.map(lambda _: httpx.get(f"{base}/api/status", timeout=60), range(calls.slots))
            )
        took = time.monotonic() - began
        assert [answer.status_code for answer in slow] == [503] * calls.slots
        assert all("not answering" in answer.json()["error"] for answer in slow)
        assert took < 5 * calls.read_timeout, took
        refused = httpx.get(f"{base}/", timeout=60)
        assert refused.status_code == 503 and "still waiting" in refused.text
        for path in ("/login", "/static/console.css", "/static/console.js"):
            began = time.monotonic()
            assert httpx.get(f"{base}{path}", timeout=60).status_code == 200, path
            assert time.monotonic() - began < ANSWER_WITHIN, path
