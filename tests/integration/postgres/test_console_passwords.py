"""The console never shows a password of its connection string: not on its pages, not in
its JSON, not when the server cannot be reached."""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient

import rselection as rs
from rselection.web import create_app
from tests.support.backends import closed_port

SECRET = "hunter2-Zq9"


def with_password(dsn: str, port: int | None = None) -> str:
    """``dsn`` with user ``postgres`` and password SECRET (the test server trusts it)."""
    parts = urlsplit(dsn)
    host = f"{parts.hostname or '127.0.0.1'}:{port or parts.port or 5432}"
    return urlunsplit(parts._replace(netloc=f"postgres:{SECRET}@{host}"))


def test_no_page_or_answer_shows_the_password(pg_dsn: str) -> None:
    dsn = with_password(pg_dsn)
    tasks = rs.TaskHandler()
    leader = rs.PostgresLeader(dsn, tasks, name="pw", node_id="n1", heartbeat_interval=0.2)
    leader.start()
    try:
        assert leader.wait_until_leader(10)
        with TestClient(create_app(conninfo=dsn, token="t")) as client:
            answers = [
                client.get("/"),
                client.get("/api/status"),
                client.get("/leases/pw"),
                client.get("/api/leases/pw"),
                client.get("/leases/nope"),
                client.post("/api/leases/nope/step-down", headers={"authorization": "Bearer t"}),
            ]
            assert answers[0].status_code == 200 and "n1" in answers[0].text
            for answer in answers:
                assert SECRET not in answer.text and quote(SECRET) not in answer.text
    finally:
        leader.stop(timeout=10)


def test_an_unreachable_server_is_a_503_that_hides_the_password(pg_dsn: str) -> None:
    dsn = with_password(pg_dsn, port=closed_port())
    with TestClient(create_app(conninfo=dsn)) as client:
        for path in ("/", "/api/status", "/leases/x"):
            answer = client.get(path)
            assert answer.status_code == 503, (path, answer.text)
            assert SECRET not in answer.text
