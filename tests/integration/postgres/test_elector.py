"""PostgresElector against a real Postgres: what only Postgres has.

The row a renewal or a resign leaves, pool and connection sources, a session ended by the
server, the elections table (created on first use, refused when it is another table,
unsafe names). What every elector promises runs on both backends in
``tests/integration/conformance/test_elector.py``.

Every test runs in a schema of its own (the ``pg_dsn`` fixture).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from rselection.errors import ConfigError
from rselection.postgres import PostgresElector, migrate
from rselection.postgres.connections import Connections
from tests.support.waiting import wait_until


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


def test_a_renewal_moves_the_expiry_on_the_server_and_keeps_acquired_at(
    make_elector: Callable[..., PostgresElector], dsn: str
) -> None:
    a = make_elector(node_id="node-a")
    assert a.is_leader() and a.term == 1
    first = row(dsn)
    assert first is not None and first[:2] == ("node-a", 1)
    assert a.is_leader() and a.term == 1
    renewed = row(dsn)
    assert renewed is not None
    assert renewed[2] == first[2]  # acquired_at kept
    assert renewed[3] > first[3] and renewed[4] > first[4]  # renewed_at, expires_at moved
    # expiry = renewal + ttl (server), to within the time between clock readings
    drift = (renewed[4] - renewed[3]) - (first[4] - first[3])
    assert abs(drift) < timedelta(milliseconds=1)


def test_resign_clears_the_holder_and_keeps_the_term_in_the_row(
    make_elector: Callable[..., PostgresElector], dsn: str
) -> None:
    a = make_elector(ttl=3600)
    assert a.is_leader() and a.term == 1
    assert a.resign() is True
    got = row(dsn)
    assert got is not None and got[0] is None and got[1] == 1


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


def test_session_ended_by_the_server_is_replaced(
    make_elector: Callable[..., PostgresElector], pg_server_dsn: str
) -> None:
    a = make_elector(ttl=3600)
    assert a.is_leader()
    own = a._conns.idle_connections()[-1]  # the connection the call used, now idle
    with psycopg.connect(pg_server_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (own.info.backend_pid,))
    wait_until(lambda: not Connections.usable(own), 5, "the termination to arrive")
    assert a.is_leader() and a.term == 1  # the lease is in the table, not the session


def test_tables_are_created_on_first_use_unless_told_not_to(pg_dsn: str) -> None:
    elector = PostgresElector(pg_dsn, create_tables=False)
    assert elector.table == "rselection_elections"
    with pytest.raises(ConfigError, match=r"does not exist.*migrate"):
        elector.is_leader()
    elector.close()
    with PostgresElector(pg_dsn) as made:  # create_tables=True by default
        assert made.is_leader()


def test_a_lease_table_is_refused(make_elector: Callable[..., PostgresElector]) -> None:
    with pytest.raises(ConfigError, match="not an elections table"):
        make_elector(table="rselection_leases").is_leader()


@pytest.mark.parametrize("table", ["x;drop", "a.b.c", "", "9t", 'e"'])
def test_unsafe_tables_are_refused(pg_dsn: str, table: str) -> None:
    with pytest.raises(ConfigError, match="invalid table name"):
        PostgresElector(pg_dsn, table=table)
