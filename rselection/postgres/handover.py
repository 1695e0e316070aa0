"""Handover on request for Postgres leases (what ``rselection resign --dsn`` does).

:func:`request_handover` records a request for the current term on the lease row in one
statement: ``resign_term`` (the term), ``resign_from`` (its holder), ``resign_to`` (the
node asked for, or NULL) and ``resign_until`` (server time + its ``timeout``), and notifies
the lease's channel with a ``resign`` event. The leader's keeper wakes on it
(:func:`announces_handover`), renews at once, and its renewal reports the request when it
is for the term being renewed (:func:`renewal_request`); the leader then steps down
through the normal release. Until the next acquisition (which clears the request) or the
end of its timeout, the acquire statement refuses the lease to the resigning node and,
when a node was named, to every node but that one. A request only narrows who may
acquire, so it cannot make two leaders.

The ``resign_*`` columns come with schema version 2 (``rselection migrate``); leases on
an older table work, without handover requests.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
from psycopg import sql

from ..errors import ConfigError
from ..lease import HandoverRequest, LeaderInfo
from ..validation import check_name, check_node_id, check_seconds
from ._lease_sql import lease_channel, resolve_lease_table, utc
from .schema import DEFAULT_TABLE, table_identifier

__all__ = ["announces_handover", "cancel_handover", "renewal_request", "request_handover"]


def request_handover(
    conn: psycopg.Connection[Any],
    name: str,
    *,
    table: str = DEFAULT_TABLE,
    to: str | None = None,
    timeout: float = 10.0,
) -> LeaderInfo | None:
    """Ask the leader of lease ``name`` to hand over; return the holder asked.

    One statement: records the request on the lease row (``resign_term`` = the current
    term, ``resign_from`` = its holder, ``resign_to``, ``resign_until`` = server time +
    ``timeout``) and notifies the lease's channel, which wakes the leader. The leader
    sees the request in its next renewal (at once, thanks to the notification), cancels
    and drains its tasks and releases; a follower takes over. Until the next acquisition
    or the end of ``timeout``, the lease is reserved: the old holder may not take it
    back, and with ``to`` only that node may take it. Returns ``None`` when nobody holds
    the lease. A request for a term that has ended, or one whose timeout passed, is
    ignored.

    Args:
        conn: an open autocommit connection to the lease's database.
        name: the lease name.
        table: the lease table, optionally schema-qualified.
        to: node id that should take over, or ``None`` for any other node.
        timeout: seconds the request (and the reservation for ``to``) stays valid.

    Raises:
        ConfigError: the table does not exist or predates handovers (run ``rselection
            migrate``), or bad arguments.
        psycopg.Error: the statement failed.
    """
    timeout = check_seconds(timeout, "timeout")
    check_name(name, "lease name")
    if to is not None:
        check_node_id(to)
    found = resolve_lease_table(conn, table)
    if found is None:
        raise ConfigError(f"lease table {table!r} does not exist: run `rselection migrate`")
    _, qualified, handovers = found
    if not handovers:
        raise ConfigError(
            f"lease table {table!r} has schema version 1, without handover requests: "
            "run `rselection migrate` to upgrade it (rows are kept)"
        )
    row = conn.execute(
        sql.SQL(
            "WITH asked AS ("
            " UPDATE {t} AS t SET resign_term = t.term, resign_from = t.holder,"
            " resign_to = %(to)s,"
            " resign_until = clock_timestamp() + %(timeout)s * interval '1 second'"
            " WHERE t.name = %(name)s AND t.holder IS NOT NULL"
            " AND t.expires_at > clock_timestamp()"
            " RETURNING t.holder, t.term, t.acquired_at, t.expires_at)"
            " SELECT holder, term, acquired_at, expires_at,"
            " pg_notify(%(channel)s, json_build_object('event', 'resign', 'name', %(name)s,"
            " 'term', term, 'to', %(to)s)::text) FROM asked"
        ).format(t=table_identifier(table)),
        {
            "to": to,
            "timeout": timeout,
            "name": name,
            "channel": lease_channel(qualified, name),
        },
    ).fetchone()
    if row is None:
        return None
    return LeaderInfo(row[0], row[1], utc(row[2]), utc(row[3]))


def cancel_handover(
    conn: psycopg.Connection[Any], name: str, term: int, *, table: str = DEFAULT_TABLE
) -> bool:
    """Withdraw a handover request made for ``term`` of lease ``name``; ``True`` if one was.

    Args:
        conn: an open autocommit connection to the lease's database.
        name: the lease name.
        term: the term the request was made for.
        table: the lease table, optionally schema-qualified.
    """
    row = conn.execute(
        sql.SQL(
            "UPDATE {} SET resign_term = NULL, resign_from = NULL, resign_to = NULL,"
            " resign_until = NULL WHERE name = %s AND resign_term = %s RETURNING 1"
        ).format(table_identifier(table)),
        (name, term),
    ).fetchone()
    return row is not None


def announces_handover(payload: str) -> bool:
    """True when a notification payload on the lease's channel announces a handover
    request (the keeper then renews at once to see whether it is for its term)."""
    if '"resign"' not in payload:
        return False  # most notifications: skip the parse
    try:
        event = json.loads(payload)
    except ValueError:
        return False
    return isinstance(event, dict) and event.get("event") == "resign"


def renewal_request(term: int, row: tuple[Any, ...]) -> HandoverRequest | None:
    """The handover request a successful renewal of ``term`` reported, or ``None``.

    Args:
        term: the term renewed.
        row: the renewal's row: whether a request for ``term`` is pending, the node it
            names (or NULL) and the seconds left of its timeout.
    """
    asked, to, left = row
    if not asked:
        return None
    return HandoverRequest(term, to, float(left or 0.0))
