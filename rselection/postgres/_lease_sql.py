"""The SQL of :class:`~rselection.postgres.lease.PostgresLease`.

How a lease table is found and what its lock key and channel are called, and builders
for the statements the keeper runs. The builders only compose text; the lease runs
them on its keeper session (several statements in one round trip, so literals are
inlined: such a query cannot take parameters). The design, and why each condition is
there, is in :mod:`rselection.postgres.lease`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from ._conn import Keepalives
from .schema import (
    DEFAULT_TABLE,
    LEASE_HANDOVER_COLUMNS,
    LEASE_SERVER_COLUMNS,
    table_identifier,
)

__all__ = [
    "LOCK_HELD",
    "SERVER_IDENTITY_SQL",
    "SERVER_START_SQL",
    "LeaseTable",
    "acquire_sql",
    "current_sql",
    "describe_lease_table",
    "free_condition",
    "lease_channel",
    "lease_lock_key",
    "not_reserved",
    "release_sql",
    "renew_sql",
    "resolve_lease_table",
    "server_identity",
    "session_sql",
    "state_sql",
    "utc",
    "wait_lock_sql",
]

_MAX_CHANNEL = 63  # NAMEDATALEN - 1


def lease_lock_key(table_oid: int, name: str) -> int:
    """The first advisory-lock key of a lease: a stable signed 32-bit hash.

    Derived from the lease table's OID (unique in its database; advisory locks are per
    database) and the lease name, so leases in different schemas or tables never share
    a lock. It is stored in the row's ``lock_key`` when the row is created, and every
    node uses the stored value.

    Args:
        table_oid: OID of the lease table.
        name: the lease name.
    """
    digest = hashlib.blake2b(f"rselection:{table_oid}:{name}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big", signed=True)


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
        oid: its OID (names the lock key, see :func:`lease_lock_key`).
        qualified: its ``schema.table`` name (names the channel, see :func:`lease_channel`).
        handovers: it has the handover columns (schema version 2).
        servers: it has the ``holder_server`` column (schema version 3).
    """

    oid: int
    qualified: str
    handovers: bool
    servers: bool


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
        " AND a.attname = ANY(%s) AND NOT a.attisdropped)"
        " FROM pg_catalog.pg_class c"
        " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.oid = to_regclass(%s)",
        (
            list(LEASE_HANDOVER_COLUMNS),
            list(LEASE_SERVER_COLUMNS),
            table_identifier(table).as_string(conn),
        ),
    ).fetchone()
    if row is None:
        return None
    oid, schema, relname, handovers, servers = row
    return LeaseTable(
        int(oid),
        f"{schema}.{relname}",
        handovers == len(LEASE_HANDOVER_COLUMNS),
        servers == len(LEASE_SERVER_COLUMNS),
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
LOCK_HELD = (
    "EXISTS (SELECT 1 FROM pg_catalog.pg_locks l"
    " WHERE l.locktype = 'advisory'"
    " AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d"
    " WHERE d.datname = current_database())"
    " AND l.classid::bigint = (t.lock_key::bigint & 4294967295)"
    " AND l.objid::bigint = t.term % 2147483648"
    " AND l.objsubid = 2 AND l.pid = t.holder_pid AND l.granted)"
)


def session_sql(keepalives: Keepalives, user_timeout: int, channel: str) -> sql.Composed:
    """Pin the keeper session's settings, read back its TCP settings, and LISTEN.

    The second statement returns the keepalives (idle, interval, count) and
    ``tcp_user_timeout`` (ms) in effect.

    Args:
        keepalives: the server-side TCP keepalives to set.
        user_timeout: the server-side ``tcp_user_timeout`` to set, milliseconds.
        channel: the lease's channel.
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
        " current_setting('tcp_user_timeout', true)::int;"
        " LISTEN {channel}"
    ).format(values=values, channel=sql.Identifier(channel))


def same_server(server: str | None) -> sql.Composable:
    """True when row ``t``'s holder session is on this server (``server``); never NULL.

    Args:
        server: this session's :func:`server_identity`, or ``None`` when the table has
            no ``holder_server`` column (then never true).
    """
    if server is None:
        return sql.SQL("false")
    return sql.SQL("coalesce(t.holder_server = {}, false)").format(sql.Literal(server))


def free_condition(server: str | None) -> sql.Composed:
    """True when row ``t`` may be taken: free, expired, dead holder, or our own.

    The session checks (own pid, lock not held) only count for a holder whose session
    is on this very server, as recorded when it acquired (:func:`same_server`): after a
    restart or a failover to a promoted standby the holder's pid and lock mean nothing
    here, and its leader, cut off from the old server, may not have noticed; such a
    lease is only taken over once it expires.

    Args:
        server: this session's server identity (``None``: expiry only).
    """
    return sql.SQL(
        "(t.holder IS NULL OR t.holder_pid IS NULL OR t.expires_at IS NULL"
        " OR t.expires_at <= clock_timestamp()"
        " OR ({same} AND (t.holder_pid = pg_backend_pid() OR NOT " + LOCK_HELD + ")))"
    ).format(same=same_server(server))


def not_reserved(node: sql.Literal, *, handovers: bool) -> sql.Composable:
    """True unless a handover request reserves row ``t`` against node ``node``.

    While a request's window lasts (until the next acquisition clears it), the node
    that was asked to hand over may not take the lease back, and when a node was
    named only that node may take it. This only ever narrows who may take the
    lease, so it cannot make two leaders. Never NULL (``CASE`` below relies on it).

    Args:
        node: the node id, as a literal.
        handovers: the table has the handover columns (else always true).
    """
    if not handovers:
        return sql.SQL("true")
    return sql.SQL(
        "(t.resign_until IS NULL OR t.resign_until <= clock_timestamp()"
        " OR t.resign_to IS NOT DISTINCT FROM {node}"
        " OR (t.resign_to IS NULL AND t.resign_from IS DISTINCT FROM {node}))"
    ).format(node=node)


def state_sql(
    table: sql.Composable, name: str, node_id: str, *, handovers: bool, server: str | None
) -> sql.Composed:
    """Read the lease row as node ``node_id`` sees it.

    Columns: holder, term, lock_key, acquired_at, expires_at, seconds until expiry,
    whether the holder's lock is held (on this server: see :func:`same_server`), and
    seconds the row stays reserved against ``node_id`` by a handover request (0 when it
    may take the lease).
    """
    node = sql.Literal(node_id)
    reserved: sql.Composable
    if handovers:
        reserved = sql.SQL(
            "CASE WHEN NOT {free} THEN greatest(0, extract(epoch FROM"
            " t.resign_until - clock_timestamp()))::float8 ELSE 0::float8 END"
        ).format(free=not_reserved(node, handovers=handovers))
    else:
        reserved = sql.SQL("0::float8")
    return sql.SQL(
        "SELECT t.holder, t.term, t.lock_key, t.acquired_at, t.expires_at,"
        " greatest(0, extract(epoch FROM t.expires_at - clock_timestamp()))::float8,"
        " ({same} AND " + LOCK_HELD + "), {reserved} FROM {t} AS t WHERE t.name = {name}"
    ).format(t=table, name=sql.Literal(name), reserved=reserved, same=same_server(server))


def acquire_sql(
    table: sql.Composable,
    name: str,
    node_id: str,
    *,
    lock_key: int | None,
    ttl: float,
    channel: str,
    handovers: bool,
    server: str | None,
    lock_timeout: float,
) -> sql.Composed:
    """Take the lease for ``node_id`` if it may be taken, then read the row (one query).

    Statements: bound the row-lock wait by ``lock_timeout`` seconds, drop any advisory
    lock the session holds, create the row if missing (with ``lock_key``), take it over
    (new term, the new term's advisory lock, this session's ``server`` identity, a
    NOTIFY on ``channel``; one row, or none), and :func:`state_sql`.
    """
    literal_name = sql.Literal(name)
    clear = (
        sql.SQL(", resign_term = NULL, resign_from = NULL, resign_to = NULL, resign_until = NULL")
        if handovers
        else sql.SQL("")
    )
    record = (
        sql.SQL(", holder_server = {}").format(sql.Literal(server))
        if server is not None
        else sql.SQL("")
    )
    return sql.SQL(
        "SET LOCAL lock_timeout = {lock_timeout};"
        " SELECT pg_advisory_unlock_all();"
        " INSERT INTO {t} (name, lock_key) VALUES ({name}, {key})"
        " ON CONFLICT (name) DO NOTHING;"
        " WITH locked AS MATERIALIZED ("
        "  SELECT t.name FROM {t} AS t WHERE t.name = {name} AND {free} AND {open}"
        "  FOR UPDATE OF t"
        " ), taken AS ("
        "  UPDATE {t} AS t SET holder = {node}, term = t.term + 1,"
        "  holder_pid = pg_backend_pid(), acquired_at = clock_timestamp(),"
        "  renewed_at = clock_timestamp(),"
        "  expires_at = clock_timestamp() + {ttl} * interval '1 second'{record}{clear}"
        "  FROM locked WHERE t.name = locked.name AND {free} AND {open}"
        "  RETURNING t.term, t.lock_key"
        " )"
        " SELECT taken.term,"
        " pg_advisory_lock(taken.lock_key, (taken.term % 2147483648)::integer),"
        " pg_notify({channel}, json_build_object('event', 'acquired', 'name', {name},"
        " 'node_id', {node}, 'term', taken.term)::text)"
        " FROM taken;"
        " {state}"
    ).format(
        lock_timeout=sql.Literal(f"{round(lock_timeout * 1000)}ms"),
        t=table,
        name=literal_name,
        key=sql.Literal(lock_key),
        free=free_condition(server),
        open=not_reserved(sql.Literal(node_id), handovers=handovers),
        record=record,
        clear=clear,
        node=sql.Literal(node_id),
        ttl=sql.Literal(ttl),
        channel=sql.Literal(channel),
        state=state_sql(table, name, node_id, handovers=handovers, server=server),
    )


def renew_sql(
    table: sql.Composable,
    name: str,
    node_id: str,
    term: int,
    *,
    ttl: float,
    handovers: bool,
    server: str | None,
) -> sql.Composed:
    """Extend ``node_id``'s ``term`` to ``now() + ttl``; one row when renewed, else none.

    Only the holder's own session renews: same pid on the same server (``server``, as
    recorded at acquisition; without the column, a renewal since the server started),
    so a backend that reuses the pid after a restart or on a promoted standby cannot.
    The row returned says whether a handover request is pending for ``term``, the node
    it names and the seconds left of its window.
    """
    if handovers:
        # The same single statement also reports a handover request for this term.
        returning = sql.SQL(
            "coalesce(resign_term = term AND resign_until > now(), false), resign_to,"
            " greatest(0, extract(epoch FROM resign_until - now()))::float8"
        )
    else:
        returning = sql.SQL("false, NULL::text, 0::float8")
    return sql.SQL(
        "UPDATE {t} SET renewed_at = now(), expires_at = now() + {ttl} * interval '1 second'"
        " WHERE name = {name} AND holder = {node} AND term = {term}"
        " AND holder_pid = pg_backend_pid() AND expires_at > now()"
        " AND {same} RETURNING {returning}"
    ).format(
        same=(
            sql.SQL("holder_server = {}").format(sql.Literal(server))
            if server is not None
            else sql.SQL("renewed_at > pg_postmaster_start_time()")
        ),
        t=table,
        ttl=sql.Literal(ttl),
        name=sql.Literal(name),
        node=sql.Literal(node_id),
        term=sql.Literal(term),
        returning=returning,
    )


def release_sql(
    table: sql.Composable, name: str, node_id: str, term: int, *, channel: str, unlock: bool
) -> sql.Composed:
    """Clear the holder if ``node_id`` holds ``term`` and notify ``channel``.

    With ``unlock``, a second statement frees every advisory lock of the session.
    """
    unlock_sql = sql.SQL("; SELECT pg_advisory_unlock_all()") if unlock else sql.SQL("")
    return sql.SQL(
        "WITH released AS ("
        " UPDATE {t} SET holder = NULL, holder_pid = NULL, expires_at = now()"
        " WHERE name = {name} AND holder = {node} AND term = {term}"
        " RETURNING term)"
        " SELECT pg_notify({channel}, json_build_object('event', 'released',"
        " 'name', {name}, 'node_id', {node}, 'term', released.term)::text)"
        " FROM released{unlock}"
    ).format(
        t=table,
        name=sql.Literal(name),
        node=sql.Literal(node_id),
        term=sql.Literal(term),
        channel=sql.Literal(channel),
        unlock=unlock_sql,
    )


def current_sql(table: sql.Composable) -> sql.Composed:
    """The live holder of lease ``%s``: holder, term, acquired_at, expires_at."""
    return sql.SQL(
        "SELECT holder, term, acquired_at, expires_at FROM {t}"
        " WHERE name = %s AND holder IS NOT NULL AND expires_at > now()"
    ).format(t=table)


def wait_lock_sql(lock_args: sql.Composable, timeout: float) -> sql.Composed:
    """Wait up to ``timeout`` seconds for the advisory lock ``lock_args``, then free it."""
    ms = min(2**31 - 1, max(1, math.ceil(timeout * 1000)))
    return sql.SQL(
        "SET LOCAL lock_timeout = {ms}; SELECT pg_advisory_lock({args}), pg_advisory_unlock({args})"
    ).format(ms=sql.Literal(f"{ms}ms"), args=lock_args)
