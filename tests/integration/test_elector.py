"""PostgresElector against a real Postgres: acquire, renew, follow, fail over, resign, terms.

Every test runs in a schema of its own (the ``pg_dsn`` fixture). Waits for a ttl to pass
poll with a deadline; threads are joined through futures with a timeout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from rselection.errors import BackendUnavailable, ConfigError
from rselection.postgres import PostgresElector, migrate
from rselection.postgres._conn import Connections


@pytest.fixture
def dsn(pg_dsn: str) -> str:
    """This test's schema, with every table migrated."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
    return pg_dsn


@pytest.fixture
def make_elector(dsn: str) -> Iterator[Callable[..., PostgresElector]]:
    """Factory of electors on this test's schema, all closed after the test."""
    made: list[PostgresElector] = []

    def make(**kw: Any) -> PostgresElector:
        elector = PostgresElector(kw.pop("source", dsn), **kw)
        made.append(elector)
        return elector

    yield make
    for elector in made:
        elector.close()


def row(dsn: str, name: str = "default") -> tuple[Any, ...] | None:
    """(holder, term, acquired_at, renewed_at, expires_at) of one election."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT holder, term, acquired_at, renewed_at, expires_at"
            " FROM rselection_elections WHERE name = %s",
            (name,),
        ).fetchone()


def expired_on_server(dsn: str, name: str = "default") -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        got = conn.execute(
            "SELECT expires_at <= clock_timestamp() FROM rselection_elections WHERE name = %s",
            (name,),
        ).fetchone()
    return bool(got and got[0])


def until_true(attempt: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not attempt():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def test_acquire_renew_and_follow(make_elector: Callable[..., PostgresElector], dsn: str) -> None:
    a = make_elector(node_id="node-a")
    b = make_elector(node_id="node-b")
    assert a.term is None
    assert a.is_leader() is True
    assert a.term == 1
    first = row(dsn)
    assert first is not None and first[:2] == ("node-a", 1)
    assert b.is_leader() is False and b.term is None
    assert a.is_leader() is True and a.term == 1  # renewed, same term
    renewed = row(dsn)
    assert renewed is not None
    assert renewed[2] == first[2]  # acquired_at kept
    assert renewed[3] > first[3] and renewed[4] > first[4]  # renewed_at, expires_at moved
    # expiry = renewal + ttl (server), to within the time between clock readings
    drift = (renewed[4] - renewed[3]) - (first[4] - first[3])
    assert abs(drift) < timedelta(milliseconds=1)
    assert b.is_leader() is False


def test_failover_after_ttl_increments_the_term(
    make_elector: Callable[..., PostgresElector], dsn: str
) -> None:
    a = make_elector(ttl=0.4)
    b = make_elector(ttl=0.4)
    assert a.is_leader() and a.term == 1
    assert not b.is_leader()
    waited = until_true(b.is_leader, 10, "b to take over after the ttl")
    assert 0.1 < waited < 5
    assert b.term == 2
    assert not a.is_leader() and a.term is None
    got = row(dsn)
    assert got is not None and got[:2] == (b.node_id, 2)


def test_a_holder_renewing_after_its_own_expiry_keeps_its_term(
    make_elector: Callable[..., PostgresElector], dsn: str
) -> None:
    a = make_elector(ttl=0.2)
    assert a.is_leader() and a.term == 1
    until_true(lambda: expired_on_server(dsn), 10, "the lease to expire")
    assert a.is_leader() and a.term == 1  # nobody else held it in between


def test_resign_hands_over_at_once(make_elector: Callable[..., PostgresElector], dsn: str) -> None:
    a = make_elector(ttl=3600)
    b = make_elector(ttl=3600)
    assert a.is_leader() and a.term == 1
    assert a.resign() is True
    assert a.term is None
    got = row(dsn)
    assert got is not None and got[0] is None and got[1] == 1  # term kept
    assert b.is_leader() and b.term == 2  # no wait for the hour-long ttl
    assert a.resign() is False  # not the holder: changes nothing
    assert b.is_leader() and b.term == 2
    assert b.resign()
    assert a.is_leader() and a.term == 3  # re-acquiring after a resign is a new term


def test_names_are_independent_elections(make_elector: Callable[..., PostgresElector]) -> None:
    a = make_elector(name="reports")
    b = make_elector(name="billing")
    assert a.is_leader() and b.is_leader()
    assert not make_elector(name="reports").is_leader()


def test_exactly_one_of_many_concurrent_candidates_wins(
    make_elector: Callable[..., PostgresElector],
) -> None:
    electors = [make_elector(ttl=3600) for _ in range(8)]
    barrier = threading.Barrier(len(electors))

    def run(elector: PostgresElector) -> list[bool]:
        barrier.wait(timeout=30)
        return [elector.is_leader() for _ in range(20)]

    with ThreadPoolExecutor(len(electors)) as pool:
        futures = [pool.submit(run, e) for e in electors]
        results = [f.result(timeout=60) for f in futures]
    winners = [i for i, r in enumerate(results) if any(r)]
    assert len(winners) == 1
    assert all(results[winners[0]])  # the winner kept it on every call
    assert electors[winners[0]].term == 1


def test_node_id_is_new_per_instance(make_elector: Callable[..., PostgresElector]) -> None:
    a, b = make_elector(), make_elector()
    assert a.node_id != b.node_id and a.node_id and b.node_id
    assert (a.name, a.ttl, a.table) == ("default", 30.0, "rselection_elections")


def test_with_block_resigns(make_elector: Callable[..., PostgresElector], dsn: str) -> None:
    with PostgresElector(dsn, ttl=3600) as a:
        assert a.is_leader()
    assert make_elector(ttl=3600).is_leader()


def test_pool_and_connection_sources(
    make_elector: Callable[..., PostgresElector], dsn: str
) -> None:
    class Pool:
        def __init__(self) -> None:
            self.conn = psycopg.connect(dsn)

        @contextlib.contextmanager
        def connection(self) -> Iterator[psycopg.Connection[Any]]:
            yield self.conn
            self.conn.commit()

    pool = Pool()
    try:
        a = make_elector(source=pool, ttl=3600)
        assert a.is_leader()
        with psycopg.connect(dsn, autocommit=True) as conn:
            b = make_elector(source=conn, ttl=3600)
            assert not b.is_leader()
            assert a.resign()
            assert b.is_leader() and b.term == 2
    finally:
        pool.conn.close()


def test_unreachable_server_raises_and_never_says_leader(pg_dsn: str) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    elector = PostgresElector(
        make_conninfo(pg_dsn, port=str(port), password="s3cret-pw"), connect_timeout=2
    )
    with pytest.raises(BackendUnavailable) as info:
        elector.is_leader()
    assert "s3cret-pw" not in str(info.value)
    assert elector.term is None
    with pytest.raises(BackendUnavailable):
        elector.resign()


def test_session_ended_by_the_server_is_replaced(
    make_elector: Callable[..., PostgresElector], pg_server_dsn: str
) -> None:
    a = make_elector(ttl=3600)
    assert a.is_leader()
    own = a._conns._idle[-1]  # the connection the call used, now idle
    with psycopg.connect(pg_server_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (own.info.backend_pid,))
    until_true(lambda: not Connections.usable(own), 5, "the termination to arrive")
    assert a.is_leader() and a.term == 1  # the lease is in the table, not the session


def test_tables_are_created_on_first_use_unless_told_not_to(pg_dsn: str) -> None:
    elector = PostgresElector(pg_dsn, create_tables=False)
    with pytest.raises(ConfigError, match=r"does not exist.*migrate"):
        elector.is_leader()
    elector.close()
    with PostgresElector(pg_dsn) as made:  # create_tables=True by default
        assert made.is_leader()


def test_a_lease_table_is_refused(make_elector: Callable[..., PostgresElector]) -> None:
    with pytest.raises(ConfigError, match="not an elections table"):
        make_elector(table="rselection_leases").is_leader()


@pytest.mark.parametrize("name", ["", "   ", "a\x00", None, 3])
def test_bad_names_are_refused(pg_dsn: str, name: Any) -> None:
    with pytest.raises(ConfigError, match="name"):
        PostgresElector(pg_dsn, name=name)


@pytest.mark.parametrize("ttl", [0, 0.0005, -3, float("nan"), float("inf"), False, "30"])
def test_bad_ttl_is_refused(pg_dsn: str, ttl: Any) -> None:
    with pytest.raises(ConfigError, match="ttl"):
        PostgresElector(pg_dsn, ttl=ttl)


@pytest.mark.parametrize("table", ["x;drop", "a.b.c", "", "9t", 'e"'])
def test_unsafe_tables_are_refused(pg_dsn: str, table: str) -> None:
    with pytest.raises(ConfigError, match="invalid table name"):
        PostgresElector(pg_dsn, table=table)


@pytest.mark.parametrize("source", [None, "", object()])
def test_no_connection_is_refused(source: Any) -> None:
    with pytest.raises(ConfigError, match="PostgresElector needs"):
        PostgresElector(source)


@pytest.mark.parametrize("node_id", ["", " ", "x\x00", "n" * 1001])
def test_bad_node_id_is_refused(pg_dsn: str, node_id: str) -> None:
    with pytest.raises(ConfigError, match="node_id"):
        PostgresElector(pg_dsn, node_id=node_id)
