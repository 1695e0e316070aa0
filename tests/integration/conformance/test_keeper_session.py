"""A leader never lets its keeper session end while its term's tasks may still run.

Followers take over the moment the holder's session is gone (Postgres frees its advisory
lock, Redis forgets its client id), so a renewal that fails or hangs must first end the
term and join its tasks, and only then may the session end. Each test makes the keeper's
renewal hang or fail on a healthy server, watches from another connection when the
keeper's session lets go of the lease, and compares that instant with when the old term's
task really finished.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis

import rselection as rs
from rselection.postgres.leader import PostgresLeader
from tests.support.pg import PrivateRedis
from tests.support.waiting import wait_until

# ttl 4 s, deadline 2 s, stop_grace 1.5 s: 2 + 1.5 + 0.5 = 4.
TIMINGS: dict[str, float] = {
    "ttl": 4.0,
    "renew_interval": 0.5,
    "renew_deadline": 2.0,
    "retry_interval": 0.5,
}
LINGER = 1.0  # the task's cleanup after cancellation, within stop_grace


class Finish:
    """When the task of the first term finished (monotonic), from inside the task.

    The first term is 1 on Postgres; on Redis it is the server's clock in microseconds.
    """

    def __init__(self) -> None:
        self.started = threading.Event()
        self.at: float | None = None
        self.first: int | None = None

    def handler(self) -> rs.TaskHandler:
        handler = rs.TaskHandler(stop_grace=1.5)

        @handler.persistent("work")
        def work(ctx: rs.TaskContext) -> None:
            if self.first is None:
                self.first = ctx.term  # terms run one after another: the first is first
            if ctx.term != self.first:
                return
            self.started.set()
            try:
                ctx.cancelled.wait()
                time.sleep(LINGER)
            finally:
                self.at = time.monotonic()

        return handler


def watch(gone: Callable[[], bool], stop: threading.Event) -> list[float]:
    """Poll ``gone`` every 10 ms in a thread; the list gets the first instant it was true."""
    seen: list[float] = []

    def run() -> None:
        while not stop.is_set():
            if gone():
                seen.append(time.monotonic())
                return
            time.sleep(0.01)

    threading.Thread(target=run, daemon=True).start()
    return seen


def assert_outlived_the_task(finish: Finish, freed: list[float], what: str) -> None:
    """Wait for the old task to finish and the session to let go (``what``); fail if it
    let go first."""
    wait_until(lambda: finish.at is not None, 10, "the old task to finish")
    wait_until(lambda: bool(freed), 10, f"{what} to let go")
    assert finish.at is not None
    assert freed[0] >= finish.at, (
        f"{what} let go {finish.at - freed[0]:.3f} s before the old term's task finished"
    )


# -- Postgres -------------------------------------------------------------------------------


Setup = tuple[PostgresLeader, psycopg.Connection[Any], Finish]


@pytest.fixture
def leader_and_admin(pg_dsn: str) -> Iterator[Setup]:
    finish = Finish()
    name = f"t-{uuid.uuid4().hex[:8]}"
    leader = PostgresLeader(
        pg_dsn, finish.handler(), name=name, node_id="holder", claimer=None, **TIMINGS
    )
    admin = psycopg.connect(pg_dsn, autocommit=True)
    try:
        yield leader, admin, finish
    finally:
        leader.stop(timeout=15)
        admin.close()


def keeper_lock_gone(dsn: str, pid: int) -> Callable[[], bool]:
    """True once the keeper session ``pid`` no longer holds term 1's advisory lock (taken
    as ``pg_advisory_lock(lease key, term)``: ``objid`` is the term)."""
    conn = psycopg.connect(dsn, autocommit=True)

    def gone() -> bool:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory'"
            " AND objid = 1 AND objsubid = 2 AND granted",
            (pid,),
        ).fetchone()
        return row is not None and row[0] == 0

    return gone


def renewal_blocked(admin: psycopg.Connection[Any], pid: int) -> Callable[[], bool]:
    def blocked() -> bool:
        row = admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        return row is not None and row[0] == "Lock"

    return blocked


def lead_and_lock_the_row(
    pg_dsn: str,
    leader: PostgresLeader,
    admin: psycopg.Connection[Any],
    finish: Finish,
) -> tuple[int, psycopg.Connection[Any]]:
    """Start ``leader``; once it leads, hold its lease table locked from another session
    (as a migration or ``VACUUM FULL`` would) so its next renewal hangs (a renewal skips
    a locked row, but waits for the table). Returns the keeper's backend pid and the
    blocking session."""
    leader.start()
    assert finish.started.wait(10)
    pid = leader._backend.backend_pid  # type: ignore[attr-defined]
    assert pid is not None
    blocker = psycopg.connect(pg_dsn)
    blocker.execute("LOCK TABLE rselection_leases IN ACCESS EXCLUSIVE MODE")
    wait_until(renewal_blocked(admin, pid), 5, "the renewal to wait for the table lock")
    return pid, blocker


def test_a_hung_renewal_keeps_the_session_until_the_old_tasks_are_joined(
    pg_dsn: str, leader_and_admin: Setup
) -> None:
    leader, admin, finish = leader_and_admin
    pid, blocker = lead_and_lock_the_row(pg_dsn, leader, admin, finish)
    blocked_at = time.monotonic()
    stop = threading.Event()
    freed = watch(keeper_lock_gone(pg_dsn, pid), stop)
    try:
        # The term's deadline passes ~1.5 s after the renewal was sent, its task winds
        # down until ~2.5 s, and the renewal's own bound (renew_deadline, 2 s) passes in
        # between. Let the renewal through at ~2.2 s: a session aborted by that bound ends
        # then (its backend notices when it answers); a held one answers, and the keeper
        # releases once the task is joined.
        time.sleep(max(0.0, blocked_at + 2.2 - time.monotonic()))
        blocker.rollback()
        assert_outlived_the_task(finish, freed, "the keeper's advisory lock")
    finally:
        stop.set()
        blocker.close()


def test_a_failed_renewal_keeps_the_session_until_the_old_tasks_are_joined(
    pg_dsn: str, leader_and_admin: Setup
) -> None:
    leader, admin, finish = leader_and_admin
    pid, blocker = lead_and_lock_the_row(pg_dsn, leader, admin, finish)
    stop = threading.Event()
    freed = watch(keeper_lock_gone(pg_dsn, pid), stop)
    try:
        # The renewal fails with an error on a healthy connection.
        admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
        assert_outlived_the_task(finish, freed, "the keeper's advisory lock")
    finally:
        stop.set()
        blocker.close()
    wait_until(lambda: leader.term is not None and leader.term > 1, 15, "the next term")


# -- Redis ------------------------------------------------------------------------------------


def test_a_hung_redis_renewal_keeps_the_connection_until_the_old_tasks_are_joined(
    private_redis: PrivateRedis,
) -> None:
    finish = Finish()
    leader = rs.RedisLeader(
        private_redis.url,
        finish.handler(),
        name=f"t-{uuid.uuid4().hex[:8]}",
        node_id="holder",
        claimer=None,
        **TIMINGS,
    )
    admin = redis.Redis.from_url(private_redis.url)
    stop = threading.Event()
    try:
        leader.start()
        assert finish.started.wait(10)
        client_id = leader.lease.client_id  # type: ignore[attr-defined]
        assert client_id

        def gone() -> bool:
            return not admin.execute_command("CLIENT", "LIST", "ID", client_id)

        freed = watch(gone, stop)
        # Renewals (scripts that write) wait while writes are paused; the client's own
        # socket timeout (renew_deadline) passes while the term's task winds down.
        admin.execute_command("CLIENT", "PAUSE", 4000, "WRITE")
        assert_outlived_the_task(finish, freed, "the keeper's connection")
    finally:
        stop.set()
        admin.execute_command("CLIENT", "UNPAUSE")
        leader.stop(timeout=15)
        admin.close()
