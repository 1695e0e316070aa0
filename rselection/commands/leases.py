"""What the subcommands read from a lease table: live holders, node heartbeats, columns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

__all__ = ["has_columns", "lease_exists", "lease_nodes", "live_holder"]


def live_holder(conn: psycopg.Connection[Any], table: str, name: str) -> tuple[str, int] | None:
    """``(node id, term)`` of the live holder of lease ``name``, or ``None``.

    Args:
        conn: an open autocommit connection.
        table: the lease table.
        name: the lease name.
    """
    from psycopg import sql

    from ..postgres.schema import table_identifier

    row = conn.execute(
        sql.SQL(
            "SELECT holder, term FROM {} WHERE name = %s AND holder IS NOT NULL"
            " AND expires_at > clock_timestamp()"
        ).format(table_identifier(table)),
        (name,),
    ).fetchone()
    return (row[0], row[1]) if row is not None else None


def lease_exists(conn: psycopg.Connection[Any], table: str, name: str) -> bool:
    """Whether lease ``name`` has a row in ``table`` (held, released or retired).

    Args:
        conn: an open autocommit connection.
        table: the lease table.
        name: the lease name.
    """
    from psycopg import sql

    from ..postgres.schema import table_identifier

    row = conn.execute(
        sql.SQL("SELECT 1 FROM {} WHERE name = %s").format(table_identifier(table)), (name,)
    ).fetchone()
    return row is not None


def lease_nodes(
    conn: psycopg.Connection[Any], nodes_table: str, name: str, node_timeout: float
) -> list[tuple[str, bool]] | None:
    """``(node id, alive)`` of every node row of lease ``name``; ``None`` without a table.

    Args:
        conn: an open autocommit connection.
        nodes_table: the node heartbeats table.
        name: the lease name.
        node_timeout: a node is alive when seen within this many seconds.
    """
    from psycopg import sql

    from ..postgres.schema import table_identifier
    from .connections import table_exists

    if not table_exists(conn, nodes_table):
        return None
    rows = conn.execute(
        sql.SQL(
            "SELECT node_id, last_seen >= clock_timestamp() - make_interval(secs => %s)"
            " FROM {} WHERE name = %s ORDER BY started_at, node_id"
        ).format(table_identifier(nodes_table)),
        (node_timeout, name),
    ).fetchall()
    return [(node_id, bool(alive)) for node_id, alive in rows]


def has_columns(conn: psycopg.Connection[Any], table: str, columns: tuple[str, ...]) -> bool:
    """Whether the existing ``table`` has every one of ``columns`` (a schema version check).

    Args:
        conn: an open autocommit connection.
        table: the table, optionally schema-qualified.
        columns: column names.
    """
    from ..postgres.schema import table_identifier

    row = conn.execute(
        "SELECT count(*) FROM pg_catalog.pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attname = ANY(%s) AND NOT attisdropped",
        (table_identifier(table).as_string(conn), list(columns)),
    ).fetchone()
    return row is not None and row[0] == len(columns)
