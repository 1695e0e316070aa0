"""``PostgresLease``: a :class:`~rselection.abc.LeaseBackend` over one Postgres row.

One row per lease name holds the holder, the fencing term, the holder's keeper backend
pid and the identity of its server; every time is the server's. Every lease of a process
on one connection string and lease table is a client of one
:class:`~rselection.postgres.keeper.SharedKeeper`, whose session acquires, renews and
releases all of them and holds each led term's advisory lock, so a dead holder's lease is
taken over at once. That session is never closed while a term taken through it may run.

See ``docs/explanation/how-it-works.md`` ("The lease", "Fast failover after a crash",
"Restarts and failover to a standby") for the design and why each step is safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from .. import forks
from ..closeable import Closeable
from ..drains import DrainNotices
from ..errors import BackendUnavailable, ConfigError
from ..history import HISTORY_LIMIT, TermEnding, check_history_limit
from ..lease import Acquisition, HandoverRequest, LeaderInfo, ReleaseOutcome, RenewOutcome
from ..task_board import TaskNotices
from ..timing import MAX_TIMING
from ..validation import check_name, check_node_id, check_seconds
from ..versions import check_version
from ._conn import (
    Keepalives,
    describe_conninfo,
    per_call_source,
    server_keepalives,
    server_user_timeout,
    session_conninfo,
)
from ._lease_sql import (
    LEASE_PROTOCOL,
    current_sql,
    lease_channel,
    resolve_lease_table,
    utc,
)
from .connections import Connections
from .handover import cancel_handover, renewal_request, request_handover
from .keeper import RELEASE_REFUSED, RENEWAL_SKIPPED, Attempt, Queued, SharedKeeper
from .notices import LeaseNotice
from .schema import DEFAULT_TABLE, table_identifier

__all__ = [
    "PostgresLease",
    "cancel_handover",
    "lease_channel",
    "request_handover",
    "resolve_lease_table",
]

logger = logging.getLogger(__name__)

TAKEABLE_RETRY = 0.25
"""Seconds before a follower attempts again a lease it may take whose row another
transaction held (reported as free, reserved that long)."""

SKIPPED_RETRY = 0.1
"""Seconds between renewals of a term whose row another transaction holds locked."""

PROTOCOL_CONFIRM = 1.0
"""Seconds a holder must still look like a node of another lease protocol before an
attempt refuses to go on. A keeper session of this protocol that ends (its process
killed) frees its ring lock and its term's lock one after the other, and an attempt that
reads the lock table in between sees a node of protocol 1; the first sighting only makes
the attempt look again (each :data:`TAKEABLE_RETRY`)."""


class PostgresLease(Closeable):
    """A lease kept in a Postgres table, with server time, fencing terms and fast failover.

    One instance is used by one keeper thread (:meth:`connect`, :meth:`try_acquire`,
    :meth:`renew`, :meth:`release`, :meth:`wait_for_change`, :meth:`close`);
    :meth:`current`, :meth:`interrupt` and :meth:`term_ended` are safe from any thread.
    Every lease of a process with the same ``conninfo`` and ``table`` shares one keeper
    session and one watcher session (see the module docstring). Keeper methods raise
    :class:`~rselection.errors.BackendUnavailable` on any connection problem; the shared
    session is then reopened once no term acquired through it may still run (see
    :meth:`term_ended`). ``with PostgresLease(...) as lease:`` connects and closes on exit.

    Args:
        conninfo: the lease's database (a direct connection, or a pooler in session
            mode): a libpq connection string or URI, a ``psycopg.Connection`` or a pool
            (``psycopg_pool.ConnectionPool``). The keeper and watcher sessions are the
            lease's own, opened with the parameters a connection connected with (the
            connection itself is never used) or with a pool's ``conninfo`` and libpq
            ``kwargs``; a pool lends the connections of :meth:`current`.
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
        create_tables: run :func:`~rselection.postgres.migrate` when the shared keeper
            session connects (cheap no-ops when the tables exist).
        connect_timeout: seconds to wait for a connection (libpq rounds up to whole
            seconds, at least 2).
        version: the node's version (PEP 440), recorded with each term it takes.
        history_limit: terms of the lease's leadership history to keep in the table
            ``<table>_history`` (see :mod:`rselection.history`); an acquisition trims
            the older ones.

    Raises:
        ConfigError: bad arguments (the message says which and why).
    """

    def __init__(
        self,
        conninfo: str | Any,
        *,
        name: str = "default",
        ttl: float = 15.0,
        renew_deadline: float = 10.0,
        stop_grace: float = 5.0,
        table: str = DEFAULT_TABLE,
        create_tables: bool = True,
        connect_timeout: float = 5.0,
        version: str | None = None,
        history_limit: int = HISTORY_LIMIT,
    ) -> None:
        sessions = session_conninfo(conninfo, type(self).__name__)  # validates
        self.name = check_name(name, "lease name")
        self.ttl = check_seconds(ttl, "ttl")
        if self.ttl > MAX_TIMING:
            # Shared with every lease of the process: an expiry that overflows the
            # server's timestamps would fail the renewals of all of them.
            raise ConfigError(f"ttl must be at most {MAX_TIMING:g} s (a day), got {self.ttl:g}")
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
        self.version = check_version(version)
        self.history_limit = check_history_limit(history_limit)
        self._ending = TermEnding()  # why the term ending now ends, for its record
        self.table = table
        self.create_tables = create_tables
        self.channel: str | None = None
        """LISTEN/NOTIFY channel of this lease (known once connected)."""
        self.row_seen = False
        """True once an attempt found the lease's row (no need to create it again)."""
        self.interrupts = 0  # interrupt() calls: a connect waiting for the session gives up
        hold = self.renew_deadline + self.stop_grace  # a cut-off leader's wind-down
        self.server_keepalives: Keepalives = server_keepalives(hold)
        self.server_user_timeout: int = server_user_timeout(hold)
        """The keeper session's server-side ``tcp_user_timeout`` this lease needs, ms."""
        self.client_keepalives: Keepalives = self.server_keepalives
        self._conninfo = sessions
        self._where = describe_conninfo(sessions)
        self._keeper: SharedKeeper | None = None
        self._generation = 0  # the keeper session our last acquisition went through
        self._held: int | None = None  # the term we hold, while we hold it
        self._node_id: str | None = None  # the node of the last attempt
        self._death_announced = False  # a keeper session died since the last attempt
        self._announced: LeaderInfo | None = None  # a new holder a notification named
        # The holder's keeper session as last seen, with the term it was seen for (a
        # row read before a newer acquisition's notification must not replace it).
        self._holder_seen: tuple[int, int | None] = (0, None)
        self._must_attempt = False  # a wake since the last attempt that needs one
        self._wake = threading.Event()  # sticky: interrupt(), a notification, a failure
        # A renewal waiting on the shared session (a round trip of other leases' renewals
        # in flight) waits on this; interrupt() sets it, so the renewal gives up at once.
        self._renewal_done: threading.Event | None = None
        self._pending: Queued | None = None  # a renewal started by renew_soon, unanswered
        self._waker: Callable[[], None] | None = None  # see on_wake
        self._handover_hint = False
        self._handover: HandoverRequest | None = None
        self._drain_notices = DrainNotices(self.name)  # see on_drain
        self._task_notices = TaskNotices(self.name)  # see on_tasks
        # (holder, term, first seen) of a holder that looks like a node of another lease
        # protocol (see PROTOCOL_CONFIRM)
        self._other_protocol: tuple[str, int, float] | None = None
        # A holder is read in one short statement: bound each read by about twice the
        # connect timeout, as a caller of current() expects of a quick look.
        self._observer = Connections(
            per_call_source(conninfo, sessions),
            owner="PostgresLease",
            application_name="rselection:observer",
            connect_timeout=self.connect_timeout,
            statement_timeout=self.connect_timeout,
            pooled=True,
        )
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): the shared keeper, its
        sessions and threads are the parent's. Forget them (never close them: that
        would end the parent's session and free its leases) and hold nothing; the next
        call joins this process's own keeper."""
        forks.keep_inherited(self._keeper)
        self._keeper = None
        self._generation = 0
        self._held = None
        self._node_id = None
        self.channel = None
        self._death_announced = False
        self._announced = None
        self._holder_seen = (0, None)
        self._other_protocol = None
        self._must_attempt = False
        self._wake = threading.Event()
        self._renewal_done = None
        self._pending = None
        self._waker = None
        self._handover_hint = False
        self._handover = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, table={self.table!r}, "
            f"{self._where}, connected={self._keeper is not None})"
        )

    def _enter_block(self) -> None:
        """Connect; the ``with`` block closes the lease on exit."""
        self.connect()

    @property
    def conninfo(self) -> str:
        """The connection string of the lease's sessions (the shared keeper is keyed by it
        and the table): the one given, or one made from the connection or pool given."""
        return self._conninfo

    @property
    def backend_pid(self) -> int | None:
        """The shared keeper session's backend pid, or ``None`` when not connected."""
        keeper = self._keeper
        return keeper.pid if keeper is not None else None

    @property
    def keeper(self) -> SharedKeeper | None:
        """The shared keeper this lease is a client of, once connected."""
        return self._keeper

    def wake(self) -> None:
        """Wake :meth:`wait_for_change` (the shared keeper calls it when its own session
        failed, or a keeper session it cannot tell is announced dead)."""
        self._death_announced = True
        self._set_wake()

    def holder_died(self, pid: int) -> None:
        """A keeper session (backend ``pid``) was announced dead: wake
        :meth:`wait_for_change` unless this lease's holder, as last seen, has another
        session (its lease is not the dead one's: an attempt would only find it held)."""
        known = self._holder_seen[1]
        if known is not None and known != pid:
            return
        self.wake()

    def _saw_holder(self, term: object, pid: int | None) -> None:
        """Record the holder's keeper session ``pid`` (``None``: free) seen for ``term``,
        unless a newer term was seen already; for one term, free wins (a release comes
        after the acquisition it ends). A term that is not a number forgets the pid."""
        if isinstance(term, bool) or not isinstance(term, int):
            self._holder_seen = (0, None)
            return
        seen = self._holder_seen[0]
        if term > seen or (term == seen and pid is None):
            self._holder_seen = (term, pid)

    @property
    def death_announced(self) -> bool:
        """True when a keeper session (the holder's, maybe) was announced dead since this
        lease's last attempt: an attempt now may take the lease over."""
        return self._death_announced

    def notified(
        self, notice: LeaseNotice, *, sender: int, own_session: bool, proven: bool
    ) -> None:
        """A notification on this lease's channel (the shared keeper calls it): wake
        :meth:`wait_for_change`, unless it only reports this node's own acquisition or
        release through the shared session.

        What it says is believed only when ``proven`` (its ``sender`` is a trusted peer's
        keeper session, see :mod:`.notice_gate`): then an ``acquired`` notice from the
        holder's own session names the holder, and a ``released`` one may reserve the
        lease for another node. Otherwise it is a wake-up: an attempt reads the row.
        """
        if own_session and notice.node_id == self._node_id:
            return
        if notice.event == "acquired" and proven and notice.holder_pid == sender:
            self._saw_holder(notice.term, sender)
            if notice.holder is not None:
                self._announced = notice.holder
                self._set_wake(attempt=False)
                return
        elif notice.event == "released" and proven:
            self._saw_holder(notice.term, None)
            if notice.to not in (None, self._node_id):
                # Reserved for another node by a handover: only that one may take it
                # now. Should it not, the others find the lease free at their next
                # attempt (or at once if its keeper session dies).
                return
        elif notice.event == "drain":
            # Only a wake-up, from whoever sent it: the node reads its drain state.
            self._drain_notices.tell(notice.node_id)
            return
        elif notice.event == "tasks":
            # Only a wake-up too: the leader reads the task controls.
            self._task_notices.tell()
            return
        elif notice.event == "resign":
            self._hint_handover()
            # Only the holder has something to do: a follower's attempt would find the
            # row held (and, in a busy fleet, lock it while the holder's release goes
            # by). The release that follows wakes the followers.
            return
        self._set_wake()

    def nudged(self, kinds: frozenset[str]) -> None:
        """Notifications of ``kinds`` on this lease's channel were held back by the
        keeper's rate limit: act as on any of them, believing none (a ``resign``
        makes the holder renew at once and read a request from the row; the others
        make a follower attempt)."""
        if "resign" in kinds:
            self._hint_handover()
        if "drain" in kinds:
            self._drain_notices.tell(None)
        if "tasks" in kinds:
            self._task_notices.tell()
        if kinds - {"resign", "drain", "tasks"}:
            self._set_wake()

    def on_drain(self, callback: Callable[[str | None], None] | None) -> None:
        """Call ``callback(node_id)`` when a notification says the drains of this lease
        changed (of that node; ``None``: of any), from the keeper's thread: it must not
        block. ``None`` stops the calls. A notification is anyone's: the callback reads
        the drain state from the table, never from the notification."""
        self._drain_notices.callback = callback

    def on_tasks(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` when a notification says the task controls of this lease
        changed, from the keeper's thread: it must not block. ``None`` stops the calls.
        A notification is anyone's: the callback reads the controls from the tables."""
        self._task_notices.callback = callback

    def _hint_handover(self) -> None:
        self._handover_hint = True
        if self._held is not None:
            self._set_wake(attempt=False)  # the holder renews at once to see it

    def renewal_slot(self, due: float, interval: float, after: float) -> float:
        """The shared keeper's renewal tick at or before ``due`` (see
        :class:`~rselection.abc.SharedSchedule`)."""
        keeper = self._keeper
        return due if keeper is None else keeper.renewal_slot(due, interval, after)

    def attempt_slot(self, due: float, interval: float) -> float:
        """The shared keeper's attempt tick at or after ``due``."""
        keeper = self._keeper
        return due if keeper is None else keeper.attempt_slot(due, interval)

    # -- connections ------------------------------------------------------------------

    def _shared(self) -> SharedKeeper:
        keeper = self._keeper
        if keeper is None:
            keeper = self._keeper = SharedKeeper.attach(self)
        return keeper

    def join_keeper(self) -> None:
        """Become a client of the process's shared keeper session, without connecting.

        Leases that join before any of them connects listen for their notifications in
        one round trip, at the first connect (a sharded leader joins its shards' leases
        before it starts them). :meth:`connect` joins by itself.
        """
        self._shared()

    def connect(self) -> None:
        """Join the process's shared keeper session, connecting it when needed.

        The first connect checks that the connection keeps one database session (see
        :mod:`rselection.postgres.pooler`), creates the tables when ``create_tables`` is
        set, and records the server's identity. A new session holds nothing: after a
        reconnect a former leader cannot renew.

        Raises:
            ConfigError: the connection goes through a pooler in transaction or statement
                mode, or the lease table is of an older schema (the message says what to
                do).
            BackendUnavailable: the server cannot be reached (within ``connect_timeout``)
                or refused, or the shared session broke and terms taken through it have
                not ended yet; the message names host, port and database, never the
                password.
        """
        self._shared().ensure(self)

    def term_ended(self, term: int) -> None:
        """The leader ended ``term`` and joined its tasks: the session may end from now on.

        Until every lease of the process that holds a term through the shared keeper
        session has said so, an error leaves that session open (only marked broken) and a
        round trip that overruns its bound is not aborted, because the server frees the
        holder's advisory lock with the session and a follower takes over at once. Safe
        from any thread.

        Args:
            term: the term that ended.
        """
        keeper = self._keeper
        if keeper is not None:
            for node_id in keeper.nodes_holding(self):
                keeper.end_hold(self, node_id, term)

    # -- the lease --------------------------------------------------------------------

    def _other_protocol_confirmed(self, holder: str, term: int) -> bool:
        """Whether ``holder`` (of ``term``) was first seen as a node of another lease
        protocol at least :data:`PROTOCOL_CONFIRM` seconds ago (and is so again now: a
        session that ends never looks so twice for one term)."""
        now = time.monotonic()
        seen = self._other_protocol
        if seen is None or seen[:2] != (holder, term):
            self._other_protocol = (holder, term, now)
            return False
        return now - seen[2] >= PROTOCOL_CONFIRM

    def _acquisition(self, row: tuple[Any, ...] | None, acquired: bool) -> Acquisition:
        if row is None or row[1] is None:
            self._saw_holder(row[2] if row is not None else None, None)
            # A free lease reserved for another node: expires_in says for how long.
            reserved = float(row[8]) if row is not None and not acquired else 0.0
            return Acquisition(acquired, None, max(0.0, reserved))
        _, holder, term, _, acquired_at, expires_at, expires_in, lock_held, _, protocol, free = row[
            :11
        ]
        self._saw_holder(term, row[11])
        info = LeaderInfo(holder, term, utc(acquired_at), utc(expires_at))
        if not acquired and protocol != LEASE_PROTOCOL and (lock_held or expires_in > 0):
            if not self._other_protocol_confirmed(holder, term):
                logger.debug(
                    "lease %r: holder %r looks like a node of lease protocol %s; looking "
                    "again (its session may be ending)",
                    self.name,
                    holder,
                    protocol or 1,
                )
                return Acquisition(False, None, TAKEABLE_RETRY)
            raise ConfigError(
                f"lease {self.name!r} in table {self.table!r} is held by node {holder!r} "
                f"speaking lease protocol {protocol or 1}; this node speaks protocol "
                f"{LEASE_PROTOCOL}. Nodes of both could lead at once: stop every node of the "
                "other release before starting this one"
            )
        self._other_protocol = None
        if not acquired and free:
            # Takeable, but another transaction held the row (fenced transactions of the
            # gone holder's term, another node's attempt): no live leader; look again
            # soon rather than at the dead holder's expiry (but not in a busy loop while
            # a long fenced statement of the old term runs on).
            return Acquisition(False, None, TAKEABLE_RETRY)
        return Acquisition(acquired, info, max(0.0, float(expires_in)))

    def try_acquire(self, node_id: str) -> Acquisition:
        """Take the lease when it is free, expired, or its holder's session is gone.

        One round trip, shared with the other leases of the process attempting now. A
        successful acquisition increments the term, sets the expiry to server
        ``clock_timestamp() + ttl`` (taken after the row lock, so any wait does not
        shorten the lease), takes the keeper session's advisory lock for the new term and
        notifies :attr:`channel`. A row that fenced transactions of the old term (or
        another node's attempt) hold locked is not waited for: the attempt reports the
        lease free but not acquired, and the leader looks again soon.

        Args:
            node_id: this node's id (non-empty, at most 1000 characters).

        Raises:
            ConfigError: the statement ran on another backend than the keeper's session
                (a pooler in transaction mode), the holder speaks another lease
                protocol, or the lease's row was deleted since this object last saw it.
            BackendUnavailable: connection problem, or the server refused the attempt
                (the other leases of the process attempt on).
        """
        keeper = self._before_attempt(node_id)
        return self._after_attempt(keeper, node_id, keeper.acquire(self, node_id))

    def acquire_soon(
        self, node_id: str, done: Callable[[Acquisition | BaseException], None]
    ) -> bool:
        """Start :meth:`try_acquire` with the attempts of the process's other leases due
        now, without blocking: ``done`` gets what it would return or raise (see
        :class:`~rselection.abc.NonBlockingLease`). ``False`` when the shared session
        is not connected and listening for this lease yet: call :meth:`try_acquire`."""
        keeper = self._before_attempt(node_id)

        def answered(queued: Queued) -> None:
            if queued.error is not None:
                done(queued.error)
                return
            try:
                done(self._after_attempt(keeper, node_id, queued.result))
            except Exception as exc:  # ConfigError: the caller raises it
                done(exc)

        return keeper.acquire_soon(self, node_id, answered) is not None

    def release_soon(self, node_id: str, term: int, done: Callable[[ReleaseOutcome], None]) -> bool:
        """Start :meth:`release` with the releases of the process's other leases queued
        now, without blocking: ``done`` gets ``True`` (released), ``False`` (no longer
        held), ``None`` (the batch was refused: call :meth:`release`, which sends it
        alone) or what :meth:`release` would raise, a row locked past the bound
        included (see :class:`~rselection.abc.NonBlockingRelease`). ``False`` when the
        shared session is not ready: call :meth:`release`."""
        keeper = self._shared()

        def answered(queued: Queued) -> None:
            if queued.error is not None:
                done(queued.error)
            elif queued.result is RELEASE_REFUSED:
                done(None)
            else:
                if self._held == term:
                    self._held = None
                done(bool(queued.result))

        return keeper.release_soon(self, node_id, term, answered) is not None

    def _before_attempt(self, node_id: str) -> SharedKeeper:
        if node_id is not self._node_id:  # the last attempt's was checked already
            check_node_id(node_id)
        keeper = self._shared()
        self._node_id = node_id
        self._wake.clear()
        self._handover_hint = False
        self._handover = None
        self._death_announced = False
        self._must_attempt = False
        return keeper

    def _after_attempt(self, keeper: SharedKeeper, node_id: str, attempt: Attempt) -> Acquisition:
        if self.row_seen and attempt.row is None:
            raise ConfigError(
                f"the row of lease {self.name!r} in table {self.table!r} was deleted: its "
                "terms (the fencing tokens) would start again from 1. A lease row is "
                "retired (`rselection forget`), never deleted; stop every leader of this "
                "lease and insert the row again with a term above the last one issued"
            )
        self.row_seen = self.row_seen or attempt.row is not None
        acq = self._acquisition(attempt.row, attempt.acquired)
        if attempt.acquired and acq.holder is not None:
            self._held = acq.holder.term
            self._generation = keeper.generation
            logger.debug("lease %r: acquired by %s, term %s", self.name, node_id, acq.holder.term)
        return acq

    def renew(self, node_id: str, term: int) -> bool:
        """Extend this node's lease to server ``now() + ttl``.

        Sent with the renewals of the process's other leases that are due now, in one
        statement. Succeeds only for the same holder, term and keeper session, on a
        lease that has not expired. ``False`` means the term is lost: step down.

        Args:
            node_id: this node's id.
            term: the term being renewed.

        Raises:
            ConfigError: the renewal ran on another backend than the keeper's session (a
                pooler in transaction mode); it renewed nothing.
            BackendUnavailable: connection problem (the term is lost as well: a new
                session cannot renew it).
        """
        keeper = self._before_renewal()
        try:
            while True:
                self._renewal_done = done = threading.Event()
                row = keeper.renew(self, node_id, term, done=done)
                if row is not RENEWAL_SKIPPED:
                    break
                # Another transaction holds the row (an operator's lock, `rselection
                # forget` looking at it): still ours, not renewed; again soon. The
                # deadline still counts from the last renewal that went through.
                self._renewal_done = pause = threading.Event()
                if pause.wait(SKIPPED_RETRY):
                    raise BackendUnavailable(
                        f"lease {self.name!r}: interrupted while its row was locked"
                    )
        finally:
            self._renewal_done = None
        return self._after_renewal(node_id, term, row)

    def renew_soon(self, node_id: str, term: int, done: Callable[[RenewOutcome], None]) -> bool:
        """Start :meth:`renew` with the renewals of the process's other leases due now,
        without blocking: ``done`` gets ``True``, ``False``, ``None`` (the row was locked
        by another transaction: not renewed this time, try again in a moment) or what
        :meth:`renew` would raise (see :class:`~rselection.abc.NonBlockingLease`).
        :meth:`interrupt` makes it answer ``BackendUnavailable`` at once. ``False`` when
        the shared session is not ready: call :meth:`renew`."""
        keeper = self._before_renewal()

        def answered(queued: Queued) -> None:
            self._pending = None
            if queued.error is not None:
                done(queued.error)
            elif queued.result is RENEWAL_SKIPPED:
                done(None)
            else:
                done(self._after_renewal(node_id, term, queued.result))

        queued = keeper.renew_soon(self, node_id, term, answered)
        if queued is None:
            return False
        self._pending = queued
        if queued.done.is_set():  # answered before it was recorded
            self._pending = None
        return True

    def _before_renewal(self) -> SharedKeeper:
        keeper = self._shared()
        self._handover_hint = False
        self._handover = None
        self._must_attempt = False  # a wake while leading is answered by the renewal
        return keeper

    def _after_renewal(self, node_id: str, term: int, row: tuple[Any, ...] | None) -> bool:
        if row is not None:
            self._handover = renewal_request(term, row[2:5])
            return True
        logger.debug("lease %r: renewal of term %s by %s refused", self.name, term, node_id)
        return False

    def on_wake(self, waker: Callable[[], None] | None) -> None:
        """Call ``waker`` whenever :meth:`wait_for_change` would return early (see
        :class:`~rselection.abc.NonBlockingLease`)."""
        self._waker = waker
        if waker is not None and self._wake.is_set():
            waker()

    def take_announced(self) -> LeaderInfo | None:
        """The holder an acquisition's notification announced since the last call, when
        nothing else woke this lease since its last attempt (see
        :class:`~rselection.abc.AnnouncesHolder`); forgets it."""
        announced, self._announced = self._announced, None
        return None if self._must_attempt else announced

    def _set_wake(self, *, attempt: bool = True) -> None:
        if attempt:
            self._must_attempt = True
        self._wake.set()
        waker = self._waker
        if waker is not None:
            waker()

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

    def term_ending(self, term: int, reason: str, by: str | None) -> None:
        """Ability ``"records_history"``: remember why ``term`` ends, for the record its
        release closes (see :mod:`rselection.history`)."""
        self._ending.note(term, reason, by)

    def ending(self, term: int) -> tuple[str, str | None]:
        """Why ``term`` ends and who ended it, as :meth:`term_ending` said (a release
        nobody explained is ``released``)."""
        return self._ending.of(term)

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
        released = self._shared().release(self, node_id, term)
        if self._held == term:
            self._held = None
        logger.debug(
            "lease %r: %s released term %s%s",
            self.name,
            node_id,
            term,
            "" if released else " (it no longer held it)",
        )

    def current(self) -> LeaderInfo | None:
        """The live holder (not released, not expired on the server), or ``None``.

        Safe from any thread. Read on the keeper session while the process only follows
        (so a follower holds no other session), else on the process's pooled sessions
        (or a connection of the pool given as ``conninfo``), so that renewals never wait
        behind it.

        Raises:
            BackendUnavailable: connection problem.
        """
        try:
            keeper = self._keeper
            rows = (
                None
                if keeper is None
                else keeper.read(current_sql(self._ident, self.name), "read the lease holder")
            )
            if rows is None:
                with self._observer.connection() as conn:
                    rows = conn.execute(current_sql(self._ident), (self.name,)).fetchall()
        except psycopg.errors.UndefinedTable:
            return None  # not created yet: nobody holds it
        except psycopg.Error as exc:
            raise self._observer.wrap("read the lease holder", exc) from exc
        row = rows[0] if rows else None
        if row is None:
            return None
        return LeaderInfo(row[0], row[1], utc(row[2]), utc(row[3]))

    # -- waiting ----------------------------------------------------------------------

    def wait_for_change(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until the holder may have changed.

        Returns early on a notification on :attr:`channel` (a release, an acquisition,
        and, while this lease holds a term, a handover request), when a keeper session is
        announced dead (the holder's, maybe), and on :meth:`interrupt` (also one that came
        just before the call).

        Args:
            timeout: seconds to wait at most.

        Raises:
            BackendUnavailable: the shared keeper session broke.
        """
        keeper = self._shared()
        try:
            if timeout > 0:
                self._wake.wait(timeout)
        finally:
            self._wake.clear()
        keeper.check_alive()

    def interrupt(self) -> None:
        """Wake the keeper thread blocked in :meth:`wait_for_change` or :meth:`renew`;
        safe from any thread.

        Sticky: an interrupt that arrives just before the wait makes it return at once. A
        renewal waiting for the shared session (whose round trip may hang on a silent
        server) raises ``BackendUnavailable`` at once; the round trip goes on for the
        other leases of the process. So does a :meth:`connect` waiting for the shared
        session to open (on a server that does not answer, up to ``connect_timeout``):
        the opening goes on for the other leases.
        """
        self.interrupts += 1
        keeper = self._keeper
        if keeper is not None:
            keeper.interrupted()
        done = self._renewal_done
        if done is not None:
            done.set()
        pending = self._pending
        if pending is not None:
            pending.give_up(
                BackendUnavailable(f"lease {self.name!r}: renewal interrupted while in flight")
            )
        self._set_wake()

    def close(self) -> None:
        """Leave the shared keeper (the last lease of the process closes its sessions) and
        give up any session lock this lease holds.

        Idempotent; :meth:`connect` may be called again later.
        """
        keeper, self._keeper = self._keeper, None
        self._held = None
        self.channel = None
        if keeper is not None:
            keeper.detach(self)
        self._observer.close()
