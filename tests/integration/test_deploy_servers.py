"""The examples served as in production: gunicorn and uvicorn, three workers, real Postgres.

Each test starts the real server command on ``examples/fastapi_app.py`` (gunicorn with
uvicorn's worker and ``--preload``, or ``uvicorn --workers 3``) or on the Django
example's ASGI application, with ``examples/logging.json`` as its logging
configuration, and checks from the outside, as an operator would:

- ``rselection status --json`` (the command, as a subprocess) shows one node per worker,
  three distinct node ids, exactly one of them leading; the server's output shows the
  election at INFO from the ``rselection.leader`` logger;
- ``kill -9`` of the leading worker: another worker leads within ``FAILOVER_LIMIT``
  (measured from the kill to its election line), and the worker the master spawns in
  its place joins as a follower;
- SIGTERM to the master: every worker has exited within ``stop_grace + 2 s``, the
  master exits 0, the lease is released (not merely left to expire), and none of the
  workers' Postgres sessions is left on the server.

Each test uses a lease table of its own (a schema per test, through ``RSELECTION_DSN``)
and a lease name of its own (``RSELECTION_NAME``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]
import pytest

from rselection.timing import Timings
from tests.support.pg import find_free_port
from tests.support.servers import (
    Server,
    backends_left,
    backends_of,
    leading_nodes,
    status,
    worker_nodes,
)
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LOG_CONFIG = EXAMPLES / "logging.json"
WORKERS = 3
STOP_GRACE = Timings().stop_grace(None)  # the examples use the default timings
STOP_LIMIT = STOP_GRACE + 2.0  # SIGTERM to the master until every worker has exited
FAILOVER_LIMIT = 3.0  # kill -9 to the next election; milliseconds, the rest is margin
START_TIMEOUT = 45.0  # three workers importing the app on a busy 2-core machine


def elected(name: str) -> re.Pattern[str]:
    """An election line of ``examples/logging.json``'s format: pid, node id and term."""
    return re.compile(
        rf"\[(?P<pid>\d+)\] INFO rselection\.leader: node (?P<node>\S+) leads "
        rf"'{re.escape(name)}' with term (?P<term>\d+)$"
    )


def stopped(name: str) -> re.Pattern[str]:
    """A leader's line when it stops leading because it was asked to stop."""
    return re.compile(
        rf"\[(?P<pid>\d+)\] INFO rselection\.leader: node (?P<node>\S+) stops leading "
        rf"'{re.escape(name)}' \(term (?P<term>\d+)\): stopped$"
    )


PROBLEMS = re.compile(r"Traceback|\b(ERROR|CRITICAL) rselection")


def server_env(dsn: str, name: str) -> dict[str, str]:
    """The server's environment: the example's lease on ``dsn`` under ``name``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSELECTION_")}
    env.update(PYTHONUNBUFFERED="1", RSELECTION_DSN=dsn, RSELECTION_NAME=name)
    return env


def gunicorn_options() -> list[str]:
    """Options every gunicorn here gets: no control socket when this gunicorn has one
    (its default path is shared by every gunicorn of the user)."""
    from gunicorn.config import Config

    return ["--no-control-socket"] if "control_socket_disable" in Config().settings else []


def gunicorn(app: str, port: int, *more: str) -> list[str]:
    """``gunicorn -k uvicorn.workers.UvicornWorker -w 3 ... APP``."""
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "-k",
        "uvicorn.workers.UvicornWorker",
        "-w",
        str(WORKERS),
        "-b",
        f"127.0.0.1:{port}",
        "--log-config-json",
        str(LOG_CONFIG),
        *gunicorn_options(),
        *more,
        app,
    ]


def uvicorn(app: str, port: int, *more: str) -> list[str]:
    """``uvicorn APP --workers 3 ...``."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        app,
        "--workers",
        str(WORKERS),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-config",
        str(LOG_CONFIG),
        *more,
    ]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def wait_for_status(
    server: Server,
    dsn: str,
    name: str,
    check: Callable[[dict[str, Any], set[int]], bool],
    timeout: float,
    what: str,
) -> tuple[dict[str, Any], set[int]]:
    """Run ``rselection status`` until ``check(document, worker pids)``; both, then.

    Fails after ``timeout`` seconds with the last document and the server's output.
    """
    deadline = time.monotonic() + timeout
    while True:
        workers = server.workers()
        document = status(dsn, name) or {"leases": [], "nodes": []}
        if check(document, workers):
            return document, workers
        if server.popen.poll() is not None or time.monotonic() > deadline:
            pytest.fail(
                f"no {what} within {timeout}s (server exit code {server.popen.poll()}); "
                f"workers {sorted(workers)}, last status:\n{json.dumps(document, indent=1)}\n"
                f"server output:\n{server.output()}"
            )
        time.sleep(0.2)


def one_leader_among_workers(document: dict[str, Any], workers: set[int]) -> bool:
    """Three workers, one node each (distinct ids), exactly one node of the lease leads."""
    nodes = worker_nodes(document, workers)
    return (
        len(workers) == WORKERS
        and len(nodes) == WORKERS
        and len({n["pid"] for n in nodes}) == WORKERS
        and len({n["node_id"] for n in nodes}) == WORKERS
        and len(leading_nodes(document)) == 1
        and leading_nodes(document)[0] in nodes
    )


def status_of(dsn: str, name: str) -> dict[str, Any]:
    """``rselection status --json NAME`` once the lease table exists."""
    document = status(dsn, name)
    assert document is not None, "no lease table"
    return document


def check_started(server: Server, dsn: str, name: str) -> tuple[dict[str, Any], set[int]]:
    """Three workers with distinct node ids, one leading, its election logged at INFO.

    Returns the leading node (from the status document) and the worker pids.
    """
    document, workers = wait_for_status(
        server, dsn, name, one_leader_among_workers, START_TIMEOUT, "one leader among 3 workers"
    )
    [leader] = leading_nodes(document)
    [lease] = document["leases"]
    assert lease["live"] and lease["holder"] == leader["node_id"], lease
    # The election is in the server's output, from the rselection logger at INFO.
    _, line = server.wait_line(elected(name), 10)
    assert (line["node"], int(line["pid"]), int(line["term"])) == (
        leader["node_id"],
        leader["pid"],
        lease["term"],
    ), server.output()
    return leader, workers


def check_failover(
    server: Server, dsn: str, name: str, leader: dict[str, Any], workers: set[int]
) -> tuple[float, dict[str, Any], set[int]]:
    """``kill -9`` the leading worker: another leads within the limit, a new worker
    follows. Returns the failover time, the new leader and the new worker pids."""
    term = status_of(dsn, name)["leases"][0]["term"]
    killed_at = time.monotonic()
    os.kill(leader["pid"], signal.SIGKILL)
    at, line = server.wait_line(elected(name), 30, since=killed_at)
    took = at - killed_at
    assert int(line["term"]) == term + 1, line.group(0)
    assert int(line["pid"]) in workers - {leader["pid"]}, line.group(0)
    assert took < FAILOVER_LIMIT, f"the next worker led {took:.3f}s after kill -9"

    def replaced(document: dict[str, Any], now: set[int]) -> bool:
        return (
            one_leader_among_workers(document, now)
            and leader["pid"] not in now
            and len(now - workers) == 1
        )

    document, now = wait_for_status(server, dsn, name, replaced, 30, "replacement worker")
    [successor] = leading_nodes(document)
    [lease] = document["leases"]
    # The worker that led after the kill still leads, in the same term: the replacement
    # joined as a follower.
    assert (successor["node_id"], successor["pid"]) == (line["node"], int(line["pid"]))
    assert lease["live"] and lease["term"] == term + 1, lease
    [newcomer] = worker_nodes(document, now - workers)
    assert not newcomer["is_leader"] and newcomer["node_id"] != leader["node_id"], newcomer
    return took, successor, now


def check_clean_stop(server: Server, dsn: str, name: str, workers: set[int]) -> tuple[float, float]:
    """SIGTERM to the master: every worker exits within ``STOP_LIMIT``, the master exits
    0, the lease is released and no session of the workers is left on the server.

    Returns the seconds until the last worker exited and until the master exited.
    """
    before = status_of(dsn, name)["leases"][0]
    assert before["live"], before
    # Every worker holds at least one session (its keeper's): what must be gone after.
    sessions = backends_of(dsn, {*workers, server.pid})
    assert len(sessions) >= len(workers), sessions
    sent = time.monotonic()
    os.kill(server.pid, signal.SIGTERM)
    workers_took = wait_until(
        lambda: not any(alive(pid) for pid in workers),
        STOP_LIMIT,
        f"the workers {sorted(workers)} to exit after SIGTERM to the master",
        interval=0.01,
    )
    assert server.popen.wait(STOP_LIMIT) == 0, server.output()
    master_took = time.monotonic() - sent
    assert master_took < STOP_LIMIT, f"the master exited {master_took:.2f}s after SIGTERM"
    after = status_of(dsn, name)
    [lease] = after["leases"]
    # Released, not expired: had nobody released it, it would still be live now.
    assert time.monotonic() - sent < before["expires_in"], "too slow to tell"
    assert not lease["live"] and lease["holder"] is None, lease
    assert not [n for n in after["nodes"] if n["pid"] in workers], after["nodes"]
    wait_until(
        lambda: not backends_left(dsn, sessions),
        2,
        f"the workers' Postgres sessions {sorted(sessions)} to end",
        interval=0.05,
    )
    text = server.output()
    assert server.find(stopped(name), since=sent), text
    assert not PROBLEMS.search(text), text
    return workers_took, master_took


# -- FastAPI under gunicorn --preload and uvicorn --workers ----------------------------------


SERVERS = {
    "gunicorn-preload": lambda port: gunicorn("examples.fastapi_app:app", port, "--preload"),
    "uvicorn-workers": lambda port: uvicorn("examples.fastapi_app:app", port),
}


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_fastapi_app_under_a_server_with_three_workers(kind: str, pg_dsn: str) -> None:
    name = f"deploy-{kind}-{uuid.uuid4().hex[:8]}"
    port = find_free_port()
    with Server(SERVERS[kind](port), server_env(pg_dsn, name), cwd=ROOT) as server:
        leader, workers = check_started(server, pg_dsn, name)
        took, _, workers = check_failover(server, pg_dsn, name, leader, workers)
        workers_took, master_took = check_clean_stop(server, pg_dsn, name, workers)
    print(
        f"\n{kind}: kill -9 of the leading worker to the next election {took * 1000:.0f} ms; "
        f"SIGTERM to the master: workers exited in {workers_took:.2f}s, "
        f"master in {master_took:.2f}s (limit {STOP_LIMIT:g}s)"
    )


# -- Django's ASGI application under gunicorn ------------------------------------------------


def test_django_asgi_app_under_gunicorn_with_uvicorn_workers(pg_dsn: str) -> None:
    import httpx

    name = f"deploy-django-{uuid.uuid4().hex[:8]}"
    port = find_free_port()
    argv = gunicorn("project.asgi:application", port, "--pythonpath", str(EXAMPLES / "django_app"))
    with Server(argv, server_env(pg_dsn, name), cwd=ROOT) as server:
        leader, workers = check_started(server, pg_dsn, name)
        nodes = {n["node_id"] for n in worker_nodes(status_of(pg_dsn, name), workers)}
        seen = set()
        for _ in range(6):  # which worker answers is the kernel's choice
            answer = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
            assert answer.status_code == 200, answer.text
            view = answer.json()
            assert view["node_id"] in nodes, (view, nodes)
            assert view["holder"]["node_id"] == leader["node_id"], view
            assert view["is_leader"] == (view["node_id"] == leader["node_id"]), view
            seen.add(view["node_id"])
        workers_took, master_took = check_clean_stop(server, pg_dsn, name, workers)
    print(
        f"\ndjango under gunicorn: {len(seen)} workers answered; SIGTERM to the master: "
        f"workers exited in {workers_took:.2f}s, master in {master_took:.2f}s"
    )
