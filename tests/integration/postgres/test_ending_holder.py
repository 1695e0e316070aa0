"""A holder whose keeper session is ending looks, for an instant, like a node of lease
protocol 1: the server frees the ending session's ring lock and its term's lock one after
the other, and a follower's attempt that reads the lock table in between sees the term's
lock held and no ring lock. It must look again, not refuse to lead.

Before the fix, a follower woken by the ring's announcement of a killed leader's keeper
took it for a node of the old protocol and stopped for good ("cannot lead safely"): the
lease then passed on only at its expiry, and that follower never led again (CI, once:
a kill -9 failover of 12 s). Here a session of the test plays that instant, for as long
as the test likes: it holds the term's lock as the holder's, and no ring lock.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

import rselection as rs
from rselection.postgres import PostgresLeader
from rselection.postgres.lease import PROTOCOL_CONFIRM
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

LEASES = sql.Identifier("rselection_leases")
LOOKING_AGAIN = "looks like a node of lease protocol 1; looking again"
REFUSED = "cannot lead safely"


def said(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in record.getMessage() for record in caplog.records)


def make(dsn: str, name: str, node_id: str) -> PostgresLeader:
    return rs.PostgresLeader(dsn, rs.TaskHandler(), name=name, node_id=node_id)


def hold_as_old_protocol(conn: psycopg.Connection[Any], name: str) -> None:
    """Make ``conn``'s session the lease's holder for the next term, holding that term's
    lock and no ring lock (as a keeper session that is ending does, for an instant)."""
    key = secrets.randbits(31)
    row = conn.execute(
        sql.SQL(
            "UPDATE {} SET holder = 'ending', holder_pid = pg_backend_pid(),"
            " term = term + 1, lock_key = %s, protocol = 2,"
            " acquired_at = now(), expires_at = now() + interval '30 seconds'"
            " WHERE name = %s RETURNING term"
        ).format(LEASES),
        (key, name),
    ).fetchone()
    assert row is not None
    conn.execute("SELECT pg_advisory_lock(%s, %s)", (key, row[0] % 2**31))


def freed_lease(dsn: str, name: str) -> None:
    """The lease's row, created by a leader that led it once and released it."""
    first = make(dsn, name, "first")
    first.start()
    try:
        assert first.wait_until_leader(15)
    finally:
        first.stop(10)


def test_a_holder_whose_session_ends_is_taken_over_not_refused(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"ending-{secrets.token_hex(3)}"
    freed_lease(pg_dsn, name)
    caplog.set_level(logging.DEBUG, logger="rselection.postgres.lease")
    follower = make(pg_dsn, name, "follower")
    with psycopg.connect(pg_dsn, autocommit=True) as ending:
        hold_as_old_protocol(ending, name)
        follower.start()
        try:
            wait_until(
                lambda: said(caplog, LOOKING_AGAIN) or said(caplog, REFUSED),
                10,
                "the follower to see the ending holder as a node of protocol 1",
            )
            assert not said(caplog, REFUSED), "the follower refused to lead for good"
        except BaseException:
            follower.stop(10)
            raise
    # The session is gone (its locks with it), within PROTOCOL_CONFIRM of the sighting.
    try:
        assert follower.wait_until_leader(10), "the follower never took the lease over"
        assert not said(caplog, REFUSED)
    finally:
        follower.stop(10)


def test_a_holder_that_stays_a_node_of_protocol_1_is_refused(pg_dsn: str) -> None:
    name = f"old-{secrets.token_hex(3)}"
    freed_lease(pg_dsn, name)
    follower = make(pg_dsn, name, "follower")
    failed: list[BaseException] = []

    def lead() -> None:
        try:
            follower.lead()
        except BaseException as exc:
            failed.append(exc)

    with psycopg.connect(pg_dsn, autocommit=True) as old:
        hold_as_old_protocol(old, name)
        began = time.monotonic()
        leading = threading.Thread(target=lead, daemon=True)
        leading.start()
        leading.join(30)
        took = time.monotonic() - began
    assert not leading.is_alive(), "lead() did not refuse a holder of protocol 1"
    assert failed and isinstance(failed[0], rs.ConfigError), failed
    assert "'ending' speaking lease protocol 1" in str(failed[0])
    assert took >= PROTOCOL_CONFIRM, f"refused after {took:.2f}s, before looking again"
    assert not follower.is_leader
