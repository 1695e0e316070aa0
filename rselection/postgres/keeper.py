"""The shared keeper: one Postgres session per process, conninfo and lease table.

Every :class:`~rselection.postgres.PostgresLease` of a process that uses the same
connection string and lease table is a client of one :class:`SharedKeeper`. Its session
(the *keeper session*) holds every lease those clients lead: each term's advisory lock,
its ``holder_pid``, the server identity recorded with it. It runs, one round trip at a
time:

* **renewals** of every lease due, in one ``UPDATE`` (group commit: the clients' keeper
  threads queue their renewals, and whoever gets the session next sends all that are
  queued; the leader aligns renewals on :meth:`SharedKeeper.renewal_slot`, so a process
  sends about one renewal statement per ``renew_interval`` whatever its number of
  leases);
* **acquisition attempts**, batched the same way (aligned on
  :meth:`SharedKeeper.attempt_slot`); a takeover skips a row it would have to wait for
  (``SKIP LOCKED``) and tries again soon, so it never stalls the renewals;
* releases, one per lease.

It ``LISTEN``\\ s on every client's lease channel and on the ring channel; a thread of its
own takes notifications in while the session is idle (or as a round trip brings them),
and reads them between round trips: it believes what they say only from a trusted
peer's keeper session and rate-limits what the others wake (see
:mod:`~rselection.postgres.notice_gate`). Its
session also holds the process's *ring lock*, and a :class:`~.ring.RingWatcher` (the one
other session) waits on the next keeper's, so a keeper that dies is announced within
milliseconds to every follower (see :mod:`rselection.postgres.ring`).

The session is never closed while any client holds a term through it (the rule of
:class:`~rselection.session_hold.SessionHolds`, for many terms): an error only marks it
broken; every client's next call then raises ``BackendUnavailable``, and the session is
closed and reopened once every term taken through it has ended. Its server-side TCP
keepalives and ``tcp_user_timeout`` are sized for the longest wind-down
(``renew_deadline + stop_grace``) of its clients and raised when a client with a longer
one joins.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import psycopg
from psycopg import sql
from psycopg.pq import ConnStatus, TransactionStatus

from .. import clock, forks
from ..errors import BackendUnavailable, ConfigError, first_line
from ..session_hold import SessionHolds
from ..wakeup import Wakeup
from . import notices
from ._conn import (
    IoWatchdog,
    describe_conninfo,
    unavailable,
)
from ._lease_sql import (
    AcquireRequest,
    LeaseTable,
    ReleaseRequest,
    RenewRequest,
    acquire_batch_sql,
    bounded_sql,
    give_back_sql,
    lease_channel,
    listen_sql,
    new_lock_key,
    release_batch_sql,
    release_sql,
    renew_batch_sql,
    unlisten_sql,
    unlock_next_terms_sql,
    unlock_sql,
)
from .keeper_opening import OpenedSession, Opening, open_session
from .keeper_session import pin_session
from .notice_gate import NoticeGate
from .notices import LeaseNotice, lease_notice, ring_notice
from .pooler import BACKEND_PID, check_same_backend
from .ring import RingWatcher, members_sql, ring_class
from .schema import create_tables, history_table_name, table_identifier
from .session_pool import SessionPool

__all__ = [
    "GATHER",
    "RELEASE_REFUSED",
    "RENEWAL_SKIPPED",
    "Attempt",
    "Queued",
    "SharedKeeper",
]

_LOCK_POLL = 0.05  # seconds between looks at an interrupt while the statement lock is busy

logger = logging.getLogger(__name__)

GATHER = 0.01
"""Most seconds the keeper waits, before sending a batch, for more of its clients'
renewals, attempts and releases that are due at the same moment (only when it has
several clients)."""

GATHER_QUIET = 0.001
"""The keeper stops gathering once this many seconds passed with nothing more queued: a
few leases due together go out at once, a thousand stepped by the driver in one pass
still go in one batch."""

HEARTBEAT_LIMIT = 10.0  # seconds a batch of heartbeats may take on the client's side

INBOX_LIMIT = 10_000
"""Notifications received and not read yet that the keeper keeps; more (a flood) are
dropped, counted, and stand for one wake-up of every client (rate-limited as any)."""

_READ_PER_ROUND = 500  # notifications read between two sends of the queued batches

HEARTBEAT_BOUND = 1.0
"""Seconds a heartbeat (or the nodes table's creation) may take on the keeper session,
lock waits included, before the server cancels it: renewals queue behind it, and a
locked nodes table (``VACUUM FULL``, a migration, a row locked by hand) must never make
the leases of a process pass their deadlines. The heartbeat is retried a second later."""

RENEWAL_SKIPPED = ("skipped",)
"""What :meth:`SharedKeeper.renew` returns for a term still held whose row another
transaction holds locked: not renewed this time; try again (the deadline counts from the
last renewal that went through)."""

RELEASE_REFUSED = ("refused",)
"""A batch's answer when the server refused the whole batch (a trigger, say): each
release is sent in a round trip of its own, so that only a row at fault fails."""

RELEASE_RETRY = 0.05
"""Seconds between two tries of a release whose row is locked."""

LOCK_BOUND = 1.0
"""Seconds an acquisition or a release may wait for a lock on the keeper session before
the server cancels it (renewals queue behind it; a release that fails leaves the lease
to expire)."""

_T = TypeVar("_T")


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


class Heartbeat(Protocol):
    """A node whose heartbeats ride on the keeper session (see
    :class:`~rselection.postgres.membership.PostgresMembership`)."""

    @property
    def table(self) -> str:
        """The nodes table."""

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats."""

    @property
    def create_tables(self) -> bool:
        """Create the nodes table before the first heartbeat."""

    def heartbeat_sql(self, batch: Sequence[Heartbeat]) -> sql.Composable:
        """One statement that records a heartbeat of every node of ``batch`` (all of
        them of this kind and table)."""


@dataclass
class Queued:
    """A client's renewal or attempt waiting for the next batch."""

    lease: KeptLease
    node_id: str
    term: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    """Set by :meth:`fill`, or by the client giving up (then ``filled`` stays false)."""
    result: Any = None
    error: BaseException | None = None
    filled: bool = False
    on_done: Callable[[Queued], None] | None = None
    """Called once, after ``done`` is set, by whoever settles the entry first (a batch's
    answer, or the client giving up): how a non-blocking caller learns of it."""
    give_up_at: float = 0.0
    """A release whose row is locked is sent again with later batches until this
    :func:`rselection.clock.monotonic` time, then answered with an error."""
    _settled: threading.Lock = field(default_factory=threading.Lock)

    def fill(self, result: Any = None, error: BaseException | None = None) -> None:
        """The batch's answer for this entry; wakes its client (once: a client that gave
        up first keeps its own answer)."""
        if not self._settled.acquire(blocking=False):
            return
        self.result, self.error, self.filled = result, error, True
        self._finish()

    def give_up(self, error: BaseException) -> None:
        """The client stops waiting: ``error`` is its answer unless the batch's came first."""
        if not self._settled.acquire(blocking=False):
            return
        self.error = error
        self._finish()

    def _finish(self) -> None:
        self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # the sender goes on with the rest of its batch
                logger.exception("keeper: error handing over the answer of %r", self.lease.name)


@dataclass(frozen=True)
class Attempt:
    """What one acquisition attempt found: the lease's row as the node saw it."""

    acquired: bool
    row: tuple[Any, ...] | None
    """``STATE_COLUMNS`` of :mod:`._lease_sql`, or ``None`` when the row is missing."""


class SharedKeeper:
    """The keeper session of one process, connection string and lease table.

    Get it with :meth:`attach`; every method is safe from any thread. Statements run one
    at a time on the session (a lock); renewals and attempts of many clients share one.
    """

    _registry: ClassVar[dict[tuple[int, str, str], SharedKeeper]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

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
        # Channels no client listens on any more (their leases closed): the keeper's
        # thread sends UNLISTEN soon, so that a process that opens and closes leases
        # does not listen on ever more channels.
        self._unlistens: set[str] = set()
        self._renewals: list[Queued] = []
        self._attempts: list[Queued] = []
        self._releases: list[Queued] = []
        self._retries: list[tuple[float, Queued]] = []  # locked releases: when to resend
        self._phase = clock.monotonic()  # renewal and attempt slots count from here
        self._io = IoWatchdog(f"keeper-{table}")
        self._wakeup = Wakeup()
        self._pump: threading.Thread | None = None
        self._closed = False
        # Nodes that heartbeat through the session: node -> when its next beat is due.
        self._beats: dict[Heartbeat, float] = {}
        # The most seconds a node's heartbeat goes out before it is due (a quarter of the
        # longest interval of a node that beat here): none is due while the earliest
        # beat is further off than this.
        self._beat_early = 0.0
        self._beating = threading.RLock()  # held while a batch of heartbeats is sent
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

    # -- clients -------------------------------------------------------------------------

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child (see :mod:`rselection.forks`): the registry's lock is made
        anew (a parent's thread may have held it). The parent's keepers stay in the
        registry, under its process id, and their clients forget them: their sessions
        are never used here, nor closed."""
        cls._registry_lock = threading.Lock()

    @classmethod
    def attach(cls, lease: KeptLease) -> SharedKeeper:
        """The keeper of ``lease``'s process, conninfo and table, with ``lease`` a client."""
        key = (os.getpid(), lease.conninfo, lease.table)
        with cls._registry_lock:
            keeper = cls._registry.get(key)
            if keeper is None:
                keeper = cls._registry[key] = SharedKeeper(lease.conninfo, lease.table)
            with keeper._state:
                keeper._clients.add(lease)
                keeper._want = max(keeper._want, lease.renew_deadline + lease.stop_grace)
                keeper._timeout = max(keeper._timeout, lease.connect_timeout)
        return keeper

    @classmethod
    def beat_through(cls, conninfo: str, table: str, node: Heartbeat) -> SharedKeeper:
        """Heartbeat ``node`` on the keeper session of this process, ``conninfo`` and
        lease ``table`` (its first heartbeat goes out as soon as the session is up)."""
        key = (os.getpid(), conninfo, table)
        with cls._registry_lock:
            keeper = cls._registry.get(key)
            if keeper is None:
                keeper = cls._registry[key] = SharedKeeper(conninfo, table)
            with keeper._state:
                keeper._beats[node] = 0.0
                keeper._beat_early = max(keeper._beat_early, node.heartbeat_interval / 4)
        keeper._wakeup.wake()
        return keeper

    def stop_beating(self, node: Heartbeat) -> None:
        """No more heartbeats of ``node``; the last client closes the session.

        Returns once a batch in flight, which may hold a heartbeat of ``node``, has ended
        (waited for as long as the batch may last): a row deleted after this call is not
        written back by it.
        """
        with self._registry_lock, self._state:
            self._beats.pop(node, None)
            last = self._last_client()
        if last:
            self._shut()
        elif self._beating.acquire(timeout=HEARTBEAT_LIMIT):
            self._beating.release()

    def _last_client(self) -> bool:
        """Under both locks: with no client left, leave the registry (then shut)."""
        if self._clients or self._beats or self._closed:
            return False
        self._registry.pop((os.getpid(), self._conninfo, self.table), None)
        self._closed = True
        return True

    def detach(self, lease: KeptLease) -> None:
        """``lease`` is closed: end its holds and stop listening on its channel unless
        another client listens there; the last client closes the session."""
        with self._registry_lock, self._state:
            self._clients.discard(lease)
            for channel, clients in list(self._by_channel.items()):
                clients.discard(lease)
                if not clients:
                    del self._by_channel[channel]
                    self._unlistens.add(channel)
            for key in [k for k in self._holds.holders() if k[0] is lease]:
                held = self._holds.take(key)
                if held is not None:
                    self._unlocks.append((held[1], held[0]))
            last = self._last_client()
            leave = bool(self._unlistens) and not last
        if last:
            self._shut()
        elif leave:
            self._wakeup.wake()  # the keeper's thread sends the UNLISTEN

    # -- connecting ----------------------------------------------------------------------

    def ensure(self, lease: KeptLease) -> int:
        """Connect when needed and make ``lease`` a listener; return the generation.

        The session is opened on a thread of its own (see :mod:`.keeper_opening`), which
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
        self, query: sql.Composable, what: str, *, timeout: float = 0.0
    ) -> list[tuple[Any, ...]] | None:
        """The rows of a short read (``query``, parameters inlined) run on the keeper
        session, or ``None`` when the process should use its pooled sessions instead.

        ``timeout``: seconds to wait for a read of another lease under way (else it goes
        to the pool at once): the reads every lease of a process makes as it connects
        (its drain state) queue here rather than open pooled sessions.

        A process that only follows reads here (``leader()``, ``nodes()``), so that it
        holds no more sessions than the keeper and the watcher; the read is bounded on
        the server by :data:`HEARTBEAT_BOUND`, as a heartbeat, since the process's
        attempts wait behind it. A process that leads reads on its pool: its renewals
        never wait behind a read.

        Raises:
            BackendUnavailable: the session broke during the read.
            psycopg.Error: the read failed on a healthy session.
        """
        with self._state:
            usable = (
                not self._holds.holding
                and self._conn is not None
                and not self._holds.broken
                and not self._conn.closed
                and not self._conn.broken
            )
        # One read at a time: more (many threads asking leader()) go to the pool rather
        # than queue on the session ahead of the process's attempts.
        if not usable:
            return None
        if not self._reading.acquire(timeout=timeout):  # 0: only if free now
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
        may end as far as that term goes, and its lock is freed on the next round trip."""
        with self._state:
            held = self._holds.end_term((lease, node_id), term)
            if held is None:
                return
            self._unlocks.append((held[1], term))
            close = self._holds.stale
        self._io.recheck()
        if close:
            self._drop()

    def _drop(self) -> None:
        with self._lock:
            with self._state:
                conn, self._conn = self._conn, None
                self._holds.reset()
                self._unlocks = []
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
        with self._state:
            queued = self._renewals + self._attempts + self._releases
            queued += [item for _, item in self._retries]
            self._renewals, self._attempts, self._releases, self._retries = [], [], [], []
        for item in queued:  # nobody sends them any more
            item.give_up(self._lost())
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
    ) -> list[list[tuple[Any, ...]] | None]:
        """Run a (multi-statement) query on the session, with the freed locks of ended
        terms first and the backend pid last; one entry per statement, pid popped and
        checked. An error marks the session failed (see :meth:`_fail`), except, with
        ``tolerate``, an error of the statement on a healthy session (it is raised).
        When the query ran on another backend (a transaction pooler), ``undo(pid)`` of
        that backend's pid is run first, to give back what it took there."""
        bound = limit.renew_deadline if not isinstance(limit, float) else limit
        with self._lock:
            with self._state:
                conn, broken = self._conn, self._holds.broken
                unlocks, self._unlocks = self._unlocks, []
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

    def _batch(
        self,
        queue: list[Queued],
        item: Queued,
        send: Callable[[list[Queued]], None],
    ) -> Any:
        """Queue ``item`` for the keeper's thread and wait until a batch sent it.

        The keeper's own thread sends every batch (it is idle otherwise): the callers
        wait on their own entry, never on the statement lock, so a round of a thousand
        renewals wakes each waiting thread once. A client that sets ``item.done`` itself
        gives up (``BackendUnavailable``): a batch in flight goes on for the others, and
        its answer for ``item`` is dropped.
        """
        self._enqueue(queue, item)
        while not item.done.wait(1.0):
            with self._state:
                gone = self._closed or self._pump is None or not self._pump.is_alive()
            if gone and not item.done.is_set():
                raise self._lost()
        if not item.filled:
            with self._state:
                if item in queue:
                    queue.remove(item)
            raise BackendUnavailable(
                f"lease {item.lease.name!r}: interrupted while the shared keeper session "
                f"({self.where}) was busy with a round trip"
            )
        if item.error is not None:
            raise item.error
        return item.result

    def _enqueue(self, queue: list[Queued], item: Queued) -> None:
        """Queue ``item`` for the keeper's thread, which sends it with the next batch."""
        with self._state:
            closed = self._closed
            if not closed:
                queue.append(item)
        if closed:
            item.give_up(self._lost())
            return
        self._wakeup.wake()

    def _send_queued(self) -> None:
        """Send the queued renewals, then the queued attempts, in as few batches as the
        one-entry-per-lease rule allows (on the keeper's thread)."""
        with self._state:
            now = clock.monotonic()
            # Locked releases whose next try is due join this round (unless given up).
            self._releases += [q for at, q in self._retries if at <= now and not q.done.is_set()]
            self._retries = [(at, q) for at, q in self._retries if at > now]
            if not (self._renewals or self._attempts or self._releases):
                return
            several = len(self._clients) > 1
        if several:
            self._gather()  # let the others due now join these batches
        for queue, send in (
            (self._renewals, self._send_renewals),
            (self._releases, self._send_releases),
            (self._attempts, self._send_attempts),
        ):
            while True:
                with self._state:
                    batch, queue[:] = _one_per_lease(queue)
                if not batch:
                    break
                try:
                    with self._lock:
                        send(batch)
                except BaseException as exc:  # every caller in the batch learns of it
                    for queued in batch:
                        if not queued.done.is_set():
                            queued.fill(error=exc)

    def _gather(self) -> None:
        """Wait while more round trips are being queued (see :data:`GATHER_QUIET`), at
        most :data:`GATHER` seconds."""
        deadline = clock.monotonic() + GATHER
        seen = -1
        while True:
            with self._state:
                queued = len(self._renewals) + len(self._attempts) + len(self._releases)
            if queued == seen or clock.monotonic() >= deadline:
                return
            seen = queued
            time.sleep(GATHER_QUIET)

    def renew(
        self,
        lease: KeptLease,
        node_id: str,
        term: int,
        *,
        done: threading.Event | None = None,
    ) -> tuple[Any, ...] | None:
        """Renew ``term``; the row (name, term, handover columns), ``None`` when lost, or
        :data:`RENEWAL_SKIPPED`.

        Only the client that took ``term`` for ``node_id`` through this session renews it
        (not another client of the same lease and node, and not after its term ended).
        ``done``: the event the call waits on; a client that sets it gives up waiting
        (see :meth:`_batch`).
        """
        self.ensure(lease)
        with self._state:
            if self._holds.term_of((lease, node_id)) != term:
                return None
        queued = Queued(lease, node_id, term, done=done or threading.Event())
        row: tuple[Any, ...] | None = self._batch(self._renewals, queued, self._send_renewals)
        return row

    def renew_soon(
        self, lease: KeptLease, node_id: str, term: int, on_done: Callable[[Queued], None]
    ) -> Queued | None:
        """Queue a renewal of ``term`` without waiting: ``on_done(entry)`` is called once
        with its answer (as :meth:`renew` returns or raises it). ``None`` (nothing
        queued) when the session is not ready (see :meth:`ready`) or ``term`` is not held
        through it for ``node_id`` (the blocking :meth:`renew` answers that)."""
        if not self.ready(lease):
            return None
        with self._state:
            if self._holds.term_of((lease, node_id)) != term:
                return None
        queued = Queued(lease, node_id, term, on_done=on_done)
        self._enqueue(self._renewals, queued)
        return queued

    def acquire_soon(
        self, lease: KeptLease, node_id: str, on_done: Callable[[Queued], None]
    ) -> Queued | None:
        """Queue an attempt without waiting, as :meth:`renew_soon` does (its answer is
        an :class:`Attempt`)."""
        if not self.ready(lease):
            return None
        queued = Queued(lease, node_id, on_done=on_done)
        self._enqueue(self._attempts, queued)
        return queued

    def _send_renewals(self, batch: list[Queued]) -> None:
        requests = [RenewRequest(q.lease.name, q.node_id, q.term, q.lease.ttl) for q in batch]
        try:
            results = self._run(
                renew_batch_sql(self._ident, requests, server=self._server),
                "renew the leases",
                limit=max(q.lease.renew_deadline for q in batch),
                tolerate=True,
            )
        except psycopg.Error as exc:
            # The statement failed on a healthy session: it renewed nothing. One row at
            # fault (a trigger, a constraint): halves are sent again until that lease is
            # alone, so that only its renewal fails. Otherwise (cancelled by hand, a
            # deadlock) every renewal of the batch is refused: those terms end.
            if len(batch) > 1 and _row_at_fault(exc):
                self._split(batch, self._send_renewals)
                return
            for queued in batch:
                logger.warning(
                    "lease %r: the server refused its renewal (%s); its term is lost",
                    queued.lease.name,
                    first_line(exc),
                )
                queued.fill(None)
            return
        renewed = {(row[0], row[1]): row for row in results[0] or []}
        for queued in batch:
            row = renewed.get((queued.lease.name, queued.term))
            queued.fill(RENEWAL_SKIPPED if row is not None and row[5] else row)

    def _free_next_terms(self, requests: list[AcquireRequest]) -> None:
        """Free the next-term locks a failed acquisition may have taken (bounded: under a
        table lock they stay, which only keeps those leases held until the session
        ends, never frees one early)."""
        with self._state:
            held = [(key, term) for term, key in self._holds.terms()]
        try:
            self._run(
                sql.SQL("{}; {}").format(
                    bounded_sql(LOCK_BOUND), unlock_next_terms_sql(self._ident, requests, held)
                ),
                "free the locks of a failed acquisition",
                limit=LOCK_BOUND + 1.0,
                tolerate=True,
            )
        except psycopg.Error as exc:
            logger.warning(
                "keeper: could not free the locks of a failed acquisition: %s", first_line(exc)
            )

    @staticmethod
    def _split(batch: list[Queued], send: Callable[[list[Queued]], None]) -> None:
        middle = len(batch) // 2
        send(batch[:middle])
        send(batch[middle:])

    def acquire(self, lease: KeptLease, node_id: str) -> Attempt:
        """Attempt ``lease`` for ``node_id`` (batched with the other attempts due)."""
        self.ensure(lease)
        attempt: Attempt = self._batch(self._attempts, Queued(lease, node_id), self._send_attempts)
        return attempt

    def _listening(self, lease: KeptLease) -> None:
        """Under the statement lock: have ``lease`` listen on the session as it is.

        Never waits for an opening of the session, as :meth:`ensure` does: the opening's
        thread takes this lock to adopt the session, so a wait under it would never end.

        Raises:
            BackendUnavailable: the session is down (its opening has begun): try again.
        """
        if self.ready(lease):
            return
        if self._opening_needed(lease) is not None:
            raise BackendUnavailable(
                f"cannot acquire lease {lease.name!r} now: the keeper session is being "
                "opened again; trying again later"
            )
        self._listen(lease)

    def _send_attempts(self, batch: list[Queued]) -> None:
        with self._state:
            for q in batch:
                # A lease object that asks again while it holds a term gives that term
                # up (its leader attempts only once the term ended): its lock is freed
                # first in this round trip, so the attempt takes a fresh term. Another
                # object's hold of the same lease keeps its lock, and the lease, held.
                held = self._holds.take((q.lease, q.node_id))
                if held is not None:
                    self._unlocks.append((held[1], held[0]))
        requests = []
        for q in batch[:]:
            try:
                self._listening(q.lease)
            except BackendUnavailable as exc:
                batch.remove(q)
                q.fill(error=exc)
                continue
            assert q.lease.channel is not None
            requests.append(
                AcquireRequest(
                    q.lease.name,
                    q.node_id,
                    q.lease.ttl,
                    new_lock_key(),  # nobody can know the next term's lock beforehand
                    q.lease.channel,
                    create=not q.lease.row_seen,
                    version=q.lease.version,
                    history_limit=q.lease.history_limit,
                )
            )
        if not batch:
            return
        assert self._found is not None
        try:
            results = self._run(
                sql.SQL("{}; {}").format(
                    # A wait for a row another node inserts, or for a lock another
                    # session left, must not hold up the renewals queued behind.
                    bounded_sql(LOCK_BOUND, statement=False),
                    acquire_batch_sql(
                        self._ident,
                        requests,
                        server=self._server,
                        ring=ring_class(self._found.oid),
                        history=self._history,
                        process=(socket.gethostname(), os.getpid()),
                    ),
                ),
                "acquire the leases",
                limit=max(q.lease.connect_timeout + q.lease.renew_deadline for q in batch),
                tolerate=True,
                undo=lambda pid: give_back_sql(self._ident, requests, pid),
            )
        except psycopg.Error as exc:
            # Failed on a healthy session: nothing was taken, but the locks of the new
            # terms it took before the error stay (a rollback does not free them).
            self._free_next_terms(requests)
            if len(batch) > 1 and _row_at_fault(exc):
                self._split(batch, self._send_attempts)
                return
            for queued in batch:
                queued.fill(
                    error=BackendUnavailable(
                        f"cannot acquire lease {queued.lease.name!r}: the server refused "
                        f"({first_line(exc)}); trying again later"
                    )
                )
            return
        # Each term taken locked the key it drew, now its row's: freed when the term ends.
        # A row locked but not taken (its new lock held by another session) has no term.
        taken = {
            row[0]: (int(row[1]), int(row[2])) for row in results[-2] or [] if row[1] is not None
        }
        states = {row[0]: row for row in results[-1] or []}
        with self._state:
            for q in batch:
                if q.lease.name in taken:
                    self._holds.hold((q.lease, q.node_id), *taken[q.lease.name])
        for q in batch:
            q.fill(Attempt(q.lease.name in taken, states.get(q.lease.name)))

    def release(self, lease: KeptLease, node_id: str, term: int) -> bool:
        """Give ``term`` back (row cleared, followers notified, its lock freed); ``True``
        when the row was still ours.

        Sent with the other releases queued now (a process stopping a thousand leaders
        releases them in a few round trips). A row another transaction holds locked is
        skipped, not waited for, and tried again with the next batches for up to
        ``LOCK_BOUND`` seconds: the session never waits for a row lock, so no renewal
        waits behind a release.

        Raises:
            BackendUnavailable: the session broke, or the row stayed locked (the lease
                then passes on at the latest when it expires).
        """
        self.ensure(lease)
        queued = Queued(lease, node_id, term, give_up_at=clock.monotonic() + LOCK_BOUND)
        outcome = self._batch(self._releases, queued, self._send_releases)
        if outcome is RELEASE_REFUSED:
            return self._release_alone(lease, node_id, term)
        released: bool = outcome
        return released

    def release_soon(
        self, lease: KeptLease, node_id: str, term: int, on_done: Callable[[Queued], None]
    ) -> Queued | None:
        """Queue a release without waiting, as :meth:`renew_soon` does: ``on_done`` gets
        the entry once it is settled (a bool, :data:`RELEASE_REFUSED`, or an error; a
        locked row is retried by the keeper's thread meanwhile, as for :meth:`release`).
        """
        if not self.ready(lease):
            return None
        queued = Queued(
            lease, node_id, term, on_done=on_done, give_up_at=clock.monotonic() + LOCK_BOUND
        )
        self._enqueue(self._releases, queued)
        return queued

    def _lock_key(self, lease: KeptLease, node_id: str, term: int) -> int | None:
        """Under ``_state``: the key of the advisory lock that ``term`` of ``lease`` holds
        through the session (the one its acquisition locked), or ``None`` when it holds
        none any more (its end already queued the unlock): nothing to free then."""
        held = self._holds.get((lease, node_id))
        return held[1] if held is not None and held[0] == term else None

    def _released(self, lease: KeptLease, node_id: str, term: int) -> None:
        with self._state:
            self._holds.end_term((lease, node_id), term)
        self._io.recheck()

    def _send_releases(self, batch: list[Queued]) -> None:
        with self._state:
            requests = []
            for q in batch[:]:
                channel = q.lease.channel
                if channel is None:  # the session that held the term is gone
                    batch.remove(q)
                    q.fill(error=self._lost())
                    continue
                key = self._lock_key(q.lease, q.node_id, q.term)
                reason, by = q.lease.ending(q.term)
                requests.append(
                    ReleaseRequest(q.lease.name, q.node_id, q.term, channel, key, reason, by)
                )
        if not batch:
            return
        try:
            results = self._run(
                sql.SQL("{}; {}").format(
                    bounded_sql(LOCK_BOUND),
                    release_batch_sql(self._ident, requests, history=self._history),
                ),
                "release the leases",
                limit=max(q.lease.renew_deadline for q in batch),
                tolerate=True,
            )
        except psycopg.Error as exc:
            # Refused on a healthy session (a trigger, say): nothing was released, and no
            # lock freed; each is sent alone, so that only a row at fault fails.
            logger.debug("keeper: a batch of releases was refused (%s)", first_line(exc))
            for queued in batch:
                queued.fill(RELEASE_REFUSED)
            return
        answers = {row[0]: (bool(row[1]), bool(row[2])) for row in results[-1] or []}
        for q in batch:
            released, skipped = answers.get(q.lease.name, (False, False))
            if skipped:
                now = clock.monotonic()
                with self._state:
                    closed = self._closed
                    if not closed and now < q.give_up_at:
                        # Sent again with a later round: nobody waits for it meanwhile.
                        self._retries.append((now + RELEASE_RETRY, q))
                        continue
                if closed:
                    q.fill(error=self._lost())
                else:
                    q.fill(
                        error=BackendUnavailable(
                            f"cannot release lease {q.lease.name!r}: its row stayed locked by "
                            f"another transaction for {LOCK_BOUND:g} s; it passes on at the "
                            "latest when it expires"
                        )
                    )
                continue
            self._released(q.lease, q.node_id, q.term)
            q.fill(released)

    def _release_alone(self, lease: KeptLease, node_id: str, term: int) -> bool:
        """:meth:`release` in a round trip of its own (after a refused batch)."""
        channel = lease.channel
        if channel is None:  # the session that held the term is gone
            raise self._lost()
        with self._state:
            key = self._lock_key(lease, node_id, term)
        request = ReleaseRequest(lease.name, node_id, term, channel, key, *lease.ending(term))
        try:
            results = self._run(
                sql.SQL("{}; {}").format(
                    bounded_sql(LOCK_BOUND, statement=False),
                    release_sql(self._ident, request, history=self._history),
                ),
                "release the lease",
                limit=lease,
                tolerate=True,
            )
        except psycopg.Error as exc:
            # Refused on a healthy session (its row locked past LOCK_BOUND, a trigger):
            # this lease only; the session and every other lease's term go on, and this
            # one passes on by expiry.
            raise BackendUnavailable(
                f"cannot release lease {lease.name!r}: the server refused "
                f"({first_line(exc)}); it passes on when it expires"
            ) from exc
        self._released(lease, node_id, term)
        return bool(results[-2])

    # -- slots ---------------------------------------------------------------------------

    def renewal_slot(self, due: float, interval: float, after: float) -> float:
        """The latest tick of the shared renewal grid (period ``interval``) at or before
        ``due`` and after ``after``; ``due`` itself when there is none."""
        ticks = math.floor((due - self._phase) / interval)
        slot = self._phase + ticks * interval
        return slot if slot > after else due

    def attempt_slot(self, due: float, interval: float) -> float:
        """The first tick of the shared attempt grid (period ``interval``) at or after
        ``due``."""
        ticks = math.ceil((due - self._phase) / interval)
        return self._phase + ticks * interval

    # -- notifications -------------------------------------------------------------------

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
        """Send the queued batches, read notifications (and see a dead session) while the
        session is idle, and send the heartbeats due."""
        while True:
            with self._state:
                if self._closed:
                    return
                conn = self._conn if not self._holds.broken else None
            wake = self._wakeup.socket
            try:
                with selectors.DefaultSelector() as sel:
                    if wake is not None:
                        sel.register(wake, selectors.EVENT_READ, "wake")
                    if conn is not None and not conn.closed:
                        sel.register(conn.pgconn.socket, selectors.EVENT_READ, "db")
                    events = sel.select(0.0 if self._inbox else self._until_beat(1.0))
                self._wakeup.clear()
                if conn is not None and any(key.data == "db" for key, _ in events):
                    self._poll(conn)
                self._read_inbox()
                self._send_queued()
                self._wake_deferred()
                if conn is not None:
                    self._leave_channels()
                    self._read_members()
                    self._beat_due()
                SessionPool.close_idle(self._conninfo)
            except Exception:  # never let the pump die: it wakes every follower
                logger.exception("keeper: error reading notifications; going on")
                time.sleep(0.1)

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

    def _until_beat(self, cap: float) -> float:
        """Seconds until the next heartbeat or locked release is due (at most ``cap``)."""
        with self._state:
            due = min(self._beats.values(), default=None)
            retry = min((at for at, _ in self._retries), default=None)
            usable = self._conn is not None and not self._holds.broken
        for at in (retry, self._gate.next_due(reading=usable)):
            if at is not None:
                due = at if due is None else min(due, at)
        return cap if due is None else max(0.0, min(cap, due - clock.monotonic()))

    def _beat_due(self) -> None:
        """Heartbeat every node due now (or within a quarter of its interval: nodes of
        one process beat together), one statement per kind and table."""
        now = clock.monotonic()
        with self._state:
            if not self._beats or min(self._beats.values()) > now + self._beat_early:
                return  # the pump loops often: most loops find no beat due, in one pass
            due = [n for n, at in self._beats.items() if at <= now + n.heartbeat_interval / 4]
        groups: dict[tuple[type, str], list[Heartbeat]] = {}
        for node in due:
            groups.setdefault((type(node), node.table), []).append(node)
        for (_, table), batch in groups.items():
            try:
                if any(n.create_tables for n in batch) and table not in self._created:
                    with self._lock:
                        conn = self._conn
                        if conn is None:
                            return
                        # Bounded on the server: renewals wait behind this round trip
                        # (a migration holding the lock only delays the creation).
                        with self._io.guard(conn, self._timeout + 10.0, held=self.holding):
                            create_tables(conn, nodes=table, timeout=HEARTBEAT_BOUND)
                    self._created.add(table)
                with self._beating:
                    with self._state:  # a node that stopped beating meanwhile is left out
                        batch = [node for node in batch if node in self._beats]
                    if batch:
                        self._run(
                            sql.SQL("{}; {}").format(
                                bounded_sql(HEARTBEAT_BOUND), batch[0].heartbeat_sql(batch)
                            ),
                            "record heartbeats",
                            limit=HEARTBEAT_LIMIT,
                            tolerate=True,
                        )
                failed = False
            except (BackendUnavailable, ConfigError, psycopg.Error) as exc:
                failed = True
                logger.warning("keeper: could not record heartbeats: %s", first_line(exc))
            with self._state:
                for node in batch:
                    if node in self._beats:
                        # After a failure, try again soon; else at the next interval.
                        wait = (
                            min(1.0, node.heartbeat_interval) if failed else node.heartbeat_interval
                        )
                        self._beats[node] = now + wait

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

    def _read_inbox(self) -> None:
        """Act on the notifications received, at most :data:`_READ_PER_ROUND` of them
        (then the queued batches go out, and the rest are read next round)."""
        inbox = self._inbox
        for _ in range(min(len(inbox), _READ_PER_ROUND)):
            self._dispatch(*inbox.popleft())
        overflow, self._overflow = self._overflow, None
        if overflow is None:
            return
        count, channel, payload, sender = overflow
        notices.dropped.add(channel, payload, sender, count=count)
        # Which of them mattered is unknown: every client looks, as after a death.
        with self._state:
            ring = self._ring_channel
            clients = list(self._clients)
        if self._admit(ring, False, "down"):
            for client in clients:
                client.wake()

    def _dispatch(self, channel: str, payload: str, sender: int) -> None:
        """Act on one notification (on the keeper's thread); never raises."""
        try:
            self._notice(channel, payload, sender)
        except Exception:  # counted and reported as a dropped notice: at most once a minute
            logger.debug("keeper: error acting on a notification", exc_info=True)
            notices.dropped.add(channel, payload, sender)

    def _notice(self, channel: str, payload: str, sender: int) -> None:
        """Wake the clients ``channel``'s notice concerns, believing what it says only
        from a proven sender (see :mod:`.notice_gate`)."""
        with self._state:
            ring = channel == self._ring_channel
            clients = list(self._clients) if ring else list(self._by_channel.get(channel, ()))
        proven = self._gate.proven(sender)
        if ring:
            announced = ring_notice(channel, payload, sender)
            if announced is None:
                return
            if announced.kind == "up":
                self._gate.joined()
                if self._ring is not None and not self._gate.is_own(announced.pid):
                    self._ring.ring_changed(announced.pid)
                self._wakeup.wake()  # the pump reads the members
                return
            # "down": a keeper died; the followers of its leases attempt at once.
            if self._admit(channel, proven, "down"):
                for client in clients:
                    client.holder_died(announced.pid)
            return
        notice = lease_notice(channel, payload, sender)
        if notice is None:
            return
        if not proven and notice.event == "acquired" and notice.holder_pid == sender:
            self._gate.joined()  # a keeper not known yet, perhaps: the next one counts
        if not self._admit(channel, proven, notice.event):
            return
        own = self._gate.is_own(sender)
        for client in clients:
            client.notified(notice, sender=sender, own_session=own, proven=proven)

    def _admit(self, channel: str, proven: bool, kind: str) -> bool:
        """Whether a notice may wake now (else the pump wakes for it later)."""
        if self._gate.admit(channel, proven, kind):
            return True
        self._wakeup.wake()  # the pump's next wait ends when the deferred wake-up is due
        return False

    def _wake_deferred(self) -> None:
        """Deliver the wake-ups the rate limit held back, now due: on the ring, as a
        keeper's death that names nobody; on a lease channel, as notices of the kinds
        held back, believing none."""
        due = self._gate.due()
        if not due:
            return
        with self._state:
            ring = self._ring_channel
            woken = [
                (
                    channel,
                    kinds,
                    list(self._clients if channel == ring else self._by_channel.get(channel, ())),
                )
                for channel, kinds in due
            ]
        for channel, kinds, clients in woken:
            for client in clients:
                if channel == ring:
                    client.wake()
                else:
                    client.nudged(kinds)

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


forks.register(SharedKeeper)


def _row_at_fault(exc: psycopg.Error) -> bool:
    """Whether ``exc`` may come from one row of a batch (a trigger, a constraint, a value
    out of range), so that sending the rows apart isolates it; not a lock or statement
    timeout, a cancel or a deadlock, which say nothing about a row and would only
    repeat."""
    transient = (
        psycopg.errors.LockNotAvailable,
        psycopg.errors.QueryCanceled,
        psycopg.errors.DeadlockDetected,
        psycopg.errors.SerializationFailure,
    )
    return not isinstance(exc, transient)


def _one_per_lease(queue: list[Queued]) -> tuple[list[Queued], list[Queued]]:
    """Split the queue: at most one entry per lease name in a batch, the rest wait."""
    batch: list[Queued] = []
    rest: list[Queued] = []
    names: set[str] = set()
    for queued in queue:
        if queued.lease.name in names:
            rest.append(queued)
        else:
            names.add(queued.lease.name)
            batch.append(queued)
    return batch, rest
