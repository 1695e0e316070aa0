"""The integration examples against real Postgres: worker, FastAPI, Django; metrics.

Each example runs as documented: the worker and the Django command as subprocesses
(SIGTERM hands leadership over), the FastAPI app through its lifespan in TestClient.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

import rselection as rs
import rselection.metrics as metrics
from tests.support.waiting import wait_until

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}
HANDOVER_LIMIT = 3.0  # seconds; a graceful handover takes milliseconds, the rest is margin


def example_env(dsn: str | None) -> dict[str, str]:
    """The environment for an example process: unbuffered, with or without a DSN."""
    env = {k: v for k, v in os.environ.items() if k != "RSELECTION_DSN"}
    env["PYTHONUNBUFFERED"] = "1"
    if dsn is not None:
        env["RSELECTION_DSN"] = dsn
    return env


class Proc:
    """A subprocess whose output lines are read into a queue, tagged with its index.

    Its log (stderr) is read apart, into :attr:`log`: in one pipe, a log line written by
    another thread could land in the middle of a printed line (``print`` writes the text
    and its newline apart).
    """

    def __init__(self, args: list[str], env: dict[str, str], index: int, out: queue.Queue[Any]):
        self.index = index
        self.popen = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[str] = []
        self.log: list[str] = []
        threading.Thread(target=self._pump, args=(out,), daemon=True).start()
        threading.Thread(target=self._pump_log, daemon=True).start()

    def _pump(self, out: queue.Queue[Any]) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip())
            out.put((self.index, line.rstrip(), time.monotonic()))

    def _pump_log(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.log.append(line.rstrip())

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., tuple[list[Proc], queue.Queue[Any]]]]:
    """Start example processes; every one is killed at the end if still running."""
    made: list[Proc] = []

    def start(args_per_proc: list[list[str]], env: dict[str, str]) -> tuple[list[Proc], Any]:
        out: queue.Queue[Any] = queue.Queue()
        procs = [Proc(args, env, i, out) for i, args in enumerate(args_per_proc)]
        made.extend(procs)
        return procs, out

    yield start
    for proc in made:
        proc.close()


def expect(out: queue.Queue[Any], needle: str, timeout: float, index: int | None = None) -> Any:
    """The first (index, line, time) containing ``needle`` (from process ``index``)."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            item = out.get(timeout=left)
        except queue.Empty:
            break
        seen.append(f"[{item[0]}] {item[1]}")
        if needle in item[1] and (index is None or item[0] == index):
            return item
    raise AssertionError(f"{needle!r} not printed within {timeout}s; got {seen[-30:]}")


def check_handover(procs: list[Proc], out: queue.Queue[Any], tick: str) -> None:
    """One of two processes leads; SIGTERM on it; the other leads within the limit."""
    first = expect(out, "elected:", 30)[0]
    expect(out, tick, 10, index=first)
    other = 1 - first
    sent = time.monotonic()
    procs[first].popen.send_signal(signal.SIGTERM)
    _, _, took_over = expect(out, "elected:", 15, index=other)
    assert took_over - sent < HANDOVER_LIMIT, f"handover took {took_over - sent:.2f}s"
    assert procs[first].popen.wait(15) == 0, procs[first].log
    assert any("(stopped)" in line for line in procs[first].lines), procs[first].lines
    assert procs[first].lines[-1] == "stopped cleanly", procs[first].lines
    expect(out, tick, 10, index=other)  # the new leader runs the tasks
    procs[other].popen.send_signal(signal.SIGTERM)
    assert procs[other].popen.wait(15) == 0


# --------------------------------------------------------------------------- worker


def test_worker_hands_over_on_sigterm(pg_dsn: str, spawn: Callable[..., Any]) -> None:
    worker = str(EXAMPLES / "worker.py")
    procs, out = spawn(
        [[sys.executable, worker, "--node-id", f"w{i}"] for i in range(2)], example_env(pg_dsn)
    )
    check_handover(procs, out, "] tick tick@")
    # Each leader wrote its own term.
    leads = [line for p in procs for line in p.lines if line.startswith("elected:")]
    assert sorted(line.split()[-1] for line in leads) == ["1", "2"], leads


def test_worker_leads_alone_without_a_dsn(spawn: Callable[..., Any]) -> None:
    procs, out = spawn([[sys.executable, str(EXAMPLES / "worker.py")]], example_env(None))
    expect(out, "elected: local leads with term 1", 30)
    expect(out, "[local] tick tick@", 10)
    procs[0].popen.send_signal(signal.SIGINT)
    assert procs[0].popen.wait(15) == 0
    assert procs[0].lines[-1] == "stopped cleanly"


# --------------------------------------------------------------------------- Django


def test_django_runleader_runs_tasks_and_stops_after_seconds(
    pg_dsn: str, spawn: Callable[..., Any]
) -> None:
    manage = str(EXAMPLES / "django_app" / "manage.py")
    procs, out = spawn(
        [[sys.executable, manage, "runleader", "--seconds", "2.5", "--node-id", "dj"]],
        example_env(pg_dsn),
    )
    expect(out, "elected: dj leads with term 1", 30)
    expect(out, "[dj] tick tick@", 10)
    assert procs[0].popen.wait(30) == 0
    assert procs[0].lines[-2:] == ["demoted: term 1 ended (stopped)", "stopped cleanly"]


def test_django_runleader_hands_over_on_sigterm(pg_dsn: str, spawn: Callable[..., Any]) -> None:
    manage = str(EXAMPLES / "django_app" / "manage.py")
    procs, out = spawn(
        [[sys.executable, manage, "runleader", "--node-id", f"dj{i}"] for i in range(2)],
        example_env(pg_dsn),
    )
    check_handover(procs, out, "] tick tick@")


def test_django_runleader_leads_alone_without_a_dsn(spawn: Callable[..., Any]) -> None:
    manage = str(EXAMPLES / "django_app" / "manage.py")
    procs, out = spawn(
        [[sys.executable, manage, "runleader", "--seconds", "1.5"]], example_env(None)
    )
    expect(out, "elected: local leads with term 1", 30)
    assert procs[0].popen.wait(30) == 0
    assert procs[0].lines[-1] == "stopped cleanly"


# --------------------------------------------------------------------------- FastAPI


@pytest.fixture(scope="module")
def fastapi_app() -> ModuleType:
    """examples/fastapi_app.py, imported from its path (it is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "fastapi_app_example", EXAMPLES / "fastapi_app.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = os.environ.pop("RSELECTION_DSN", None)
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is not None:
            os.environ["RSELECTION_DSN"] = saved
    return module


def healthz(client: TestClient) -> dict[str, Any]:
    response = client.get("/healthz")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_fastapi_single_node_lifespan_and_healthz(fastapi_app: ModuleType) -> None:
    app = fastapi_app.create_app()
    with TestClient(app) as client:
        wait_until(lambda: healthz(client)["is_leader"], 10, "the app to lead")
        wait_until(
            lambda: healthz(client)["tasks"]["refresh-cache"]["runs"] >= 1,
            10,
            "a refresh-cache run",
        )
        body = healthz(client)
        assert body["status"] == "ok"
        assert body["term"] == 1
        assert body["holder"]["node_id"] == body["node_id"] == "local"
        assert body["tasks"]["outbox-relay"]["state"] == "running"
        assert body["tasks"]["refresh-cache"]["next_fire"] is not None
    # Shutdown ran the lifespan's exit: tasks joined, leadership given up.
    leader = app.state.leader
    assert not leader.is_leader
    assert app.state.tasks.health()["outbox-relay"]["state"] == "idle"


def test_fastapi_two_replicas_on_postgres_hand_over(fastapi_app: ModuleType, pg_dsn: str) -> None:
    lease = f"api-{uuid.uuid4().hex[:8]}"
    apps = [
        fastapi_app.create_app(pg_dsn, name=lease, node_id=f"api-{i}", **FAST) for i in range(2)
    ]
    clients = [TestClient(app) for app in apps]
    running: list[TestClient] = []
    for client in clients:
        client.__enter__()
        running.append(client)
    try:
        wait_until(
            lambda: sum(healthz(c)["is_leader"] for c in clients) == 1, 20, "one leading replica"
        )
        views = [healthz(c) for c in clients]
        chief = next(i for i, v in enumerate(views) if v["is_leader"])
        other = 1 - chief
        # Both replicas agree on the holder; the follower runs nothing.
        assert {v["holder"]["node_id"] for v in views} == {f"api-{chief}"}
        assert views[other]["term"] is None
        first_term = views[chief]["term"]
        wait_until(
            lambda: healthz(clients[chief])["tasks"]["refresh-cache"]["runs"] >= 1,
            10,
            "a run on the leader",
        )
        began = time.monotonic()
        running.remove(clients[chief])
        clients[chief].__exit__(None, None, None)  # app shutdown: stop() releases the lease
        wait_until(lambda: healthz(clients[other])["is_leader"], 10, "the other replica to lead")
        assert time.monotonic() - began < 5 + HANDOVER_LIMIT
        assert healthz(clients[other])["term"] == first_term + 1
        assert healthz(clients[other])["tasks"]["refresh-cache"]["runs"] == 0
    finally:
        for client in running:
            client.__exit__(None, None, None)


def test_fastapi_healthz_is_503_while_a_task_fails(fastapi_app: ModuleType) -> None:
    app = fastapi_app.create_app()
    tasks: rs.TaskHandler = app.state.tasks

    @tasks.interval(0.05, name="broken")
    def broken(ctx: rs.TaskContext) -> None:
        ctx.sleep(0.03)  # running about half the time: probes land in runs too
        raise RuntimeError("downstream is down")

    with TestClient(app) as client:
        wait_until(lambda: client.get("/healthz").status_code == 503, 10, "a 503")
        # Every probe until the task passes again: none while its next run goes on.
        probes = [client.get("/healthz") for _ in range(20)]
        assert [p.status_code for p in probes] == [503] * 20
        body = probes[-1].json()
        assert body["status"] == "failing"
        assert body["failing"] == ["broken"]
        assert "downstream is down" in body["tasks"]["broken"]["last_error"]


def test_fastapi_serves_metrics(fastapi_app: ModuleType) -> None:
    app = fastapi_app.create_app(metrics=True)
    try:
        with TestClient(app) as client:
            wait_until(lambda: healthz(client)["is_leader"], 10, "the app to lead")
            wait_until(
                lambda: (
                    'rselection_task_runs_total{task="refresh-cache"}'
                    in client.get("/metrics").text
                ),
                10,
                "refresh-cache runs in /metrics",
            )
            # Served at /metrics itself, not by a redirect to /metrics/.
            got = client.get("/metrics", follow_redirects=False)
            assert got.status_code == 200, got.headers
            assert got.headers["content-type"].startswith("text/plain")
            text = got.text
            assert 'rselection_is_leader{lease="fastapi-app"} 1.0' in text
            assert 'rselection_task_duration_seconds_count{task="refresh-cache"}' in text
    finally:
        metrics.disable()


# --------------------------------------------------------------------------- metrics


def test_metrics_follow_a_postgres_handover(pg_dsn: str) -> None:
    lease = f"m-{uuid.uuid4().hex[:8]}"
    registry = CollectorRegistry()
    metrics.enable(registry=registry)
    leaders = [
        rs.PostgresLeader(pg_dsn, rs.TaskHandler(), name=lease, node_id=f"n{i}", **FAST)
        for i in range(2)
    ]

    def sample(name: str, **labels: str) -> float:
        found = registry.get_sample_value(name, {"lease": lease, **labels})
        return 0.0 if found is None else found

    try:
        for leader in leaders:
            leader.start()
        wait_until(lambda: sum(x.is_leader for x in leaders) == 1, 20, "one leader")
        chief = next(x for x in leaders if x.is_leader)
        heir = next(x for x in leaders if x is not chief)
        first_term = chief.term
        assert first_term is not None
        # The elected signal follows the start of the term: wait for its receiver.
        wait_until(
            lambda: sample("rselection_leadership_transitions_total", reason="elected") == 1,
            5,
            "the elected transition",
        )
        assert sample("rselection_is_leader") == 1
        assert sample("rselection_term") == first_term
        # Renewals every 0.5 s: their latency and the time left on the lease.
        wait_until(
            lambda: sample("rselection_lease_renew_latency_seconds_count") >= 2,
            10,
            "two renewals",
        )
        remaining = sample("rselection_lease_remaining_seconds_sum") / sample(
            "rselection_lease_remaining_seconds_count"
        )
        assert 0 < remaining <= FAST["renew_deadline"]

        chief.stop(timeout=15)
        assert heir.wait_until_leader(10)
        wait_until(
            lambda: sample("rselection_leadership_transitions_total", reason="elected") == 2,
            5,
            "the second elected transition",
        )
        assert sample("rselection_term") == first_term + 1
        assert sample("rselection_is_leader") == 1
        assert sample("rselection_leadership_transitions_total", reason="stopped") == 1
        heir.stop(timeout=15)
        assert sample("rselection_is_leader") == 0
        assert sample("rselection_leadership_transitions_total", reason="stopped") == 2
    finally:
        for leader in leaders:
            leader.stop(timeout=15)
        metrics.disable()
