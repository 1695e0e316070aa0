"""Forked children of a busy process: the parent leads one leader, another thread of it
is inside a call at the fork, or a task of the parent forks.

The parent's started leaders, and their terms, must stay still in the child (never
stepped there, never released, renewed or led from there), and the leaders not started
yet must work there as in any process: what a thread of the parent held at the fork (a
lock, the process's driver) is not in the child.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection import signals
from rselection.postgres import PostgresCheckpointStore
from rselection.sharded.leader import SHARDS_RECORD
from tests.support.forking import fork_child, in_child
from tests.support.waiting import wait_until

FAST = {"ttl": 6.0, "renew_interval": 0.5, "renew_deadline": 3.0, "retry_interval": 0.5}


def _idle_tasks() -> rs.TaskHandler:
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.sleep(3600)

    return tasks


def _returns_within(call: Callable[[], object], timeout: float) -> bool:
    """Run ``call`` in a thread; whether it returned within ``timeout`` seconds."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


def _wait_for_a_waiter(blocker: psycopg.Connection[Any], table: str) -> None:
    """Wait until a session waits for ``table``, which ``blocker`` has locked."""
    waiting = "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass"
    wait_until(
        lambda: blocker.execute(waiting, (table,)).fetchone() == (1,),
        10,
        f"a session to wait for the table {table}",
    )


class _Naming(logging.Handler):
    """Keeps the log lines that name ``lease`` (quoted, as the library names leases)."""

    def __init__(self, lease: str) -> None:
        super().__init__(logging.DEBUG)
        self.quoted = repr(lease)
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if self.quoted in line:
            self.lines.append(line)
            self.seen.set()


def test_a_child_uses_leaders_built_before_fork_while_the_parent_leads(pg_dsn: str) -> None:
    parents = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="parents", **FAST)
    childs = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="childs", **FAST)
    never = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="never", **FAST)
    renewed = threading.Event()

    def on_renewed(sender: object, **kw: Any) -> None:
        if sender is parents:
            renewed.set()

    signals.lease_renewed.connect(on_renewed)
    naming = _Naming("parents")
    logging.getLogger("rselection").addHandler(naming)
    try:
        with parents:
            assert parents.wait_until_leader(20)
            term = parents.term
            # Forked between two renewals: none in flight, the parent's leader idle.
            renewed.clear()
            assert renewed.wait(10)

            def child() -> dict[str, Any]:
                naming.lines.clear()
                naming.seen.clear()
                never.stop()  # never started: it has nothing to stop, in no process
                childs.start()
                led = childs.wait_until_leader(10)
                stopped = _returns_within(lambda: childs.stop(timeout=10), 15)
                # Stepped here, the parent's leader would give its term back, after
                # waiting up to stop_grace + 5 s for the term's tasks (which are not
                # here, so it logs that it keeps the term instead).
                naming.seen.wait(parents.stop_grace + 5.0 + 2.0)
                return {"led": led, "stopped": stopped, "about the parent's": naming.lines}

            report = in_child(child, timeout=60)
            assert report == {"led": True, "stopped": True, "about the parent's": []}
            # The parent leads on in the same term, renewing through its own session.
            renewed.clear()
            assert renewed.wait(10)
            assert parents.is_leader and parents.term == term
    finally:
        logging.getLogger("rselection").removeHandler(naming)
        signals.lease_renewed.disconnect(on_renewed)


def test_a_child_reads_the_holder_while_a_parent_thread_was_reading_it(pg_dsn: str) -> None:
    with rs.PostgresLeader(pg_dsn, _idle_tasks(), name="observed", **FAST) as holder:
        assert holder.wait_until_leader(20)  # the lease table exists from here on
        observer = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="observed", **FAST)
        reading = threading.Thread(target=observer.leader, daemon=True)
        with psycopg.connect(pg_dsn) as blocker:
            # The parent's thread waits inside leader() until the lock is let go.
            blocker.execute("LOCK TABLE rselection_leases IN ACCESS EXCLUSIVE MODE")
            reading.start()
            _wait_for_a_waiter(blocker, "rselection_leases")

            def child() -> dict[str, Any]:
                seen: list[object] = []
                # The blocker lets go right after the fork: the read itself is quick.
                answered = _returns_within(lambda: seen.append(observer.leader()), 10)
                node = seen[0].node_id if seen else None  # type: ignore[attr-defined]
                return {"answered": answered, "holder": node}

            forked = fork_child(child)
            blocker.commit()
        report = forked.report(60)
        reading.join(10)
        assert report == {"answered": True, "holder": holder.node_id}


def test_a_child_starts_a_sharded_leader_a_parent_thread_was_starting(pg_dsn: str) -> None:
    with rs.PostgresShardedLeader(pg_dsn, _idle_tasks(), name="split", shards=2, **FAST) as fleet:
        assert fleet.wait_until_leader(20)  # the tables exist from here on
        # The coordinator records the number of shards once its term starts, which may be
        # just after a shard is led: a write of it under the lock would be a second waiter.
        with PostgresCheckpointStore(pg_dsn) as store:
            wait_until(
                lambda: store.load((SHARDS_RECORD, "split")) is not None,
                20,
                "the coordinator to record the number of shards",
            )
        joiner = rs.PostgresShardedLeader(pg_dsn, _idle_tasks(), name="split", shards=2, **FAST)
        starting = threading.Thread(target=joiner.start, daemon=True)
        try:
            with psycopg.connect(pg_dsn) as blocker:
                # The parent's thread waits inside start(), reading the number of shards
                # the coordinator recorded, until the lock is let go.
                blocker.execute("LOCK TABLE rselection_checkpoints IN ACCESS EXCLUSIVE MODE")
                starting.start()
                _wait_for_a_waiter(blocker, "rselection_checkpoints")

                def child() -> dict[str, Any]:
                    started = _returns_within(joiner.start, 10)
                    stopped = started and _returns_within(lambda: joiner.stop(timeout=10), 15)
                    return {"started": started, "stopped": stopped}

                forked = fork_child(child)
                blocker.commit()
            report = forked.report(60)
            starting.join(10)
        finally:
            joiner.stop()  # its threads must not outlive the test, whatever failed
        assert report == {"started": True, "stopped": True}


@pytest.mark.parametrize("kind", ["postgres", "single"])
def test_a_process_a_task_forks_does_not_lead(pg_dsn: str, kind: str) -> None:
    reports: queue.Queue[dict[str, Any]] = queue.Queue()
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        # What multiprocessing's fork start method does: the worker gets the task's ctx.
        def worker() -> dict[str, Any]:
            try:
                ctx.check()
                checked = "passed"
            except rs.LeadershipLost:
                checked = "raised"
            slept = ctx.sleep(0.01)
            return {
                "live": ctx.is_live(),
                "slept": slept,
                "cancelled": ctx.cancelled.is_set(),
                "check": checked,
            }

        reports.put(in_child(worker))
        ctx.sleep(3600)

    leader: rs.Leader = (
        rs.PostgresLeader(pg_dsn, tasks, name="forking", **FAST)
        if kind == "postgres"
        else rs.SingleNodeLeader(tasks)
    )
    with leader:
        report = reports.get(timeout=30)
        assert leader.is_leader  # the parent's term goes on
    # The worker is not joined when the term ends: it must not believe it leads.
    assert report == {"live": False, "slept": False, "cancelled": True, "check": "raised"}
