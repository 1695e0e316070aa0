"""A follower's attempt that read the lock table before another node took a lease over,
and reaches the lease's row after that takeover committed, must not take the lease: the
row it locks then is the new term's, whose lock the new holder holds.

The attempt is held at that point deterministically. Its session resolves
``clock_timestamp()`` to a function of the test's schema (its ``search_path`` names
that schema before ``pg_catalog``) that, the second time it is called, waits on an
advisory lock the test holds. The first call checks lease A, held by a live session,
which reads the lock table; the second checks lease B, whose holder's session is gone,
before B's row is locked. While the attempt waits there, another node takes B over and
commits; then the test lets the attempt go on.

An acquisition that read the lock table once for the whole statement (a ``WITH`` item,
shared by the row lock's recheck) saw B's new term as free: it locked the new holder's
row and took the lock of the term after it, and without the check that the row's term
is still the one it locked, it took the lease while the new holder held it.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql

from rselection.postgres._lease_sql import AcquireRequest, acquire_batch_sql, new_lock_key
from rselection.postgres.schema import create_tables, history_table_name
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

LEASES = "rselection_leases"
SERVER = "same-server"  # every session of the test records the same server identity


def _attempt(
    conn: psycopg.Connection[Any], node: str, names: list[str], *, create: bool = False
) -> list[tuple[Any, ...]]:
    """One acquisition of ``names`` by ``node`` on ``conn``: the rows it locked, as
    ``(name, term taken or None, lock_key, notified, unlocked)``."""
    requests = [
        AcquireRequest(name, node, 30.0, new_lock_key(), f"ch_{name}", create) for name in names
    ]
    statement = acquire_batch_sql(
        sql.Identifier(LEASES),
        requests,
        server=SERVER,
        ring=1,
        history=sql.Identifier(history_table_name(LEASES)),
        process=("host", 1),
    )
    cur = conn.execute(statement)
    if create:
        cur.nextset()  # the INSERT of the missing rows
    return cur.fetchall()


def _holders(conn: psycopg.Connection[Any]) -> dict[str, str | None]:
    query = sql.SQL("SELECT name, holder FROM {}").format(sql.Identifier(LEASES))
    return dict(conn.execute(query).fetchall())


def test_a_follower_never_takes_a_lease_taken_over_after_it_read_the_locks(
    pg_dsn: str,
) -> None:
    gate = secrets.randbits(62)
    with (
        psycopg.connect(pg_dsn, autocommit=True) as admin,
        psycopg.connect(pg_dsn, autocommit=True) as old,
        psycopg.connect(pg_dsn, autocommit=True) as new,
        psycopg.connect(pg_dsn, autocommit=True) as follower,
    ):
        create_tables(admin, leases=LEASES, timeout=10)
        found = admin.execute("SELECT current_schema()").fetchone()
        assert found is not None
        schema = sql.Identifier(found[0])
        admin.execute(sql.SQL("CREATE SEQUENCE {}.calls").format(schema))
        admin.execute(
            sql.SQL(
                "CREATE FUNCTION {schema}.clock_timestamp() RETURNS timestamptz"
                " LANGUAGE plpgsql VOLATILE AS $$ BEGIN"
                " IF pg_catalog.nextval({calls}::regclass) = 2 THEN"
                "  PERFORM pg_catalog.pg_advisory_lock_shared({gate});"
                "  PERFORM pg_catalog.pg_advisory_unlock_shared({gate});"
                " END IF;"
                " RETURN pg_catalog.clock_timestamp(); END $$"
            ).format(
                schema=schema,
                calls=sql.Literal(f'"{found[0]}".calls'),
                gate=sql.Literal(gate),
            )
        )
        # A (first in the table and in the request) is held by a live session; B's
        # holder takes it, then its session ends: B may be taken over at once.
        assert [r[:2] for r in _attempt(new, "new", ["a"], create=True)] == [("a", 1)]
        assert [r[:2] for r in _attempt(old, "old", ["b"], create=True)] == [("b", 1)]
        old.close()

        follower.execute(sql.SQL("SET search_path = {}, pg_catalog").format(schema))
        follower_pid = follower.info.backend_pid
        admin.execute("SELECT pg_advisory_lock(%s)", (gate,))
        locked: list[tuple[Any, ...]] = []
        failure: list[BaseException] = []

        def follow() -> None:
            try:
                locked.extend(_attempt(follower, "follower", ["a", "b"]))
            except BaseException as exc:  # reported by the test
                failure.append(exc)

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        try:
            # The follower waits on the gate: it has read the lock table (checking A)
            # and has not locked B's row yet.
            wait_until(
                lambda: (
                    admin.execute(
                        "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted"
                        " AND locktype = 'advisory'",
                        (follower_pid,),
                    ).fetchone()
                    == (1,)
                ),
                timeout=10,
                what="the follower's attempt to wait on the gate",
            )
            # Another node takes B over and commits.
            assert [r[:2] for r in _attempt(new, "new", ["b"])] == [("b", 2)]
        finally:
            admin.execute("SELECT pg_advisory_unlock(%s)", (gate,))
        thread.join(20)
        assert not thread.is_alive()
        assert not failure, failure

        # One leader: B's holder is the node that took it over, whose session holds the
        # lock of its term.
        assert _holders(admin) == {"a": "new", "b": "new"}
        held = admin.execute(
            sql.SQL(
                "SELECT count(*) FROM {} t JOIN pg_locks l ON l.locktype = 'advisory'"
                " AND l.objsubid = 2 AND l.granted AND l.pid = t.holder_pid"
                " AND l.classid::bigint = t.lock_key::bigint & 4294967295"
                " AND l.objid::bigint = t.term %% 2147483648"
                " WHERE t.name = 'b' AND t.holder_pid = %s"
            ).format(sql.Identifier(LEASES)),
            (new.info.backend_pid,),
        ).fetchone()
        assert held == (1,)
        # Nor did the attempt lock the new holder's row and take the next term's lock
        # (it reads the lock table again once the row is locked, and sees the new term's).
        assert locked == [], locked
