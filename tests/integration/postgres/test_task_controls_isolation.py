"""Task controls and run history on Postgres stay off the renewal path and out of the
way of fire claims, whatever their tables do: a term starts, and renews, while the
controls table is locked; fires go on while the run history's table is locked.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.postgres import PostgresAdmin, PostgresClaimer, PostgresLeader
from tests.support.sessions import process_sessions
from tests.support.waiting import wait_until

# Tables locked for seconds while leaders renew on bounds of a second: one at a time.
pytestmark = pytest.mark.serial

FAST = {"ttl": 3, "renew_interval": 0.5, "renew_deadline": 2, "retry_interval": 0.5}


class Fires:
    """The fires of ``tick`` (every 50 ms) and the runs of ``loop`` (persistent)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ticks: list[float] = []
        self.loops = 0
        self.running = 0  # runs of loop going on

    def handler(self) -> rs.TaskHandler:
        tasks = rs.TaskHandler()

        @tasks.interval(0.05, name="tick")
        def tick(ctx: rs.TaskContext) -> None:
            with self.lock:
                self.ticks.append(time.monotonic())

        @tasks.persistent(name="loop")
        def loop(ctx: rs.TaskContext) -> None:
            with self.lock:
                self.loops += 1
                self.running += 1
            try:
                while ctx.sleep(0.01):
                    pass
            finally:
                with self.lock:
                    self.running -= 1

        return tasks

    def ticks_since(self, since: float) -> int:
        with self.lock:
            return sum(1 for at in self.ticks if at >= since)


@pytest.fixture
def leaders() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for leader in made:
        leader.stop(timeout=10)


def _leader(dsn: str, fires: Fires, node_id: str, **kw: Any) -> PostgresLeader:
    return PostgresLeader(
        dsn,
        fires.handler(),
        name="iso",
        node_id=node_id,
        heartbeat_interval=0.2,
        **{**FAST, **kw},
    )


def _first_term(dsn: str, leaders: list[Any]) -> None:
    """A first leader creates the task tables, publishes its tasks and stops."""
    first = _leader(dsn, Fires(), "first")
    leaders.append(first)
    first.start()
    assert first.wait_until_leader(10)
    with PostgresAdmin(dsn) as admin:
        wait_until(lambda: admin.tasks("iso"), 5, "the tasks published")
    first.stop(timeout=10)


def test_a_term_starts_and_renews_while_the_controls_table_is_locked(
    pg_dsn: str, leaders: list[Any]
) -> None:
    _first_term(pg_dsn, leaders)
    locker = psycopg.connect(pg_dsn)
    try:
        # An open transaction holds the controls table (a migration's ALTER TABLE
        # waiting, say) for twice the renew deadline.
        locker.execute("LOCK TABLE rselection_leases_tasks IN ACCESS EXCLUSIVE MODE")
        leader = _leader(pg_dsn, Fires(), "y")
        leaders.append(leader)
        leader.start()
        assert leader.wait_until_leader(10)
        term = leader.term
        held_until = time.monotonic() + 4.0
        while time.monotonic() < held_until:
            assert leader.is_leader and leader.term == term, "the term was lost"
            time.sleep(0.05)
    finally:
        locker.close()
    time.sleep(1.0)
    assert leader.is_leader and leader.term == term


def test_fires_go_on_while_the_run_history_table_is_locked(pg_dsn: str, leaders: list[Any]) -> None:
    fires = Fires()
    leader = _leader(pg_dsn, fires, "x", ttl=15, renew_interval=2, renew_deadline=10)
    leaders.append(leader)
    leader.start()
    assert leader.wait_until_leader(10)
    wait_until(lambda: fires.ticks_since(0.0) >= 10, 5, "the first fires")
    locker = psycopg.connect(pg_dsn)
    stop = threading.Event()

    def read_history() -> None:  # an app's status page, say, asking again and again
        while not stop.is_set():
            with contextlib.suppress(rs.BackendUnavailable):
                leader.task_runs("tick")

    reader = threading.Thread(target=read_history, daemon=True)
    try:
        locker.execute("LOCK TABLE rselection_leases_task_runs IN ACCESS EXCLUSIVE MODE")
        began = time.monotonic()
        reader.start()
        time.sleep(5.0)  # batch writes and history reads wait on the lock meanwhile
        with fires.lock:
            ticks = [began] + [at for at in fires.ticks if at >= began]
    finally:
        stop.set()
        locker.close()
        reader.join(10)
    # A tick every 50 ms: the fire claims found a pooled session all along (the task
    # store takes one at a time, bounded), rather than wait for the locked table.
    gap = max(b - a for a, b in zip(ticks, [*ticks[1:], began + 5.0], strict=True))
    assert gap < 1.0, f"fires stopped for {gap:.2f} s"


def test_a_term_whose_controls_cannot_be_read_starts_no_task_until_they_are(
    pg_dsn: str, leaders: list[Any]
) -> None:
    _first_term(pg_dsn, leaders)
    with PostgresAdmin(pg_dsn) as admin:
        admin.pause_task("iso", "loop")
        admin.pause_task("iso", "tick")
    locker = psycopg.connect(pg_dsn)
    fires = Fires()
    try:
        # The new leader's first reads of the controls fail (their statement times out).
        locker.execute("LOCK TABLE rselection_leases_task_triggers IN ACCESS EXCLUSIVE MODE")
        leader = _leader(pg_dsn, fires, "b", ttl=15, renew_interval=2, renew_deadline=10)
        leaders.append(leader)
        leader.start()
        assert leader.wait_until_leader(10)
        time.sleep(5.0)
        assert fires.ticks_since(0.0) == 0 and fires.loops == 0, "a paused task ran"
    finally:
        locker.close()
    # Read at last: still paused, so nothing runs; a resume starts the task.
    with PostgresAdmin(pg_dsn) as admin:
        wait_until(
            lambda: any(r.reason == "paused" for r in admin.task_runs("iso", "tick")),
            10,
            "a paused fire skipped",
        )
        assert fires.ticks_since(0.0) == 0 and fires.loops == 0, "a paused task ran"
        admin.resume_task("iso", "loop")
    wait_until(lambda: fires.loops == 1, 5, "the loop resumed")


class GatedClaimer(PostgresClaimer):
    """A claimer whose claims of triggered fires wait for :attr:`gate` (so that the
    term can end between a trigger's claim and its fire)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        if any("@trigger:" in key for key in fire_keys):
            self.entered.set()
            self.gate.wait(10)
        return super().claim_many(fire_keys, term=term)


def test_a_trigger_claimed_as_its_term_ends_runs_on_the_next_leader(
    pg_dsn: str, leaders: list[Any]
) -> None:
    claimer = GatedClaimer(pg_dsn)
    first, second = Fires(), Fires()
    a = _leader(pg_dsn, first, "a", claimer=claimer)
    leaders.append(a)
    a.start()
    assert a.wait_until_leader(10)
    b = _leader(pg_dsn, second, "b")
    leaders.append(b)
    b.start()
    with PostgresAdmin(pg_dsn) as admin:
        wait_until(lambda: admin.tasks("iso"), 5, "the tasks published")
        admin.pause_task("iso", "tick")  # only the trigger fires from now on
        time.sleep(0.5)
        paused = time.monotonic()  # a's term may have fired before the pause
        admin.trigger_task("iso", "tick")
        assert claimer.entered.wait(5), "the trigger's claim never began"
        stepping = threading.Thread(target=lambda: a.step_down(hold=5.0), daemon=True)
        stepping.start()
        wait_until(lambda: not a.is_leader, 5, "a's term over")
        claimer.gate.set()  # won now, as its term ended
        stepping.join(10)
        wait_until(lambda: b.is_leader, 10, "b leads")
        wait_until(lambda: second.ticks_since(paused) == 1, 10, "the trigger run by b")
        time.sleep(1.0)
        assert first.ticks_since(paused) + second.ticks_since(paused) == 1


def test_a_pause_is_seen_within_a_second_while_the_run_history_table_is_locked(
    pg_dsn: str, leaders: list[Any]
) -> None:
    fires = Fires()
    leader = _leader(pg_dsn, fires, "x", ttl=15, renew_interval=2, renew_deadline=10)
    leaders.append(leader)
    leader.start()
    assert leader.wait_until_leader(10)
    wait_until(lambda: fires.running == 1, 5, "the loop running")
    locker = psycopg.connect(pg_dsn)
    try:
        locker.execute("LOCK TABLE rselection_leases_task_runs IN ACCESS EXCLUSIVE MODE")
        time.sleep(0.5)  # a batch write of the ticks' runs now waits on the lock
        with PostgresAdmin(pg_dsn) as admin:
            began = time.monotonic()
            assert admin.pause_task("iso", "loop").changed  # no read of the run history
            wait_until(lambda: fires.running == 0, 5, "the loop paused")
            seen = time.monotonic() - began
    finally:
        locker.close()
    assert seen < 1.0, f"the pause was seen after {seen:.2f} s"


def test_a_follower_whose_controls_read_waits_opens_no_pooled_session(
    pg_dsn: str, leaders: list[Any]
) -> None:
    # DESIGN.md's budget: a process that only follows holds 2 sessions, keeper and
    # watcher, however often it is asked leader().
    _first_term(pg_dsn, leaders)

    def sessions() -> Counter[str]:
        return process_sessions(pg_dsn, os.getpid())

    locker = psycopg.connect(pg_dsn)
    stop = threading.Event()
    try:
        # The controls read every lease makes as it connects waits on the lock (1 s on
        # the server, then again a second later), on the keeper session, while an
        # application asks leader() again and again.
        locker.execute("LOCK TABLE rselection_leases_tasks IN ACCESS EXCLUSIVE MODE")
        follower = _leader(pg_dsn, Fires(), "f", eligible=False)
        leaders.append(follower)
        follower.start()
        wait_until(lambda: sessions()["rselection:keeper"], 10, "the follower's keeper")
        before = sessions()["rselection:pool"]

        def ask() -> None:
            while not stop.is_set():
                with contextlib.suppress(rs.BackendUnavailable):
                    follower.leader()

        threading.Thread(target=ask, daemon=True).start()
        peak = before
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            peak = max(peak, sessions()["rselection:pool"])
            time.sleep(0.1)
    finally:
        stop.set()
        locker.close()
    assert peak == before, f"pooled sessions went from {before} to {peak} on a follower"
