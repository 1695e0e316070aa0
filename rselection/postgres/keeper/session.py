"""The keeper session: opened, listening, holding terms, and one round trip at a time.

:class:`KeeperSession` is the part of the shared keeper (:mod:`.shared`) that owns the
Postgres session: it opens it on a thread of its own (:mod:`.opening`, with the steps of
:mod:`.session_setup`), makes its clients (:class:`KeptLease`) listen on their lease
channels, keeps the terms taken through it (the session is never closed while one may
still run: :class:`~rselection.session_hold.SessionHolds`), runs each round trip under
one lock with the freed locks of ended terms and a check of its backend, and takes the
notifications in that arrive on it. Its server-side TCP keepalives and
``tcp_user_timeout`` are sized for the longest wind-down (``renew_deadline +
stop_grace``) of its clients, and raised when a client with a longer one joins. What is
sent through it is :mod:`.batches`' and :mod:`.heartbeats`'; the thread that sends it
and acts on the notifications is :mod:`.pump`'s.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import psycopg
from psycopg import sql
from psycopg.pq import ConnStatus, TransactionStatus

from ... import clock
from ...errors import BackendUnavailable, ConfigError, first_line
from ...session_hold import SessionHolds
from ...wakeup import Wakeup
from .._conn import IoWatchdog, describe_conninfo, unavailable
from .._lease_sql import (
    Ending,
    LeaseTable,
    bounded_sql,
    lease_channel,
    listen_sql,
    unlisten_sql,
    unlock_sql,
)
from ..notice_gate import NoticeGate
from ..notices import LeaseNotice
from ..pooler import BACKEND_PID, check_same_backend
from ..ring import RingWatcher, members_sql
from ..schema import history_table_name, table_identifier
from .opening import OpenedSession, Opening, open_session
from .session_setup import pin_session

__all__ = [
    "HEARTBEAT_BOUND",
    "INBOX_LIMIT",
    "OPENING_WAIT",
    "READ_QUEUE",
    "RELEASE_WAIT",
    "KeeperSession",
    "KeptLease",
]

_LOCK_POLL = 0.05  # seconds between looks at an interrupt while the statement lock is busy

logger = logging.getLogger(__name__)

INBOX_LIMIT = 10_000
"""Notifications received and not read yet that the keeper keeps; more (a flood) are
dropped, counted, and stand for one wake-up of every client (rate-limited as any)."""

READ_QUEUE = 5.0
"""Seconds a read on the keeper session waits at most for the read under way before it
goes to the process's pooled sessions instead (see :meth:`KeeperSession.read`)."""

OPENING_WAIT = 1.0
"""Seconds a read waits at most for the keeper session being opened (see
:meth:`KeeperSession.read`)."""

RELEASE_WAIT = 1.0
"""Seconds the lock of a term that ended (its tasks joined) waits for that term's
release, which frees it in the statement that clears the row, before the session frees
it anyway. Freed earlier, by any other round trip of the session, it let a follower of
another process take the lease over before the release and record a graceful end as a
lost session. The lock of a term given no release (its lease lost, a fatal error) is
freed at once when its lease attempts again or closes, or its release is refused; else
once this bound has passed."""

HEARTBEAT_BOUND = 1.0
"""Seconds a heartbeat (or the nodes table's creation) may take on the keeper session,
lock waits included, before the server cancels it: renewals queue behind it, and a
locked nodes table (``VACUUM FULL``, a migration, a row locked by hand) must never make
the leases of a process pass their deadlines. The heartbeat is retried a second later."""


class KeptLease(Protocol):
    """What the keeper needs of a lease it keeps: a
    :class:`~rselection.postgres.PostgresLease` (which calls the keeper, so the keeper
    names only what it needs of it)."""

    name: str
    ttl: float
    renew_deadline: float
    stop_grace: float
    connect_timeout: float
    table: str
    create_tables: bool
    channel: str | None
    row_seen: bool
    interrupts: int  # counts the lease's interrupt() calls
    version: str | None  # the node's, recorded with each term
    history_limit: int  # terms of its history to keep

    def ending(self, term: int) -> tuple[str, str | None]:
        """Why ``term`` ends and who ended it, for its record (see
        :mod:`rselection.history`)."""

    @property
    def conninfo(self) -> str:
        """The connection string the keeper session is opened with."""

    def wake(self) -> None:
        """Wake the lease's waits (the keeper's session failed, or a dead keeper session
        could not be told apart)."""

    def holder_died(self, pid: int) -> None:
        """The keeper session of backend ``pid`` was announced dead."""

    def notified(
        self, notice: LeaseNotice, *, sender: int, own_session: bool, proven: bool
    ) -> None:
        """A notification on the lease's channel."""

    def nudged(self, kinds: frozenset[str]) -> None:
        """Notifications of ``kinds`` were held back by the rate limit."""


class KeeperSession:
    """The keeper session of one process, connection string and lease table, and its
    clients (see :class:`~.shared.SharedKeeper`, the class to use).

    Statements run one at a time on the session (a lock); every method is safe from any
    thread. The keeper's own thread (:meth:`_pump_loop`) is a subclass's.
    """

    def __init__(self, conninfo: str, table: str) -> None:
        self._conninfo = conninfo
        self.table = table
        self._ident = table_identifier(table)
        self._history = table_identifier(history_table_name(table))
        self.where = describe_conninfo(conninfo)
        self._lock = threading.RLock()  # one round trip at a time on the session
        self._state = threading.Lock()  # guards the fields below (never held in I/O)
        self._clients: set[KeptLease] = set()
        self._by_channel: dict[str, set[KeptLease]] = {}
        self._conn: psycopg.Connection[Any] | None = None
        self._pid = 0
        self._server = ""
        self._found: LeaseTable | None = None
        self.generation = 0  # bumped by every connect: terms of older sessions are lost
        # Terms taken through the session whose tasks may still run, by (lease, node),
        # with their lock key: the one the acquisition drew and locked, stored in the row
        # with the term. The session is never closed while it holds one; whether it
        # failed is kept there too. Changed only under _state, with the fields it goes
        # with (_unlocks, _conn).
        self._holds: SessionHolds[tuple[KeptLease, str], int] = SessionHolds()
        self._want = 0.0  # the longest wind-down (renew_deadline + stop_grace) of a client
        self._timeout = 0.0  # the longest connect_timeout of a client
        self._pinned = 0.0  # the wind-down the session's keepalives are sized for
        self._unlocks: list[tuple[int, int]] = []  # locks of ended terms, freed next trip
        # By (lease, node): the term that ended, its lock key and when to free that lock
        # if its release has not (RELEASE_WAIT); its release frees it.
        self._parked: dict[tuple[KeptLease, str], tuple[int, int, float]] = {}
        self._unlocks_after = -math.inf  # a refused round trip that frees them: later
        # By lease name, the last term held through the session that ended, and why, as
        # its leader said, until its release: should its lock be freed without it (see
        # RELEASE_WAIT) and an attempt of this process take it over, its record keeps
        # that reason (see AcquireRequest.ended).
        self._endings: dict[str, Ending] = {}
        # Channels no client listens on any more (their leases closed): the keeper's
        # thread sends UNLISTEN soon, so that a process that opens and closes leases
        # does not listen on ever more channels.
        self._unlistens: set[str] = set()
        self._io = IoWatchdog(f"keeper-{table}")
        self._wakeup = Wakeup()
        self._pump: threading.Thread | None = None
        self._closed = False
        self._created: set[str] = set()  # nodes tables created through this session
        self._ring: RingWatcher | None = None
        self._ring_channel = ""
        self._opening: Opening | None = None  # opening the session (statement lock)
        self._opened = threading.Condition()  # an opening ended, or a client interrupted
        self._reading = threading.Lock()  # a read in flight on the session (read())
        self._gate = NoticeGate()  # whom notifications are believed from, and how often
        # Notifications as received (channel, payload, sender), read by the keeper's
        # thread between its round trips: receiving one costs the round trip that
        # brought it next to nothing, however many a flood brings.
        self._inbox: collections.deque[tuple[str, str, int]] = collections.deque()
        self._overflow: tuple[int, str, str, int] | None = None  # dropped: count, last

    # -- connecting ----------------------------------------------------------------------

    def ensure(self, lease: KeptLease) -> int:
        """Connect when needed and make ``lease`` a listener; return the generation.

        The session is opened on a thread of its own (see :mod:`.opening`), which
        every lease that needs it waits for: a lease interrupted meanwhile
        (``lease.interrupts`` changed) gives up at once.

        Raises:
            ConfigError: a pooler in transaction mode, or a lease table of another
                protocol or too old a schema.
            BackendUnavailable: the server cannot be reached, the session broke and
                terms taken through it have not ended yet, or ``lease`` was interrupted.
        """
        # The common case, without the statement lock: a batch in flight holds it,
        # and every lease due now must queue its renewal while that batch is out.
        if self.ready(lease):
            return self.generation
        seen = lease.interrupts

        def interrupted() -> bool:
            return lease.interrupts != seen

        while True:
            # The statement lock may be held by a round trip that hangs on a silent
            # server (left alone while a term taken through it runs): an interrupt ends
            # this wait too.
            while not self._lock.acquire(timeout=_LOCK_POLL):
                if interrupted():
                    raise BackendUnavailable("waiting for the keeper session was interrupted")
            try:
                opening = self._opening_needed(lease)
                if opening is None:
                    return self._listen(lease)
            finally:
                self._lock.release()
            opening.wait(interrupted)

    def interrupted(self) -> None:
        """A client was interrupted: its wait for the session's opening ends."""
        with self._opened:
            self._opened.notify_all()

    def _opening_needed(self, lease: KeptLease) -> Opening | None:
        """Under the statement lock: ``None`` when the session is up, else the opening
        to wait for (started now unless one is under way).

        Raises:
            BackendUnavailable: the session broke and holds terms not ended yet.
            RuntimeError: no thread could start for the opening.
        """
        with self._state:
            conn = self._conn
            # A session the server ended counts as broken even before a round trip
            # marked it so: reconnecting now would drop the holds of running terms.
            broken = self._holds.broken or (conn is not None and (conn.closed or conn.broken))
            holds = self._holds.holding
        if broken and holds:
            self._fail()
            raise self._lost()
        if not broken and conn is not None:
            return None
        if self._opening is None:
            self._drop()
            with self._state:
                create = any(c.create_tables for c in self._clients)
            opening = Opening(self._opened)
            opening.start(
                lambda: self._open(opening, create, lease.renew_deadline),
                name=f"rselection-keeper-open-{self.table}",
            )
            self._opening = opening
        return self._opening

    def _listen(self, lease: KeptLease) -> int:
        """Under the statement lock, the session up: listen on the channel of ``lease``
        and of every client not listening yet; return the generation."""
        conn = self._conn
        assert conn is not None and self._found is not None
        # Every client not listening yet, not only this one: leases started together
        # (a sharded leader's) listen in one round trip, not one each.
        with self._state:
            waiting = {lease} | {
                c
                for c in self._clients
                if c.channel is None or c not in self._by_channel.get(c.channel, ())
            }
        for client in waiting:
            if client.channel is None:
                client.channel = lease_channel(self._found.qualified, client.name)
        new: list[str] = []
        with self._state:
            for client in waiting:
                if client is not lease and client not in self._clients:
                    continue  # closed meanwhile
                assert client.channel is not None
                if client.channel in self._unlistens:
                    # Its lease was closed and opened again before the keeper's
                    # thread left the channel (it does so holding the statement
                    # lock, which we hold): still listening, so stay.
                    self._unlistens.discard(client.channel)
                elif client.channel not in self._by_channel and client.channel not in new:
                    new.append(client.channel)
                self._by_channel.setdefault(client.channel, set()).add(client)
        if new:
            self._run(listen_sql(new), "listen for the leases", limit=lease)
        if self._want > self._pinned:
            self._pinned = pin_session(conn, self._want)
        return self.generation

    def ready(self, lease: KeptLease) -> bool:
        """True when ``lease`` can queue a round trip without connecting or listening
        first (never waits for the session's statement lock)."""
        with self._state:
            return (
                self._conn is not None
                and not self._holds.broken
                and not self._closed
                and lease.channel is not None
                and lease in self._by_channel.get(lease.channel, ())
                and self._want <= self._pinned
            )

    def _open(self, opening: Opening, create: bool, renew_deadline: float) -> None:
        """The opening's thread: open the session, then make it the keeper's (or close
        it, the keeper being closed meanwhile). Takes the statement lock only to adopt.
        Its round trips have a watchdog of their own: the keeper's ends when the keeper
        closes, which may be before the opening ends."""
        io = IoWatchdog(f"keeper-open-{self.table}")
        try:
            opened = open_session(
                self._conninfo,
                hold=self._want,
                timeout=self._timeout,
                io=io,
                where=self.where,
                table=self.table,
                create=create,
                renew_deadline=renew_deadline,
            )
            self._adopt(opened)
        finally:
            io.close()
            with self._lock:
                if self._opening is opening:
                    self._opening = None

    def _adopt(self, opened: OpenedSession) -> None:
        with self._lock:
            with self._state:
                closed = self._closed
            if closed:
                opened.conn.close()
                raise BackendUnavailable("the keeper session was closed while opening")
            conn, pid = opened.conn, opened.pid
            conn.add_notify_handler(self._on_notify)
            with self._state:
                self._conn = conn
                self._pid = pid
                self._server = opened.server
                self._found = opened.found
                self._ring_channel = opened.ring
                self._holds.reset()
                self._pinned = opened.pinned
                self._by_channel = {}
                self._unlistens = set()
                self._unlocks = []
                self._parked = {}
                self._endings = {}
                self._created = set()
                self.generation += 1
                clients = list(self._clients)
            self._gate.connected(pid)
            for client in clients:
                client.channel = None  # listened to again on the client's next call
            if self._ring is None:
                self._ring = RingWatcher(
                    self._conninfo,
                    table_oid=opened.found.oid,
                    channel=opened.ring,
                    connect_timeout=self._timeout,
                    name=self.table,
                )
            self._ring.watch_from(pid)
            self._start_pump()
            logger.debug("keeper connected (%s, pid %s)", self.where, pid)

    # -- holds and failures --------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The keeper session's backend pid, or ``None`` when not connected."""
        with self._state:
            return self._pid if self._conn is not None else None

    def nodes_holding(self, lease: KeptLease) -> list[str]:
        """The nodes that hold a term of ``lease`` through the session now."""
        with self._state:
            return [node for (client, node) in self._holds.holders() if client is lease]

    def check_alive(self) -> None:
        """Raise ``BackendUnavailable`` while the session is broken (terms still held)."""
        with self._state:  # not in the middle of a change of the session
            broken = self._holds.broken
        if broken:
            raise self._lost()

    def holding(self) -> bool:
        """True while any term taken through the session may still run."""
        with self._state:  # not in the middle of a change of the session
            return self._holds.holding

    def read(
        self, query: sql.Composable, what: str, *, timeout: float = READ_QUEUE
    ) -> list[tuple[Any, ...]] | None:
        """The rows of a short read (``query``, parameters inlined) run on the keeper
        session, or ``None`` when the process should use its pooled sessions instead
        (the session holds a term, is broken, or is still being opened after
        :data:`OPENING_WAIT` seconds).

        ``timeout``: seconds to wait for a read under way (of another lease, or another
        thread's), after which it goes to the pool: the reads of a process that only
        follows (the drain state and task controls every lease reads as it connects,
        ``leader()`` asked from many threads) queue here rather than open a pooled
        session it would then keep.

        A process that only follows reads here (``leader()``, ``nodes()``), so that it
        holds no more sessions than the keeper and the watcher; the read is bounded on
        the server by :data:`HEARTBEAT_BOUND`, as a heartbeat, since the process's
        attempts wait behind it. A process that leads reads on its pool: its renewals
        never wait behind a read.

        Raises:
            BackendUnavailable: the session broke during the read.
            psycopg.Error: the read failed on a healthy session.
        """
        if not self._usable_for_reads(min(timeout, OPENING_WAIT)):
            return None
        # One read at a time, so that the process's attempts wait for one read at most.
        if not self._reading.acquire(timeout=timeout):
            return None
        try:
            results = self._run(
                sql.SQL("{}; {}").format(bounded_sql(HEARTBEAT_BOUND), query),
                what,
                limit=HEARTBEAT_BOUND + 1.0,
                tolerate=True,
            )
        finally:
            self._reading.release()
        return results[-1] or []

    def _usable_for_reads(self, wait: float) -> bool:
        """Whether reads may run on the session: it is up and holds no term. A session
        being opened is waited for up to ``wait`` seconds (a follower asked leader() as
        it starts reads here, not on a pooled session it would then keep)."""
        deadline = time.monotonic() + wait
        with self._opened:
            while True:
                with self._state:
                    conn = self._conn
                    if self._holds.holding or self._holds.broken:
                        return False
                    if conn is not None:
                        return not conn.closed and not conn.broken
                left = deadline - time.monotonic()
                if self._opening is None or left <= 0:
                    return False
                self._opened.wait(left)

    def _lost(self) -> BackendUnavailable:
        return BackendUnavailable(
            f"the keeper connection to the lease server ({self.where}) was lost; it "
            "reconnects once the terms held through it have ended"
        )

    def _fail(self) -> None:
        """The session failed: mark it broken and wake every client; it is closed now
        unless a term taken through it may still run (then once the last one ends)."""
        with self._state:
            close = self._holds.fail()
            clients = list(self._clients)
        for client in clients:
            client.wake()
        if close:
            self._drop()

    def end_hold(self, lease: KeptLease, node_id: str, term: int) -> None:
        """``term`` of ``node_id`` on ``lease`` ended (its tasks are joined): the session
        may end as far as that term goes, and its lock waits for the term's release (at
        most :data:`RELEASE_WAIT`)."""
        with self._state:
            held = self._holds.end_term((lease, node_id), term)
            if held is None:
                return
            self._parked[(lease, node_id)] = (term, held[1], clock.monotonic() + RELEASE_WAIT)
            self._wakeup.wake()  # the keeper's thread frees it when due, if nothing else
            self._endings[lease.name] = Ending(term, held[1], *lease.ending(term))
            close = self._holds.stale
        self._io.recheck()
        if close:
            self._drop()

    def _unpark(self, key: tuple[KeptLease, str], term: int | None = None) -> None:
        """Under ``_state``: free the lock of ``key``'s ended term (``term`` only, if
        given) with the next round trip, which the keeper's thread sends unless another
        does first: no release of it is coming."""
        parked = self._parked.get(key)
        if parked is not None and term in (None, parked[0]):
            del self._parked[key]
            self._unlocks.append((parked[1], parked[0]))
            self._wakeup.wake()

    def _unlocks_due(self) -> float | None:
        """Under ``_state``: when the session must free locks of ended terms, whether or
        not another round trip comes (now, when some are queued); ``None``: no lock
        waits."""
        if self._unlocks:
            return self._unlocks_after
        return min((due for _, _, due in self._parked.values()), default=None)

    def _take_unlocks(self) -> list[tuple[int, int]]:
        """Under ``_state``: the locks the next round trip frees, those of ended terms
        whose release is overdue among them."""
        now = clock.monotonic()
        for key in [k for k, (_, _, due) in self._parked.items() if due <= now]:
            self._unpark(key)
        unlocks, self._unlocks = self._unlocks, []
        return unlocks

    def _free_overdue(self) -> None:
        """Free the locks of ended terms that are queued, or whose release is overdue
        (on the keeper's thread): no other round trip may come to carry them."""
        with self._state:
            if self._conn is None or self._holds.broken:
                return
            due = self._unlocks_due()
            if due is None or due > clock.monotonic():
                return
        try:
            self._run(
                sql.SQL("SELECT 1"),
                "free the locks of ended terms",
                limit=HEARTBEAT_BOUND + 1.0,
                tolerate=True,
            )
        except (BackendUnavailable, ConfigError, psycopg.Error) as exc:
            # Refused on a healthy session (a cancel, say): the locks are queued again,
            # and tried again a second later, not at once (the keeper's thread would spin).
            with self._state:
                self._unlocks_after = clock.monotonic() + 1.0
            logger.debug("keeper: could not free the locks of ended terms: %s", first_line(exc))

    def _drop(self) -> None:
        with self._lock:
            with self._state:
                conn, self._conn = self._conn, None
                self._holds.reset()
                self._unlocks = []
                self._parked = {}
                self._endings = {}
                self._by_channel = {}
                self._unlistens = set()
                clients = list(self._clients)
            if self._ring is not None:
                self._ring.watch_from(None)
            for client in clients:
                client.channel = None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def _shut(self) -> None:
        """The last client left: close the session and stop the keeper's thread."""
        self._drop()
        if self._ring is not None:
            self._ring.stop()
        self._wakeup.wake()
        pump = self._pump
        if pump is not None and pump is not threading.current_thread():
            pump.join(2.0)
        self._io.close()
        self._wakeup.close()

    # -- round trips ---------------------------------------------------------------------

    def _run(
        self,
        query: sql.Composable,
        what: str,
        *,
        limit: KeptLease | float,
        tolerate: bool = False,
        undo: Callable[[int], sql.Composed] | None = None,
        unlocks: list[tuple[int, int]] | None = None,
    ) -> list[list[tuple[Any, ...]] | None]:
        """Run a (multi-statement) query on the session, with the freed locks of ended
        terms first and the backend pid last; one entry per statement, pid popped and
        checked. An error marks the session failed (see :meth:`_fail`), except, with
        ``tolerate``, an error of the statement on a healthy session (it is raised).
        When the query ran on another backend (a transaction pooler), ``undo(pid)`` of
        that backend's pid is run first, to give back what it took there. ``unlocks``:
        the locks to free, taken from ``_unlocks`` by a caller that holds ``_lock``
        (default: all queued now)."""
        bound = limit.renew_deadline if not isinstance(limit, float) else limit
        with self._lock:
            with self._state:
                conn, broken = self._conn, self._holds.broken
                if unlocks is None:
                    unlocks = self._take_unlocks()
            if conn is None or broken or conn.closed or conn.broken:
                if conn is not None and not broken:
                    self._fail()
                raise self._lost()
            parts: list[sql.Composable] = []
            if unlocks:
                parts.append(unlock_sql(unlocks))
            parts += [query, BACKEND_PID]
            fired = [False]
            try:
                with self._io.guard(conn, bound, held=self.holding) as fired:
                    cur = conn.execute(sql.SQL("; ").join(parts))
                    results: list[list[tuple[Any, ...]] | None] = []
                    while True:
                        results.append(cur.fetchall() if cur.description is not None else None)
                        if not cur.nextset():
                            break
            except Exception as exc:
                if not isinstance(exc, psycopg.Error):
                    # Raised in the middle of the round trip (by a notification handler,
                    # say): what the session has sent or read is unknown.
                    self._fail()
                    raise unavailable(what, self._conninfo, exc) from exc
                if tolerate and self._healthy(conn) and not fired[0]:
                    with self._state:
                        self._unlocks[:0] = unlocks  # perhaps not freed: again next time
                    raise
                self._fail()
                if fired[0]:
                    raise BackendUnavailable(
                        f"cannot {what}: no answer from the lease server ({self.where}) "
                        f"within {bound:g} s; reconnecting"
                    ) from exc
                if isinstance(exc, psycopg.errors.UndefinedTable):
                    raise BackendUnavailable(
                        f"cannot {what}: lease table {self.table!r} does not exist "
                        f"({self.where}); run `rselection migrate` or pass create_tables=True"
                    ) from exc
                raise unavailable(what, self._conninfo, exc) from exc
            if unlocks:
                results.pop(0)
            pid_rows = results.pop()
            assert pid_rows, "SELECT pg_backend_pid() returns one row"
            seen = int(pid_rows[0][0])
            if seen != self._pid:
                if undo is not None:
                    try:
                        conn.execute(undo(seen))
                    except psycopg.Error as exc:
                        logger.warning("keeper: could not give back: %s", first_line(exc))
                self._fail()
                check_same_backend(self._pid, seen, self.where)  # raises ConfigError
            return results

    @staticmethod
    def _healthy(conn: psycopg.Connection[Any]) -> bool:
        """After an error: the session is usable (a statement left running, say after
        a handler raised while reading its result, makes every later one fail with
        "another command is already in progress": a lost session, never tolerated)."""
        pgconn = conn.pgconn
        return (
            not conn.broken
            and pgconn.status == ConnStatus.OK
            and pgconn.transaction_status != TransactionStatus.ACTIVE
        )

    def _leave_channels(self) -> None:
        """``UNLISTEN`` the channels of closed leases (on the keeper's thread).

        Taken from the queue under the statement lock, which :meth:`ensure` holds while
        it decides what to listen on: a lease opened again meanwhile either finds its
        channel still queued (and keeps it) or listens again after this round trip.
        """
        with self._state:
            if not self._unlistens:
                return  # the common case: no wait for the statement lock
        with self._lock:
            with self._state:
                channels, self._unlistens = sorted(self._unlistens), set()
                usable = self._conn is not None and not self._holds.broken
            if not channels or not usable:
                return
            self._gate.forget(channels)
            try:
                self._run(
                    unlisten_sql(channels),
                    "stop listening for closed leases",
                    limit=HEARTBEAT_BOUND + 1.0,
                    tolerate=True,
                )
            except (BackendUnavailable, ConfigError, psycopg.Error) as exc:
                # Still listening there at worst: notifications for a channel without
                # a client are dropped, and a new session listens afresh.
                logger.debug("keeper: could not stop listening: %s", first_line(exc))

    def _read_members(self) -> None:
        """Read the ring's members on the session, when due (see :mod:`.notice_gate`).

        Not through :meth:`_run`: the members are the server's, whichever backend reads
        them, so a pooler that lends the session's statements to another backend is left
        to the renewals and attempts to find (they refuse it as a configuration error).
        """
        with self._state:
            found, conn = self._found, self._conn
        if found is None or conn is None or not self._gate.read_now():
            return
        try:
            with self._lock:
                if conn is not self._conn or self._holds.broken or conn.closed or conn.broken:
                    raise self._lost()
                with self._io.guard(conn, HEARTBEAT_BOUND + 1.0, held=self.holding):
                    rows = conn.execute(members_sql(found.oid)).fetchall()
        except (BackendUnavailable, psycopg.Error) as exc:
            self._gate.read_failed()
            logger.debug("keeper: could not read the ring's members: %s", first_line(exc))
            return
        self._gate.members_read(int(row[0]) for row in rows)

    # -- notifications in, and the keeper's thread ---------------------------------------

    def _poll(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            if conn is not self._conn:
                return
            pgconn = conn.pgconn
            try:
                pgconn.consume_input()
                while (notify := pgconn.notifies()) is not None:
                    self._receive(
                        notify.relname.decode(errors="replace"),
                        notify.extra.decode(errors="replace"),
                        notify.be_pid,
                    )
                ok = pgconn.status == ConnStatus.OK
            except psycopg.Error:
                ok = False
            if not ok:
                logger.warning("keeper: the session to the lease server (%s) ended", self.where)
                self._fail()

    def _on_notify(self, notify: psycopg.Notify) -> None:
        self._receive(notify.channel, notify.payload, notify.pid)

    def _receive(self, channel: str, payload: str, sender: int) -> None:
        """Keep a notification for the keeper's thread (called inside the round trip
        that brought it: never raises, and costs next to nothing)."""
        inbox = self._inbox
        if len(inbox) >= INBOX_LIMIT:
            dropped = self._overflow[0] if self._overflow is not None else 0
            self._overflow = (dropped + 1, channel, payload, sender)
            return
        inbox.append((channel, payload, sender))
        if len(inbox) == 1:
            self._wakeup.wake()

    def _start_pump(self) -> None:
        with self._state:
            if self._pump is not None or self._closed:
                return
            self._wakeup.open()
            self._pump = threading.Thread(
                target=self._pump_loop, name=f"rselection-keeper-{self.table}", daemon=True
            )
        self._pump.start()

    def _pump_loop(self) -> None:
        """The keeper's thread (see :class:`~.pump.KeeperPump`)."""
        raise NotImplementedError
