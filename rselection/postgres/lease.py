"""``PostgresLease``: a :class:`~rselection.lease.LeaseBackend` over one Postgres row.

How the lease works
-------------------

One row per lease name (see :mod:`rselection.postgres.schema`) holds the holder's node
id, the fencing ``term``, the holder's keeper backend pid, the identity of the server
that session is on, and server times. Every time comparison is made by the server
(``now()``, ``clock_timestamp()``); no client clock is ever compared.

**Session liveness.** The holder's keeper session holds the session advisory lock
``pg_advisory_lock(lock_key, term % 2**31)`` (two-int form) for as long as it leads, so
"the holder's session is alive" is exactly "that lock is granted to ``holder_pid``" in
``pg_locks`` *of the server that session is on*. When the holder's process dies, its
connection closes, or an admin terminates its backend, the server frees the lock at
once. The session checks only count on that server: see "Restarts and promoted
standbys" below.

**Acquire** (:meth:`PostgresLease.try_acquire`) is one round trip, one implicit
transaction. The row is locked ``FOR UPDATE`` *only* when a takeover looks possible
(holder NULL, lease expired, holder's lock not granted to ``holder_pid``, or this very
session is the holder; the last two only when the row's ``holder_server`` is this
server), then re-checked under the lock and updated: ``term + 1``, ``holder_pid =
pg_backend_pid()``, ``holder_server``, ``expires_at = clock_timestamp() + ttl``, measured
after any wait for the row lock, so a takeover that waited still gets a full ttl (never
less than the ttl from when the request was sent); the new holder takes
its advisory lock in the same transaction, before commit, so nobody can see the new
holder without its lock. The ``FOR UPDATE`` lock serialises acquirers and makes a
takeover wait for fenced transactions of the old term (``FOR KEY SHARE``, see
:mod:`rselection.postgres.fencing`). Followers that find a live holder take no row lock,
so they never block renewals or fenced transactions, and are never blocked by them.

**Renew** is a single ``UPDATE`` of non-key columns guarded by holder, term, the keeper's
backend pid on the recorded server and ``expires_at > now()``: a renewal never revives
an expired lease and a reconnected keeper (new pid, or the same pid on another server)
can never renew, so a leader whose session ended has lost. The same round trip (like
every acquisition's) reads ``pg_backend_pid()``: a statement that ran on another backend
than the keeper's session means a transaction pooler, refused with
:class:`~rselection.errors.ConfigError`.

**Release** clears the holder (the term is kept), frees the advisory lock and sends a
``NOTIFY`` on :attr:`PostgresLease.channel` (also sent on every acquisition).

**Waiting.** A follower waits on the holder's advisory lock with a server-side bound
(``SET LOCAL lock_timeout``): the wait ends the moment the holder's session ends or it
releases, and costs one statement per wait. A leader waits on its keeper socket (plus a
self-pipe for :meth:`PostgresLease.interrupt`), so a session closed by the server is seen
at once and reported as :class:`~rselection.errors.BackendUnavailable`.

**Never closed while the term may run.** From an acquisition until the leader calls
:meth:`PostgresLease.term_ended` (its tasks are joined), :meth:`~PostgresLease.release`
or :meth:`~PostgresLease.close`, the lease itself never ends the keeper session: an
error only marks the connection broken (calls raise ``BackendUnavailable``), and a round
trip that overruns its bound is aborted only once the hold is over. Closing the session
would free the advisory lock, and a follower would take over while the old term's tasks
still run.

Why the server never drops a live leader's session early
---------------------------------------------------------

Fast failover trusts the server's view of the holder's session, so the server must not
end a session whose leader may still run tasks. A leader cut off from the server ends
its term ``renew_deadline`` after it *sent* its last successful renewal and joins its
tasks within ``stop_grace`` after that; the server received that renewal no earlier than
it was sent. So the keeper pins, on every connect (``hold = renew_deadline +
stop_grace``):

* ``idle_session_timeout = 0``, ``idle_in_transaction_session_timeout = 0``,
  ``statement_timeout = 0``: no timer ends the session while the leader is healthy.
* ``tcp_keepalives_idle/interval/count`` with ``idle + interval * count > hold + 1``
  s. The server only drops a silent client after that long without receiving anything
  from it; by then the cut-off leader's tasks have ended more than a second ago.
* ``tcp_user_timeout`` = the same total, in milliseconds. It decides how long the
  server's kernel retries data the client does not acknowledge (a NOTIFY sent into a
  partition) and, with keepalives, caps unanswered probes. Left at 0 the kernel's
  ``net.ipv4.tcp_retries2`` would decide instead: about 15 minutes by default, which is
  safe but holds a vanished leader's backend that long, and a few seconds where an
  administrator lowered it for faster failure detection, which would free the lock
  while the cut-off leader still runs. An explicit value makes the bound hold on any
  server and still frees a vanished host's session as early as is safe.

A check at connect reads the values back and warns when the server did not take them.
The client side of the keeper connection uses the same keepalives and
``tcp_user_timeout``: a client kernel that gives up on the server sends a RST, which can
reach the server over a one-way partition. The leader's own deadline, not its socket,
tells it when to stop.

A session that the server ends while the network works (``pg_terminate_backend``, a
server restart) is seen by the leader at once, because its keeper waits on the socket;
it steps down then. Followers act on the freed lock within milliseconds too, so for the
short time both run, fencing (:func:`~rselection.postgres.fenced`) is what keeps a
deposed leader's writes from committing after the new term's.

Restarts and promoted standbys
------------------------------

A server restart ends every session at once, also that of a leader cut off from the
server, which cannot notice. A failover to a promoted standby (Patroni, a managed
service's Multi-AZ failover, a replica promoted by hand) is worse: the standby's copy of
the row names a ``holder_pid`` that holds nothing there, while the old leader, cut off
from the old primary, runs its term until its deadline. So every acquisition records
the server's identity in ``holder_server``: ``"<system identifier>/<timeline>/<postmaster
start time>"`` (``pg_control_system()``; the timeline of ``pg_walfile_name(
pg_current_wal_lsn())``, which is the new one from the moment a promoted standby
writes, while ``pg_control_checkpoint()`` lags until the next checkpoint; and
``pg_postmaster_start_time()``). A restart changes the start time, a promotion the
timeline (and the start time, being another postmaster). The session checks count only
when the row's ``holder_server`` equals this session's server; otherwise, and for a row
without one (acquired before schema version 3), only expiry frees the lease, and by
then the old leader's own deadline has stopped it. A renewal requires the same, so
holding the lease is always tied to one server's session. This relies on the promoted
server having the old leader's last renewal: with asynchronous replication it may lack
the renewals of its replication lag, and the lease expires that much earlier there, so
that lag must stay below ``ttl - renew_deadline - stop_grace`` (or replicate
synchronously).

The identity is read once per keeper session, at connect, and passed to every statement
as a literal: a session cannot outlive its postmaster, and a primary cannot become a
standby without a restart, so it cannot change while the session can write (a standby
is refused at connect). Every function it uses is executable by any role on a stock
server; where a hardened server refuses ``pg_control_system()`` or the WAL functions,
the start time alone is recorded, which still tells servers and restarts apart. On a
table not yet upgraded to schema version 3 (``create_tables=False``) nothing is
recorded and only expiry frees a lease.

What remains unprotected is a server that ends a *partitioned* leader's session some
other way before that leader's tasks have ended: an administrator's
``pg_terminate_backend``, or a crash of a backend (the postmaster then resets every
session without restarting, and keeps its start time). Avoid terminating keeper
sessions (``application_name`` ``rselection:<name>``) by hand.

Poolers: a pooler in session mode works; one in transaction or statement mode cannot keep
the session advisory lock, settings and LISTEN, so :meth:`PostgresLease.connect` refuses it
with :class:`~rselection.errors.ConfigError` before anything is acquired (see
:mod:`rselection.postgres.pooler`), and every acquisition and renewal refuses a statement
that ran on another backend. ``log_lock_waits = on`` logs each follower wait longer than
``deadlock_timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import selectors
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import ConnStatus

from ..closeable import Closeable
from ..errors import BackendUnavailable, ConfigError
from ..lease import Acquisition, HandoverRequest, LeaderInfo
from ..session_hold import SessionHold
from ..validation import check_name, check_node_id, check_seconds
from ..wakeup import Wakeup
from ._conn import (
    SESSION_MARGIN,
    IoWatchdog,
    Keepalives,
    check_conninfo,
    describe_conninfo,
    server_keepalives,
    server_user_timeout,
    unavailable,
)
from ._lease_sql import (
    SERVER_IDENTITY_SQL,
    SERVER_START_SQL,
    acquire_sql,
    current_sql,
    describe_lease_table,
    lease_channel,
    lease_lock_key,
    release_sql,
    renew_sql,
    resolve_lease_table,
    server_identity,
    session_sql,
    state_sql,
    utc,
    wait_lock_sql,
)
from .handover import announces_handover, cancel_handover, renewal_request, request_handover
from .pooler import BACKEND_PID, check_bound, check_same_backend, check_session_pooling
from .schema import DEFAULT_TABLE, create_tables, table_identifier

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


@dataclass(frozen=True)
class _Held:
    """A holder as the keeper last saw it: its term and its lock's first key."""

    term: int
    lock_key: int

    @property
    def lock_args(self) -> sql.Composed:
        return sql.SQL("{}, {}").format(sql.Literal(self.lock_key), sql.Literal(self.term % 2**31))


CANCEL_RETRY_FIRST = 0.02
"""Seconds before a lock-wait cancel is sent again if the wait is still marked."""

CANCEL_RETRY_CAP = 0.5
"""Longest pause between two cancel requests for the same lock wait, seconds."""


class PostgresLease(Closeable):
    """A lease kept in a Postgres table, with server time, fencing terms and fast failover.

    One instance is used by one keeper thread (:meth:`connect`, :meth:`try_acquire`,
    :meth:`renew`, :meth:`release`, :meth:`wait_for_change`, :meth:`close`);
    :meth:`current` and :meth:`interrupt` are safe from any thread. Keeper methods raise
    :class:`~rselection.errors.BackendUnavailable` on any connection problem; the
    keeper connection is then closed (once no term acquired through it may still run,
    see :meth:`term_ended`) and the next call reconnects. ``with PostgresLease(...) as
    lease:`` connects and closes on exit. The module docstring explains the protocol
    and its safety argument.

    Args:
        conninfo: a libpq connection string or URI (a direct connection, or a pooler
            in session mode).
        name: the lease name; nodes using the same name and table compete. Not blank,
            at most 1,000 characters, used as given (never trimmed).
        ttl: lease length on the server, seconds.
        renew_deadline: the leader's renew deadline, seconds (``< ttl``).
        stop_grace: seconds the leader waits for its tasks after its term ends
            (``TaskHandler.stop_grace``). With ``renew_deadline`` it sizes the keeper
            session's server-side TCP keepalives and ``tcp_user_timeout``, so that the
            server never ends a cut-off leader's session, and lets a follower take
            over, before that leader's tasks are joined.
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
        stop_grace: float = 5.0,
        table: str = DEFAULT_TABLE,
        create_tables: bool = True,
        connect_timeout: float = 5.0,
    ) -> None:
        check_conninfo(conninfo)
        self.name = check_name(name, "lease name")
        self.ttl = check_seconds(ttl, "ttl")
        self.renew_deadline = check_seconds(renew_deadline, "renew_deadline")
        self.stop_grace = check_seconds(stop_grace, "stop_grace", allow_zero=True)
        self.connect_timeout = check_seconds(connect_timeout, "connect_timeout")
        if self.renew_deadline >= self.ttl:
            raise ConfigError(
                f"renew_deadline must be shorter than ttl, got renew_deadline "
                f"{renew_deadline} >= ttl {ttl}: the leader must stop before its lease "
                "can expire on the server"
            )
        self._ident = table_identifier(table)  # validates
        self.table = table
        self.create_tables = create_tables
        self.lock_key: int | None = None
        """First advisory-lock key for new rows (known once connected)."""
        self.channel: str | None = None
        """LISTEN/NOTIFY channel of this lease (known once connected)."""
        hold = self.renew_deadline + self.stop_grace  # a cut-off leader's wind-down
        self.server_keepalives: Keepalives = server_keepalives(hold)
        self.server_user_timeout: int = server_user_timeout(hold)
        """The keeper session's server-side ``tcp_user_timeout``, milliseconds."""
        # The client's kernel must not reset the session earlier either: a keepalive
        # timeout sends a RST, which can reach the server over a one-way partition. The
        # leader's own deadline, not the socket, tells it when to stop.
        self.client_keepalives: Keepalives = self.server_keepalives
        self._conninfo = conninfo
        self._where = describe_conninfo(conninfo)

        self._conn: psycopg.Connection[Any] | None = None
        self._pid = 0
        self._leading: _Held | None = None  # our own term, while we hold it
        # From an acquisition until term_ended()/release()/close(): the term's tasks may
        # run, so errors and overruns never end this session (see term_ended()).
        self._hold = SessionHold()
        self._seen: _Held | None = None  # another holder, as the last attempt saw it
        self._foreign_notifies = 0
        self._last_notice = ""
        self._handovers = True  # the table has the handover columns (schema version 2)
        self._servers = True  # the table has the holder_server column (schema version 3)
        self._server: str | None = None  # this session's server identity, once connected
        self._handover_hint = False
        self._handover: HandoverRequest | None = None

        self._observer: psycopg.Connection[Any] | None = None
        self._observer_lock = threading.Lock()
        self._io = IoWatchdog(name)  # bounds every blocking round trip

        # interrupt(): a sticky wake-up (wakes socket waits) and a cancel request (ends a
        # lock wait), sent from a thread of its own. _lock_wait_guard guards _in_lock_wait;
        # the cancel lock orders that request before the keeper's next statement: the
        # keeper takes it after its lock wait.
        self._wakeup = Wakeup()
        self._lock_wait_guard = threading.Lock()
        self._in_lock_wait = False
        self._cancel_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, table={self.table!r}, "
            f"{self._where}, connected={self._conn is not None})"
        )

    def __enter__(self) -> PostgresLease:
        """Connect; the ``with`` block closes the lease on exit."""
        self.connect()
        return self

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
            "tcp_user_timeout": self.server_user_timeout,
            "application_name": app.encode()[:63].decode(errors="ignore"),
        }

    def _open_probe(self) -> psycopg.Connection[Any]:
        return psycopg.Connection.connect(self._conninfo, **self._connect_kwargs("probe"))

    def _session_sql(self) -> sql.Composed:
        return session_sql(self.server_keepalives, self.server_user_timeout, self._channel())

    def connect(self) -> None:
        """Open (or re-open) the keeper connection and pin its session settings.

        Checks first that the connection keeps one database session, with a second,
        short-lived connection (see :mod:`rselection.postgres.pooler`), then creates the
        tables when ``create_tables`` is set. The new session holds nothing: after a
        reconnect a former leader cannot renew.

        Raises:
            ConfigError: the connection goes through a pooler in transaction or statement
                mode (the message says to use session mode or a direct connection).
            BackendUnavailable: the server cannot be reached (within ``connect_timeout``)
                or refused; the message names host, port and database, never the
                password.
        """
        self._drop_keeper()
        self._wakeup.open()
        try:
            conn = psycopg.Connection.connect(self._conninfo, **self._connect_kwargs(""))
        except psycopg.Error as exc:
            raise unavailable("connect to the lease server", self._conninfo, exc) from exc
        try:
            # First of all: a standby cannot hold a lease, and a transaction pooler would
            # share "our" session with other clients (see rselection.postgres.pooler).
            with self._io.guard(conn, check_bound(self.connect_timeout)):
                self._refuse_standby(conn)
                pid = check_session_pooling(
                    conn,
                    self._open_probe,
                    where=self._where,
                    io=self._io,
                    timeout=self.connect_timeout,
                )
            with self._io.guard(conn, self.renew_deadline + self.connect_timeout):
                if self.create_tables:
                    # On every (re)connect: a restored or recreated database may have
                    # lost the tables, and the statements are cheap no-ops when they exist.
                    create_tables(conn, leases=self.table, timeout=self.renew_deadline)
                self._resolve_table(conn)
                server = self._read_server(conn)
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
        self._server = server
        # The server's pid: behind a pooler, conn.info.backend_pid is the pooler's own.
        self._pid = pid
        self._leading = None
        self._seen = None
        self._foreign_notifies = 0
        self._last_notice = ""
        logger.debug("lease %r: keeper connected (%s, pid %s)", self.name, self._where, self._pid)

    def _resolve_table(self, conn: psycopg.Connection[Any]) -> None:
        """Find the table's OID and schema: they name the lock key and the channel."""
        found = describe_lease_table(conn, self.table)
        if found is None:
            raise BackendUnavailable(
                f"lease table {self.table!r} does not exist ({self._where}, on this "
                "connection's search_path): run `rselection migrate` or pass "
                "create_tables=True"
            )
        self.lock_key = lease_lock_key(found.oid, self.name)
        self.channel = lease_channel(found.qualified, self.name)
        if found.handovers != self._handovers and not found.handovers:
            logger.warning(
                "lease %r: table %r has schema version 1 (no handover columns); leases "
                "work, handover requests (rselection resign) need `rselection migrate`",
                self.name,
                self.table,
            )
        if found.servers != self._servers and not found.servers:
            logger.warning(
                "lease %r: table %r predates schema version 3 (no holder_server column); "
                "leases work, but a crashed leader is replaced only when its lease "
                "expires, not at once, until `rselection migrate` upgrades the table",
                self.name,
                self.table,
            )
        self._handovers = found.handovers
        self._servers = found.servers

    def _standby(self) -> BackendUnavailable:
        return BackendUnavailable(
            f"the lease server ({self._where}) is a standby in recovery (read-only): "
            "point the connection string at the primary (with several hosts, add "
            "target_session_attrs=read-write)"
        )

    def _refuse_standby(self, conn: psycopg.Connection[Any]) -> None:
        """Refuse a standby before anything else (the pooler check needs LISTEN)."""
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        if row is not None and row[0]:
            raise self._standby()

    def _read_server(self, conn: psycopg.Connection[Any]) -> str | None:
        """This session's server identity (``None`` when the table cannot record it).

        Read once per session: a session cannot outlive its server's postmaster, and a
        primary cannot become a standby without a restart, so the identity stays the
        same for as long as the session can write. A standby is refused: it cannot hold
        a lease, and its timeline changes when it is promoted.
        """
        try:
            row = conn.execute(SERVER_IDENTITY_SQL).fetchone()
        except psycopg.DatabaseError as exc:
            if conn.broken or isinstance(exc, psycopg.OperationalError):
                raise
            # A hardened or managed server may refuse pg_control_system() or the WAL
            # functions: the postmaster start time alone still tells servers apart.
            logger.info(
                "lease %r: recording the server's start time only (%s)",
                self.name,
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )
            row = conn.execute(SERVER_START_SQL).fetchone()
        assert row is not None
        in_recovery, system_id, walfile, started = row
        if in_recovery:
            raise self._standby()
        return server_identity(system_id, walfile, started) if self._servers else None

    def _check_keepalives(self, conn: psycopg.Connection[Any], effective: Any) -> None:
        if effective is None or (conn.info.host or "").startswith("/"):
            return  # a Unix socket cannot be partitioned
        idle, interval, count, user_timeout = effective
        bound = self.renew_deadline + self.stop_grace + SESSION_MARGIN
        if idle and interval and count and idle + interval * count <= bound:
            logger.warning(
                "lease %r: the server's TCP keepalives (%s + %s * %s s) would drop a "
                "partitioned leader before renew_deadline %s s + stop_grace %s s + %s s; "
                "failover after a partition may overlap",
                self.name,
                idle,
                interval,
                count,
                self.renew_deadline,
                self.stop_grace,
                SESSION_MARGIN,
            )
        if user_timeout and user_timeout <= bound * 1000:
            logger.warning(
                "lease %r: the server's tcp_user_timeout (%s ms) would drop a partitioned "
                "leader before renew_deadline %s s + stop_grace %s s + %s s; failover "
                "after a partition may overlap",
                self.name,
                user_timeout,
                self.renew_deadline,
                self.stop_grace,
                SESSION_MARGIN,
            )

    def _channel(self) -> str:
        assert self.channel is not None, "connect() resolves the channel first"
        return self.channel

    def _on_notify(self, notify: psycopg.Notify) -> None:
        if notify.pid != self._pid:
            self._foreign_notifies += 1
            self._note_payload(notify.payload)

    def _note_payload(self, payload: str) -> None:
        """Remember a handover request announced on the channel (checked by a renewal)."""
        if announces_handover(payload):
            self._handover_hint = True

    def _on_notice(self, diag: psycopg.errors.Diagnostic) -> None:
        self._last_notice = diag.message_primary or ""

    def _drop_keeper(self) -> None:
        conn, self._conn = self._conn, None
        self._leading = None
        self._seen = None
        self._hold.reset()
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a broken connection is best effort
                logger.debug("lease %r: error closing the keeper", self.name, exc_info=True)

    def _keeper(self) -> psycopg.Connection[Any]:
        if self._hold.stale:
            self._drop_keeper()  # its failure was reported; the hold is over: start afresh
        conn = self._conn
        if conn is None:
            self.connect()
            conn = self._conn
            assert conn is not None
        elif self._hold.broken or conn.closed or conn.broken:
            self._fail()
            raise BackendUnavailable(
                f"the keeper connection to the lease server ({self._where}) was lost"
                + (f": {self._last_notice}" if self._last_notice else "")
            )
        return conn

    def _is_holding(self) -> bool:
        return self._hold.holding

    def _fail(self) -> None:
        """The keeper connection failed: close it, unless it holds a term whose tasks may
        still run; then it stays open (broken) until :meth:`term_ended` or :meth:`close`."""
        if self._hold.fail():
            self._drop_keeper()

    def term_ended(self, term: int) -> None:
        """The leader ended ``term`` and joined its tasks: the session may end from now on.

        Until then, an error leaves the keeper session open (only marked broken) and a
        round trip that overruns its bound is not aborted, because the server frees the
        holder's advisory lock with the session and a follower takes over at once. Safe
        from any thread.

        Args:
            term: the term that ended.
        """
        self._hold.end(term)
        if not self._hold.holding:
            self._io.recheck()

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
            with self._io.guard(conn, limit, held=self._is_holding) as fired:
                cur = conn.execute(query)
                results: list[list[tuple[Any, ...]] | None] = []
                while True:
                    results.append(cur.fetchall() if cur.description is not None else None)
                    if not cur.nextset():
                        break
        except expected:
            raise
        except psycopg.Error as exc:
            self._fail()
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

    @staticmethod
    def _with_pid(query: sql.Composable) -> sql.Composed:
        """``query`` followed, in the same round trip, by the backend pid it ran on."""
        return sql.Composed([query, sql.SQL("; "), BACKEND_PID])

    def _check_backend(
        self, results: list[list[tuple[Any, ...]] | None], taken: tuple[str, int] | None = None
    ) -> None:
        """Pop the pid :meth:`_with_pid` appended; refuse a statement on another backend.

        Only a pooler in transaction or statement mode moves a client between backends
        (:meth:`connect` checks for one; this is the second line of defence). A term
        taken on the wrong backend is given back at once (its lock stays with that
        backend, the row is freed), and the keeper connection is closed.
        """
        rows = results.pop()
        assert rows, "SELECT pg_backend_pid() returns one row"
        try:
            check_same_backend(self._pid, int(rows[0][0]), self._where)
        except ConfigError:
            if taken is not None:
                node_id, term = taken
                release = release_sql(
                    self._ident, self.name, node_id, term, channel=self._channel(), unlock=False
                )
                with contextlib.suppress(BackendUnavailable):
                    self._run(
                        release,
                        "give back a term taken on another backend",
                        limit=self.connect_timeout,
                    )
            self._fail()  # closed once a term begun through it has ended (see _fail)
            raise

    # -- the lease --------------------------------------------------------------------

    def _state_sql(self, node_id: str) -> sql.Composed:
        return state_sql(
            self._ident, self.name, node_id, handovers=self._handovers, server=self._server
        )

    def _acquire_sql(self, node_id: str) -> sql.Composed:
        return acquire_sql(
            self._ident,
            self.name,
            node_id,
            lock_key=self.lock_key,  # set by connect(), before any query
            ttl=self.ttl,
            channel=self._channel(),
            handovers=self._handovers,
            server=self._server,
            lock_timeout=ACQUIRE_LOCK_TIMEOUT,
        )

    def _acquisition(self, row: tuple[Any, ...] | None, acquired: bool) -> Acquisition:
        if row is None or row[0] is None:
            self._seen = None
            # A free lease reserved for another node: expires_in says for how long.
            reserved = float(row[7]) if row is not None and not acquired else 0.0
            return Acquisition(acquired, None, max(0.0, reserved))
        holder, term, lock_key, acquired_at, expires_at, expires_in, lock_held, _ = row
        info = LeaderInfo(holder, term, utc(acquired_at), utc(expires_at))
        if acquired:
            self._leading = _Held(term, lock_key)
            self._hold.begin(term)
            self._seen = None
        elif lock_held:
            self._seen = _Held(term, lock_key)  # wait on its lock: wakes when it ends
        else:
            # A holder without its session here that could not be taken yet (its session
            # was on another server: before a restart or a failover; or fenced transactions
            # held the row): only its expiry or a notification can change things, so wait
            # on the socket, not on a free lock.
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
            ConfigError: the statement ran on another backend than the keeper's session
                (a pooler in transaction mode); a term it took is given back.
            BackendUnavailable: connection problem.
        """
        check_node_id(node_id)
        self._keeper()  # connects first when needed: the query needs the lock key
        self._foreign_notifies = 0
        self._handover_hint = False
        self._handover = None
        self._leading = None
        try:
            results = self._run(
                self._with_pid(self._acquire_sql(node_id)),
                "acquire the lease",
                limit=ACQUIRE_LOCK_TIMEOUT + self.connect_timeout,
                expected=(psycopg.errors.LockNotAvailable,),
            )
        except psycopg.errors.LockNotAvailable:
            # Fenced transactions of the old term still hold the row. Nothing of ours
            # survived the rollback except possibly a session lock: drop those.
            logger.debug("lease %r: takeover blocked by open fenced transactions", self.name)
            results = self._run(
                self._with_pid(
                    sql.SQL("SELECT pg_advisory_unlock_all(); {}").format(self._state_sql(node_id))
                ),
                "read the lease",
                limit=self.renew_deadline,
            )
            self._check_backend(results)
            state = results[-1]
            return self._acquisition(state[0] if state else None, False)
        taken = results[-3]
        if taken:
            self._check_backend(results, taken=(node_id, int(taken[0][0])))
        else:
            self._check_backend(results)
        state = results[-1]
        acquired = bool(taken)
        acq = self._acquisition(state[0] if state else None, acquired)
        if acq.acquired and acq.holder is not None:
            logger.debug("lease %r: acquired by %s, term %s", self.name, node_id, acq.holder.term)
        return acq

    def renew(self, node_id: str, term: int) -> bool:
        """Extend this node's lease to server ``now() + ttl``; one round trip.

        Succeeds only for the same holder, term and keeper session, on a lease that has
        not expired. ``False`` means the term is lost: step down.

        Args:
            node_id: this node's id.
            term: the term being renewed.

        Raises:
            ConfigError: the renewal ran on another backend than the keeper's session (a
                pooler in transaction mode); it renewed nothing.
            BackendUnavailable: connection problem (the term is lost as well: a new
                session cannot renew it).
        """
        if self._handover_hint and not self._handovers:
            # Someone asks for a handover: the table may have been upgraded since we
            # connected. One catalog query, only when asked.
            conn = self._keeper()
            try:
                with self._io.guard(conn, self.renew_deadline, held=self._is_holding):
                    found = resolve_lease_table(conn, self.table)
            except psycopg.Error as exc:
                self._fail()
                raise unavailable("look up the lease table", self._conninfo, exc) from exc
            self._handovers = found is not None and found[2]
        self._handover_hint = False
        self._handover = None
        query = renew_sql(
            self._ident,
            self.name,
            node_id,
            term,
            ttl=self.ttl,
            handovers=self._handovers,
            server=self._server,
        )
        results = self._run(self._with_pid(query), "renew the lease", limit=self.renew_deadline)
        self._check_backend(results)
        rows = results[0]
        if rows:
            self._handover = renewal_request(term, rows[0])
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
        query = release_sql(
            self._ident,
            self.name,
            node_id,
            term,
            channel=self._channel(),
            # unless we lead another term: never drop the lock of the term we still hold
            unlock=leading is None or leading.term == term,
        )
        results = self._run(query, "release the lease", limit=self.renew_deadline)
        if leading is None or leading.term == term:
            self._leading = None
        self._hold.end(term)
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
        query = current_sql(self._ident)
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
        return LeaderInfo(row[0], row[1], utc(row[2]), utc(row[3]))

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
            if self._wakeup.pending:
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
            self._wakeup.clear()

    def _wait_lock(self, conn: psycopg.Connection[Any], seen: _Held, timeout: float) -> None:
        query = wait_lock_sql(seen.lock_args, timeout)
        with self._lock_wait_guard:
            # interrupt() wakes first, then looks for a lock wait to cancel: it either
            # finds this wait marked, or this check finds its wake-up.
            if self._wakeup.pending:
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
            # Taking the cancel lock waits for a cancel request in flight: once it has
            # been sent the server has been signalled, so the cancel cannot hit the next
            # statement. Clearing the flag also keeps a later cancel from going through a
            # connection being closed below.
            with self._cancel_lock, self._lock_wait_guard:
                self._in_lock_wait = False
        if error is not None:
            self._fail()
            raise unavailable("wait for the lease holder", self._conninfo, error) from error
        if interrupted:
            # A cancel landing between lock and unlock would leave the lock held.
            self._run(
                sql.SQL("SELECT pg_advisory_unlock_all()"),
                "wait for the lease holder",
                limit=self.renew_deadline,
            )

    def _wait_socket(self, conn: psycopg.Connection[Any], timeout: float) -> None:
        wake = self._wakeup.socket
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
            self._fail()
            detail = self._last_notice or str(exc).strip().splitlines()[0]
            raise BackendUnavailable(
                f"the keeper connection to the lease server ({self._where}) was lost: {detail}"
            ) from exc
        if pgconn.status != ConnStatus.OK:
            self._fail()
            raise BackendUnavailable(
                f"the keeper connection to the lease server ({self._where}) was lost"
                + (f": {self._last_notice}" if self._last_notice else "")
            )
        return self._foreign_notifies != before

    def interrupt(self) -> None:
        """Wake the keeper thread blocked in :meth:`wait_for_change`; safe from any thread.

        Sticky: an interrupt that arrives just before the wait makes it return at once.
        """
        self._wakeup.wake()
        with self._lock_wait_guard:
            if self._in_lock_wait and self._conn is not None:
                # The cancel request is a network round trip of its own: never make the
                # caller (stop(), perhaps on an event loop) wait for it.
                threading.Thread(
                    target=self._cancel_lock_wait, name="rselection-cancel", daemon=True
                ).start()

    def _cancel_lock_wait(self) -> None:
        # The wait is marked a moment before its statement reaches the server; a cancel
        # that lands in that gap finds the backend idle and is ignored. So the request
        # is sent again, with backoff, for as long as the wait is marked.
        pause = CANCEL_RETRY_FIRST
        while True:
            with self._cancel_lock:
                with self._lock_wait_guard:
                    conn = self._conn if self._in_lock_wait else None
                if conn is None:
                    return  # the wait ended
                try:
                    conn.cancel_safe(timeout=self.connect_timeout)
                except Exception as exc:  # the wait ends by its own timeout anyway
                    logger.debug("lease %r: cancel request failed: %s", self.name, exc)
                    return
            time.sleep(pause)
            pause = min(2 * pause, CANCEL_RETRY_CAP)

    def close(self) -> None:
        """Close the keeper and observer connections (ending LISTEN and any lock held).

        Idempotent; :meth:`connect` may be called again later.
        """
        self._drop_keeper()
        with self._observer_lock:
            self._close_observer()
        self._io.close()
        self._wakeup.close()
