"""The listener of :class:`~rselection.postgres.PostgresBroadcaster`: delivers every node's
messages to this one.

The listener owns its position in the outbox (the last id it delivered), its counters
and its gap reports; it delivers only rows it read from the outbox table, fetching after
every (re)connect, on a NOTIFY (a wake-up, see :mod:`.wakeups`) and on silence. Its
thread and session are the process's shared
:class:`~rselection.postgres.broadcast.listening.ListeningSession`. See
``docs/explanation/broadcaster.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from ... import forks
from ...backoff import backoff
from ...broadcast import BroadcasterClosed
from .fetches import Fetches
from .listening import ListeningSession
from .location import Location
from .sessions import Sessions
from .wakeups import IgnoredPayloads, notified_id

__all__ = ["Gap", "GapHook", "Listener"]

logger = logging.getLogger(__name__)

#: Bytes of payloads a listener fetches per round trip, about (a page holds at least one
#: row, whatever its size), and rows at most; it fetches again for more.
_FETCH_BYTES = 16 * 1024 * 1024
_FETCH_ROWS = 1000


@dataclass(frozen=True)
class Gap:
    """Messages this node can no longer deliver: they were deleted by retention unread;
    or, with ``reset``, the outbox's ids went back.

    :param after_id: the last outbox id delivered before the gap (or the reset).
    :param through_id: the highest id the gap may cover; ids ``after_id + 1`` through
        ``through_id`` were not delivered (some may be ids of failed publishes, which
        never held a message). After a reset: the id of the new sequence that delivery
        resumed after (every message above it is delivered).
    :param reset: the outbox's ids went back below ``after_id`` (the table was dropped
        and created again, its sequence reset, or it was restored from a backup): ids
        above ``after_id`` of the old sequence will never come, and the listener
        resynchronised on the new one, delivering every message the table holds from
        ``through_id`` on (after a restore, some may be messages delivered before it).
    :param missed: an upper bound of the messages lost: ``through_id - after_id`` (0
        for a reset: the messages lost with the old table, if any, cannot be counted).
    """

    after_id: int
    through_id: int
    reset: bool = False

    @property
    def missed(self) -> int:
        """At most this many messages were lost."""
        return 0 if self.reset else self.through_id - self.after_id


# Defined here, where gaps are found, and public as rselection.postgres.broadcast.Gap:
# named so in reprs, pickles and docs.
Gap.__module__ = "rselection.postgres.broadcast"

GapHook = Callable[[Gap], object]
"""The ``on_gap`` hook: ``hook(gap)``, called in the listener thread for each gap."""


Readers = Callable[[str | None], bool]
"""``has_readers(channel)``: whether this node reads ``channel`` (any channel for None)."""

Deliver = Callable[[str, object], object]
"""``deliver(channel, message)``: hand a message to this node's readers of ``channel``."""


class Listener:
    """Delivers every node's messages to this broadcaster's readers, in outbox id order,
    through the :class:`~.listening.ListeningSession` of its process and conninfo.

    The listener owns its position in the outbox (the last id it delivered), its
    counters and its gap reports; the session it attaches to owns the thread and the
    Postgres session, shared by every broadcaster of the process on the same conninfo,
    and calls :meth:`resolve`, :meth:`begin`, :meth:`on_notify` and :meth:`catch_up`.

    Args:
        sessions: the broadcaster's sessions (its settings and outbox).
        has_readers: whether this node has readers (of a channel, or of any).
        deliver: hands a message to this node's subscriptions and receivers.
        on_gap: called in the listener thread for each :class:`Gap`.
    """

    def __init__(
        self,
        sessions: Sessions,
        has_readers: Readers,
        deliver: Deliver,
        on_gap: GapHook | None,
    ) -> None:
        """Create the listener's state (:meth:`start` attaches it to its session)."""
        self.sessions = sessions
        self.settings = sessions.settings
        """The broadcaster's settings."""
        self._outbox = sessions.outbox
        self._has_readers = has_readers
        self._deliver_local = deliver
        self._on_gap = on_gap
        self._fetches: Fetches | None = None  # on the session's connection (resolve())
        self._stop = threading.Event()
        self._session: ListeningSession | None = None
        self._last_of_session = False  # stop() detached the session's last listener

        # Set while the listener LISTENs (or reconnects to LISTEN again) from a known
        # position; cleared, under _lstate, only when this node has no readers left.
        self.positioned = threading.Event()
        """Set while the listener LISTENs from a known position: every message committed
        from then on is delivered."""
        self._lstate = threading.Lock()

        # Written by the session's thread only; read by the session, stats(), the writer.
        self.generation = 0
        """The session connection this listener's table is resolved on (0: none)."""
        self.channel = ""
        """The NOTIFY channel of its outbox table, once resolved."""
        self.retry_at = 0.0
        """When to resolve again after a failure of its own (monotonic seconds)."""
        self._failures = 0
        self._error = ""
        self._lost = False  # served on a session that broke: count the reconnect
        self.last_id = 0
        """The outbox id of the last message delivered (or skipped by a gap)."""
        self.received = 0
        """Outbox rows read (every channel)."""
        self.gaps = 0
        """Gaps reported."""
        self.resets = 0
        """Times the outbox's ids went back and the listener resynchronised."""
        self._oid: int | None = None  # the outbox table's oid where the position was taken
        self._location: Location | None = None  # where the table was found
        # The highest id a NOTIFY named since this LISTEN began, at most the newest id
        # of the last fetch (see on_notify): it only decides whether to fetch.
        self._notified = 0
        self._ignored = IgnoredPayloads(self._outbox.table, sessions.where)
        self._stale_watermark = 0  # a purge watermark left from before a reset
        self.missed = 0
        """Upper bound of the messages lost in those gaps."""
        self.reconnects = 0
        """Times the listener lost its session and connected again."""
        self.listening = False
        """Whether the listener LISTENs from a known position (it may still be behind)."""
        self.behind = False
        """Whether its last fetch was a full page: the session fetches again on its next
        turn, without waiting for a NOTIFY (one page per turn, so that a catch-up, however
        long, never holds up the other broadcasters of the process, nor a new reader's
        start)."""
        self.pid: int | None = None
        """The backend pid of the listener's session (``None`` while disconnected)."""

    def start(self) -> None:
        """Attach to the process's listening session (it connects only once a
        broadcaster of the process has readers)."""
        self._session = ListeningSession.attach(self)

    def reset_after_fork(self) -> None:
        """In a forked child: the listening session (its thread, its Postgres session)
        is the parent's; forget it, and the position with it. :meth:`start` attaches
        to this process's session, which starts from the newest row."""
        forks.keep_inherited(self._session)
        self._session = None
        self._last_of_session = False
        self._lstate = threading.Lock()
        self.positioned = threading.Event()
        if not self._stop.is_set():  # one stopped in the parent (closed) stays stopped
            self._stop = threading.Event()
        self.generation = 0
        self.retry_at = 0.0
        self._lost = False
        self.listening = False
        self.behind = False
        self.pid = None

    def resume(self) -> None:
        """Listen again, without waiting, when the broadcaster has readers (those a
        forked child inherited): the session connects and takes its position in its
        own thread."""
        session = self._session
        if session is not None and self._has_readers(None):
            session.want()

    def stop(self) -> None:
        """Detach; the last listener of the session stops it (waking its thread)."""
        self._stop.set()
        session = self._session
        if session is not None:
            self._last_of_session = session.detach(self)

    def join(self, timeout: float) -> None:
        """Wait for the session's thread to end, once this was its last listener (not
        when called from that thread)."""
        session = self._session
        if session is not None and self._last_of_session:
            session.join(timeout)

    def keep_listening(self) -> bool:
        """Whether the listener should LISTEN; forget the position when it should not.

        Checked and cleared under ``_lstate``, which :meth:`await_position` also holds
        to read the position: a reader added before this check keeps the listener, one
        added after it finds the position cleared and waits for a new one.
        """
        with self._lstate:
            if self._has_readers(None):
                return True
            self.positioned.clear()
            self.listening = False
            return False

    def await_position(self, action: str) -> None:
        """Start listening for a new reader and wait until the listener knows where it
        starts, at most ``io_timeout`` seconds (then log a warning and return).

        Args:
            action: what the reader called (``"subscribe"``), for the warning.
        """
        with self._lstate:
            if self.positioned.is_set():
                return
        session = self._session
        if session is None:
            return
        session.want()
        if threading.current_thread() is session.thread:
            # A receiver subscribing: the thread that would start the listener is this
            # one, which cannot wait for itself; it starts it now.
            session.position(self)
            return
        io_timeout = self.settings.io_timeout
        deadline = time.monotonic() + io_timeout
        while not self.positioned.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self._stop.is_set():
                return
            if time.monotonic() >= deadline:
                logger.warning(
                    "broadcast: %s() returns before the listener could LISTEN on %s (not "
                    "within io_timeout=%s s); messages are delivered from when it connects",
                    action,
                    self.sessions.where,
                    io_timeout,
                )
                return

    def reader_left(self) -> None:
        """A subscription closed or a receiver disconnected: when it was this
        broadcaster's last reader, wake the session, which closes its Postgres session
        if no broadcaster of the process has readers left."""
        session = self._session
        if session is not None and not self._has_readers(None):
            session.wake()

    # -- steps run by the session's thread ---------------------------------------------

    def resolve(self, session: ListeningSession, conn: psycopg.Connection[Any]) -> None:
        """Make the tables ready (``create_tables``) and find the table's NOTIFY channel
        on the session's (new) connection."""
        locator = self.sessions.locator
        with session.guard(conn):
            self.sessions.prepare(conn)
            locator.read_path(conn)  # on a session of the broadcaster's own
            location = locator.find(conn)
        self._fetches = Fetches(conn, location, locator)
        previous = self._location
        if previous is not None and previous.oid != location.oid:
            logger.warning(
                "broadcast table %r on %s is another table now, in schema %r (it was in "
                "%r); reading that one",
                self._outbox.table,
                self.sessions.where,
                location.schema,
                previous.schema,
            )
        elif previous is not None and previous.schema != location.schema:
            logger.info(
                "broadcast table %r on %s moved from schema %r to %r; following it",
                self._outbox.table,
                self.sessions.where,
                previous.schema,
                location.schema,
            )
        self._location = location
        self.channel = location.channel
        self.generation = session.generation
        self.pid = conn.info.backend_pid
        self._failures, self._error = 0, ""
        if self._lost and not self._has_readers(None):
            self._reconnected()  # connected; nothing to catch up on for nobody

    def begin(self, session: ListeningSession, conn: psycopg.Connection[Any]) -> None:
        """Start delivering, once the session LISTENs on the table's channel: from the
        newest row on a new start, else catch up from the last id delivered."""
        location = self._location
        assert location is not None, "resolve() first"
        if not self.positioned.is_set():
            # A new start: from the newest row (older ones had no reader here).
            with session.guard(conn):
                row = conn.execute(location.outbox.start_position(), self._finds()).fetchone()
            newest, purged, oid = row if row is not None else (0, 0, None)
            if oid != location.oid:
                self._relocate()  # the name finds another table since resolve()
                return
            if 0 < newest <= purged:
                # Retention leaves only ids above its watermark: this one was left by an
                # older table of the same name (its state table kept); new ids come
                # after the newest row, not after it.
                self.last_id, self._stale_watermark = newest, purged
            else:
                self.last_id, self._stale_watermark = max(newest, purged), 0
            self._oid = None if oid is None else int(oid)
        self._notified = 0
        # Catch up on what was published while not listening (LISTEN came first, so
        # nothing committed after this fetch's snapshot can be missed): a first page
        # now, the rest on the session's next turns (see :attr:`behind`). The position
        # is known from here on, so a reader waiting for it returns at once, even while
        # a stream keeps this listener behind.
        self.catch_up(session, conn)
        if self.generation != session.generation:
            return  # the name finds another table now: found again on the next turn
        self.listening = True
        self.positioned.set()
        if self._lost and not self.behind:
            self._reconnected()

    def lose(self, generation: int) -> None:
        """The session's connection ``generation`` ended: resolve again on the next."""
        if generation and self.generation == generation:
            self._lost = True
        self.generation = 0
        self.listening = False
        self.behind = False
        self.pid = None

    def release(self) -> None:
        """The session was closed on purpose (no reader left in the process): resolve
        again on the next, without counting a reconnect."""
        self.generation = 0
        self.listening = False
        self.behind = False
        self.pid = None

    def fail(self, exc: BaseException) -> None:
        """A step of this listener failed on a working session (its table is missing,
        a statement timed out): retry it with backoff, the other listeners go on."""
        self.generation = 0
        self.listening = False
        self.behind = False
        self._failures += 1
        self.retry_at = time.monotonic() + backoff(self._failures)
        detail = self.sessions.error_text(exc)
        if detail != self._error:
            logger.warning(
                "broadcast listener cannot read broadcast table %r on %s: %s; retrying "
                "with backoff",
                self._outbox.table,
                self.sessions.where,
                detail,
            )
        self._error = detail

    def _reconnected(self) -> None:
        self._lost = False
        self.reconnects += 1
        logger.info(
            "broadcast listener of table %r back on %s; caught up to id %d",
            self._outbox.table,
            self.sessions.where,
            self.last_id,
        )

    @property
    def ignored(self) -> int:
        """NOTIFY payloads on the table's channel that were not ids, ignored."""
        return self._ignored.count

    def on_notify(self, payload: str, pid: int = 0) -> bool:
        """Whether a NOTIFY on the table's channel calls for a fetch now. Never raises.

        A NOTIFY is a wake-up, never data: any role that can connect may send one on
        this channel (see :mod:`.wakeups`). Nothing in it is delivered, and nothing in
        it moves the position, resets it, or counts a gap: :meth:`catch_up` reads all of
        that from the table. Its payload, the last id a publish committed, only spares
        a fetch that could find nothing new: an id at most the last one delivered, when
        the ids did not go back. A payload that is not an id (no broadcaster sends one)
        is counted and reported (:class:`~.wakeups.IgnoredPayloads`) and wakes nothing:
        the next NOTIFY, or the poll after ``probe_interval``, fetches.

        Args:
            payload: the NOTIFY's payload.
            pid: the backend pid that sent it, for the report.
        """
        notified = notified_id(payload)
        if notified is None:
            self._ignored.add(payload, pid)
            return False
        # The publish lock orders commits by id, so each publish's NOTIFY names a higher
        # id than the ones before it: an id not above the highest one named since the
        # last fetch means that the ids went back (or that someone else sent it), and
        # a fetch finds out which. A forged high id can only cost fetches: every fetch
        # lowers the mark to the newest id the table holds.
        back = notified <= self._notified
        self._notified = max(self._notified, notified)
        return back or notified > self.last_id

    def _finds(self) -> tuple[list[str], str]:
        """The parameters that find the table (see :mod:`.location`)."""
        locator = self.sessions.locator
        return list(locator.path), locator.name

    def _relocate(self) -> None:
        """The table's name finds another table, or none: find it again (on the next
        turn of the session's loop, which LISTENs on its channel before this listener
        fetches again; a position taken stays, and a new table is a reset)."""
        self.generation = 0
        self.listening = False
        self.behind = False

    def catch_up(self, session: ListeningSession, conn: psycopg.Connection[Any]) -> None:
        """Fetch and deliver the next page of rows after the last id, in order, reporting
        gaps; :attr:`behind` tells whether more wait (the session's next turn fetches
        them). One page per call: the session's thread serves every broadcaster of the
        process, and new readers wait for it to start them.

        Only rows read here are delivered, and the position, gaps and resets follow
        what this fetch reads, in one snapshot, from the outbox table and its state
        table, which only roles with privileges on them can write."""
        self._page(session, conn, woken=False)

    def fetch_next(self, session: ListeningSession, conn: psycopg.Connection[Any]) -> None:
        """:meth:`catch_up` after a wake-up (a NOTIFY, or a page that left more): the
        rows that follow the last id, read without searching the table's name through
        the search path (see :meth:`~.outbox.Outbox.fetch_next`). Whatever else such a
        page shows (no new row, another table, ids that went back), the listener fetches
        again as :meth:`catch_up` does, which finds out."""
        self._page(session, conn, woken=True)

    def _page(self, session: ListeningSession, conn: psycopg.Connection[Any], woken: bool) -> None:
        location, fetches = self._location, self._fetches
        assert location is not None and fetches is not None, "resolve() first"
        self.behind = False
        while not self._stop.is_set():
            with session.guard(conn):
                rows = fetches.run(self.last_id, _FETCH_ROWS, _FETCH_BYTES, woken=woken)
            purged, newest, found = rows[0][:3]
            if woken and (
                rows[0][3] is None
                or found != location.oid
                or found != self._oid
                or max(purged, newest) < self.last_id
            ):
                # Nothing new (the NOTIFY was not a publish's, or its rows are
                # elsewhere), or a table or ids that changed: a full fetch tells.
                woken = False
                continue
            if found != location.oid:
                # The name finds another table (or none) now: these rows may come from
                # either; find the table again and read it from there.
                self._relocate()
                return
            oid = location.oid
            if (self._oid is not None and oid != self._oid) or max(purged, newest) < self.last_id:
                # Another table under the same name, or every id at and below the last
                # one delivered is gone without retention deleting it: the ids went back.
                self._reset(purged, oid)
                continue
            self._oid = oid
            # Every NOTIFY of a publish seen so far names at most the newest id: a
            # higher mark was forged, and would only make the next NOTIFYs fetch.
            self._notified = min(self._notified, newest)
            if purged <= self._stale_watermark:
                purged = 0  # the watermark of the old sequence says nothing of the new one
            if purged > self.last_id:
                self._report_gap(Gap(self.last_id, purged))
            last_read = 0
            for _, _, _, row_id, channel, payload in rows:
                if row_id is None:
                    continue
                last_read = row_id
                if row_id > self.last_id:
                    self._deliver(row_id, channel, payload)
            if purged > self.last_id:
                self.last_id = purged
            # The page stopped short of the newest row (its limits): more wait.
            self.behind = 0 < last_read < newest
            if not self.behind and self._lost and self.listening:
                self._reconnected()
            return

    def _reset(self, purged: int, oid: int) -> None:
        """Resynchronise on a new outbox sequence: deliver everything it holds."""
        gap = Gap(self.last_id, 0, reset=True)
        self.last_id = 0
        self._oid = oid
        self._notified = 0
        # A state table kept across the reset keeps the old sequence's watermark: it
        # covers none of the new ids until purges of the new sequence move it up.
        self._stale_watermark = purged
        self.resets += 1
        logger.warning(
            "broadcast table %r on %s went back: the ids restarted below id %d, the last "
            "this node delivered (the table was created again, its sequence reset, or it "
            "was restored from a backup); delivering every message it holds now",
            self._outbox.table,
            self.sessions.where,
            gap.after_id,
        )
        self._call_hook(gap)

    def _deliver(self, row_id: int, channel: str, payload: str) -> None:
        self.last_id = row_id
        self.received += 1
        if not self._has_readers(channel):
            return  # nobody here listens: skip decoding
        try:
            message = json.loads(payload)
        except (ValueError, RecursionError):
            logger.warning(
                "broadcast: outbox row %d on channel %r does not hold JSON; skipped",
                row_id,
                channel[:80],
            )
            return
        with contextlib.suppress(BroadcasterClosed):
            self._deliver_local(channel, message)

    def _report_gap(self, gap: Gap) -> None:
        self.gaps += 1
        self.missed += gap.missed
        logger.warning(
            "broadcast listener fell behind by more than retention=%s s: messages with ids "
            "%d..%d were deleted before this node read them (at most %d lost); raise "
            "retention or keep nodes connected",
            self.settings.retention,
            gap.after_id + 1,
            gap.through_id,
            gap.missed,
        )
        self._call_hook(gap)

    def _call_hook(self, gap: Gap) -> None:
        hook = self._on_gap
        if hook is not None:
            try:
                hook(gap)
            except Exception:
                logger.exception("on_gap hook %r raised; ignored", hook)
