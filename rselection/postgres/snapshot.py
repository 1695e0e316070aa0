"""Read a status snapshot of a Postgres lease table (what ``rselection status`` shows).

One pass over the lease table, its history table (the last change of holder), the
nodes table and the claims table (the last fires).
Columns a lease table of an older schema version lacks read as absent: no retired
mark, no handover requests (``handovers`` is then ``None``).
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from ..admin import LastFire, LeaseStatus, PendingHandover, StatusSnapshot
from ..history import TermRecord
from .history import last_changes
from .membership import node_infos, nodes_sql
from .schema import (
    LEASE_HANDOVER_COLUMNS,
    LEASE_RETIRED_COLUMNS,
    has_columns,
    table_exists,
    table_identifier,
)

__all__ = ["last_fires_sql", "read_snapshot"]


def _utc(value: datetime | None) -> datetime | None:
    return None if value is None else value.astimezone(UTC)


def _lease_rows(conn: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    """Every lease row: name, holder, term, acquired_at, expires_at, seconds to expiry,
    retired, and the pending handover request (term, node asked, node named, its end,
    seconds left) or NULLs. Columns a table of an older schema version lacks read NULL."""
    retired: sql.Composable
    handover: sql.Composable
    if has_columns(conn, table, LEASE_RETIRED_COLUMNS):
        retired = sql.SQL("coalesce(retired_term = term, false)")
    else:
        retired = sql.SQL("false")
    if has_columns(conn, table, LEASE_HANDOVER_COLUMNS):
        # A request lasts until its window ends or the next acquisition clears it; the
        # asked node stays kept out even after it released, so show it until then.
        pending = sql.SQL("resign_until > clock_timestamp()")
        handover = sql.SQL(
            "CASE WHEN {p} THEN resign_term END, CASE WHEN {p} THEN resign_from END,"
            " CASE WHEN {p} THEN resign_to END, CASE WHEN {p} THEN resign_until END,"
            " CASE WHEN {p} THEN"
            " extract(epoch FROM resign_until - clock_timestamp())::float8 END"
        ).format(p=pending)
    else:
        handover = sql.SQL("NULL::bigint, NULL::text, NULL::text, NULL::timestamptz, NULL::float8")
    return conn.execute(
        sql.SQL(
            "SELECT name, holder, term, acquired_at, expires_at,"
            " extract(epoch FROM expires_at - clock_timestamp())::float8, {retired}, {handover}"
            " FROM {t} ORDER BY name"
        ).format(retired=retired, handover=handover, t=table_identifier(table))
    ).fetchall()


def last_fires_sql() -> sql.SQL:
    """The newest claimed fire of each task of each lease, as (lease, task, fire, node,
    term, claimed_at), in a few index probes per task whatever the table's size; format
    it with ``l`` (the lease table) and ``c`` (the claims table).

    Claim keys are ``"<lease>/<task>@<UTC RFC 3339 nanos>"``, with ``%`` and ``/`` in the
    lease name written ``%25`` and ``%2F`` (:mod:`rselection.keys`): in byte order (the
    claims table's ``fire_key COLLATE "C"`` index) one lease's keys are one range, one
    task's keys are one range within it, and its newest fire sorts last. The walk visits
    each task once: the first key of the lease's range, the newest key of that key's
    task (same length, before ``"<lease>/<task>@["``), then the first key after it, and
    so on. A key that is not a fire key (no instant) counts as a task of its own.
    """
    key = '(c.fire_key COLLATE "C")'
    end = "((left(p.prefix, -1) || '0') COLLATE \"C\")"  # "/" + 1: past the lease's keys
    instant = "'@[0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}}T[0-9]{{2}}:[0-9]{{2}}:[0-9]{{2}}[.][0-9]{{9}}Z$'"
    newest = (
        f"CASE WHEN s.k ~ {instant} THEN (SELECT c.fire_key FROM {{c}} c"
        f' WHERE {key} >= (s.k COLLATE "C")'
        f" AND {key} < ((left(s.k, -30) || '[') COLLATE \"C\")"
        f" AND length(c.fire_key) = length(s.k) ORDER BY {key} DESC LIMIT 1) ELSE s.k END"
    )

    def first(op: str, bound: str) -> str:
        return (
            f'(SELECT c.fire_key FROM {{c}} c WHERE {key} {op} ({bound} COLLATE "C")'
            f" AND {key} < {end} ORDER BY {key} LIMIT 1)"
        )

    return sql.SQL(
        "WITH RECURSIVE p AS ("
        " SELECT l.name, replace(replace(l.name, '%', '%25'), '/', '%2F') || '/' AS prefix"
        " FROM {l} l"
        "), walk(name, prefix, newest) AS ("
        " SELECT p.name, p.prefix, f.newest FROM p"
        f" CROSS JOIN LATERAL (SELECT {first('>=', 'p.prefix')} AS k) s"
        f" CROSS JOIN LATERAL (SELECT {newest} AS newest) f WHERE s.k IS NOT NULL"
        " UNION ALL"
        " SELECT p.name, p.prefix, f.newest FROM walk p"
        f" CROSS JOIN LATERAL (SELECT {first('>', 'p.newest')} AS k) s"
        f" CROSS JOIN LATERAL (SELECT {newest} AS newest) f WHERE s.k IS NOT NULL"
        ") SELECT DISTINCT ON (w.name, k.task) w.name, k.task, k.fire,"
        " c.holder, c.term, c.claimed_at"
        " FROM walk w CROSS JOIN LATERAL (SELECT c.holder, c.term, c.claimed_at"
        " FROM {c} c WHERE c.fire_key = w.newest LIMIT 1) c"
        " CROSS JOIN LATERAL (SELECT"
        " regexp_replace(substr(w.newest, length(w.prefix) + 1), '@[^@]*$', '') AS task,"
        " substring(w.newest FROM '@([^@]*)$') AS fire) k"
        " ORDER BY w.name, k.task, k.fire DESC"
    )


def _lease(row: tuple[Any, ...], changes: dict[str, TermRecord]) -> LeaseStatus:
    name, holder, term, acquired_at, expires_at, expires_in, retired = row[:7]
    live = holder is not None and expires_in is not None and expires_in > 0
    return LeaseStatus(
        name=name,
        holder=holder if live else None,
        term=term,
        acquired_at=_utc(acquired_at) if live else None,
        expires_at=_utc(expires_at) if live else None,
        expires_in=expires_in if live else None,
        retired=bool(retired),
        last_change=changes.get(name),
    )


def _handover(row: tuple[Any, ...]) -> PendingHandover | None:
    term, node_id, to, until, left = row[7:]
    if until is None:
        return None
    return PendingHandover(row[0], term, node_id, to, until.astimezone(UTC), left)


def read_snapshot(
    conn: psycopg.Connection[Any],
    *,
    table: str,
    nodes_table: str,
    claims_table: str,
    node_timeout: float,
    names: Collection[str] | None = None,
) -> StatusSnapshot:
    """One snapshot of leases ``names`` (and their shards), or of every lease.

    Args:
        conn: an open connection to a database with the lease table.
        table: the lease table.
        nodes_table: the nodes table (``nodes`` is ``None`` when it does not exist).
        claims_table: the claims table (``fires`` is ``None`` when it does not exist).
        node_timeout: a node is alive when seen within this many seconds.
        names: the leases asked for (with their shards ``NAME/<k>``); ``None``: all.

    Raises:
        psycopg.Error: the database failed (or has no lease table).
    """
    asked = None if names is None else set(names)

    def wanted(lease: str) -> bool:
        return asked is None or lease in asked or lease.rpartition("/")[0] in asked

    with conn.transaction():
        now_row = conn.execute("SELECT clock_timestamp()").fetchone()
        handovers_recorded = has_columns(conn, table, LEASE_HANDOVER_COLUMNS)
        lease_rows = [row for row in _lease_rows(conn, table) if wanted(row[0])]
        changes = last_changes(conn, [row[0] for row in lease_rows], table=table)
        node_rows = None
        if table_exists(conn, nodes_table):
            node_rows = conn.execute(nodes_sql(nodes_table, table, node_timeout)).fetchall()
        fire_rows = None
        if table_exists(conn, claims_table):
            # A few index probes per task: compiling the query (JIT, tempted by the
            # recursive walk's estimates) would take longer than running it.
            conn.execute("SET LOCAL jit = off")
            fire_rows = conn.execute(
                last_fires_sql().format(l=table_identifier(table), c=table_identifier(claims_table))
            ).fetchall()
    assert now_row is not None
    handovers = [h for h in map(_handover, lease_rows) if h is not None]
    return StatusSnapshot(
        checked_at=now_row[0].astimezone(UTC),
        leases=tuple(_lease(row, changes) for row in lease_rows),
        handovers=tuple(handovers) if handovers_recorded else None,
        nodes=None
        if node_rows is None
        else tuple(node for node in node_infos(node_rows) if wanted(node.name)),
        fires=None
        if fire_rows is None
        else tuple(
            LastFire(lease, task, fire, node, term, claimed_at.astimezone(UTC))
            for lease, task, fire, node, term, claimed_at in fire_rows
            if wanted(lease)
        ),
    )
