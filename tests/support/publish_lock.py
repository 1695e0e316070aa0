"""Holding a PostgresBroadcaster's publish lock from a test, to keep a batch waiting on
the server: the row of the outbox's state table, locked ``FOR UPDATE`` (see
:mod:`rselection.postgres.broadcast.outbox`)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from rselection.postgres.schema import suffixed_name, table_identifier

__all__ = ["blocked_by", "hold_publish_lock"]


def hold_publish_lock(conn: psycopg.Connection[Any], table: str) -> None:
    """Lock the publish lock of outbox ``table`` (as ``conn``'s search path finds it)
    until ``conn``'s transaction ends: call it inside ``conn.transaction()``."""
    state = table_identifier(suffixed_name(table, "state"))
    conn.execute(sql.SQL("SELECT FROM {} FOR UPDATE").format(state))


def blocked_by(dsn: str, conn: psycopg.Connection[Any]) -> list[int]:
    """Backend pids waiting for a lock that ``conn``'s session holds (a blocked writer)."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            (conn.info.backend_pid,),
        ).fetchall()
    return [int(r[0]) for r in rows]
