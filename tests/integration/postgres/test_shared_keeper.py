"""The keeper session that every lease of a process shares: what sharing must not break.

Several leaders in one process (one connection string and lease table) share one keeper
session. A lease held through it must stay held against every other leader of the
process, also one with the same node id; a stall of one kind of statement on it (a
heartbeat waiting for a locked row) must not hold up the renewals of every lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection import signals
from rselection.postgres import PostgresLeader
from tests.support.waiting import wait_until

TIMINGS: dict[str, Any] = {
    "ttl": 8.0,
    "renew_interval": 0.5,
    "renew_deadline": 4.0,
    "retry_interval": 0.5,
}


class Events:
    """``elected`` and ``demoted`` of this test's leases, with the time each came."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[float, str, str, int, str | None]] = []

    def elected(self, sender: Any, **kw: Any) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), "elected", kw["name"], kw["term"], None))

    def demoted(self, sender: Any, **kw: Any) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), "demoted", kw["name"], kw["term"], kw["reason"]))

    def of(self, kind: str) -> list[tuple[float, str, str, int, str | None]]:
        with self.lock:
            return [e for e in self.seen if e[1] == kind]


@pytest.fixture
def events() -> Iterator[Events]:
    recorded = Events()
    signals.elected.connect(recorded.elected)
    signals.demoted.connect(recorded.demoted)
    yield recorded
    signals.elected.disconnect(recorded.elected)
    signals.demoted.disconnect(recorded.demoted)


@pytest.fixture
def made(pg_dsn: str) -> Iterator[list[PostgresLeader]]:
    """Leaders of this test, stopped after it (before its schema is dropped)."""
    leaders: list[PostgresLeader] = []
    yield leaders
    for leader in leaders:
        leader.stop(15)


def idle_handler() -> rs.TaskHandler:
    handler = rs.TaskHandler()

    @handler.persistent("idle")
    def idle(ctx: rs.TaskContext) -> None:
        ctx.cancelled.wait()

    return handler


def test_a_leader_restarted_with_the_same_node_id_waits_for_the_old_terms_tasks(
    pg_dsn: str, made: list[PostgresLeader], events: Events
) -> None:
    # A service restarts its leader in the process (node id from its configuration); the
    # old leader's stop(timeout) returns while its task still winds down.
    running = threading.Event()
    finished: list[float] = []
    old_handler = rs.TaskHandler(stop_grace=3.0)

    @old_handler.persistent("slow")
    def slow(ctx: rs.TaskContext) -> None:
        running.set()
        ctx.cancelled.wait()
        time.sleep(1.5)  # careless clean-up after the cancel
        finished.append(time.monotonic())

    old = PostgresLeader(pg_dsn, old_handler, name="svc", node_id="svc-1", claimer=None, **TIMINGS)
    made.append(old)
    old.start()
    wait_until(running.is_set, 15, "the old leader's task to run")
    old.stop(0.3)  # returns before the task is joined
    new = PostgresLeader(
        pg_dsn, idle_handler(), name="svc", node_id="svc-1", claimer=None, **TIMINGS
    )
    made.append(new)
    new.start()
    wait_until(lambda: new.is_leader, 20, "the new leader to lead")
    assert finished, "the new leader leads while the old term's task still runs"
    second = [at for at, _, name, term, _ in events.of("elected") if term == 2]
    assert second and second[0] >= finished[0], (second, finished)


def test_two_leaders_of_one_lease_and_node_id_in_one_process_never_lead_at_once(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    a = PostgresLeader(pg_dsn, idle_handler(), name="x", node_id="same", claimer=None, **TIMINGS)
    b = PostgresLeader(pg_dsn, idle_handler(), name="x", node_id="same", claimer=None, **TIMINGS)
    made.extend([a, b])
    a.start()
    wait_until(lambda: a.is_leader, 15, "a to lead")
    b.start()
    both = 0
    deadline = time.monotonic() + 3.0  # six renewals of a, six attempts of b
    while time.monotonic() < deadline:
        both += a.is_leader and b.is_leader
        time.sleep(0.01)
    assert both == 0, f"both led at once in {both} samples"
    assert a.is_leader and a.term == 1 and not b.is_leader
    a.stop(10)
    wait_until(lambda: b.is_leader, 10, "b to lead once a released")
    assert b.term == 2


def test_a_locked_nodes_row_does_not_stop_the_renewals(
    pg_dsn: str, made: list[PostgresLeader], events: Events
) -> None:
    leaders = [
        PostgresLeader(
            pg_dsn,
            idle_handler(),
            name=f"l{i}",
            node_id=f"n{i}",
            claimer=None,
            heartbeat_interval=0.5,
            **TIMINGS,
        )
        for i in range(3)
    ]
    made.extend(leaders)
    for leader in leaders:
        leader.start()
    wait_until(lambda: all(x.is_leader for x in leaders), 20, "every lease to be led")
    wait_until(lambda: bool(leaders[0].nodes()), 10, "the first heartbeat")
    with psycopg.connect(pg_dsn) as locker:
        # An operator's row lock (VACUUM FULL or a migration would lock the whole table).
        locker.execute("SELECT 1 FROM rselection_nodes WHERE node_id = 'n0' FOR UPDATE")
        # Longer than any term lasts unrenewed: every lease must be led all along.
        until = time.monotonic() + TIMINGS["renew_deadline"] + 2.0
        while time.monotonic() < until:
            assert all(x.is_leader for x in leaders), [x.is_leader for x in leaders]
            time.sleep(0.05)
        locker.rollback()
    assert not events.of("demoted"), events.of("demoted")
    assert [x.term for x in leaders] == [1, 1, 1]
    before = next(n.last_seen for n in leaders[0].nodes() if n.node_id == "n0")
    wait_until(
        lambda: next(n.last_seen for n in leaders[0].nodes() if n.node_id == "n0") > before,
        10,
        "heartbeats to go on once the row is free",
    )
