"""Handover on request for Postgres leases (what ``rselection resign --dsn`` does).

:func:`request_handover` records a request for the current term on the lease row and
notifies the lease's channel; the leader's keeper renews at once and its renewal
reports the request (:func:`renewal_request`), so it steps down through the normal
release. A request only narrows who may acquire, so it cannot make two leaders. See
``docs/explanation/how-it-works.md`` ("Handover on request"). Every function takes a
``conninfo`` (a connection string, a ``psycopg.Connection`` or a pool).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from ..errors import ConfigError
from ..lease import HandoverRequest, LeaderInfo
from ..validation import check_name, check_node_id, check_seconds, check_term
from ._lease_sql import lease_channel, resolve_lease_table, rows_sql, utc
from .connections import Connections
from .schema import DEFAULT_TABLE, NODES_TABLE, table_identifier

__all__ = [
    "announces_handover",
    "cancel_handover",
    "current_holder",
    "renewal_request",
    "reopen_handovers",
    "request_handover",
    "request_handovers",
]

#: The shortest request ``valid_for``, seconds (as on Redis, whose expiries are whole
#: milliseconds).
MIN_VALID_FOR = 0.001


@contextlib.contextmanager
def _one_call(conninfo: object, owner: str, what: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection for one call in one transaction; driver errors become
    :class:`~rselection.errors.BackendUnavailable` (a connection string's connection is
    closed after)."""
    conns = Connections(conninfo, owner=owner, application_name=f"rselection:{owner}", pooled=True)
    try:
        with conns.connection() as conn:
            try:
                with conn.transaction():
                    yield conn
            except psycopg.Error as exc:
                raise conns.wrap(what, exc) from exc
    finally:
        conns.close()


def _lease_table(conn: psycopg.Connection[Any], table: str) -> tuple[int, str, bool]:
    """The lease table as :func:`resolve_lease_table` finds it; a missing one raises."""
    found = resolve_lease_table(conn, table)
    if found is None:
        raise ConfigError(f"lease table {table!r} does not exist: run `rselection migrate`")
    return found


def request_handover(
    conninfo: Any,
    name: str,
    *,
    table: str = DEFAULT_TABLE,
    to: str | None = None,
    valid_for: float = 10.0,
) -> LeaderInfo | None:
    """Ask the leader of lease ``name`` to hand over; return the holder asked.

    One statement: records the request on the lease row (``resign_term`` = the current
    term, ``resign_from`` = its holder, ``resign_to``, ``resign_until`` = server time +
    ``valid_for``) and notifies the lease's channel, which wakes the leader. The leader
    sees the request in its next renewal (at once, thanks to the notification), cancels
    and drains its tasks and releases; a follower takes over. Until the next acquisition
    or the end of ``valid_for``, the lease is reserved: the old holder may not take it
    back, and with ``to`` only that node may take it. Returns ``None`` when nobody holds
    the lease. A request for a term that has ended, or one whose ``valid_for`` passed, is
    ignored.

    Args:
        conninfo: the lease's database: a connection string, a ``psycopg.Connection`` or
            a pool (``psycopg_pool.ConnectionPool``).
        name: the lease name.
        table: the lease table, optionally schema-qualified.
        to: node id that should take over, or ``None`` for any other node.
        valid_for: seconds the request (and the reservation for ``to``) stays valid (at
            least 1 ms).

    Raises:
        ConfigError: the table does not exist or predates handovers (run ``rselection
            migrate``), or bad arguments.
        BackendUnavailable: the database cannot be reached or the statement failed.
    """
    name = check_name(name, "lease name")
    valid_for = check_seconds(valid_for, "valid_for", minimum=MIN_VALID_FOR)
    if to is not None:
        to = check_node_id(to)
    with _one_call(conninfo, "request_handover", "record the handover request") as conn:
        row = _request(conn, name, table, to, valid_for)
    if row is None:
        return None
    return LeaderInfo(row[0], row[1], utc(row[2]), utc(row[3]))


def _request(
    conn: psycopg.Connection[Any], name: str, table: str, to: str | None, valid_for: float
) -> tuple[Any, ...] | None:
    """The request statement of :func:`request_handover`: the holder's row, or ``None``."""
    _, qualified, handovers = _lease_table(conn, table)
    if not handovers:
        raise _too_old(table)
    return conn.execute(
        sql.SQL(
            "WITH asked AS ("
            " UPDATE {t} AS t SET resign_term = t.term, resign_from = t.holder,"
            " resign_to = %(to)s,"
            " resign_until = clock_timestamp() + %(valid_for)s * interval '1 second'"
            " WHERE t.name = %(name)s AND t.holder IS NOT NULL"
            " AND t.expires_at > clock_timestamp()"
            " RETURNING t.holder, t.term, t.acquired_at, t.expires_at)"
            " SELECT holder, term, acquired_at, expires_at,"
            " pg_notify(%(channel)s, json_build_object('event', 'resign', 'name', %(name)s,"
            " 'term', term, 'to', %(to)s)::text) FROM asked"
        ).format(t=table_identifier(table)),
        {
            "to": to,
            "valid_for": valid_for,
            "name": name,
            "channel": lease_channel(qualified, name),
        },
    ).fetchone()


def request_handovers(
    conninfo: Any,
    targets: Mapping[str, str],
    *,
    table: str = DEFAULT_TABLE,
    valid_for: float = 10.0,
    members_of: str | None = None,
    nodes_table: str = NODES_TABLE,
    fence: tuple[str, int] | None = None,
) -> dict[str, LeaderInfo]:
    """:func:`request_handover` of many leases, each to a node of its own, in one
    statement; return the holder asked of each lease a request was recorded for.

    A lease nobody holds, or that its target holds already, is left alone (and missing
    from the answer).

    Args:
        conninfo: the leases' database: a connection string, a ``psycopg.Connection``
            or a pool.
        targets: the node that should take over each lease, by lease name.
        table: the lease table, optionally schema-qualified.
        valid_for: seconds each request (and its reservation) stays valid (at least 1 ms).
        members_of: when given, a lease name: a request is recorded only if its target
            has a row of that lease in ``nodes_table`` (it heartbeats as one of its
            nodes and has not left). The rows are locked ``FOR KEY SHARE`` by the
            statement, so a node that leaves (deletes its row) at the same moment either
            is skipped or leaves after the request committed, and then sees it (see
            :func:`reopen_handovers`).
        nodes_table: the nodes table ``members_of`` is looked up in.
        fence: when given, ``(lease name, term)``: the requests are recorded only while
            that term still holds that lease (as :func:`~rselection.postgres.fenced`
            checks, in the same statement), else nothing is and the answer is empty. A
            sharded leader's coordinator fences its moves by its own term, so that a
            deposed coordinator cannot move shards from a stale view.

    Raises:
        ConfigError: the table does not exist or predates handovers, or bad arguments.
        BackendUnavailable: the database cannot be reached or the statement failed.
    """
    if not isinstance(targets, Mapping):
        raise ConfigError(f"targets must map lease names to node ids, got {type(targets).__name__}")
    names = [check_name(name, "lease name") for name in targets]
    nodes = [check_node_id(node) for node in targets.values()]
    valid_for = check_seconds(valid_for, "valid_for", minimum=MIN_VALID_FOR)
    if members_of is not None:
        members_of = check_name(members_of, "lease name")
        table_identifier(nodes_table)  # validates
    if fence is not None:
        fence = (check_name(fence[0], "lease name"), check_term(fence[1]))
    if not names:
        return {}
    conditions: list[sql.Composable] = []
    if members_of is not None:
        # Locked: a node deleting its row (leaving) waits for this statement, or this
        # statement sees the row gone.
        conditions.append(
            sql.SQL(
                " AND r.target IN (SELECT m.node_id FROM {n} AS m WHERE m.name = %(members)s"
                " AND m.node_id IN (SELECT target FROM r) FOR KEY SHARE)"
            ).format(n=table_identifier(nodes_table))
        )
    if fence is not None:
        # As fenced(): a takeover of the fencing lease waits for this statement.
        conditions.append(
            sql.SQL(
                " AND EXISTS (SELECT 1 FROM {t} AS f WHERE f.name = %(fence_name)s"
                " AND f.term = %(fence_term)s AND f.holder IS NOT NULL"
                " AND f.expires_at > clock_timestamp() FOR KEY SHARE)"
            ).format(t=table_identifier(table))
        )
    with _one_call(conninfo, "request_handover", "record the handover requests") as conn:
        _, qualified, handovers = _lease_table(conn, table)
        if not handovers:
            raise _too_old(table)
        rows = conn.execute(
            sql.SQL(
                "WITH r(name, target, channel) AS ({values}),"
                " asked AS ("
                " UPDATE {t} AS t SET resign_term = t.term, resign_from = t.holder,"
                " resign_to = r.target,"
                " resign_until = clock_timestamp() + %(valid_for)s * interval '1 second'"
                " FROM r WHERE t.name = r.name AND t.holder IS NOT NULL"
                " AND t.holder <> r.target AND t.expires_at > clock_timestamp(){conditions}"
                " RETURNING t.name, t.holder, t.term, t.acquired_at, t.expires_at,"
                " r.target, r.channel)"
                " SELECT name, holder, term, acquired_at, expires_at,"
                " pg_notify(channel, json_build_object('event', 'resign', 'name', name,"
                " 'term', term, 'to', target)::text) FROM asked"
            ).format(
                t=table_identifier(table),
                values=_lease_rows(qualified, names, target=nodes),
                conditions=sql.Composed(conditions),
            ),
            {
                "valid_for": valid_for,
                "members": members_of,
                "fence_name": fence[0] if fence is not None else None,
                "fence_term": fence[1] if fence is not None else None,
            },
        ).fetchall()
    return {row[0]: LeaderInfo(row[1], row[2], utc(row[3]), utc(row[4])) for row in rows}


def reopen_handovers(
    conninfo: Any, names: Sequence[str], node_id: str, *, table: str = DEFAULT_TABLE
) -> list[str]:
    """Open to every node the handover requests of leases ``names`` reserved for
    ``node_id``; return the leases whose request was opened.

    What a node that leaves does once it no longer counts as a member (after its row in
    the nodes table is gone, see ``members_of`` of :func:`request_handovers`): a lease
    handed to it meanwhile is not left reserved for a node that will never take it. The
    old holder still may not take the lease back; any other node may, and the lease's
    channel is notified so that waiting followers attempt at once.

    Args:
        conninfo: the leases' database: a connection string, a ``psycopg.Connection``
            or a pool.
        names: the lease names to look at.
        node_id: the node the requests were reserved for.
        table: the lease table, optionally schema-qualified.

    Raises:
        ConfigError: the table does not exist or predates handovers, or bad arguments.
        BackendUnavailable: the database cannot be reached or the statement failed.
    """
    names = [check_name(name, "lease name") for name in names]
    node_id = check_node_id(node_id)
    if not names:
        return []
    with _one_call(conninfo, "reopen_handovers", "open the handover requests") as conn:
        _, qualified, handovers = _lease_table(conn, table)
        if not handovers:
            return []  # no requests without the columns
        rows = conn.execute(
            sql.SQL(
                "WITH r(name, channel) AS ({values}),"
                " opened AS ("
                " UPDATE {t} AS t SET resign_to = NULL FROM r WHERE t.name = r.name"
                " AND t.resign_to = %(node)s AND t.resign_until > clock_timestamp()"
                " RETURNING t.name, t.term, r.channel)"
                " SELECT name, pg_notify(channel, json_build_object('event', 'reopened',"
                " 'name', name, 'term', term)::text) FROM opened"
            ).format(t=table_identifier(table), values=_lease_rows(qualified, names)),
            {"node": node_id},
        ).fetchall()
    return [row[0] for row in rows]


def _lease_rows(qualified: str, names: list[str], **columns: list[str]) -> sql.Composed:
    """The rows ``x(name, <columns>..., channel)`` of leases ``names`` (text each), with
    the channel each lease's nodes listen on (in the table ``qualified``) last."""
    heads = ", ".join(["name", *columns, "channel"])
    channels = [lease_channel(qualified, name) for name in names]
    texts = [names, *columns.values(), channels]
    return rows_sql(f"x({heads})", *((values, "text") for values in texts))


def _one_row(
    conninfo: Any, table: str, statement: str, params: tuple[Any, ...], *, owner: str, what: str
) -> Any:
    """The row (or ``None``) of one ``statement`` on the lease ``table`` (its ``{}``), in a
    call of ``owner`` that does ``what`` (see :func:`_one_call`)."""
    with _one_call(conninfo, owner, what) as conn:
        _lease_table(conn, table)
        return conn.execute(sql.SQL(statement).format(table_identifier(table)), params).fetchone()


def _too_old(table: str) -> ConfigError:
    return ConfigError(
        f"lease table {table!r} has schema version 1, without handover requests: "
        "run `rselection migrate` to upgrade it (rows are kept)"
    )


def cancel_handover(conninfo: Any, name: str, term: int, *, table: str = DEFAULT_TABLE) -> bool:
    """Withdraw a handover request made for ``term`` of lease ``name``; ``True`` if one was.

    Args:
        conninfo: the lease's database: a connection string, a ``psycopg.Connection`` or
            a pool.
        name: the lease name.
        term: the term the request was made for (the ``term`` of
            :func:`request_handover`'s answer).
        table: the lease table, optionally schema-qualified.

    Raises:
        ConfigError: bad arguments, or the table does not exist.
        BackendUnavailable: the database cannot be reached or the statement failed.
    """
    name = check_name(name, "lease name")
    term = check_term(term)
    row = _one_row(
        conninfo,
        table,
        "UPDATE {} SET resign_term = NULL, resign_from = NULL, resign_to = NULL,"
        " resign_until = NULL WHERE name = %s AND resign_term = %s RETURNING 1",
        (name, term),
        owner="cancel_handover",
        what="withdraw the handover request",
    )
    return row is not None


def current_holder(conninfo: Any, name: str, *, table: str = DEFAULT_TABLE) -> LeaderInfo | None:
    """The live holder of Postgres lease ``name``, or ``None``.

    Args:
        conninfo: the lease's database: a connection string, a ``psycopg.Connection`` or
            a pool.
        name: the lease name.
        table: the lease table, optionally schema-qualified.

    Raises:
        ConfigError: bad arguments, or the table does not exist.
        BackendUnavailable: the database cannot be reached or the statement failed.
    """
    name = check_name(name, "lease name")
    row = _one_row(
        conninfo,
        table,
        "SELECT holder, term, acquired_at, expires_at FROM {} WHERE name = %s"
        " AND holder IS NOT NULL AND expires_at > clock_timestamp()",
        (name,),
        owner="current_holder",
        what="read the lease holder",
    )
    if row is None:
        return None
    return LeaderInfo(row[0], row[1], utc(row[2]), utc(row[3]))


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
            names (or NULL) and the seconds it stays valid.
    """
    asked, to, left = row
    if not asked:
        return None
    return HandoverRequest(term, to, float(left or 0.0))
