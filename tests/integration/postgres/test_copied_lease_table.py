"""A lease table copied under a new OID: every node keeps to the lock key of each row.

A dump and restore, a table rebuilt by hand (copy the rows to a new table, drop the old
one, rename) or a move to another server gives the lease table a new OID, while its rows
keep their ``lock_key``. The row's key is the one a term locks, and the one every node
checks to tell a live holder's session from a gone one; so it is also the one the holder
must free when the term ends. Each test copies the table with plain SQL, then leads and
follows through it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import rselection as rs
from rselection.errors import BackendUnavailable
from rselection.lease import Acquisition
from rselection.postgres import PostgresLeader, PostgresLease
from tests.support.waiting import wait_until

LEASES = "rselection_leases"
CYCLES = 500
STEP_DOWNS = 100


@pytest.fixture
def make_lease(pg_dsn: str) -> Iterator[Callable[..., PostgresLease]]:
    """Connected leases on this test's schema, each with a keeper session of its own (a
    node of its own process); all closed after the test."""
    made: list[PostgresLease] = []

    def make(**kw: Any) -> PostgresLease:
        options: dict[str, Any] = {"ttl": 30.0, "renew_deadline": 20.0, **kw}
        dsn = make_conninfo(pg_dsn, application_name=f"n{len(made)}")
        lease = PostgresLease(dsn, **options)
        made.append(lease)
        lease.connect()
        return lease

    yield make
    for lease in made:
        lease.close()


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True, connect_timeout=10) as conn:
        yield conn


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(max_workers=4)
    yield executor
    executor.shutdown(wait=True, cancel_futures=True)


def acquired(acq: Acquisition) -> int:
    assert acq.acquired, acq
    assert acq.holder is not None
    return acq.holder.term


def table_oid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT %s::regclass::oid::bigint", (LEASES,)).fetchone()
    assert row is not None
    return int(row[0])


def copied_table(dsn: str, admin: psycopg.Connection[Any], name: str = "default") -> None:
    """Create lease ``name``'s row (led and released once, by a node that then closes),
    then rebuild the lease table under a new OID as a restore would: a new table like
    it, the rows copied, the old one dropped, the new one renamed."""
    with PostgresLease(make_conninfo(dsn, application_name="seed"), name=name) as seed:
        term = acquired(seed.try_acquire("seed"))
        seed.term_ended(term)
        seed.release("seed", term)
    old = table_oid(admin)
    query = sql.SQL("SELECT lock_key FROM {} WHERE name = %s").format(sql.Identifier(LEASES))
    before = admin.execute(query, (name,)).fetchone()
    with admin.transaction():
        table, copy = sql.Identifier(LEASES), sql.Identifier(f"{LEASES}_copy")
        admin.execute(sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(copy, table))
        admin.execute(sql.SQL("INSERT INTO {} SELECT * FROM {}").format(copy, table))
        admin.execute(sql.SQL("DROP TABLE {}").format(table))
        admin.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(copy, table))
    new = table_oid(admin)
    # What these tests are about: a table under a new OID whose rows kept their keys.
    assert new != old
    assert before is not None and admin.execute(query, (name,)).fetchone() == before


def advisory_locks(admin: psycopg.Connection[Any], pid: int | None) -> tuple[int, int]:
    """The advisory locks the backend ``pid`` holds: (per-lease locks, all of them)."""
    assert pid is not None
    row = admin.execute(
        "SELECT count(*) FILTER (WHERE objsubid = 2), count(*) FROM pg_locks"
        " WHERE locktype = 'advisory' AND granted AND pid = %s",
        (pid,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.mark.parametrize("end", ["release", "attempt again"])
def test_terms_on_a_copied_table_leave_no_advisory_lock_behind(
    pg_dsn: str,
    admin: psycopg.Connection[Any],
    make_lease: Callable[..., PostgresLease],
    end: str,
) -> None:
    copied_table(pg_dsn, admin)
    a = make_lease()
    for cycle in range(CYCLES):
        attempt = a.try_acquire("A")
        assert attempt.acquired, (
            f"term {cycle + 2}: the node cannot take its own lease again after its term "
            f"ended; it passes on only at expiry, {attempt.expires_in:.1f} s from now"
        )
        term = acquired(attempt)
        a.term_ended(term)  # its tasks are joined
        if end == "release":
            a.release("A", term)
        # else the next attempt takes a fresh term over the ended one, as a leader does
        # that competes again after a release that did not go through
    held = acquired(a.try_acquire("A"))
    assert held == CYCLES + 2
    lease_locks, every = advisory_locks(admin, a.backend_pid)
    # One lease held: its term's lock, plus the keeper session's ring lock.
    assert (lease_locks, every) == (1, 2), (
        f"after {CYCLES} terms the keeper session holds {lease_locks} per-lease advisory "
        f"locks ({every} in all) for 1 lease held"
    )
    a.term_ended(held)
    a.release("A", held)
    assert advisory_locks(admin, a.backend_pid) == (0, 1)


def test_a_leader_stepping_down_on_a_copied_table_holds_one_lock(
    pg_dsn: str, admin: psycopg.Connection[Any]
) -> None:
    copied_table(pg_dsn, admin)
    leader = PostgresLeader(
        pg_dsn,
        rs.TaskHandler(),
        node_id="A",
        claimer=None,
        ttl=30.0,
        renew_interval=2.0,
        renew_deadline=20.0,
        retry_interval=1.0,
    )
    try:
        leader.start()
        for term in range(2, STEP_DOWNS + 2):
            wait_until(lambda: leader.term == term, 10, f"term {term}")  # noqa: B023
            leader.step_down()
        wait_until(lambda: leader.term == STEP_DOWNS + 2, 10, "the last term")
        pid = leader._backend.backend_pid  # type: ignore[attr-defined]
        lease_locks, every = advisory_locks(admin, pid)
        assert (lease_locks, every) == (1, 2), (
            f"after {STEP_DOWNS} step-downs the keeper session holds {lease_locks} "
            f"per-lease advisory locks ({every} in all) for 1 lease held"
        )
    finally:
        leader.stop(15)


def test_a_term_ended_without_a_release_passes_on_at_once_not_at_expiry(
    pg_dsn: str, admin: psycopg.Connection[Any], make_lease: Callable[..., PostgresLease]
) -> None:
    copied_table(pg_dsn, admin)
    a, b = make_lease(), make_lease()  # ttl 30 s
    term = acquired(a.try_acquire("A"))
    first = b.try_acquire("B")
    assert not first.acquired and first.expires_in > 25, first
    # An operator holds the row locked while the leader stops: its term ends (tasks
    # joined) but the release cannot go through; its keeper session lives on.
    with psycopg.connect(pg_dsn) as locker:
        locker.execute(
            sql.SQL("SELECT 1 FROM {} WHERE name = 'default' FOR UPDATE").format(
                sql.Identifier(LEASES)
            )
        )
        a.term_ended(term)
        with pytest.raises(BackendUnavailable, match="stayed locked"):
            a.release("A", term)
        locker.rollback()
    start = time.monotonic()
    attempt = b.try_acquire("B")
    took = time.monotonic() - start
    assert attempt.acquired, (
        f"the ended term's lock is still held: the lease passes on only at expiry, "
        f"{attempt.expires_in:.1f} s from now (ttl 30 s)"
    )
    assert acquired(attempt) == term + 1
    assert took < 2.0, took


HOLDER = textwrap.dedent(
    """
    import sys, time
    from rselection.postgres import PostgresLease
    lease = PostgresLease(sys.argv[1], ttl=30, renew_deadline=20)
    lease.connect()
    for _ in range(5):  # a few terms first, as a leader that stepped down would
        acq = lease.try_acquire("doomed")
        lease.term_ended(acq.holder.term)
        lease.release("doomed", acq.holder.term)
    acq = lease.try_acquire("doomed")
    print(acq.acquired, acq.holder.term if acq.holder else 0, lease.backend_pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("how", ["kill -9", "terminate"])
def test_a_dead_holder_on_a_copied_table_is_taken_over_long_before_the_ttl(
    pg_dsn: str,
    admin: psycopg.Connection[Any],
    make_lease: Callable[..., PostgresLease],
    pool: ThreadPoolExecutor,
    how: str,
) -> None:
    copied_table(pg_dsn, admin)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    dsn = make_conninfo(pg_dsn, application_name="doomed")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, dsn], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = pool.submit(proc.stdout.readline).result(timeout=30).split()
        assert line[:2] == ["True", "7"], line  # the seed's term, then six of its own
        b = make_lease()
        first = b.try_acquire("B")
        assert not first.acquired and first.expires_in > 25, first
        doomed = int(line[2])

        def watched() -> bool:  # b's process's ring watcher waits on the holder's keeper
            row = admin.execute(
                "SELECT count(*) FROM pg_locks w JOIN pg_locks h"
                " ON (h.classid, h.objid, h.objsubid) = (w.classid, w.objid, w.objsubid)"
                " WHERE w.locktype = 'advisory' AND h.locktype = 'advisory'"
                " AND NOT w.granted AND h.granted AND w.objsubid = 1 AND h.pid = %s",
                (doomed,),
            ).fetchone()
            return row == (1,)

        wait_until(watched, 10, "the ring watcher to wait on the holder's keeper session")
        start = time.monotonic()
        waiting = pool.submit(lambda: b.wait_for_change(10))  # a wake is never lost
        if how == "kill -9":
            proc.send_signal(signal.SIGKILL)
        else:
            ended = admin.execute("SELECT pg_terminate_backend(%s, 5000)", (doomed,))
            assert ended.fetchone() == (True,)
        waiting.result(timeout=15)
        assert acquired(b.try_acquire("B")) == 8
        took = time.monotonic() - start
        assert took < 2.0, f"takeover {took:.3f}s after the holder died ({how}; ttl 30 s)"
    finally:
        proc.kill()
        proc.wait(timeout=10)
