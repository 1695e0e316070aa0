"""The SQL of :class:`~rselection.postgres.lease.PostgresLease`.

How a lease table is found, how lock keys are drawn and what a lease's channel is
called, and builders for the statements the keeper runs. The builders only compose
text; the lease runs them on its keeper session (several statements in one round trip,
so literals are inlined: such a query cannot take parameters). The design, and why each
condition is there, is in :mod:`rselection.postgres.lease`.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from ..history import HISTORY_LIMIT
from ._conn import Keepalives
from .schema import (
    DEFAULT_TABLE,
    LEASE_HANDOVER_COLUMNS,
    LEASE_PROTOCOL_COLUMNS,
    LEASE_SERVER_COLUMNS,
    history_table_name,
    table_identifier,
)

__all__ = [
    "LEASE_PROTOCOL",
    "SERVER_IDENTITY_SQL",
    "SERVER_START_SQL",
    "STATE_COLUMNS",
    "AcquireRequest",
    "Ending",
    "array_literal",
    "LeaseTable",
    "RenewRequest",
    "acquire_batch_sql",
    "current_sql",
    "describe_lease_table",
    "lease_channel",
    "listen_sql",
    "new_lock_key",
    "ReleaseRequest",
    "release_batch_sql",
    "release_sql",
    "renew_batch_sql",
    "resolve_lease_table",
    "server_identity",
    "session_sql",
    "give_back_sql",
    "unlisten_sql",
    "unlock_next_terms_sql",
    "unlock_sql",
    "utc",
]

_MAX_CHANNEL = 63  # NAMEDATALEN - 1

LEASE_PROTOCOL = 2
"""The lease protocol this release speaks, recorded in every row it acquires.

1 (rselection 0.1, rows without a ``protocol``): one keeper session per lease, followers
waiting on the holder's lock. 2: one keeper session per process shared by all its leases,
takeovers that never wait for a row lock (``SKIP LOCKED``), a ring of watcher sessions
that announces a dead keeper session. Nodes of different protocols must never compete for
one lease table (see :mod:`rselection.postgres.lease`)."""


def new_lock_key() -> int:
    """A fresh advisory-lock key for the next term of a lease: 32 random bits, signed.

    Every acquisition draws one and stores it in the row's ``lock_key`` in the statement
    that takes the lease, so a term locks ``(lock_key, term % 2**31)`` under a key that
    nobody knew before that term began: a role that may not read the lease table cannot
    take the lock of a term to come (the lock of the running term, which ``pg_locks``
    shows to every role, says nothing about the next one). The stored value stays the
    only one any node uses for that term: the holder locks it, frees it when the term
    ends, and followers look for it in ``pg_locks``. Before this, a row kept for ever a
    key derived from the table's OID and the lease name, which any role could compute
    (such a row gets a random key at its next acquisition; see
    :func:`acquire_batch_sql`).
    """
    return secrets.randbits(32) - 2**31


def lease_channel(qualified_table: str, name: str) -> str:
    """The LISTEN/NOTIFY channel of a lease (at most 63 bytes).

    ``rselection:<schema>.<table>:<name>``, or ``rselection:<hash>`` when that is longer
    than Postgres allows for a channel name.

    Args:
        qualified_table: the lease table as ``schema.table`` (resolved by the server).
        name: the lease name.
    """
    channel = f"rselection:{qualified_table}:{name}"
    if len(channel.encode()) <= _MAX_CHANNEL:
        return channel
    return "rselection:" + hashlib.blake2b(channel.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class LeaseTable:
    """A lease table as the server resolved it.

    Attributes:
        oid: its OID (names the ring, see :mod:`rselection.postgres.ring`).
        qualified: its ``schema.table`` name (names the channel, see :func:`lease_channel`).
        handovers: it has the handover columns (schema version 2).
        servers: it has the ``holder_server`` column (schema version 3).
        protocols: it has the ``protocol`` column (schema version 5), which the shared
            keeper of lease protocol 2 needs.
        history: its leadership history table exists (``<table>_history``, created
            beside it whatever its version), which the keeper's acquisitions and releases
            write.
    """

    oid: int
    qualified: str
    handovers: bool
    servers: bool
    protocols: bool = False
    history: bool = False


def describe_lease_table(
    conn: psycopg.Connection[Any], table: str = DEFAULT_TABLE
) -> LeaseTable | None:
    """Find a lease table as the server resolves it; ``None`` when it does not exist.

    Args:
        conn: an open connection (its ``search_path`` resolves an unqualified name).
        table: the lease table, optionally schema-qualified.
    """
    row = conn.execute(
        "SELECT c.oid::bigint, n.nspname, c.relname,"
        " (SELECT count(*) FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid"
        " AND a.attname = ANY(%s) AND NOT a.attisdropped),"
        " (SELECT count(*) FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid"
        " AND a.attname = ANY(%s) AND NOT a.attisdropped),"
        " (SELECT count(*) FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid"
        " AND a.attname = ANY(%s) AND NOT a.attisdropped),"
        " to_regclass(%s) IS NOT NULL"
        " FROM pg_catalog.pg_class c"
        " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.oid = to_regclass(%s)",
        (
            list(LEASE_HANDOVER_COLUMNS),
            list(LEASE_SERVER_COLUMNS),
            list(LEASE_PROTOCOL_COLUMNS),
            table_identifier(history_table_name(table)).as_string(conn),
            table_identifier(table).as_string(conn),
        ),
    ).fetchone()
    if row is None:
        return None
    oid, schema, relname, handovers, servers, protocols, history = row
    return LeaseTable(
        int(oid),
        f"{schema}.{relname}",
        handovers == len(LEASE_HANDOVER_COLUMNS),
        servers == len(LEASE_SERVER_COLUMNS),
        protocols == len(LEASE_PROTOCOL_COLUMNS),
        bool(history),
    )


def resolve_lease_table(
    conn: psycopg.Connection[Any], table: str = DEFAULT_TABLE
) -> tuple[int, str, bool] | None:
    """Find a lease table as the server resolves it; ``None`` when it does not exist.

    Returns its OID, its ``schema.table`` name (for :func:`lease_channel`) and whether
    it has the handover columns (schema version 2).

    Args:
        conn: an open connection (its ``search_path`` resolves an unqualified name).
        table: the lease table, optionally schema-qualified.
    """
    found = describe_lease_table(conn, table)
    if found is None:
        return None
    return found.oid, found.qualified, found.handovers


#: Reads what identifies the server of this session, as long as the session lives:
#: whether it is a standby (in recovery), its system identifier, its WAL insertion
#: timeline (the first 8 hex digits of the current WAL file name: it is the new
#: timeline from the moment a promoted standby accepts writes, while
#: ``pg_control_checkpoint()`` lags until the next checkpoint) and the postmaster's
#: start time. Every function here is executable by any role on a stock server.
SERVER_IDENTITY_SQL = sql.SQL(
    "SELECT pg_is_in_recovery(),"
    " (SELECT system_identifier FROM pg_catalog.pg_control_system()),"
    " CASE WHEN NOT pg_is_in_recovery()"
    " THEN pg_walfile_name(pg_current_wal_lsn()) END,"
    " pg_postmaster_start_time()"
)

#: The same without the functions a hardened or managed server may refuse: the postmaster
#: start time alone still tells servers and restarts apart.
SERVER_START_SQL = sql.SQL(
    "SELECT pg_is_in_recovery(), NULL::bigint, NULL::text, pg_postmaster_start_time()"
)


def server_identity(system_id: int | None, walfile: str | None, started: datetime) -> str:
    """The ``holder_server`` text of a server: ``"<system id>/<timeline>/<start>"``.

    Args:
        system_id: ``pg_control_system().system_identifier`` (``None``: unknown, ``-``).
        walfile: a WAL file name of the server's current timeline (``None``: unknown).
        started: ``pg_postmaster_start_time()``.
    """
    timeline = "-" if not walfile else str(int(walfile[:8], 16))
    system = "-" if system_id is None else str(system_id)
    return f"{system}/{timeline}/{utc(started).isoformat()}"


def utc(value: datetime) -> datetime:
    """A server timestamp (``timestamptz``) in UTC."""
    return value.astimezone(UTC)


#: True when the holder of row ``t`` still has its keeper session: the session advisory
#: lock (lock_key, term % 2**31) is granted to holder_pid. classid and objid are oids
#: (unsigned): compare as bigint, the signed lock_key mapped to its unsigned value.
#: Written as ``IN`` over a subquery that names no column of ``t``: the server reads the
#: lock table once per use into a hash table, where ``EXISTS`` with ``t``'s columns
#: scanned every lock of the server again for each row (a batch of a thousand leases,
#: with a thousand locks held, took a second).
#:
#: Each use reads the lock table anew, when it is first evaluated, and an acquisition
#: relies on that (see :func:`acquire_batch_sql`); a statement that only reports uses
#: :data:`HELD_LOCKS` and :data:`LOCK_SEEN` instead.
LOCK_HELD = (
    "COALESCE((t.lock_key::bigint & 4294967295, t.term % 2147483648, t.holder_pid) IN"
    " (SELECT l.classid::bigint, l.objid::bigint, l.pid FROM pg_catalog.pg_locks l"
    " WHERE l.locktype = 'advisory'"
    " AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d"
    " WHERE d.datname = current_database())"
    " AND l.objsubid = 2 AND l.granted AND l.pid IS NOT NULL), false)"
)

#: The advisory locks a statement that only reports looks at (:func:`states_sql`), read
#: from the server's lock table once for the whole statement (a ``WITH`` item,
#: ``held_locks``): the two-key locks of terms (``objsubid = 2``) in this database, and
#: the one-key ring locks of the lease table's ring class ``{ring}`` (``objsubid = 1``,
#: in any database). Each reference to ``pg_locks`` is a call of ``pg_lock_status()``,
#: which copies the whole lock table: the states of an attempt read it four times, which
#: took most of a one-lease attempt's time on a server where a thousand locks are held.
HELD_LOCKS = (
    "held_locks AS MATERIALIZED (SELECT l.objsubid, l.classid::bigint AS classid,"
    " l.objid::bigint AS objid, l.pid FROM pg_catalog.pg_locks l"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL"
    " AND ((l.objsubid = 2 AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d"
    " WHERE d.datname = current_database()))"
    " OR (l.objsubid = 1 AND l.classid::bigint = {ring})))"
)

#: :data:`LOCK_HELD` as ``held_locks`` (:data:`HELD_LOCKS`) saw the lock table.
LOCK_SEEN = (
    "COALESCE((t.lock_key::bigint & 4294967295, t.term % 2147483648, t.holder_pid) IN"
    " (SELECT h.classid, h.objid, h.pid FROM held_locks h WHERE h.objsubid = 2), false)"
)


def held_locks(ring: int) -> sql.Composed:
    """The ``WITH`` item :data:`HELD_LOCKS` of the lease table whose ring class is
    ``ring`` (:func:`~rselection.postgres.ring.ring_class`)."""
    return sql.SQL(HELD_LOCKS).format(ring=sql.Literal(ring))


def session_sql(keepalives: Keepalives, user_timeout: int) -> sql.Composed:
    """Pin the keeper session's settings and read back its TCP settings.

    The second statement returns the keepalives (idle, interval, count) and
    ``tcp_user_timeout`` (ms) in effect. Run again on a connected session when a lease
    with a longer wind-down joins it.

    Args:
        keepalives: the server-side TCP keepalives to set.
        user_timeout: the server-side ``tcp_user_timeout`` to set, milliseconds.
    """
    ka = keepalives
    settings = {
        "idle_session_timeout": "0",
        "idle_in_transaction_session_timeout": "0",
        "statement_timeout": "0",
        "lock_timeout": "0",
        "tcp_keepalives_idle": str(ka.idle),
        "tcp_keepalives_interval": str(ka.interval),
        "tcp_keepalives_count": str(ka.count),
        "tcp_user_timeout": str(user_timeout),
        "default_transaction_isolation": "read committed",
        "default_transaction_read_only": "off",
    }
    values = sql.SQL(", ").join(
        sql.SQL("({}, {})").format(sql.Literal(k), sql.Literal(v)) for k, v in settings.items()
    )
    # pg_settings filters out settings this server version does not have.
    return sql.SQL(
        "SELECT count(set_config(s.name, v.setting, false))"
        " FROM (VALUES {values}) AS v(name, setting)"
        " JOIN pg_catalog.pg_settings s ON s.name = v.name;"
        " SELECT current_setting('tcp_keepalives_idle')::int,"
        " current_setting('tcp_keepalives_interval')::int,"
        " current_setting('tcp_keepalives_count')::int,"
        " current_setting('tcp_user_timeout', true)::int"
    ).format(values=values)


def listen_sql(channels: Iterable[str]) -> sql.Composed:
    """``LISTEN`` on every channel, in one round trip."""
    return sql.SQL("; ").join(
        sql.SQL("LISTEN {}").format(sql.Identifier(channel)) for channel in channels
    )


def unlisten_sql(channels: Iterable[str]) -> sql.Composed:
    """``UNLISTEN`` every channel, in one round trip."""
    return sql.SQL("; ").join(
        sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)) for channel in channels
    )


def same_server(server: str | None) -> sql.Composable:
    """True when row ``t``'s holder session is on this server (``server``); never NULL.

    Args:
        server: this session's :func:`server_identity`, or ``None`` when the table has
            no ``holder_server`` column (then never true).
    """
    if server is None:
        return sql.SQL("false")
    return sql.SQL("coalesce(t.holder_server = {}, false)").format(sql.Literal(server))


def free_condition(server: str | None, *, held: str = LOCK_HELD) -> sql.Composed:
    """True when row ``t`` may be taken: free, expired, or its holder's session is gone.

    The session check (the term's lock not held) only counts for a holder whose session
    is on this very server, as recorded when it acquired (:func:`same_server`): after a
    restart or a failover to a promoted standby the holder's pid and lock mean nothing
    here, and its leader, cut off from the old server, may not have noticed; such a
    lease is only taken over once it expires.

    A lease held through this very session is no exception: the session is shared by
    every lease object and node of the process, and another leader of the same lease
    and node id (a leader restarted in the process while the old one's term still winds
    down) must wait until that term's lock is freed, when its tasks are joined.

    Args:
        server: this session's server identity (``None``: expiry only).
        held: the condition that the holder's lock is held: :data:`LOCK_HELD`, or
            :data:`LOCK_SEEN` in a statement that only reports.
    """
    return sql.SQL(
        "(t.holder IS NULL OR t.holder_pid IS NULL OR t.expires_at IS NULL"
        " OR t.expires_at <= clock_timestamp()"
        " OR ({same} AND NOT " + held + "))"
    ).format(same=same_server(server))


def not_reserved(node: sql.Composable, *, handovers: bool = True) -> sql.Composable:
    """True unless a handover request reserves row ``t`` against node ``node``.

    While a request's window lasts (until the next acquisition clears it), the node
    that was asked to hand over may not take the lease back, and when a node was
    named only that node may take it. This only ever narrows who may take the
    lease, so it cannot make two leaders. Never NULL (``CASE`` below relies on it).

    Args:
        node: the node id, as a literal or a column.
        handovers: the table has the handover columns (else always true).
    """
    if not handovers:
        return sql.SQL("true")
    return sql.SQL(
        "(t.resign_until IS NULL OR t.resign_until <= clock_timestamp()"
        " OR t.resign_to IS NOT DISTINCT FROM {node}"
        " OR (t.resign_to IS NULL AND t.resign_from IS DISTINCT FROM {node}))"
    ).format(node=node)


class Ending(NamedTuple):
    """Why a term ended, as its leader said, kept by the session that held it until its
    release (see :attr:`AcquireRequest.ended`)."""

    term: int
    lock_key: int  # the term's lock key: no other incarnation of the term has it
    reason: str
    by: str | None


@dataclass(frozen=True)
class AcquireRequest:
    """One node's attempt at one lease in a batch (:func:`acquire_batch_sql`).

    Attributes:
        name: the lease name (at most one request per name in a batch).
        node_id: the node asking.
        ttl: the lease's ttl, seconds.
        lock_key: the key of the term this attempt would take (and of a new row): drawn
            afresh for every attempt (:func:`new_lock_key`).
        channel: the lease's channel (notified on acquisition).
        create: insert the row first (the lease was not seen yet).
        version: the node's version, recorded with the term it takes.
        history_limit: terms of the lease's history to keep (older ones are trimmed
            when it takes one).
        ended: the term of this lease that a leader of this process last ended (its
            tasks joined), and why: if the attempt takes that very term over (its term
            and lock key) before its release, its record closes with that reason, not
            as ``session_lost``.
    """

    name: str
    node_id: str
    ttl: float
    lock_key: int
    channel: str
    create: bool
    version: str | None = None
    history_limit: int = HISTORY_LIMIT
    ended: Ending | None = None


#: Columns of the rows :func:`acquire_batch_sql` and :func:`states_sql` return, in order.
STATE_COLUMNS = (
    "name",
    "holder",
    "term",
    "lock_key",
    "acquired_at",
    "expires_at",
    "expires_in",
    "lock_held",
    "reserved",
    "protocol",
    "takeable",
    "holder_pid",
)


def array_literal(values: Iterable[str | int | float | None], kind: str) -> sql.Composed:
    """An array of ``kind`` (``text``, ``bigint``, ``integer``, ``float8``) as one
    quoted literal, ``'{...}'::kind[]``.

    Written here rather than by psycopg's list adapter, which looks up a dumper and runs
    a regular expression for each element: the keeper composes arrays of a thousand
    names every few seconds, and that adapter was most of an idle follower's work on
    its thread. Each string element is double-quoted with its ``"`` and ``\\``
    escaped (array input syntax: only those two are special inside quotes, so any text
    reads back as itself, ``NULL`` included); ``None`` is a SQL NULL; numbers are
    written as Python spells them (finite ones only: a lease's timings are). The
    whole is one string literal, quoted by psycopg.
    """
    parts = []
    for value in values:
        if value is None:
            parts.append("NULL")
        elif isinstance(value, str):
            parts.append('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"cannot write {value!r:.40} into an array literal")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} into an array literal")
        else:
            parts.append(repr(value))
    return sql.SQL("{}::{}[]").format(sql.Literal("{" + ",".join(parts) + "}"), sql.SQL(kind))


def rows_sql(columns: str, *arrays: tuple[Sequence[Any], str]) -> sql.Composed:
    """``SELECT`` of ``unnest`` over one array literal per column (``(values, type)``):
    a batch of a thousand rows is a few array literals, not thousands of literals to
    compose every round."""
    return sql.SQL("SELECT * FROM unnest({}) AS {}").format(
        sql.SQL(", ").join(array_literal(values, kind) for values, kind in arrays),
        sql.SQL(columns),
    )


def batch_sql(columns: str, rows: Iterable[Sequence[Any]]) -> sql.Composed:
    """:func:`rows_sql` of ``rows`` as ``x(<names>)``: each row a tuple in the order of
    ``columns``, ``"name type, ..."``."""
    names, kinds = zip(*(column.split() for column in columns.split(",")), strict=True)
    arrays = list(zip(*rows, strict=True)) or [()] * len(names)
    return rows_sql(f"x({', '.join(names)})", *zip(arrays, kinds, strict=True))


_REQUEST_TYPES = (
    "name text, node text, ttl float8, channel text, lock_key integer, version text,"
    " keep integer, ended_term bigint, ended_key integer, ended_reason text, ended_by text"
)

#: The columns of :func:`_requests`' rows.
REQUEST_COLUMNS = "(" + ", ".join(column.split()[0] for column in _REQUEST_TYPES.split(",")) + ")"

_NOT_ENDED = (None, None, None, None)  # the ended_* columns of a request without an Ending


def _requests(requests: Sequence[AcquireRequest]) -> sql.Composed:
    return batch_sql(
        _REQUEST_TYPES,
        (
            (r.name, r.node_id, r.ttl, r.channel, r.lock_key, r.version, r.history_limit)
            + (r.ended or _NOT_ENDED)
            for r in requests
        ),
    )


#: True when the holder's session of row ``t`` holds a ring lock (of the ring class
#: :data:`HELD_LOCKS` reads, whatever the lower 32 bits), as ``held_locks`` saw the lock
#: table: every keeper session of protocol 2 does, none of protocol 1. Another session's
#: lock cannot count for the holder's.
RING_HELD = "COALESCE(t.holder_pid IN (SELECT h.pid FROM held_locks h WHERE h.objsubid = 1), false)"


def states_sql(
    table: sql.Composable, requests: Sequence[AcquireRequest], *, server: str, ring: int
) -> sql.Composed:
    """Read each requested lease row as its requesting node sees it (see
    :data:`STATE_COLUMNS`): seconds until expiry, whether the holder's lock is held (on
    this server), seconds the row stays reserved against that node by a handover request
    (0 when it may take the lease), the protocol the holder speaks, and whether the node
    may take the lease now (free, expired or its holder's session gone, and not reserved):
    true for a lease an attempt did not take only when another transaction held its row
    (fenced transactions of the old term, another node's attempt), so look again soon.

    The protocol is the row's, except for a holder whose session holds its lease lock
    but no ring lock: that is a node of protocol 1, which never writes the column (a row
    it took over from a node of protocol 2 still says 2).
    """
    node = sql.SQL("r.node")
    return sql.SQL(
        "WITH {locks}"
        " SELECT t.name, t.holder, t.term, t.lock_key, t.acquired_at, t.expires_at,"
        " greatest(0, extract(epoch FROM t.expires_at - clock_timestamp()))::float8,"
        " ({same} AND " + LOCK_SEEN + "),"
        " CASE WHEN NOT {open} THEN greatest(0, extract(epoch FROM"
        " t.resign_until - clock_timestamp()))::float8 ELSE 0::float8 END,"
        " CASE WHEN {same} AND " + LOCK_SEEN + " AND NOT " + RING_HELD + " THEN 1"
        " ELSE t.protocol END,"
        " ({free} AND {open}), t.holder_pid"
        " FROM {t} AS t JOIN ({req}) AS r" + REQUEST_COLUMNS + " ON r.name = t.name"
    ).format(
        t=table,
        req=_requests(requests),
        same=same_server(server),
        free=free_condition(server, held=LOCK_SEEN),
        open=not_reserved(node),
        locks=held_locks(ring),
    )


#: The node a released row stays reserved for (a handover request's ``resign_to`` whose
#: timeout has not passed), or NULL: the release's notification names it, so that only
#: that follower attempts at once.
RESERVED_FOR = "CASE WHEN t.resign_until > clock_timestamp() THEN t.resign_to END AS reserved_for"

# Why a term ended, from the reason its leader gave (`{reason}`) and the node the lease is
# reserved for as it ends (`{reserved}`): a release while a handover request reserves
# the lease for a node hands it to that node (a drained holder's stays `drained`, naming
# the node), and a handover with nobody named is a step-down.
_END_REASON = (
    "CASE WHEN {reserved} IS NOT NULL AND {reason} IN"
    " ('released', 'handed_over', 'stepped_down') THEN 'handed_over'"
    " WHEN {reason} = 'handed_over' THEN 'stepped_down' ELSE {reason} END"
)

# The term taken over is the one its leader ended in this process (`r.ended_*`, see
# `AcquireRequest.ended`): the same term number and lock key, and still held.
_ENDED = "(locked.holder IS NOT NULL AND r.ended_term = h.term AND r.ended_key = locked.lock_key)"

# The history CTEs of an acquisition (after `taken` and `locked`): open the new term's
# record, close the previous term's if its holder did not (at the takeover: its holder
# crashed, or lost its session; or, on the session that held it, its leader ended it
# and said why, `_ENDED`, but had not released it yet), and trim the records beyond the
# lease's limit, never the two just written (a DELETE and an UPDATE of one row in one
# statement would race), and those of terms above the new one (left by a lease row
# deleted and made again: one of the same term is overwritten).
_OPEN_TERMS = (
    "opened AS (INSERT INTO {h} AS h (name, term, node_id, version, hostname, pid, began_at)"
    " SELECT taken.name, taken.term, taken.node, taken.version, {host}, {pid},"
    " taken.acquired_at FROM taken"
    " ON CONFLICT (name, term) DO UPDATE SET node_id = EXCLUDED.node_id,"
    " version = EXCLUDED.version, hostname = EXCLUDED.hostname, pid = EXCLUDED.pid,"
    " began_at = EXCLUDED.began_at, ended_at = NULL, end_reason = NULL, handed_to = NULL,"
    " ended_by = NULL),"
    " closed AS (UPDATE {h} AS h SET ended_at = taken.acquired_at, end_reason = CASE"
    " WHEN locked.holder IS NULL THEN 'released' WHEN "
    + _ENDED
    + " THEN "
    + _END_REASON.format(reserved="locked.reserved_for", reason="r.ended_reason")
    + " WHEN locked.live THEN 'session_lost' ELSE 'expired' END,"
    " handed_to = CASE WHEN " + _ENDED + " THEN locked.reserved_for END,"
    " ended_by = CASE WHEN " + _ENDED + " THEN r.ended_by END"
    " FROM taken JOIN locked ON locked.name = taken.name JOIN r ON r.name = taken.name"
    " WHERE h.name = taken.name AND h.term = taken.term - 1 AND h.ended_at IS NULL),"
    " trimmed AS (DELETE FROM {h} AS h USING taken WHERE h.name = taken.name"
    " AND (h.term > taken.term OR (h.term < taken.term - 1 AND h.term <= taken.term - taken.keep)))"
)

# Close the record of each ended term (`{closing}`: rows of (name, reserved_for), joined
# to the requests `r`), for the reason its leader gave (see `_END_REASON`).
_CLOSE_TERMS = (
    "ended AS (UPDATE {h} AS h SET ended_at = clock_timestamp(), end_reason = "
    + _END_REASON.format(reserved="rel.reserved_for", reason="r.reason")
    + ", handed_to = rel.reserved_for, ended_by = r.by"
    " FROM {closing} AS rel JOIN r ON r.name = rel.name"
    " WHERE h.name = r.name AND h.term = r.term AND h.ended_at IS NULL)"
)


def acquire_batch_sql(
    table: sql.Composable,
    requests: Sequence[AcquireRequest],
    *,
    server: str,
    ring: int,
    history: sql.Composable,
    process: tuple[str, int],
) -> sql.Composed:
    """Take every requested lease that may be taken, then read them all (one round trip).

    Statements: create the missing rows; take over each row that is free for its node and
    not locked (``SKIP LOCKED``: a row held by fenced transactions of the old term, or by
    another node's acquisition, is left for a later attempt, so a takeover never blocks
    the shared keeper session) and whose new term's advisory lock this session gets at
    once (``pg_try_advisory_lock`` under the request's fresh ``lock_key``: a lock that
    another session holds is never waited for, and only that lease is left for a later
    attempt, under another key): new term, the new key, this session as holder, this
    session's ``server``, :data:`LEASE_PROTOCOL`, a NOTIFY on the lease's channel, the
    term's record opened in the ``history`` table (with the node's version and the
    ``process``, host name and pid), the previous term's record closed if its holder
    did not close it (``session_lost`` when taken before its expiry, else ``expired``;
    the reason its leader gave when this process ended that term, ``ended``) and the
    records beyond the request's ``history_limit`` trimmed; then
    :func:`states_sql`. Rows come back as ``(name, term, lock_key)`` for each row locked,
    with ``term`` and ``lock_key`` NULL where the lease was not taken (its lock was held
    elsewhere: the lock got meanwhile, if any, is freed in the statement), then the
    states.

    The key is changed only together with the term, by the statement that takes the
    lease, when no term of the row holds a lock any node still looks for: the previous
    holder frees the key its own acquisition returned, and followers and the old
    release (one keeper session per lease) read the key from the row, with its term. So
    nodes that do not draw keys (an older release) and nodes that do can share a table,
    and a row's old key (derived from public information before keys were drawn) is
    replaced at its next acquisition, with no migration.
    """
    node = sql.SQL("r.node")
    created = [r for r in requests if r.create]
    insert = (
        sql.SQL(
            "INSERT INTO {t} (name, lock_key) VALUES {rows} ON CONFLICT (name) DO NOTHING; "
        ).format(
            t=table,
            rows=sql.SQL(", ").join(
                sql.SQL("({}, {})").format(sql.Literal(r.name), sql.Literal(r.lock_key))
                for r in created
            ),
        )
        if created
        else sql.SQL("")
    )
    # `tried` is materialised and read whole by the outer query (the driving side of a
    # LEFT JOIN), so every lock it takes is either the taken term's or freed below.
    # A row locked FOR UPDATE is its latest version, which may be another node's term
    # begun after `locked` read the lock table (its lock taken after that read, its row
    # committed before ours was locked). Three checks keep that term its holder's: the
    # server rechecks `locked`'s condition on that version, and the recheck reads the
    # lock table anew (it evaluates subqueries afresh, but reuses a WITH item: so no
    # shared read of the locks here); `taken` takes only the term it locked (its scan
    # sees the older version, `t.term + 1 = tried.term` fails); and `taken` checks
    # {free} again with a read of its own. With one WITH item read for both, only the
    # check of the term kept the lease from a follower (test_takeover_race.py).
    return sql.SQL(
        "{insert}"
        "WITH r" + REQUEST_COLUMNS + " AS ({req}),"
        " locked AS MATERIALIZED ("
        "  SELECT t.name, t.term, t.holder, t.lock_key,"
        "  t.expires_at > clock_timestamp() AS live, "
        + RESERVED_FOR
        + "  FROM {t} AS t JOIN r ON r.name = t.name"
        "  WHERE {free} AND {open} FOR UPDATE OF t SKIP LOCKED"
        " ), tried AS MATERIALIZED ("
        "  SELECT locked.name, r.lock_key, locked.term + 1 AS term,"
        "  pg_try_advisory_lock(r.lock_key, ((locked.term + 1) % 2147483648)::integer) AS got"
        "  FROM locked JOIN r ON r.name = locked.name"
        " ), taken AS ("
        "  UPDATE {t} AS t SET holder = r.node, term = tried.term, lock_key = tried.lock_key,"
        "  holder_pid = pg_backend_pid(), acquired_at = clock_timestamp(),"
        "  renewed_at = clock_timestamp(),"
        "  expires_at = clock_timestamp() + r.ttl * interval '1 second',"
        "  holder_server = {server}, protocol = {protocol},"
        "  resign_term = NULL, resign_from = NULL, resign_to = NULL, resign_until = NULL"
        "  FROM tried JOIN r ON r.name = tried.name"
        "  WHERE t.name = tried.name AND tried.got AND t.term + 1 = tried.term"
        "  AND {free} AND {open}"
        "  RETURNING t.name, t.term, t.lock_key, r.node, r.channel, t.acquired_at,"
        "  t.expires_at, r.version, r.keep"
        " ), " + _OPEN_TERMS + ""
        " SELECT tried.name, taken.term, taken.lock_key,"
        " CASE WHEN taken.name IS NOT NULL THEN pg_notify(taken.channel, json_build_object("
        "'event', 'acquired', 'name', taken.name, 'node_id', taken.node, 'term', taken.term,"
        " 'acquired_at', taken.acquired_at, 'expires_at', taken.expires_at,"
        " 'holder_pid', pg_backend_pid())::text) END,"
        " CASE WHEN taken.name IS NULL AND tried.got THEN pg_advisory_unlock(tried.lock_key,"
        " (tried.term % 2147483648)::integer) END"
        " FROM tried LEFT JOIN taken ON taken.name = tried.name; {states}"
    ).format(
        insert=insert,
        t=table,
        req=_requests(requests),
        free=free_condition(server),
        open=not_reserved(node),
        server=sql.Literal(server),
        protocol=sql.Literal(LEASE_PROTOCOL),
        states=states_sql(table, requests, server=server, ring=ring),
        h=history,
        host=sql.Literal(process[0]),
        pid=sql.Literal(process[1]),
    )


@dataclass(frozen=True)
class RenewRequest:
    """One held term to renew in a batch (:func:`renew_batch_sql`)."""

    name: str
    node_id: str
    term: int
    ttl: float


def renew_batch_sql(
    table: sql.Composable, requests: Sequence[RenewRequest], *, server: str
) -> sql.Composed:
    """Extend each requested term to ``now() + ttl``; one row per term renewed.

    Only the holder's own session renews: same pid on the same server, as recorded at
    acquisition, so a backend that reuses the pid after a restart or on a promoted
    standby cannot. A row another transaction holds locked against updates (an
    operator's ``SELECT ... FOR UPDATE``, a long ``UPDATE`` by hand) is skipped, not
    waited for: its lease is not renewed this time, and the other leases of the batch,
    whose renewals must never wait behind it, are. Fenced transactions lock rows
    ``FOR KEY SHARE``, which a renewal does not conflict with. Each row returned: name,
    term, whether a handover request is pending for that term, the node it names, the
    seconds left of its window, and whether the row was skipped (still held, not
    renewed: try again).
    """
    values = batch_sql(
        "name text, node text, term bigint, ttl float8",
        ((r.name, r.node_id, r.term, r.ttl) for r in requests),
    )
    guard = sql.SQL(
        "t.name = r.name AND t.holder = r.node AND t.term = r.term"
        " AND t.holder_pid = pg_backend_pid() AND t.expires_at > now()"
        " AND t.holder_server = {server}"
    ).format(server=sql.Literal(server))
    return sql.SQL(
        "WITH r(name, node, term, ttl) AS ({values}),"
        " lockable AS MATERIALIZED (SELECT t.name FROM {t} AS t JOIN r ON {guard}"
        " FOR NO KEY UPDATE OF t SKIP LOCKED),"
        " renewed AS (UPDATE {t} AS t"
        " SET renewed_at = now(), expires_at = now() + r.ttl * interval '1 second'"
        " FROM r JOIN lockable ON lockable.name = r.name"
        " WHERE {guard}"
        " RETURNING t.name, t.term,"
        " coalesce(t.resign_term = t.term AND t.resign_until > now(), false) AS pending,"
        " t.resign_to,"
        " greatest(0, extract(epoch FROM t.resign_until - now()))::float8 AS time_left)"
        " SELECT name, term, pending, resign_to, time_left, false FROM renewed"
        " UNION ALL SELECT r.name, r.term, false, NULL::text, 0::float8, true"
        " FROM r JOIN {t} AS t ON {guard} WHERE r.name NOT IN (SELECT name FROM lockable)"
    ).format(t=table, values=values, guard=guard)


def give_back_sql(
    table: sql.Composable, requests: Sequence[AcquireRequest], pid: int
) -> sql.Composed:
    """Clear the holder of every requested lease that an acquisition took on backend
    ``pid`` (not the keeper's: a transaction pooler moved it), so that no term lives on
    a session that holds nothing for it; followers then take the lease at once."""
    pairs = sql.SQL(", ").join(
        sql.SQL("({}::text, {}::text)").format(sql.Literal(r.name), sql.Literal(r.node_id))
        for r in requests
    )
    return sql.SQL(
        "UPDATE {t} AS t SET holder = NULL, holder_pid = NULL, expires_at = now()"
        " FROM (VALUES {pairs}) AS r(name, node)"
        " WHERE t.name = r.name AND t.holder = r.node AND t.holder_pid = {pid}"
    ).format(t=table, pairs=pairs, pid=sql.Literal(pid))


def unlock_next_terms_sql(
    table: sql.Composable, requests: Sequence[AcquireRequest], held: Sequence[tuple[int, int]]
) -> sql.Composed:
    """Free the locks a failed acquisition may have left: the advisory lock of the next
    term of each lease requested, under the key its request drew (``pg_advisory_lock``
    is not undone by a rollback), except the ``(lock_key, term)`` locks in ``held``,
    which terms of this session hold.

    A session holds a lease's next-term lock only through an acquisition of that term,
    and a failed one committed nothing, so the row's term is still the one before it;
    but two keys drawn at random may be equal, and then one lease's next term is the
    lock of another's running term: ``held`` keeps those.
    """
    keep = (
        sql.SQL(" AND (r.lock_key, ((t.term + 1) % 2147483648)::integer) NOT IN ({})").format(
            sql.SQL(", ").join(
                sql.SQL("({}, {})").format(sql.Literal(key), sql.Literal(term % 2**31))
                for key, term in held
            )
        )
        if held
        else sql.SQL("")
    )
    return sql.SQL(
        "SELECT pg_advisory_unlock(r.lock_key, ((t.term + 1) % 2147483648)::integer)"
        " FROM {t} AS t JOIN ({req}) AS r" + REQUEST_COLUMNS + " ON r.name = t.name"
        " WHERE true{keep}"
    ).format(t=table, req=_requests(requests), keep=keep)


def release_sql(
    table: sql.Composable,
    request: ReleaseRequest,
    *,
    history: sql.Composable,
) -> sql.Composed:
    """Clear the holder if the request's node holds its term, close the term's record in
    the ``history`` table, notify its channel, and free that term's advisory lock (only
    that one: the session holds every lease of its process).
    """
    return sql.SQL(
        "WITH r(name, term, reason, by) AS (VALUES ({name}, {term}::bigint, {reason},"
        " {by}::text)),"
        " released AS ("
        " UPDATE {t} AS t SET holder = NULL, holder_pid = NULL, expires_at = now()"
        " WHERE t.name = {name} AND t.holder = {node} AND t.term = {term}"
        " RETURNING t.name, t.term, " + RESERVED_FOR + "), " + _CLOSE_TERMS + ""
        " SELECT pg_notify({channel}, json_build_object('event', 'released',"
        " 'name', {name}, 'node_id', {node}, 'term', released.term,"
        " 'to', released.reserved_for)::text)"
        " FROM released; SELECT pg_advisory_unlock({key}::integer, {part})"
    ).format(
        t=table,
        h=history,
        closing=sql.SQL("released"),
        name=sql.Literal(request.name),
        node=sql.Literal(request.node_id),
        term=sql.Literal(request.term),
        reason=sql.Literal(request.reason),
        by=sql.Literal(request.by),
        channel=sql.Literal(request.channel),
        # NULL: pg_advisory_unlock() is strict, frees nothing
        key=sql.Literal(request.lock_key),
        part=sql.Literal(request.term % 2**31),
    )


@dataclass(frozen=True)
class ReleaseRequest:
    """One term to give back in a batch: the lease, its holder, the term, the channel
    its followers listen on, and the key of the advisory lock that term holds through
    this session (its row's, as its acquisition returned it; ``None`` when the session
    holds no lock of that term any more: nothing to free); and why the term ended and
    who ended it, for its record in the leadership history (see
    :mod:`rselection.history`)."""

    name: str
    node_id: str
    term: int
    channel: str
    lock_key: int | None
    reason: str = "released"
    by: str | None = None


def release_batch_sql(
    table: sql.Composable, requests: Sequence[ReleaseRequest], *, history: sql.Composable
) -> sql.Composed:
    """:func:`release_sql` for many terms in one statement; one row per request: name,
    whether it was released (and its channel notified), and whether its row was locked
    by another transaction (skipped, not waited for: release it alone).

    The advisory lock of each term is freed (the request's ``lock_key``; none when it is
    ``None``), but that of a skipped one (its term has ended, its tasks are joined: the
    session frees it anyway once the term's end is recorded, and a follower may then
    take the lease as soon as the row is free).
    """
    values = batch_sql(
        "name text, node text, term bigint, channel text, lock_key integer, reason text, by text",
        ((r.name, r.node_id, r.term, r.channel, r.lock_key, r.reason, r.by) for r in requests),
    )
    guard = sql.SQL("t.name = r.name AND t.holder = r.node AND t.term = r.term")
    # Notified and unlocked in the outer query, whose every row is computed: a SELECT
    # in a WITH may be read only in part.
    return sql.SQL(
        "WITH r(name, node, term, channel, lock_key, reason, by) AS ({values}),"
        " lockable AS MATERIALIZED (SELECT t.name FROM {t} AS t JOIN r ON {guard}"
        " FOR NO KEY UPDATE OF t SKIP LOCKED),"
        " released AS (UPDATE {t} AS t SET holder = NULL, holder_pid = NULL,"
        " expires_at = now() FROM r JOIN lockable ON lockable.name = r.name"
        " WHERE {guard} RETURNING t.name, " + RESERVED_FOR + "),"
        " skipped AS (SELECT r.name, " + RESERVED_FOR + " FROM r JOIN {t} AS t ON {guard}"
        " WHERE r.name NOT IN (SELECT name FROM lockable)), " + _CLOSE_TERMS + ""
        " SELECT r.name, rel.name IS NOT NULL, sk.name IS NOT NULL,"
        " CASE WHEN rel.name IS NOT NULL THEN pg_notify(r.channel, json_build_object("
        "'event', 'released', 'name', r.name, 'node_id', r.node, 'term', r.term,"
        " 'to', rel.reserved_for)::text) END,"
        " CASE WHEN sk.name IS NULL"
        " THEN pg_advisory_unlock(r.lock_key, (r.term % 2147483648)::integer) END"
        " FROM r LEFT JOIN released AS rel ON rel.name = r.name"
        " LEFT JOIN skipped AS sk ON sk.name = r.name"
    ).format(
        t=table,
        h=history,
        values=values,
        guard=guard,
        # A skipped term has ended too (its tasks are joined; its lock is freed even if
        # its release never gets the row): its record is closed now, with its reason.
        closing=sql.SQL(
            "(SELECT name, reserved_for FROM released"
            " UNION ALL SELECT name, reserved_for FROM skipped)"
        ),
    )


def bounded_sql(seconds: float, *, statement: bool = True) -> sql.Composed:
    """Bound the rest of the implicit transaction (the statements sent with it in one
    query) by ``lock_timeout`` and, with ``statement``, ``statement_timeout`` of
    ``seconds``, on a session pinned to no timeouts: ``set_config(..., true)`` lasts
    until the transaction ends."""
    millis = sql.Literal(f"{max(1, round(seconds * 1000))}ms")
    if not statement:
        return sql.SQL("SELECT set_config('lock_timeout', {ms}, true)").format(ms=millis)
    return sql.SQL(
        "SELECT set_config('statement_timeout', {ms}, true), set_config('lock_timeout', {ms}, true)"
    ).format(ms=millis)


def unlock_sql(locks: Iterable[tuple[int, int]]) -> sql.Composed:
    """Free the advisory locks of the given ``(lock_key, term)`` pairs (held or not)."""
    return sql.SQL("SELECT {}").format(
        sql.SQL(", ").join(
            sql.SQL("pg_advisory_unlock({}, {})").format(
                sql.Literal(key), sql.Literal(term % 2**31)
            )
            for key, term in locks
        )
    )


def current_sql(table: sql.Composable, name: str | None = None) -> sql.Composed:
    """The live holder of lease ``name`` (``%s`` when ``None``): holder, term,
    acquired_at, expires_at."""
    return sql.SQL(
        "SELECT holder, term, acquired_at, expires_at FROM {t}"
        " WHERE name = {name} AND holder IS NOT NULL AND expires_at > now()"
    ).format(t=table, name=sql.Placeholder() if name is None else sql.Literal(name))
