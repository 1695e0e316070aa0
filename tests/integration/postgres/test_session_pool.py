"""The pooled sessions of a process: at most two per connection string, for every object.

Claimers, checkpoint stores, electors and ``leader()`` reads given one connection string
share :class:`~rselection.postgres.session_pool.SessionPool`'s sessions. Counted on the
server (``pg_stat_activity`` by ``application_name``); every test uses a connection
string of its own (its own schema), so its pool is its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from rselection.errors import BackendUnavailable
from rselection.postgres import (
    PostgresCheckpointStore,
    PostgresClaimer,
    PostgresElector,
    PostgresLease,
    migrate,
)
from rselection.postgres.connections import Connections
from rselection.postgres.session_pool import APPLICATION_NAME, POOL_SIZE, SessionPool
from tests.support.waiting import wait_until


def pool_of(dsn: str) -> SessionPool | None:
    """This process's pool for ``dsn``, if one is attached."""
    return SessionPool._registry.get((os.getpid(), dsn))


def on_server(admin: psycopg.Connection[Any], pids: set[int]) -> int:
    """How many of the backends ``pids`` are pooled sessions on the server now."""
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND pid = ANY(%s)",
        (APPLICATION_NAME, list(pids)),
    ).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture
def admin(pg_server_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection of the test's own, outside the pool."""
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        yield conn


def test_every_object_of_a_process_shares_at_most_two_sessions(
    pg_dsn: str, admin: psycopg.Connection[Any]
) -> None:
    migrate(pg_dsn)
    claimers = [PostgresClaimer(pg_dsn, node_id=f"n{i}") for i in range(10)]
    stores = [PostgresCheckpointStore(pg_dsn) for _ in range(10)]
    electors = [PostgresElector(pg_dsn, name=f"e{i}") for i in range(5)]
    leases = [PostgresLease(pg_dsn, name=f"l{i}", ttl=15) for i in range(5)]
    backends: set[int] = set()
    seen = threading.Lock()
    calls: list[Callable[[int], object]] = [
        lambda i: claimers[i % 10].claim(f"fire-{i}"),
        lambda i: stores[i % 10].save(("k", str(i % 10)), i),
        lambda i: stores[i % 10].load(("k", str(i % 10))),
        lambda i: electors[i % 5].is_leader(),
        lambda i: leases[i % 5].current(),
    ]

    def run(i: int) -> None:
        calls[i % len(calls)](i)
        pool = pool_of(pg_dsn)
        assert pool is not None
        with seen:
            backends.update(c.info.backend_pid for c in pool.idle_connections())

    with ThreadPoolExecutor(20) as workers:
        list(workers.map(run, range(400)))
    # Every backend the pool ever lent is seen idle after some call: never more than 2.
    assert 1 <= len(backends) <= POOL_SIZE, backends
    assert 1 <= on_server(admin, backends) <= POOL_SIZE
    pool = pool_of(pg_dsn)
    assert pool is not None
    for obj in [*claimers, *stores, *electors, *leases]:
        obj.close()
    # The last object closed the pool's sessions and left the registry.
    assert pool_of(pg_dsn) is None
    assert pool.open_sessions == 0
    wait_until(lambda: on_server(admin, backends) == 0, 10, "the pooled sessions to end")


def test_each_call_brings_its_own_statement_timeout(pg_dsn: str) -> None:
    short = Connections(
        pg_dsn, owner="short", application_name="x", statement_timeout=0.2, pooled=True
    )
    long = Connections(pg_dsn, owner="long", application_name="x", statement_timeout=5, pooled=True)
    try:
        for _ in range(3):  # on the same session, one after the other
            with pytest.raises(psycopg.errors.QueryCanceled), short.connection() as conn:
                conn.execute("SELECT pg_sleep(1)")
            with long.connection() as conn:
                conn.execute("SELECT pg_sleep(0.5)")  # not cut by the short one's 0.2 s
    finally:
        short.close()
        long.close()


def test_a_call_that_finds_every_session_busy_fails_within_its_bound(pg_dsn: str) -> None:
    slow = Connections(
        pg_dsn, owner="slow", application_name="x", statement_timeout=30, pooled=True
    )
    quick = Connections(
        pg_dsn,
        owner="quick",
        application_name="x",
        connect_timeout=0.5,
        statement_timeout=0.5,
        pooled=True,
    )
    release = threading.Event()
    holding = threading.Semaphore(0)

    def hold() -> None:
        with slow.connection() as conn:
            conn.execute("SELECT 1")
            holding.release()
            release.wait(20)

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(POOL_SIZE)]
    try:
        for thread in holders:
            thread.start()
        for _ in holders:
            assert holding.acquire(timeout=10)
        started = time.monotonic()
        busy = r"pooled sessions .* stayed busy for 1s"
        with pytest.raises(BackendUnavailable, match=busy), quick.connection():
            pass
        took = time.monotonic() - started
        assert 0.9 <= took < 5.0, took
    finally:
        release.set()
        for thread in holders:
            thread.join(10)
    with quick.connection() as conn:  # free again
        assert conn.execute("SELECT 1").fetchone() == (1,)
    slow.close()
    quick.close()


def test_a_session_the_server_ended_is_replaced(
    pg_dsn: str, admin: psycopg.Connection[Any]
) -> None:
    claimer = PostgresClaimer(pg_dsn)
    assert claimer.claim("a")
    (own,) = claimer._conns.idle_connections()
    admin.execute("SELECT pg_terminate_backend(%s, 5000)", (own.info.backend_pid,))
    wait_until(lambda: not Connections.usable(own), 5, "the termination to arrive")
    assert claimer.claim("b")
    assert claimer._conns.idle_connections() != [own]
    claimer.close()


def test_sessions_idle_for_long_are_closed(pg_dsn: str) -> None:
    # A process that led and now only follows goes back to a follower's sessions: the
    # keeper closes pooled sessions idle for a minute (here: for any time at all).
    claimer = PostgresClaimer(pg_dsn)
    assert claimer.claim("a")
    pool = pool_of(pg_dsn)
    assert pool is not None and pool.open_sessions == 1
    SessionPool.close_idle(pg_dsn, older_than=60.0)
    assert pool.open_sessions == 1  # idle for less than a minute: kept
    SessionPool.close_idle(pg_dsn, older_than=0.0)
    assert pool.open_sessions == 0
    assert claimer.claim("b")  # a later call opens a new one
    claimer.close()
