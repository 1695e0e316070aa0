"""The listener of :class:`~rselection.postgres.PostgresBroadcaster`: delivers every node's
messages to this one.

The listener owns a thread, a session and its position in the outbox (the last id it
delivered). It LISTENs only while its node has subscriptions or receivers, catches up
by fetching every row after the last id it delivered (after every (re)connect, on a
NOTIFY that does not carry the rows, and on silence, which also probes the
connection), reports gaps left by retention, and reconnects with backoff.
:mod:`rselection.postgres.broadcast` explains the design.
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
from psycopg import sql

from ...broadcast import BroadcasterClosed
from ...errors import BackendUnavailable, ConfigError
from .sessions import Sessions, abort_socket, backoff

__all__ = ["Gap", "GapHook", "Listener"]

logger = logging.getLogger(__name__)

#: Bytes of rows a listener fetches per round trip at most (it fetches again for more).
_FETCH_BYTES = 16 * 1024 * 1024
_FETCH_ROWS = 1000


@dataclass(frozen=True)
class Gap:
    """Messages this node can no longer deliver: they were deleted by retention unread.

    :param after_id: the last outbox id delivered before the gap.
    :param through_id: the highest id the gap may cover; ids ``after_id + 1`` through
        ``through_id`` were not delivered (some may be ids of failed publishes, which
        never held a message).
    :param missed: an upper bound of the messages lost: ``through_id - after_id``.
    """

    after_id: int
    through_id: int

    @property
    def missed(self) -> int:
        """At most this many messages were lost."""
        return self.through_id - self.after_id


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
    """Delivers every node's messages to this node's readers, in outbox id order, from a
    thread and a session of its own.

    Args:
        sessions: opens the listener's session.
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
        """Create the listener's state and thread (:meth:`start` starts it)."""
        self._sessions = sessions
        self._settings = sessions.settings
        self._outbox = sessions.outbox
        self._deadlines = sessions.deadlines
        self._has_readers = has_readers
        self._deliver_local = deliver
        self._on_gap = on_gap
        self._fetch_rows = max(
            1, min(_FETCH_ROWS, _FETCH_BYTES // self._settings.max_message_bytes)
        )
        self._stop = threading.Event()
        self._conn_lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

        self.connected = threading.Event()
        """Set once the listener connected (its tables ready)."""
        # Set while the listener LISTENs (or reconnects to LISTEN again) from a known
        # position; cleared, under _lstate, only when this node has no readers left.
        self.positioned = threading.Event()
        """Set while the listener LISTENs from a known position: every message committed
        from then on is delivered."""
        self._lstate = threading.Lock()
        self._wake = threading.Event()  # a reader arrived: the idle listener starts

        # Written by the listener thread only; read by stats() and the writer.
        self.last_id = 0
        """The outbox id of the last message delivered (or skipped by a gap)."""
        self.received = 0
        """Outbox rows read (every channel)."""
        self.gaps = 0
        """Gaps reported."""
        self.missed = 0
        """Upper bound of the messages lost in those gaps."""
        self.reconnects = 0
        """Times the listener lost its session and connected again."""
        self.listening = False
        """Whether the listener LISTENs and has caught up."""
        self.pid: int | None = None
        """The backend pid of the listener's session (``None`` while disconnected)."""

        self._thread = threading.Thread(
            target=self._listen_loop, name="rselection-broadcast-listen", daemon=True
        )

    def start(self) -> None:
        """Start the listener thread (it connects at once, and LISTENs once needed)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread: wake it, and abort a round trip it is blocked on."""
        self._stop.set()
        self._wake.set()  # an idle listener waits on it, not on its session
        with self._conn_lock:
            if self._conn is not None:
                abort_socket(self._conn)

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (not when called from it)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _keep_listening(self) -> bool:
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
        starts, at most ``timeout`` seconds (then log a warning and return).

        Args:
            action: what the reader called (``"subscribe"``), for the warning.
        """
        with self._lstate:
            if self.positioned.is_set():
                return
        self._wake.set()
        if threading.current_thread() is self._thread:
            return  # a receiver subscribing: the listener starts after it returns
        timeout = self._settings.timeout
        deadline = time.monotonic() + timeout
        while not self.positioned.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self._stop.is_set():
                return
            if time.monotonic() >= deadline:
                logger.warning(
                    "broadcast: %s() returns before the listener could LISTEN on %s (not "
                    "within timeout=%s s); messages are delivered from when it connects",
                    action,
                    self._sessions.where,
                    timeout,
                )
                return

    def _listen_loop(self) -> None:
        failures = 0
        down_since: float | None = None
        last_error = ""

        def healthy() -> None:
            nonlocal failures, down_since, last_error
            if down_since is not None:
                self.reconnects += 1
                logger.info(
                    "broadcast listener reconnected to %s after %.1f s; caught up to id %d",
                    self._sessions.where,
                    time.monotonic() - down_since,
                    self.last_id,
                )
            failures, down_since, last_error = 0, None, ""

        while not self._stop.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = self._sessions.connect("listen for broadcasts", listen=True)
                with self._conn_lock:
                    if self._stop.is_set():
                        break
                    self._conn = conn
                with self._deadlines.guard(conn, self._settings.timeout):
                    channel, _ = self._outbox.resolve(conn)
                self.pid = conn.info.backend_pid
                self.connected.set()
                self._serve(conn, channel, healthy)
            except (psycopg.Error, OSError, BackendUnavailable, ConfigError) as exc:
                if self._stop.is_set():
                    break
                failures += 1
                detail = self._sessions.error_text(exc)
                if down_since is None:
                    down_since = time.monotonic()
                    logger.warning(
                        "broadcast listener lost its connection to %s (%s); reconnecting "
                        "with backoff, messages published meanwhile are fetched afterwards",
                        self._sessions.where,
                        detail,
                    )
                elif detail != last_error:
                    logger.warning(
                        "broadcast listener cannot reconnect to %s: %s",
                        self._sessions.where,
                        detail,
                    )
                last_error = detail
            except Exception:
                # A bug must not silently end delivery: log it and start over.
                failures += 1
                if down_since is None:
                    down_since = time.monotonic()
                logger.exception("broadcast listener failed; restarting it")
            finally:
                self.listening = False
                self.pid = None
                with self._conn_lock:
                    self._conn = None
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
            if failures:
                self._stop.wait(backoff(failures))

    def _serve(
        self, conn: psycopg.Connection[Any], channel: str, healthy: Callable[[], None]
    ) -> None:
        """LISTEN while this node has readers, deliver NOTIFYs, poll on silence; idle
        otherwise. Returns when we stop; raises when the connection fails."""
        listen = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
        unlisten = sql.SQL("UNLISTEN {}").format(sql.Identifier(channel))
        listening = False
        quiet_since = time.monotonic()
        if not self._has_readers(None):
            healthy()  # connected; nothing to catch up on for nobody
        while not self._stop.is_set():
            wait = max(0.0, quiet_since + self._settings.probe_interval - time.monotonic())
            if not listening:
                self._wake.clear()
                if not self._keep_listening():
                    # Idle: no NOTIFY wakes this node. Wait for a reader; probe the
                    # connection on silence so a dead one is replaced before it is needed.
                    if not self._wake.wait(wait):
                        with self._deadlines.guard(conn, self._settings.timeout):
                            conn.execute("SELECT 1")
                        quiet_since = time.monotonic()
                    continue
                with self._deadlines.guard(conn, self._settings.timeout):
                    conn.execute(listen)
                    if not self.positioned.is_set():
                        # A new start: from the newest row (older ones had no reader here).
                        row = conn.execute(self._outbox.start_position()).fetchone()
                        self.last_id = int(row[0]) if row else 0
                # Catch up on what was published while not listening (LISTEN came first,
                # so nothing committed after this fetch's snapshot can be missed).
                self._catch_up(conn)
                listening = True
                self.listening = True
                self.positioned.set()
                quiet_since = time.monotonic()
                healthy()
                continue
            notes = list(conn.notifies(timeout=wait, stop_after=1))
            if self._stop.is_set():
                return
            if not notes:
                # Silence: poll. The round trip is bounded by the watchdog, so a
                # half-open connection fails here instead of waiting forever.
                self._catch_up(conn)
            else:
                fetch = False
                for note in notes:
                    fetch = self._on_notify(note.payload) or fetch
                if fetch:
                    self._catch_up(conn)
            quiet_since = time.monotonic()
            if not self._keep_listening():
                # The last reader left: stop waking for every message.
                with self._deadlines.guard(conn, self._settings.timeout):
                    conn.execute(unlisten)
                listening = False

    def _on_notify(self, payload: str) -> bool:
        """Deliver the rows a NOTIFY carries; return whether a fetch is needed."""
        if payload.startswith("["):
            try:
                rows = json.loads(payload)
            except ValueError:
                logger.warning("broadcast: ignoring a malformed NOTIFY payload %r", payload[:80])
                return True
            for row in rows:
                row_id = int(row[0])
                if row_id <= self.last_id:
                    continue
                if row_id != self.last_id + 1:
                    # An id in between is unused (a failed publish) or was not seen: the
                    # table knows which; fetching also delivers the rest of this batch.
                    return True
                self._deliver(row_id, row[1], row[2])
            return False
        try:
            return int(payload) > self.last_id
        except ValueError:
            return True

    def _catch_up(self, conn: psycopg.Connection[Any]) -> None:
        """Fetch and deliver every row after the last id, in order, reporting gaps."""
        while not self._stop.is_set():
            with self._deadlines.guard(conn, self._settings.timeout):
                cursor = conn.execute(self._outbox.fetch(), (self.last_id, self._fetch_rows))
                rows = cursor.fetchall()
            purged = int(rows[0][0]) if rows else 0
            if purged > self.last_id:
                self._report_gap(Gap(self.last_id, purged))
            got = 0
            for _, row_id, channel, payload in rows:
                if row_id is None:
                    continue
                got += 1
                if row_id > self.last_id:
                    self._deliver(int(row_id), channel, payload)
            if purged > self.last_id:
                self.last_id = purged
            if got < self._fetch_rows:
                return

    def _deliver(self, row_id: int, channel: str, payload: str) -> None:
        self.last_id = row_id
        self.received += 1
        if not self._has_readers(channel):
            return  # nobody here listens: skip decoding
        try:
            message = json.loads(payload)
        except ValueError:
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
            self._settings.retention,
            gap.after_id + 1,
            gap.through_id,
            gap.missed,
        )
        hook = self._on_gap
        if hook is not None:
            try:
                hook(gap)
            except Exception:
                logger.exception("on_gap hook %r raised; ignored", hook)
