"""A rolling upgrade from lease protocol 1 to 2: node processes of both releases, one lease.

The previous release (lease protocol 1, lease table schema version 4) runs from a venv
of its own (:mod:`tests.support.previous_release`); this release (protocol 2, schema
version ``LEASES_VERSION``) from this checkout. Every node is
``tests/support/release_node.py`` under its release's interpreter, with a persistent
task that reports when it runs, and every test ends with the activity ledger
(:mod:`tests.support.activity`): no two nodes' tasks ever ran at the same time. Each
test has a schema of its own, so a fresh lease table.

The previous release checks the schema version only when it creates tables on connect: a
node of it started with ``create_tables=False``, or running since before the upgrade,
competes on a table of this release's version. It never overlaps with a node of this
release (both find a live holder through the same advisory lock). It does not write
``protocol``, so after it took over from a node of this release the row still says
protocol 2; a node of this release tells it apart all the same, because its keeper
session holds no ring lock, and refuses it (the last test below).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from rselection.postgres.schema import LEASES, LEASES_VERSION, VERSION_TABLE
from tests.conftest import unavailable
from tests.support import activity
from tests.support.previous_release import (
    BuildFailed,
    PreviousRelease,
    RefMissing,
    previous_release,
)

REPO = Path(__file__).resolve().parents[3]
NODE = REPO / "tests" / "support" / "release_node.py"
TTL = 4.0  # release_node.TTL
# A resumed process needs a moment to learn that its term ended while it was frozen.
RESUME_GRACE = 0.25
Event = dict[str, Any]


@pytest.fixture(scope="session")
def old_release() -> PreviousRelease:
    """The previous release's venv, built once per session (cached across sessions)."""
    try:
        release = previous_release()
    except RefMissing as exc:
        unavailable(str(exc))  # fails under CI=true
    except BuildFailed as exc:
        pytest.fail(f"could not build the previous release's venv: {exc}", pytrace=False)
    noted("previous release venv", built_in=release.build_seconds, cached=release.cached)
    return release


class MixedFleet:
    """Node processes of both releases on one lease; their events gathered in one list.

    ``ended_at`` and ``history`` feed :func:`tests.support.activity.check`.
    """

    def __init__(self, dsn: str, old: PreviousRelease, logs: Path) -> None:
        self.dsn = dsn
        self.old = old
        self.logs = logs
        self.lease = f"upgrade-{uuid.uuid4().hex[:6]}"
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.history: list[Event] = []
        self.ended_at: dict[str, float] = {}
        self._events: queue.Queue[Event] = queue.Queue()
        self._readers: list[threading.Thread] = []
        self.paused: dict[str, list[tuple[float, float]]] = {}
        self._paused_since: dict[str, float] = {}

    def spawn(self, node: str, release: str, *, create_tables: bool = True) -> None:
        """Start ``node`` on the ``"old"`` or the ``"new"`` release."""
        args = [str(NODE), "--lease", self.lease, "--node", node]
        if not create_tables:
            args.append("--no-create-tables")
        if release == "old":
            cmd, env = self.old.command(*args), self.old.env()
        else:
            cmd = [sys.executable, "-P", *args]
            env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's rselection
        env["RSELECTION_DSN"] = self.dsn
        with open(self.logs / f"{node}.log", "w") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
                env=env,
                cwd=self.logs,  # nothing of this checkout in the working directory
            )
        self.procs[node] = proc
        assert proc.stdout is not None
        reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with contextlib.suppress(ValueError):
                self._events.put(json.loads(line))

    def _drain(self, timeout: float) -> Event | None:
        try:
            event = self._events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        self.history.append(event)
        return event

    def mark(self) -> int:
        """Where the events seen so far end (for ``wait_for(since=...)``)."""
        return len(self.history)

    def next_matching(self, timeout: float, since: int = 0, **match: Any) -> Event | None:
        """The first event from ``history[since:]`` on (seen, or arriving within
        ``timeout``) whose fields equal ``match``; ``None`` when none came."""
        found = self.find(since, **match)
        if found:
            return found[0]
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            event = self._drain(left)
            if event is not None and all(event.get(k) == v for k, v in match.items()):
                return event
        return None

    def wait_for(self, timeout: float, since: int = 0, **match: Any) -> Event:
        """:meth:`next_matching`, failing the test when no such event came."""
        event = self.next_matching(timeout, since, **match)
        if event is None:
            pytest.fail(f"no event {match} within {timeout}s; events: {self.history[-30:]}")
        return event

    def watch(self, seconds: float) -> list[Event]:
        """Gather events for ``seconds``; return those that arrived."""
        start = len(self.history)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self._drain(left)
        return self.history[start:]

    def find(self, since: int = 0, **match: Any) -> list[Event]:
        """Events seen so far (from ``history[since:]``) whose fields equal ``match``."""
        return [e for e in self.history[since:] if all(e.get(k) == v for k, v in match.items())]

    def exit_code(self, node: str, timeout: float = 15.0) -> int:
        """Wait for ``node`` to exit on its own; its exit status."""
        try:
            code = self.procs[node].wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{node} still runs after {timeout}s; events: {self.history[-30:]}")
        self.ended_at.setdefault(node, time.time())
        return code

    def kill(self, node: str) -> float:
        """kill -9 ``node``; the wall-clock time after the signal was sent."""
        self.procs[node].send_signal(signal.SIGKILL)
        at = self.ended_at.setdefault(node, time.time())
        self.procs[node].wait(10)
        return at

    def pause(self, node: str) -> float:
        """SIGSTOP ``node``; the wall-clock time before the signal was sent."""
        at = time.time()
        self.procs[node].send_signal(signal.SIGSTOP)
        self._paused_since[node] = at
        return at

    def resume(self, node: str) -> float:
        """SIGCONT ``node``; the wall-clock time after the signal was sent."""
        self.procs[node].send_signal(signal.SIGCONT)
        at = time.time()
        self.paused.setdefault(node, []).append((self._paused_since.pop(node), at))
        return at

    def stop_all(self, timeout: float = 20.0) -> None:
        """Stop every node gracefully (its stdin closed), followers first, so that no
        follower takes over a lease that a stopping leader releases; kill stragglers;
        read every event."""
        for node in list(self._paused_since):
            self.resume(node)
        while self._drain(0) is not None:
            pass
        leading = self._leading()
        deadline = time.monotonic() + timeout
        for group in ([n for n in self.procs if n not in leading], sorted(leading)):
            for node in group:
                stdin = self.procs[node].stdin
                assert stdin is not None
                with contextlib.suppress(OSError):
                    stdin.close()
            for node in group:
                proc = self.procs[node]
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
                self.ended_at.setdefault(node, time.time())
        for reader in self._readers:
            reader.join(5)
        while self._drain(0) is not None:
            pass

    def _leading(self) -> set[str]:
        """Nodes whose last ``elected`` or ``demoted`` event so far is ``elected``."""
        last: dict[str, str] = {}
        for event in self.history:
            if event.get("ev") in ("elected", "demoted"):
                last[event["node"]] = event["ev"]
        return {node for node, ev in last.items() if ev == "elected"}

    def log(self, node: str) -> str:
        """What ``node`` wrote on stderr."""
        return (self.logs / f"{node}.log").read_text()

    def check(self) -> activity.Report:
        """The activity ledger of the stopped fleet; fails on any overlap (only the
        resume tail of a frozen node is excused)."""
        report = activity.check(
            self.history, ended_at=self.ended_at, paused=self.paused, resume_grace=RESUME_GRACE
        )
        assert report.runs, "no node's task ran"
        assert not report.overlaps, report.summary()
        return report

    def row(self) -> tuple[Any, ...] | None:
        """The lease row: holder, term, protocol (None without the column), holder_pid."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            has_protocol = conn.execute(
                "SELECT count(*) FROM pg_attribute WHERE attrelid = 'rselection_leases'::regclass"
                " AND attname = 'protocol' AND NOT attisdropped"
            ).fetchone()
            protocol = "protocol" if has_protocol and has_protocol[0] else "NULL::smallint"
            return conn.execute(
                f"SELECT holder, term, {protocol}, holder_pid FROM rselection_leases"
                " WHERE name = %s",
                (self.lease,),
            ).fetchone()

    def schema_version(self) -> int | None:
        """The lease table's recorded schema version."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT version FROM {VERSION_TABLE} WHERE component = %s",
                (LEASES.component("rselection_leases"),),
            ).fetchone()
        return None if row is None else int(row[0])


@pytest.fixture
def fleet(pg_dsn: str, old_release: PreviousRelease, tmp_path: Path) -> Iterator[MixedFleet]:
    """A mixed fleet in this test's own schema; its nodes stopped after the test."""
    mixed = MixedFleet(pg_dsn, old_release, tmp_path)
    try:
        yield mixed
    finally:
        mixed.stop_all()


def started(fleet: MixedFleet, node: str, release: str, **kw: Any) -> Event:
    """Spawn ``node`` and check it runs the release it should (old: from the venv)."""
    fleet.spawn(node, release, **kw)
    event = fleet.wait_for(15, ev="started", node=node)
    module = Path(event["file"]).resolve()
    if release == "old":
        assert module.is_relative_to(fleet.old.venv.resolve()), event
        assert (event["schema"], event["protocol"]) == (4, 1), event
    else:
        assert module.is_relative_to(REPO / "rselection"), event
        assert (event["schema"], event["protocol"]) == (LEASES_VERSION, 2), event
    return event


def refused(fleet: MixedFleet, node: str, timeout: float = 15.0) -> str:
    """Wait until ``node``'s ``lead()`` raised and it exited non-zero; the error."""
    event = fleet.wait_for(timeout, ev="lead-error", node=node)
    assert fleet.exit_code(node) != 0
    assert event["error"] in fleet.log(node)
    return str(event["error"])


def leads_on(fleet: MixedFleet, node: str, term: int, seconds: float) -> None:
    """For ``seconds``: nobody is elected or demoted, ``node`` holds ``term``."""
    events = fleet.watch(seconds)
    changes = [e for e in events if e["ev"] in ("elected", "demoted")]
    assert not changes, changes
    row = fleet.row()
    assert row is not None and row[:2] == (node, term), row


def noted(what: str, **numbers: Any) -> None:
    """Say what a scenario measured (``pytest -s`` shows it)."""
    figures = ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items()
    )
    print(f"\n[protocol upgrade] {what}: {figures}")


def test_new_node_upgrades_the_table_then_refuses_the_old_leader_which_keeps_leading(
    fleet: MixedFleet,
) -> None:
    started(fleet, "old-a", "old")
    term = fleet.wait_for(15, ev="elected", node="old-a")["term"]
    fleet.wait_for(5, ev="activity", node="old-a", end=None)
    assert fleet.schema_version() == 4
    assert fleet.row()[:3] == ("old-a", term, None)  # type: ignore[index]

    began = time.monotonic()
    started(fleet, "new-b", "new")
    error = refused(fleet, "new-b")
    refused_in = time.monotonic() - began
    assert error.startswith("ConfigError: ")
    assert "'old-a' speaking lease protocol 1" in error
    assert "this node speaks protocol 2" in error
    # It upgraded the table on connect, before it saw the holder.
    assert fleet.schema_version() == LEASES_VERSION
    leads_on(fleet, "old-a", term, 1.5)

    # The upgrade stays: the old release cannot use the table now, so an old node that
    # (re)starts with create_tables (the default) is refused in turn.
    started(fleet, "old-c", "old")
    error = refused(fleet, "old-c")
    assert f"has schema version {LEASES_VERSION}, newer than the 4 this release" in error
    leads_on(fleet, "old-a", term, 0.5)

    fleet.stop_all()
    report = fleet.check()
    assert [(r.node, r.term) for r in report.runs] == [("old-a", term)]
    noted("new node refused an old leader", refused_in=refused_in, task_runs=len(report.runs))


def test_old_node_refuses_schema_5_and_without_create_tables_leads_only_after_the_new_leader_died(
    fleet: MixedFleet,
) -> None:
    started(fleet, "new-a", "new")
    term = fleet.wait_for(15, ev="elected", node="new-a")["term"]
    fleet.wait_for(5, ev="activity", node="new-a", end=None)
    assert fleet.schema_version() == LEASES_VERSION
    assert fleet.row()[:3] == ("new-a", term, 2)  # type: ignore[index]

    started(fleet, "old-b", "old")
    error = refused(fleet, "old-b")
    assert error.startswith("ConfigError: ")
    assert f"has schema version {LEASES_VERSION}, newer than the 4 this release" in error

    # Without create_tables the old release does not look at the schema version: it
    # competes, and finds the new leader's session alive (the same advisory lock).
    started(fleet, "old-c", "old", create_tables=False)
    leads_on(fleet, "new-a", term, 2.0)

    since = fleet.mark()
    killed = fleet.kill("new-a")
    took_over = fleet.wait_for(TTL + 2, since, ev="elected", node="old-c")
    after = took_over["t"] - killed
    assert took_over["term"] == term + 1
    # At once, not at expiry: the old follower waits on the holder's lock, which the
    # server frees with the dead process's session.
    assert after < TTL / 2
    fleet.watch(0.5)
    fleet.stop_all()
    report = fleet.check()
    assert [(r.node, r.term) for r in report.runs] == [("new-a", term), ("old-c", term + 1)]
    noted("old node took over from a killed new leader", after_kill=after)


def test_frozen_new_leader_is_replaced_by_an_old_node_only_at_expiry_and_stops_on_resume(
    fleet: MixedFleet,
) -> None:
    started(fleet, "new-a", "new")
    term = fleet.wait_for(15, ev="elected", node="new-a")["term"]
    started(fleet, "old-c", "old", create_tables=False)
    leads_on(fleet, "new-a", term, 1.0)

    since = fleet.mark()
    paused = fleet.pause("new-a")
    took_over = fleet.wait_for(TTL + 5, since, ev="elected", node="old-c")
    after = took_over["t"] - paused
    # The frozen leader's session holds its lock: only expiry frees the lease, and the
    # last renewal was at most renew_deadline (2 s) before the pause.
    assert after > TTL - 2.0
    fleet.resume("new-a")
    # Its deadline passed while it was frozen: it ends its term as soon as it runs.
    fleet.wait_for(10, since, ev="demoted", node="new-a", term=term)
    fleet.stop_all()
    report = fleet.check()
    assert [(r.node, r.term) for r in report.runs] == [("new-a", term), ("old-c", term + 1)]
    noted(
        "old node took over from a frozen new leader",
        after_pause=after,
        resume_tail=report.max_resume_tail,
    )


def test_new_node_refuses_an_old_leader_that_took_over_from_a_new_node(
    fleet: MixedFleet,
) -> None:
    started(fleet, "new-a", "new")
    term = fleet.wait_for(15, ev="elected", node="new-a")["term"]
    started(fleet, "old-c", "old", create_tables=False)
    leads_on(fleet, "new-a", term, 1.0)
    since = fleet.mark()
    fleet.kill("new-a")
    fleet.wait_for(TTL + 2, since, ev="elected", node="old-c", term=term + 1)
    row = fleet.row()
    assert row is not None and row[:2] == ("old-c", term + 1)

    started(fleet, "new-d", "new")
    error = fleet.next_matching(TTL, ev="lead-error", node="new-d")
    assert error is not None, (
        f"new-d competes with old-c (lease protocol 1) for {TTL}s instead of refusing: "
        f"the row old-c holds says protocol {row[2]}"
    )
    assert "'old-c' speaking lease protocol 1" in error["error"]
    assert fleet.exit_code("new-d") != 0
    leads_on(fleet, "old-c", term + 1, 0.5)
    fleet.stop_all()
    fleet.check()


def test_a_missing_previous_commit_is_named(tmp_path: Path) -> None:
    with pytest.raises(RefMissing, match=r"0{40} is not in the repository"):
        previous_release("0" * 40, cache=tmp_path)
