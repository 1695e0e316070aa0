"""Read a Postgres lease table's leadership history (``<table>_history``).

The acquisition and release statements of :mod:`rselection.postgres._lease_sql` write
it; this module reads it for ``rselection history``, ``status`` and the admin API, as
:class:`~rselection.history.TermRecord` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC
from typing import Any

import psycopg
from psycopg import sql

from ..history import TermRecord
from .schema import history_table_name, table_exists, table_identifier

__all__ = ["last_changes", "read_history"]

_COLUMNS = sql.SQL(
    "h.name, h.term, h.node_id, h.version, h.hostname, h.pid, h.began_at, h.ended_at,"
    " h.end_reason, h.handed_to, h.ended_by"
)


def _record(row: Sequence[Any]) -> TermRecord:
    began, ended = row[6], row[7]
    return TermRecord(
        name=row[0],
        term=int(row[1]),
        node_id=row[2],
        version=row[3],
        hostname=row[4],
        pid=row[5],
        began_at=began.astimezone(UTC),
        ended_at=None if ended is None else ended.astimezone(UTC),
        end_reason=row[8],
        handed_to=row[9],
        by=row[10],
    )


def read_history(
    conn: psycopg.Connection[Any], name: str, *, table: str, limit: int
) -> list[TermRecord] | None:
    """The last ``limit`` terms of lease ``name``, newest first; ``None`` when the lease
    table has no history table yet (``rselection migrate`` creates it).

    Raises:
        psycopg.Error: the database failed.
    """
    history = history_table_name(table)
    if not table_exists(conn, history):
        return None
    rows = conn.execute(
        sql.SQL("SELECT {c} FROM {h} AS h WHERE h.name = %s ORDER BY h.term DESC LIMIT %s").format(
            c=_COLUMNS, h=table_identifier(history)
        ),
        (name, limit),
    ).fetchall()
    return [_record(row) for row in rows]


def last_changes(
    conn: psycopg.Connection[Any], names: Sequence[str], *, table: str
) -> dict[str, TermRecord]:
    """The newest ended term of each of ``names`` that has one: the last change of
    holder (an index probe per lease); nothing when there is no history table.

    Raises:
        psycopg.Error: the database failed.
    """
    history = history_table_name(table)
    if not names or not table_exists(conn, history):
        return {}
    rows = conn.execute(
        sql.SQL(
            "SELECT {c} FROM unnest(%s::text[]) AS l(name) CROSS JOIN LATERAL"
            " (SELECT * FROM {h} AS h WHERE h.name = l.name AND h.ended_at IS NOT NULL"
            " ORDER BY h.term DESC LIMIT 1) AS h"
        ).format(c=_COLUMNS, h=table_identifier(history)),
        (list(names),),
    ).fetchall()
    return {row[0]: _record(row) for row in rows}
