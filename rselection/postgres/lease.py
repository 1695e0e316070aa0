"""``PostgresLease``: a :class:`~rselection.lease.LeaseBackend` over one Postgres row.

How the lease works
-------------------

One row per lease name (see :mod:`rselection.postgres.schema`) holds the holder's node
id, the fencing ``term``, the holder's keeper backend pid, and server times. Every time
comparison is made by the server (``now()``, ``clock_timestamp()``); no client clock is
ever compared.

**Session liveness.** The holder's keeper session holds the session advisory lock
``pg_advisory_lock(lock_key, term % 2**31)`` (two-int form) for as long as it leads, so
"the holder's session is alive" is exactly "that lock is granted to ``holder_pid``" in
``pg_locks``. When the holder's process dies, its connection closes, or an admin
terminates its backend, the server frees the lock at once.

**Acquire** (:meth:`PostgresLease.try_acquire`) is one round trip, one implicit
transaction. The row is locked ``FOR UPDATE`` *only* when a takeover looks possible
(holder NULL, lease expired, holder's lock not granted to ``holder_pid``, or this very
session is the holder; the last two only for a holder that renewed since the server
started, see below), then re-checked under the lock and updated: ``term + 1``,
``holder_pid = pg_backend_pid()``, ``expires_at = clock_timestamp() + ttl``, measured
after any wait for the row lock, so a takeover that waited still gets a full ttl (never
less than the ttl from when the request was sent); the new holder takes
its advisory lock in the same transaction, before commit, so nobody can see the new
holder without its lock. The ``FOR UPDATE`` lock serialises acquirers and makes a
takeover wait for fenced transactions of the old term (``FOR KEY SHARE``, see
:mod:`rselection.postgres.fencing`). Followers that find a live holder take no row lock,
so they never block renewals or fenced transactions, and are never blocked by them.

**Renew** is a single ``UPDATE`` of non-key columns guarded by holder, term, the keeper's
backend pid (and a renewal since the server started) and ``expires_at > now()``: a
renewal never revives an expired lease and a reconnected keeper (new pid) can never
renew, so a leader whose session ended has lost.

**Release** clears the holder (the term is kept), frees the advisory lock and sends a
``NOTIFY`` on :attr:`PostgresLease.channel` (also sent on every acquisition).

**Waiting.** A follower waits on the holder's advisory lock with a server-side bound
(``SET LOCAL lock_timeout``): the wait ends the moment the holder's session ends or it
releases, and costs one statement per wait. A leader waits on its keeper socket (plus a
self-pipe for :meth:`PostgresLease.interrupt`), so a session closed by the server is seen
at once and reported as :class:`~rselection.errors.BackendUnavailable`.

Why the server never drops a live leader's session early
---------------------------------------------------------

Fast failover trusts the server's view of the holder's session, so the server must not
end a session whose leader still believes it leads. The keeper pins, on every connect:

* ``idle_session_timeout = 0``, ``idle_in_transaction_session_timeout = 0``,
  ``statement_timeout = 0``: no timer ends the session while the leader is healthy.
* ``tcp_keepalives_idle/interval/count`` with ``idle + interval * count >
  renew_deadline + 1`` s. The server only drops a silent client after that long
  without receiving anything from it. The leader steps down ``renew_deadline`` after it
  *sent* its last successful renewal, and the server received that renewal no earlier
  than it was sent; so by the time the server frees the lock, the leader has been
  stopped for more than a second.
* ``tcp_user_timeout = 0``: unacknowledged data (a NOTIFY to a partitioned leader) is
  then retried for the kernel's full retransmission time (minutes), not less.

A session that the server ends while the network works (``pg_terminate_backend``, a
server restart) is seen by the leader at once, because its keeper waits on the socket;
it steps down then. Followers act on the freed lock within milliseconds too, so for the
short time both run, fencing (:func:`~rselection.postgres.fenced`) is what keeps a
deposed leader's writes from committing after the new term's.

A server restart ends every session at once, also that of a leader cut off from the
server, which cannot notice. So the session checks only count for a holder whose
``renewed_at`` is later than ``pg_postmaster_start_time()``; a lease held across a
restart is taken over only when it expires (by then the leader's own deadline has
stopped it). What remains unprotected is a server that ends a *partitioned* leader's
session some other way before that leader's deadline: an administrator's
``pg_terminate_backend``, or a crash of a backend (the postmaster then resets every
session without restarting). Avoid terminating keeper sessions (``application_name``
``rselection:<name>``) by hand.

Not supported: connection poolers in transaction or statement mode (session advisory
locks and LISTEN need a real session); ``log_lock_waits = on`` logs each follower wait
longer than ``deadlock_timeout``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import ConnStatus

from ..errors import BackendUnavailable, ConfigError
from ..leader import HandoverRequest
from ..lease import Acquisition, LeaderInfo
from ._conn import (
    IoWatchdog,
    Keepalives,
    check_conninfo,
    client_keepalives,
    describe_conninfo,
    server_keepalives,
    unavailable,
)
from .schema import DEFAULT_TABLE, LEASE_HANDOVER_COLUMNS, migrate, table_identifier

__all__ = [
    "PostgresLease",
    "cancel_handover",
    "lease_channel",
    "lease_lock_key",
    "request_handover",
    "resolve_lease_table",
]

logger = logging.getLogger(__name__)

#: Longest a takeover waits for the row lock (fenced transactions of the old term)
#: before giving up for this attempt and reporting the lease as busy.
ACQUIRE_LOCK_TIMEOUT = 5.0

_MAX_NODE_ID = 1000  # keeps the NOTIFY payload far below its 8000-byte limit
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
    row = conn.execute(
        "SELECT c.oid::bigint, n.nspname, c.relname,"
        " (SELECT count(*) FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid"
        " AND a.attname = ANY(%s) AND NOT a.attisdropped)"
        " FROM pg_catalog.pg_class c"
        " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.oid = to_regclass(%s)",
        (list(LEASE_HANDOVER_COLUMNS), table_identifier(table).as_string(conn)),
    ).fetchone()
    if row is None:
        return None
    oid, schema, relname, columns = row
    return int(oid), f"{schema}.{relname}", columns == len(LEASE_HANDOVER_COLUMNS)


def request_handover(
    conn: psycopg.Connection[Any],
    name: str,
    *,
    table: str = DEFAULT_TABLE,
    to: str | None = None,
    window: float = 10.0,
) -> LeaderInfo | None:
    """Ask the leader of lease ``name`` to hand over; return the holder asked.

    One statement: records the request on the lease row (``resign_term`` = the current
    term, ``resign_from`` = its holder, ``resign_to``, ``resign_until`` = server time +
    ``window``) and notifies the lease's channel, which wakes the leader. The leader
    sees the request in its next renewal (at once, thanks to the notification), cancels
    and drains its tasks and releases; a follower takes over. Until the next acquisition
    or the end of the window, the lease is reserved: the old holder may not take it
    back, and with ``to`` only that node may take it. Returns ``None`` when nobody holds
    the lease. A request for a term that has ended, or one whose window passed, is
    ignored.

    Args:
        conn: an open autocommit connection to the lease's database.
        name: the lease name.
        table: the lease table, optionally schema-qualified.
        to: node id that should take over, or ``None`` for any other node.
        window: seconds the request (and the reservation for ``to``) stays valid.

    Raises:
        ConfigError: the table does not exist or predates handovers (run ``rselection
            migrate``), or bad arguments.
        psycopg.Error: the statement failed.
    """
    if not (isinstance(window, int | float) and window > 0 and math.isfinite(window)):
        raise ConfigError(f"window must be a positive number of seconds, got {window!r}")
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
            " resign_until = clock_timestamp() + %(window)s * interval '1 second'"
            " WHERE t.name = %(name)s AND t.holder IS NOT NULL"
            " AND t.expires_at > clock_timestamp()"
            " RETURNING t.holder, t.term, t.acquired_at, t.expires_at)"
            " SELECT holder, term, acquired_at, expires_at,"
            " pg_notify(%(channel)s, json_build_object('event', 'resign', 'name', %(name)s,"
            " 'term', term, 'to', %(to)s)::text) FROM asked"
        ).format(t=table_identifier(table)),
        {
            "to": to,
            "window": float(window),
            "name": name,
            "channel": lease_channel(qualified, name),
        },
    ).fetchone()
    if row is None:
        return None
    return LeaderInfo(row[0], row[1], _utc(row[2]), _utc(row[3]))


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


@dataclass(frozen=True)
class _Held:
    """A holder as the keeper last saw it: its term and its lock's first key."""

    term: int
    lock_key: int

    @property
    def lock_args(self) -> sql.Composed:
        return sql.SQL("{}, {}").format(sql.Literal(self.lock_key), sql.Literal(self.term % 2**31))


#: True when the holder of row ``t`` still has its keeper session: the session advisory
#: lock (lock_key, term % 2**31) is granted to holder_pid. classid and objid are oids
#: (unsigned): compare as bigint, the signed lock_key mapped to its unsigned value.
_LOCK_HELD = (
    "EXISTS (SELECT 1 FROM pg_catalog.pg_locks l"
    " WHERE l.locktype = 'advisory'"
    " AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d"
    " WHERE d.datname = current_database())"
    " AND l.classid::bigint = (t.lock_key::bigint & 4294967295)"
    " AND l.objid::bigint = t.term % 2147483648"
    " AND l.objsubid = 2 AND l.pid = t.holder_pid AND l.granted)"
)


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


class PostgresLease:
    """A lease kept in a Postgres table, with server time, fencing terms and fast failover.

    One instance is used by one keeper thread (:meth:`connect`, :meth:`try_acquire`,
    :meth:`renew`, :meth:`release`, :meth:`wait_for_change`, :meth:`close`);
    :meth:`current` and :meth:`interrupt` are safe from any thread. Keeper methods raise
    :class:`~rselection.errors.BackendUnavailable` on any connection problem (the
    keeper connection is then closed; the next call reconnects). The module docstring
    explains the protocol and its safety argument.

    Args:
        conninfo: a libpq connection string or URI (a direct session: no transaction
            pooler).
        name: the lease name; nodes using the same name and table compete.
        ttl: lease length on the server, seconds.
        renew_deadline: the leader's renew deadline, seconds (``< ttl``); sizes the
            server's TCP keepalives so the server never drops a live leader too early.
        table: lease table, optionally schema-qualified (``"ops.leases"``).
        create_tables: run :func:`~rselection.postgres.migrate` on every connect (cheap
            no-ops when the tables exist).
        connect_timeout: seconds to wait for a connection (libpq rounds up to whole
            seconds, at least 2).

    Raises:
        ConfigError: bad arguments (the message says which and why).
    """

    def __init__(
        self,
        conninfo: str,
        *,
        name: str = "default",
        ttl: float = 15.0,
        renew_deadline: float = 10.0,
        table: str = DEFAULT_TABLE,
        create_tables: bool = True,
        connect_timeout: float = 5.0,
    ) -> None:
        check_conninfo(conninfo)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"lease name must be a non-empty string, got {name!r}")
        for label, value in (
            ("ttl", ttl),
            ("renew_deadline", renew_deadline),
            ("connect_timeout", connect_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{label} must be a number of seconds, got {value!r}")
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{label} must be positive and finite, got {value!r}")
        if renew_deadline >= ttl:
            raise ConfigError(
                f"renew_deadline must be shorter than ttl, got renew_deadline "
                f"{renew_deadline} >= ttl {ttl}: the leader must stop before its lease "
                "can expire on the server"
            )
        self._ident = table_identifier(table)  # validates
        self.name = name
        self.ttl = float(ttl)
        self.renew_deadline = float(renew_deadline)
        self.table = table
        self.create_tables = create_tables
        self.connect_timeout = float(connect_timeout)
        self.lock_key: int | None = None
        """First advisory-lock key for new rows (known once connected)."""
        self.channel: str | None = None
        """LISTEN/NOTIFY channel of this lease (known once connected)."""
        self.server_keepalives: Keepalives = server_keepalives(self.renew_deadline)
        self.client_keepalives: Keepalives = client_keepalives(self.renew_deadline)
        self._conninfo = conninfo
        self._where = describe_conninfo(conninfo)

        self._conn: psycopg.Connection[Any] | None = None
        self._pid = 0
        self._leading: _Held | None = None  # our own term, while we hold it
        self._seen: _Held | None = None  # another holder, as the last attempt saw it
        self._foreign_notifies = 0
        self._last_notice = ""
        self._handovers = True  # the table has the handover columns (schema version 2)
        self._handover_hint = False
        self._handover: HandoverRequest | None = None

        self._observer: psycopg.Connection[Any] | None = None
        self._observer_lock = threading.Lock()
        self._io = IoWatchdog(name)  # bounds every blocking round trip

        # interrupt(): a sticky flag (authoritative), a self-pipe (wakes socket waits)
        # and a cancel request (ends a lock wait). The lock orders a cancel request
        # before the keeper's next statement: the keeper takes it after its lock wait.
        self._wake_lock = threading.Lock()
        self._interrupt_pending = False
        self._in_lock_wait = False
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, table={self.table!r}, "
            f"{self._where}, connected={self._conn is not None})"
        )

    def __enter__(self) -> PostgresLease:
        """Connect; the ``with`` block closes the lease on exit."""
        self.connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close every connection."""
        self.close()

    @property
    def backend_pid(self) -> int | None:
        """The keeper session's backend pid, or ``None`` when not connected."""
        return self._pid if self._conn is not None else None

    # -- connections ------------------------------------------------------------------

    def _connect_kwargs(self, role: str) -> dict[str, Any]:
        ka = self.client_keepalives
        app = f"rselection:{self.name}" + (f":{role}" if role else "")
        return {
            "autocommit": True,
            "prepare_threshold": None,
            "connect_timeout": max(2, math.ceil(self.connect_timeout)),
            "keepalives": 1,
            "keepalives_idle": ka.idle,
            "keepalives_interval": ka.interval,
            "keepalives_count": ka.count,
            "tcp_user_timeout": math.ceil(self.renew_deadline * 1000),
            "application_name": app.encode()[:63].decode(errors="ignore"),
        }

    def _session_sql(self) -> sql.Composed:
        ka = self.server_keepalives
        settings = {
            "idle_session_timeout": "0",
            "idle_in_transaction_session_timeout": "0",
            "statement_timeout": "0",
            "lock_timeout": "0",
            "tcp_keepalives_idle": str(ka.idle),
            "tcp_keepalives_interval": str(ka.interval),
            "tcp_keepalives_count": str(ka.count),
            "tcp_user_timeout": "0",
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
            " current_setting('tcp_keepalives_count')::int;"
            " LISTEN {channel}"
        ).format(values=values, channel=sql.Identifier(self._channel()))

    def connect(self) -> None:
        """Open (or re-open) the keeper connection and pin its session settings.

        Creates the tables first when ``create_tables`` is set. The
        new session holds nothing: after a reconnect a former leader cannot renew.

        Raises:
            BackendUnavailable: the server cannot be reached (within ``connect_timeout``)
                or refused; the message names host, port and database, never the
                password.
        """
        self._drop_keeper()
        self._ensure_pipe()
        try:
            conn = psycopg.Connection.connect(self._conninfo, **self._connect_kwargs(""))
        except psycopg.Error as exc:
            raise unavailable("connect to the lease server", self._conninfo, exc) from exc
        try:
            with self._io.guard(conn, self.renew_deadline + self.connect_timeout):
                if self.create_tables:
                    # On every (re)connect: a restored or recreated database may have
                    # lost the tables, and the statements are cheap no-ops when they exist.
                    migrate(
                        conn,
                        table=self.table,
                        claims_table=None,
                        elections_table=None,
                        nodes_table=None,
                    )
                self._resolve_table(conn)
                cur = conn.execute(self._session_sql())
                cur.nextset()
                effective = cur.fetchone()
            conn.add_notify_handler(self._on_notify)
            conn.add_notice_handler(self._on_notice)
        except psycopg.Error as exc:
            conn.close()
            raise unavailable("prepare the keeper session", self._conninfo, exc) from exc
        except BaseException:
            conn.close()
            raise
        self._check_keepalives(conn, effective)
        self._conn = conn
        self._pid = conn.info.backend_pid
        self._leading = None
        self._seen = None
        self._foreign_notifies = 0
        self._last_notice = ""
        logger.debug("lease %r: keeper connected (%s, pid %s)", self.name, self._where, self._pid)

    def _resolve_table(self, conn: psycopg.Connection[Any]) -> None:
        """Find the table's OID and schema: they name the lock key and the channel."""
        found = resolve_lease_table(conn, self.table)
        if found is None:
            raise BackendUnavailable(
                f"lease table {self.table!r} does not exist ({self._where}, on this "
                "connection's search_path): run `rselection migrate` or pass "
                "create_tables=True"
            )
        oid, qualified, handovers = found
        self.lock_key = lease_lock_key(oid, self.name)
        self.channel = lease_channel(qualified, self.name)
        if handovers != self._handovers and not handovers:
            logger.warning(
                "lease %r: table %r has schema version 1 (no handover columns); leases "
                "work, handover requests (rselection resign) need `rselection migrate`",
                self.name,
                self.table,
            )
        self._handovers = handovers

    def _check_keepalives(self, conn: psycopg.Connection[Any], effective: Any) -> None:
        if effective is None or (conn.info.host or "").startswith("/"):
            return  # a Unix socket cannot be partitioned
        idle, interval, count = effective
        if idle and interval and count and idle + interval * count <= self.renew_deadline + 1:
            logger.warning(
                "lease %r: the server's TCP keepalives (%s + %s * %s s) would drop a "
                "partitioned leader before its renew_deadline %s s + 1 s; failover after "
                "a partition may overlap",
                self.name,
                idle,
                interval,
                count,
                self.renew_deadline,
            )

    def _ensure_pipe(self) -> None:
        with self._wake_lock:
            if self._wake_r is None:
                self._wake_r, self._wake_w = socket.socketpair()
                self._wake_r.setblocking(False)
                self._wake_w.setblocking(False)

    def _channel(self) -> str:
        assert self.channel is not None, "connect() resolves the channel first"
        return self.channel

    def _on_notify(self, notify: psycopg.Notify) -> None:
        if notify.pid != self._pid:
            self._foreign_notifies += 1
            self._note_payload(notify.payload)

    def _note_payload(self, payload: str) -> None:
        """Remember a handover request announced on the channel (checked by a renewal)."""
        if '"resign"' not in payload:
            return  # most notifications: skip the parse
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if isinstance(event, dict) and event.get("event") == "resign":
            self._handover_hint = True

    def _on_notice(self, diag: psycopg.errors.Diagnostic) -> None:
        self._last_notice = diag.message_primary or ""

    def _drop_keeper(self) -> None:
        conn, self._conn = self._conn, None
        self._leading = None
        self._seen = None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a broken connection is best effort
                logger.debug("lease %r: error closing the keeper", self.name, exc_info=True)

    def _keeper(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None:
            self.connect()
            conn = self._conn
            assert conn is not None
        elif conn.closed or conn.broken:
            self._drop_keeper()
            raise BackendUnavailable(
                f"the keeper connection to the lease server ({self._where}) was lost"
                + (f": {self._last_notice}" if self._last_notice else "")
            )
        return conn

    def _run(
        self,
        query: sql.Composed | sql.SQL,
        what: str,
        *,
        limit: float,
        expected: tuple[type[Exception], ...] = (),
    ) -> list[list[tuple[Any, ...]] | None]:
        """Run a (multi-statement) query on the keeper; one entry per statement.

        Errors in ``expected`` propagate unchanged (the implicit transaction has been
        rolled back and the session is healthy); any other error closes the keeper
        connection, which ends the session and frees every lock it held. A round trip
        longer than ``limit`` seconds is aborted (see :class:`IoWatchdog`).
        """
        conn = self._keeper()
        fired = [False]
        try:
            with self._io.guard(conn, limit) as fired:
                cur = conn.execute(query)
                results: list[list[tuple[Any, ...]] | None] = []
                while True:
                    results.append(cur.fetchall() if cur.description is not None else None)
                    if not cur.nextset():
                        break
        except expected:
            raise
        except psycopg.Error as exc:
            self._drop_keeper()
            if fired[0]:
                raise BackendUnavailable(
                    f"cannot {what}: no answer from the lease server ({self._where}) "
                    f"within {limit:g} s; reconnecting"
                ) from exc
            if isinstance(exc, psycopg.errors.UndefinedTable):
                raise BackendUnavailable(
                    f"cannot {what}: lease table {self.table!r} does not exist "
                    f"({self._where}); run `rselection migrate` or pass create_tables=True"
                ) from exc
            raise unavailable(what, self._conninfo, exc) from exc
        return results

    # -- the lease --------------------------------------------------------------------

    def _free_condition(self) -> sql.SQL:
        """True when row ``t`` may be taken: free, expired, dead holder, or our own.

        The session checks (own pid, lock not held) only count for a holder that renewed
        since the server (re)started: a restart ends every session at once, also that of
        a leader cut off from the server, which cannot have noticed; such a lease is
        only taken over once it expires.
        """
        return sql.SQL(
            "(t.holder IS NULL OR t.holder_pid IS NULL OR t.expires_at IS NULL"
            " OR t.expires_at <= clock_timestamp()"
            " OR (t.renewed_at > pg_postmaster_start_time()"
            " AND (t.holder_pid = pg_backend_pid() OR NOT " + _LOCK_HELD + ")))"
        )

    def _not_reserved(self, node: sql.Literal) -> sql.Composable:
        """True unless a handover request reserves row ``t`` against node ``node``.

        While a request's window lasts (until the next acquisition clears it), the node
        that was asked to hand over may not take the lease back, and when a node was
        named only that node may take it. This only ever narrows who may take the
        lease, so it cannot make two leaders. Never NULL (``CASE`` below relies on it).
        """
        if not self._handovers:
            return sql.SQL("true")
        return sql.SQL(
            "(t.resign_until IS NULL OR t.resign_until <= clock_timestamp()"
            " OR t.resign_to IS NOT DISTINCT FROM {node}"
            " OR (t.resign_to IS NULL AND t.resign_from IS DISTINCT FROM {node}))"
        ).format(node=node)

    def _state_sql(self, node_id: str) -> sql.Composed:
        node = sql.Literal(node_id)
        reserved: sql.Composable
        if self._handovers:
            reserved = sql.SQL(
                "CASE WHEN NOT {free} THEN greatest(0, extract(epoch FROM"
                " t.resign_until - clock_timestamp()))::float8 ELSE 0::float8 END"
            ).format(free=self._not_reserved(node))
        else:
            reserved = sql.SQL("0::float8")
        return sql.SQL(
            "SELECT t.holder, t.term, t.lock_key, t.acquired_at, t.expires_at,"
            " greatest(0, extract(epoch FROM t.expires_at - clock_timestamp()))::float8,"
            " " + _LOCK_HELD + ", {reserved} FROM {t} AS t WHERE t.name = {name}"
        ).format(t=self._ident, name=sql.Literal(self.name), reserved=reserved)

    def _acquire_sql(self, node_id: str) -> sql.Composed:
        name = sql.Literal(self.name)
        clear = (
            sql.SQL(
                ", resign_term = NULL, resign_from = NULL, resign_to = NULL, resign_until = NULL"
            )
            if self._handovers
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
            "  expires_at = clock_timestamp() + {ttl} * interval '1 second'{clear}"
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
            lock_timeout=sql.Literal(f"{round(ACQUIRE_LOCK_TIMEOUT * 1000)}ms"),
            t=self._ident,
            name=name,
            key=sql.Literal(self.lock_key),  # set by connect(), before any query
            free=self._free_condition(),
            open=self._not_reserved(sql.Literal(node_id)),
            clear=clear,
            node=sql.Literal(node_id),
            ttl=sql.Literal(self.ttl),
            channel=sql.Literal(self._channel()),
            state=self._state_sql(node_id),
        )

    def _acquisition(self, row: tuple[Any, ...] | None, acquired: bool) -> Acquisition:
        if row is None or row[0] is None:
            self._seen = None
            # A free lease reserved for another node: expires_in says for how long.
            reserved = float(row[7]) if row is not None and not acquired else 0.0
            return Acquisition(acquired, None, max(0.0, reserved))
        holder, term, lock_key, acquired_at, expires_at, expires_in, lock_held, _ = row
        info = LeaderInfo(holder, term, _utc(acquired_at), _utc(expires_at))
        if acquired:
            self._leading = _Held(term, lock_key)
            self._seen = None
        elif lock_held:
            self._seen = _Held(term, lock_key)  # wait on its lock: wakes when it ends
        else:
            # A holder without its session that could not be taken yet (server restarted
            # since it renewed, or fenced transactions held the row): only its expiry or
            # a notification can change things, so wait on the socket, not on a free lock.
            self._seen = None
        return Acquisition(acquired, info, max(0.0, float(expires_in)))

    def try_acquire(self, node_id: str) -> Acquisition:
        """Take the lease when it is free, expired, or its holder's session is gone.

        One round trip. A successful acquisition increments the term, sets the expiry to
        server ``clock_timestamp() + ttl`` (taken after the row lock, so any wait does not
        shorten the lease), takes the keeper session's advisory lock for the new term
        and notifies :attr:`channel`. Called by the session that already holds the lease,
        it takes a fresh term (the caller is not leading any more, or it would not ask).
        A takeover waits (up to :data:`ACQUIRE_LOCK_TIMEOUT`) for fenced transactions of
        the old term; if they outlast that, the attempt reports the lease as held.

        Args:
            node_id: this node's id (non-empty, at most 1000 characters).

        Raises:
            BackendUnavailable: connection problem.
        """
        if not isinstance(node_id, str) or not node_id or len(node_id) > _MAX_NODE_ID:
            raise ConfigError(
                f"node_id must be a non-empty string of at most {_MAX_NODE_ID} characters, "
                f"got {node_id!r:.60}"
            )
        self._keeper()  # connects first when needed: the query needs the lock key
        self._foreign_notifies = 0
        self._handover_hint = False
        self._handover = None
        self._leading = None
        try:
            results = self._run(
                self._acquire_sql(node_id),
                "acquire the lease",
                limit=ACQUIRE_LOCK_TIMEOUT + self.connect_timeout,
                expected=(psycopg.errors.LockNotAvailable,),
            )
        except psycopg.errors.LockNotAvailable:
            # Fenced transactions of the old term still hold the row. Nothing of ours
            # survived the rollback except possibly a session lock: drop those.
            logger.debug("lease %r: takeover blocked by open fenced transactions", self.name)
            results = self._run(
                sql.SQL("SELECT pg_advisory_unlock_all(); {}").format(self._state_sql(node_id)),
                "read the lease",
                limit=self.renew_deadline,
            )
            state = results[-1]
            return self._acquisition(state[0] if state else None, False)
        taken, state = results[-2], results[-1]
        acquired = bool(taken)
        acq = self._acquisition(state[0] if state else None, acquired)
        if acq.acquired and acq.holder is not None:
            logger.debug("lease %r: acquired by %s, term %s", self.name, node_id, acq.holder.term)
        return acq

    def renew(self, node_id: str, term: int) -> bool:
        """Extend this node's lease to server ``now() + ttl``; one statement.

        Succeeds only for the same holder, term and keeper session, on a lease that has
        not expired. ``False`` means the term is lost: step down.

        Args:
            node_id: this node's id.
            term: the term being renewed.

        Raises:
            BackendUnavailable: connection problem (the term is lost as well: a new
                session cannot renew it).
        """
        if self._handover_hint and not self._handovers:
            # Someone asks for a handover: the table may have been upgraded since we
            # connected. One catalog query, only when asked.
            found = resolve_lease_table(self._keeper(), self.table)
            self._handovers = found is not None and found[2]
        self._handover_hint = False
        self._handover = None
        if self._handovers:
            # The same single statement also reports a handover request for this term.
            returning = sql.SQL(
                "coalesce(resign_term = term AND resign_until > now(), false), resign_to,"
                " greatest(0, extract(epoch FROM resign_until - now()))::float8"
            )
        else:
            returning = sql.SQL("false, NULL::text, 0::float8")
        query = sql.SQL(
            "UPDATE {t} SET renewed_at = now(), expires_at = now() + {ttl} * interval '1 second'"
            " WHERE name = {name} AND holder = {node} AND term = {term}"
            " AND holder_pid = pg_backend_pid() AND expires_at > now()"
            " AND renewed_at > pg_postmaster_start_time()"
            " RETURNING {returning}"
        ).format(
            t=self._ident,
            ttl=sql.Literal(self.ttl),
            name=sql.Literal(self.name),
            node=sql.Literal(node_id),
            term=sql.Literal(term),
            returning=returning,
        )
        rows = self._run(query, "renew the lease", limit=self.renew_deadline)[0]
        if rows:
            asked, to, window = rows[0]
            if asked:
                self._handover = HandoverRequest(term, to, float(window or 0.0))
            return True
        logger.debug("lease %r: renewal of term %s by %s refused", self.name, term, node_id)
        self._leading = None
        self._seen = None
        return False

    def handover_hinted(self) -> bool:
        """True when a notification announced a handover request since the last renewal."""
        return self._handover_hint

    def handover_requested(self) -> HandoverRequest | None:
        """The handover request the last successful :meth:`renew` found, once.

        A request is for one term and lapses at its ``resign_until`` (server time);
        see :func:`request_handover`.
        """
        request, self._handover = self._handover, None
        return request

    def release(self, node_id: str, term: int) -> None:
        """Give the lease up: holder cleared (term kept), lock freed, followers notified.

        One round trip; does nothing to the row unless ``node_id`` holds ``term``.

        Args:
            node_id: this node's id.
            term: the term being released.

        Raises:
            BackendUnavailable: connection problem (the server frees the lock with the
                session; followers take over at once or after expiry).
        """
        self._keeper()
        leading = self._leading
        if leading is not None and leading.term != term:
            unlock = sql.SQL("")  # never drop the lock of the term we still hold
        else:
            unlock = sql.SQL("; SELECT pg_advisory_unlock_all()")
        query = sql.SQL(
            "WITH released AS ("
            " UPDATE {t} SET holder = NULL, holder_pid = NULL, expires_at = now()"
            " WHERE name = {name} AND holder = {node} AND term = {term}"
            " RETURNING term)"
            " SELECT pg_notify({channel}, json_build_object('event', 'released',"
            " 'name', {name}, 'node_id', {node}, 'term', released.term)::text)"
            " FROM released{unlock}"
        ).format(
            t=self._ident,
            name=sql.Literal(self.name),
            node=sql.Literal(node_id),
            term=sql.Literal(term),
            channel=sql.Literal(self._channel()),
            unlock=unlock,
        )
        results = self._run(query, "release the lease", limit=self.renew_deadline)
        if leading is None or leading.term == term:
            self._leading = None
        self._seen = None
        logger.debug(
            "lease %r: %s released term %s%s",
            self.name,
            node_id,
            term,
            "" if results[0] else " (it no longer held it)",
        )

    def current(self) -> LeaderInfo | None:
        """The live holder (not released, not expired on the server), or ``None``.

        Safe from any thread: uses its own observer connection, never the keeper's.

        Raises:
            BackendUnavailable: connection problem.
        """
        query = sql.SQL(
            "SELECT holder, term, acquired_at, expires_at FROM {t}"
            " WHERE name = %s AND holder IS NOT NULL AND expires_at > now()"
        ).format(t=self._ident)
        with self._observer_lock:
            conn = self._observer
            try:
                if conn is None or conn.closed:
                    conn = psycopg.Connection.connect(
                        self._conninfo, **self._connect_kwargs("observer")
                    )
                    self._observer = conn
                    ms = max(1, round(self.connect_timeout * 1000))
                    conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(ms)))
                with self._io.guard(conn, 2 * self.connect_timeout):
                    row = conn.execute(query, (self.name,)).fetchone()
            except psycopg.errors.UndefinedTable:
                return None  # not created yet: nobody holds it
            except psycopg.Error as exc:
                self._close_observer()
                raise unavailable("read the lease holder", self._conninfo, exc) from exc
        if row is None:
            return None
        return LeaderInfo(row[0], row[1], _utc(row[2]), _utc(row[3]))

    def _close_observer(self) -> None:
        conn, self._observer = self._observer, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # best effort
                logger.debug("lease %r: error closing the observer", self.name, exc_info=True)

    # -- waiting ----------------------------------------------------------------------

    def wait_for_change(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until the holder may have changed.

        * Leading (the last :meth:`try_acquire` acquired): wait on the keeper socket;
          raise :class:`BackendUnavailable` at once if the server closes the session.
        * Following a holder: wait on the holder's advisory lock with a server-side
          bound; returns as soon as the holder releases or its session ends.
        * No holder known: wait for a NOTIFY on :attr:`channel`.

        Returns early on :meth:`interrupt` (also one that came just before the call).

        Args:
            timeout: seconds to wait at most.

        Raises:
            BackendUnavailable: the keeper connection broke.
        """
        conn = self._keeper()
        try:
            with self._wake_lock:
                if self._interrupt_pending:
                    return
            if not timeout > 0:
                return
            if self._leading is not None:
                self._wait_socket(conn, timeout)
            elif self._seen is not None:
                self._wait_lock(conn, self._seen, timeout)
            else:
                if self._foreign_notifies:
                    return
                self._wait_socket(conn, timeout)
        finally:
            self._clear_interrupt()

    def _clear_interrupt(self) -> None:
        with self._wake_lock:
            self._interrupt_pending = False
            wake = self._wake_r
            if wake is not None:
                try:
                    while wake.recv(256):
                        pass
                except OSError:  # BlockingIOError: drained
                    pass

    def _wait_lock(self, conn: psycopg.Connection[Any], seen: _Held, timeout: float) -> None:
        ms = min(2**31 - 1, max(1, math.ceil(timeout * 1000)))
        query = sql.SQL(
            "SET LOCAL lock_timeout = {ms};"
            " SELECT pg_advisory_lock({args}), pg_advisory_unlock({args})"
        ).format(ms=sql.Literal(f"{ms}ms"), args=seen.lock_args)
        with self._wake_lock:
            if self._interrupt_pending:
                return
            self._in_lock_wait = True
        interrupted = False
        error: psycopg.Error | None = None
        try:
            with self._io.guard(conn, timeout + self.connect_timeout):
                conn.execute(query)
            logger.debug("lease %r: holder of term %s is gone or released", self.name, seen.term)
        except psycopg.errors.LockNotAvailable:
            pass  # the holder is still there: timeout
        except psycopg.errors.QueryCanceled:
            interrupted = True
        except psycopg.Error as exc:
            error = exc
        finally:
            # Taking the lock waits for a cancel request in flight: once interrupt() has
            # returned from cancel_safe(), the server has been signalled, so the cancel
            # cannot hit the next statement. Clearing the flag first also keeps
            # interrupt() from cancelling through a connection being closed below.
            with self._wake_lock:
                self._in_lock_wait = False
        if error is not None:
            self._drop_keeper()
            raise unavailable("wait for the lease holder", self._conninfo, error) from error
        if interrupted:
            # A cancel landing between lock and unlock would leave the lock held.
            self._run(
                sql.SQL("SELECT pg_advisory_unlock_all()"),
                "wait for the lease holder",
                limit=self.renew_deadline,
            )

    def _wait_socket(self, conn: psycopg.Connection[Any], timeout: float) -> None:
        wake = self._wake_r
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(conn.pgconn.socket, selectors.EVENT_READ, "db")
            if wake is not None:
                sel.register(wake, selectors.EVENT_READ, "wake")
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                for key, _ in sel.select(remaining):
                    if key.data == "wake":
                        return
                    if self._poll_socket(conn):
                        return

    def _poll_socket(self, conn: psycopg.Connection[Any]) -> bool:
        """Read what the server sent; ``True`` on a notification from another session."""
        pgconn = conn.pgconn
        before = self._foreign_notifies
        try:
            pgconn.consume_input()
            while (notify := pgconn.notifies()) is not None:
                if notify.be_pid != self._pid:
                    self._foreign_notifies += 1
                    self._note_payload(notify.extra.decode(errors="replace"))
        except psycopg.Error as exc:
            self._drop_keeper()
            detail = self._last_notice or str(exc).strip().splitlines()[0]
            raise BackendUnavailable(
                f"the keeper connection to the lease server ({self._where}) was lost: {detail}"
            ) from exc
        if pgconn.status != ConnStatus.OK:
            self._drop_keeper()
            raise BackendUnavailable(
                f"the keeper connection to the lease server ({self._where}) was lost"
                + (f": {self._last_notice}" if self._last_notice else "")
            )
        return self._foreign_notifies != before

    def interrupt(self) -> None:
        """Wake the keeper thread blocked in :meth:`wait_for_change`; safe from any thread.

        Sticky: an interrupt that arrives just before the wait makes it return at once.
        """
        with self._wake_lock:
            self._interrupt_pending = True
            if self._wake_w is not None:
                with contextlib.suppress(OSError):  # pipe full (already woken)
                    self._wake_w.send(b"\0")
            conn = self._conn
            if self._in_lock_wait and conn is not None:
                try:
                    conn.cancel_safe(timeout=self.connect_timeout)
                except Exception as exc:  # the wait ends by its own timeout anyway
                    logger.debug("lease %r: cancel request failed: %s", self.name, exc)

    def close(self) -> None:
        """Close the keeper and observer connections (ending LISTEN and any lock held).

        Idempotent; :meth:`connect` may be called again later.
        """
        self._drop_keeper()
        with self._observer_lock:
            self._close_observer()
        self._io.close()
        with self._wake_lock:
            for sock in (self._wake_r, self._wake_w):
                if sock is not None:
                    sock.close()
            self._wake_r = self._wake_w = None
