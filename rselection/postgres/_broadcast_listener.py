"""The listener thread of :class:`~rselection.postgres.PostgresBroadcaster`.

Not public API. The listener has its own connection. It LISTENs only while its node has
subscriptions or receivers, catches up by fetching every row after the last id it
delivered (after every (re)connect, on a NOTIFY that does not carry the rows, and on
silence, which also probes the connection), reports gaps left by retention, and
reconnects with backoff. :mod:`rselection.postgres.broadcast` explains the design.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..broadcast import Broadcaster, BroadcasterClosed
from ..errors import BackendUnavailable, ConfigError
from ._broadcast_base import BroadcastBase
from ._broadcast_conn import backoff, first_line, logger

__all__ = ["BroadcastListener", "Gap", "GapHook"]

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


# Defined here, where gaps are found (rselection.postgres.broadcast imports this module),
# and public as rselection.postgres.broadcast.Gap: named so in reprs, pickles and docs.
Gap.__module__ = "rselection.postgres.broadcast"

GapHook = Callable[[Gap], object]
"""The ``on_gap`` hook: ``hook(gap)``, called in the listener thread for each gap."""


class BroadcastListener(BroadcastBase):
    """The listener thread of a broadcaster: delivers every node's messages to this one's
    subscriptions and receivers, in outbox id order.

    A mixin of :class:`~rselection.postgres.PostgresBroadcaster`: its state lives on the
    broadcaster, created by :meth:`_init_listener`.
    """

    def _init_listener(self, on_gap: GapHook | None) -> None:
        """Create the listener's state and thread (``PostgresBroadcaster`` starts it)."""
        self._on_gap = on_gap
        self._fetch_rows = max(1, min(_FETCH_ROWS, _FETCH_BYTES // self.max_message_bytes))

        # Listener state (written by the listener thread only, read by stats()).
        self._connected = threading.Event()  # the listener connected once (wait_ready)
        # Set while the listener LISTENs (or reconnects to LISTEN again) from a known
        # position; cleared, under _lstate, only when this node has no readers left.
        self._positioned = threading.Event()
        self._lstate = threading.Lock()
        self._wake = threading.Event()  # a reader arrived: the idle listener starts
        self._last_id = 0
        self._received = 0
        self._gaps = 0
        self._missed = 0
        self._reconnects = 0
        self._listening = False
        self._listener_pid: int | None = None

        self._listener = threading.Thread(
            target=self._listen_loop, name="rselection-broadcast-listen", daemon=True
        )

    def _keep_listening(self) -> bool:
        """Whether the listener should LISTEN; forget the position when it should not.

        Checked and cleared under ``_lstate``, which :meth:`_await_listener` also holds
        to read the position: a reader added before this check keeps the listener, one
        added after it finds the position cleared and waits for a new one.
        """
        if self._subs:
            return True  # the common case, checked per message: no lock, nothing changes
        with self._lstate:
            if self._has_any_readers():
                return True
            self._positioned.clear()
            self._listening = False
            return False

    def _await_listener(self, action: str) -> None:
        """Start the listener for a new reader and wait until it knows its position."""
        with self._lstate:
            if self._positioned.is_set():
                return
        self._wake.set()
        if threading.current_thread() is self._listener:
            return  # a receiver subscribing: the listener starts after it returns
        deadline = time.monotonic() + self.timeout
        while not self._positioned.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self._stop.is_set() or self.closed:
                return
            if time.monotonic() >= deadline:
                logger.warning(
                    "broadcast: %s() returns before the listener could LISTEN on %s (not "
                    "within timeout=%s s); messages are delivered from when it connects",
                    action,
                    self._where,
                    self.timeout,
                )
                return

    def _listen_loop(self) -> None:
        failures = 0
        down_since: float | None = None
        last_error = ""

        def healthy() -> None:
            nonlocal failures, down_since, last_error
            if down_since is not None:
                self._reconnects += 1
                logger.info(
                    "broadcast listener reconnected to %s after %.1f s; caught up to id %d",
                    self._where,
                    time.monotonic() - down_since,
                    self._last_id,
                )
            failures, down_since, last_error = 0, None, ""

        while not self._stop.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = self._connect("listen for broadcasts", listen=True)
                with self._conn_lock:
                    if self._stop.is_set():
                        break
                    self._listen_conn = conn
                with self._watchdog.guard(conn, self.timeout):
                    channel, _ = self._outbox.resolve(conn)
                self._listener_pid = conn.info.backend_pid
                self._connected.set()
                self._serve(conn, channel, healthy)
            except (psycopg.Error, OSError, BackendUnavailable, ConfigError) as exc:
                if self._stop.is_set():
                    break
                failures += 1
                detail = first_line(exc, self._conninfo)
                if down_since is None:
                    down_since = time.monotonic()
                    logger.warning(
                        "broadcast listener lost its connection to %s (%s); reconnecting "
                        "with backoff, messages published meanwhile are fetched afterwards",
                        self._where,
                        detail,
                    )
                elif detail != last_error:
                    logger.warning(
                        "broadcast listener cannot reconnect to %s: %s", self._where, detail
                    )
                last_error = detail
            except Exception:
                # A bug must not silently end delivery: log it and start over.
                failures += 1
                if down_since is None:
                    down_since = time.monotonic()
                logger.exception("broadcast listener failed; restarting it")
            finally:
                self._listening = False
                self._listener_pid = None
                with self._conn_lock:
                    self._listen_conn = None
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
        if not self._has_any_readers():
            healthy()  # connected; nothing to catch up on for nobody
        while not self._stop.is_set():
            wait = max(0.0, quiet_since + self.probe_interval - time.monotonic())
            if not listening:
                self._wake.clear()
                if not self._keep_listening():
                    # Idle: no NOTIFY wakes this node. Wait for a reader; probe the
                    # connection on silence so a dead one is replaced before it is needed.
                    if not self._wake.wait(wait):
                        with self._watchdog.guard(conn, self.timeout):
                            conn.execute("SELECT 1")
                        quiet_since = time.monotonic()
                    continue
                with self._watchdog.guard(conn, self.timeout):
                    conn.execute(listen)
                    if not self._positioned.is_set():
                        # A new start: from the newest row (older ones had no reader here).
                        row = conn.execute(self._outbox.start_position()).fetchone()
                        self._last_id = int(row[0]) if row else 0
                # Catch up on what was published while not listening (LISTEN came first,
                # so nothing committed after this fetch's snapshot can be missed).
                self._catch_up(conn)
                listening = True
                self._listening = True
                self._positioned.set()
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
                with self._watchdog.guard(conn, self.timeout):
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
                if row_id <= self._last_id:
                    continue
                if row_id != self._last_id + 1:
                    # An id in between is unused (a failed publish) or was not seen: the
                    # table knows which; fetching also delivers the rest of this batch.
                    return True
                self._deliver(row_id, row[1], row[2])
            return False
        try:
            return int(payload) > self._last_id
        except ValueError:
            return True

    def _catch_up(self, conn: psycopg.Connection[Any]) -> None:
        """Fetch and deliver every row after the last id, in order, reporting gaps."""
        while not self._stop.is_set():
            with self._watchdog.guard(conn, self.timeout):
                cursor = conn.execute(self._outbox.fetch(), (self._last_id, self._fetch_rows))
                rows = cursor.fetchall()
            purged = int(rows[0][0]) if rows else 0
            if purged > self._last_id:
                self._report_gap(Gap(self._last_id, purged))
            got = 0
            for _, row_id, channel, payload in rows:
                if row_id is None:
                    continue
                got += 1
                if row_id > self._last_id:
                    self._deliver(int(row_id), channel, payload)
            if purged > self._last_id:
                self._last_id = purged
            if got < self._fetch_rows:
                return

    def _deliver(self, row_id: int, channel: str, payload: str) -> None:
        self._last_id = row_id
        self._received += 1
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
            Broadcaster.publish(self, channel, message)

    def _has_readers(self, channel: str) -> bool:
        if self._subs.get(channel):
            return True
        signal = self._signals.get(channel)
        return signal is not None and bool(signal.receivers)

    def _report_gap(self, gap: Gap) -> None:
        self._gaps += 1
        self._missed += gap.missed
        logger.warning(
            "broadcast listener fell behind by more than retention=%s s: messages with ids "
            "%d..%d were deleted before this node read them (at most %d lost); raise "
            "retention or keep nodes connected",
            self.retention,
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
