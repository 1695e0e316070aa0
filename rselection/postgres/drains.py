"""Drained nodes on Postgres: a table beside the nodes table, and a ``drain`` notice.

:func:`set_drained` writes (or deletes) a row of the drains table
(:func:`drains_table_name`) and, in the same transaction, notifies the lease's channel
(``{"event": "drain", "node_id": ...}``); every node of the lease listens there through
its keeper session and reads its own row again (:func:`is_drained`), whoever sent the
notice: any role that can connect may ``NOTIFY``, so a notice never says more than
"look". A node reads it too each time its leader (re)connects. A missing drains table
(a database migrated by an older release) means nobody is drained.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from ._lease_sql import lease_channel, resolve_lease_table
from .schema import create_tables, drains_table_name, table_exists, table_identifier

__all__ = [
    "drained_nodes",
    "drained_pairs",
    "drained_sql",
    "drains_table_name",
    "is_drained",
    "set_drained",
]


def is_drained(conn: psycopg.Connection[Any], nodes_table: str, name: str, node_id: str) -> bool:
    """Whether node ``node_id`` of lease ``name`` is drained (``False`` when there is no
    drains table).

    Args:
        conn: an autocommit connection.
        nodes_table: the nodes table (the drains table is beside it).
        name: the lease name.
        node_id: the node.
    """
    statement = sql.SQL("SELECT 1 FROM {} WHERE name = %s AND node_id = %s").format(
        table_identifier(drains_table_name(nodes_table))
    )
    try:
        return conn.execute(statement, (name, node_id)).fetchone() is not None
    except psycopg.errors.UndefinedTable:
        return False


def drained_sql(nodes_table: str, name: str, node_id: str) -> sql.Composed:
    """The read of :func:`is_drained`, its parameters inlined (for the keeper session's
    reads); a row when the node is drained.

    Args:
        nodes_table: the nodes table (the drains table is beside it).
        name: the lease name.
        node_id: the node.
    """
    return sql.SQL("SELECT 1 FROM {} WHERE name = {} AND node_id = {}").format(
        table_identifier(drains_table_name(nodes_table)), sql.Literal(name), sql.Literal(node_id)
    )


def drained_nodes(conn: psycopg.Connection[Any], nodes_table: str, name: str) -> set[str]:
    """The drained nodes of lease ``name``; empty when there is no drains table.

    Args:
        conn: an autocommit connection.
        nodes_table: the nodes table (the drains table is beside it).
        name: the lease name.
    """
    table = drains_table_name(nodes_table)
    if not table_exists(conn, table):
        return set()
    rows = conn.execute(
        sql.SQL("SELECT node_id FROM {} WHERE name = %s").format(table_identifier(table)),
        (name,),
    ).fetchall()
    return {row[0] for row in rows}


def drained_pairs(conn: psycopg.Connection[Any], nodes_table: str) -> set[tuple[str, str]]:
    """Every (lease name, node id) drained; empty when there is no drains table.

    Args:
        conn: an autocommit connection.
        nodes_table: the nodes table (the drains table is beside it).
    """
    table = drains_table_name(nodes_table)
    if not table_exists(conn, table):
        return set()
    rows = conn.execute(
        sql.SQL("SELECT name, node_id FROM {}").format(table_identifier(table))
    ).fetchall()
    return {(row[0], row[1]) for row in rows}


def set_drained(
    conn: psycopg.Connection[Any],
    *,
    lease_table: str,
    nodes_table: str,
    name: str,
    node_id: str,
    drained: bool,
) -> bool:
    """Record node ``node_id`` of lease ``name`` drained (``drained=True``, creating the
    drains table if missing) or not, and wake the lease's nodes; ``True`` when that
    changed something.

    Args:
        conn: an autocommit connection.
        lease_table: the lease table (names the lease's channel).
        nodes_table: the nodes table (the drains table is beside it).
        name: the lease name.
        node_id: the node.
        drained: drain the node (``True``) or undrain it.
    """
    table = drains_table_name(nodes_table)
    if drained:
        statement = sql.SQL(
            "INSERT INTO {} (name, node_id) VALUES (%s, %s) ON CONFLICT (name, node_id) DO NOTHING"
        ).format(table_identifier(table))
    else:
        statement = sql.SQL("DELETE FROM {} WHERE name = %s AND node_id = %s").format(
            table_identifier(table)
        )
    found = resolve_lease_table(conn, lease_table)
    channel = lease_channel(found[1], name) if found is not None else None
    if drained:
        create_tables(conn, drains=table)
    elif not table_exists(conn, table):
        return False  # nobody was ever drained here
    with conn.transaction():
        changed = conn.execute(statement, (name, node_id)).rowcount > 0
        if channel is not None:
            # Sent on commit, also when nothing changed: a node that missed the first
            # notice reads its row again.
            conn.execute(
                "SELECT pg_notify(%s, json_build_object('event', 'drain', 'name', %s::text,"
                " 'node_id', %s::text)::text)",
                (channel, name, node_id),
            )
    return changed
