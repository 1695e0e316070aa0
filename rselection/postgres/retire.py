"""Retire a Postgres lease no service uses any more (what ``rselection forget`` does).

The lease row stays, marked by its ``retired_term`` column (schema version 4) = its
term: its term never restarts, so a term that once fenced writes never becomes valid
again, and the next acquisition (a new term) brings the lease back with nothing to undo.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from ..admin import Refused, Retirement
from ..history import OPERATOR
from .membership import node_infos, nodes_sql
from .schema import (
    LEASE_RETIRED_COLUMNS,
    has_columns,
    history_table_name,
    table_exists,
    table_identifier,
)

__all__ = ["LOCK_TIMEOUT", "retire_lease"]

LOCK_TIMEOUT = 5.0
"""Longest :func:`retire_lease` waits for the lease row another statement holds, seconds."""


def _forget_drains(conn: psycopg.Connection[Any], drains: str, name: str) -> None:
    """Forget the drained nodes of a retired lease: a lease of that name used again
    starts with none drained."""
    if table_exists(conn, drains):
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE name = %s").format(table_identifier(drains)), (name,)
        )


def retire_lease(
    conn: psycopg.Connection[Any],
    name: str,
    *,
    table: str,
    nodes_table: str | None,
    node_timeout: float,
    drains_table: str | None = None,
) -> Retirement:
    """Retire lease ``name`` unless it has a live holder (or live nodes).

    Checks and marks in one transaction holding the row (``FOR NO KEY UPDATE``, which
    fenced transactions do not block), so a leader acquiring at the same moment either
    comes first (and retiring is refused) or comes after (and brings the lease back).

    Args:
        conn: an open connection.
        name: the lease name.
        table: the lease table.
        nodes_table: also refuse while a node of the lease heartbeats in this table
            (``None``, or a table that does not exist: no such check).
        node_timeout: a node is alive when seen within this many seconds.
        drains_table: the table of drained nodes (see ``rselection drain``): those of
            the lease are forgotten with it.

    Raises:
        Refused: no such lease, a live holder, live nodes, a table without the retired
            mark, or the row stayed locked for :data:`LOCK_TIMEOUT`.
        psycopg.Error: the database failed.
    """
    if not has_columns(conn, table, LEASE_RETIRED_COLUMNS):
        raise Refused(
            f"lease table {table!r} predates schema version 4, which can retire leases: "
            "run `rselection migrate` to upgrade it (rows are kept)"
        )
    ident = table_identifier(table)
    try:
        with conn.transaction():
            conn.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(f"{round(LOCK_TIMEOUT * 1000)}ms")
                )
            )
            row = conn.execute(
                sql.SQL(
                    "SELECT holder, term, holder IS NOT NULL AND expires_at > clock_timestamp(),"
                    " extract(epoch FROM expires_at - clock_timestamp())::float8,"
                    " coalesce(retired_term = term, false)"
                    " FROM {} WHERE name = %s FOR NO KEY UPDATE"
                ).format(ident),
                (name,),
            ).fetchone()
            if row is None:
                raise Refused(f"no lease {name!r} in {table!r}: nothing to forget")
            holder, term, live, expires_in, retired = row
            if live:
                raise Refused.held(name, holder, term, expires_in)
            if nodes_table is not None and table_exists(conn, nodes_table):
                statement = nodes_sql(nodes_table, table, node_timeout, name)
                rows = conn.execute(statement).fetchall()
                alive = [node.node_id for node in node_infos(rows) if node.alive]
                if alive:
                    seen = f"seen within {node_timeout:g}s in {nodes_table!r}"
                    raise Refused.busy(name, alive, seen)
            if not retired:
                conn.execute(
                    sql.SQL("UPDATE {} SET retired_term = term WHERE name = %s").format(ident),
                    (name,),
                )
                if drains_table is not None:
                    _forget_drains(conn, drains_table, name)
                history = history_table_name(table)
                if table_exists(conn, history):
                    # A term its holder did not end (it crashed; nobody took over).
                    conn.execute(
                        sql.SQL(
                            "UPDATE {} SET ended_at = clock_timestamp(), end_reason = 'retired',"
                            " ended_by = %s WHERE name = %s AND term = %s AND ended_at IS NULL"
                        ).format(table_identifier(history)),
                        (OPERATOR, name, term),
                    )
    except psycopg.errors.LockNotAvailable as exc:
        raise Refused(
            f"lease {name!r} stayed locked for more than {LOCK_TIMEOUT:g}s (a leader "
            "acquiring it?); nothing was changed, check `rselection status` and try again"
        ) from exc
    return Retirement(name, int(term), bool(retired), f"the row's retired_term in {table!r}")
