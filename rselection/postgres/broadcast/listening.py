"""The listening session of a process: one per connection string, whatever the number of
:class:`~rselection.postgres.PostgresBroadcaster` objects on it.

:class:`ListeningSession` owns the thread and the Postgres session that LISTEN for every
broadcaster's :class:`~rselection.postgres.broadcast.listener.Listener` on that string,
and hands each NOTIFY to the listeners of its table. It holds the session only while the
process reads, and the thread ends with the last broadcaster. See
``docs/explanation/broadcaster.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import psycopg
from psycopg import sql

from ... import forks
from ...backoff import backoff
from ...errors import BackendUnavailable, ConfigError
from ...wakeup import Wakeup
from .._conn import IoWatchdog, abort_socket
from .sessions import DEADLINES, Sessions
from .settings import Settings

__all__ = ["ROUND_TRIP_ERRORS", "ListeningSession"]

logger = logging.getLogger(__name__)

ROUND_TRIP_ERRORS = (psycopg.Error, OSError, BackendUnavailable, ConfigError)
"""What a round trip of the listening session raises when it fails (not a bug)."""

Step = Callable[["ListeningSession", "psycopg.Connection[Any]"], None]
"""A listener's part of a wake-up: ``step(session, conn)``."""


class Listener(Protocol):
    """What a listening session asks of a listener attached to it: a broadcaster's
    :class:`~rselection.postgres.broadcast.listener.Listener` (which calls the session, so
    the session names only what it needs of it)."""

    sessions: Sessions
    settings: Settings
    generation: int
    channel: str
    retry_at: float
    listening: bool
    behind: bool

    def keep_listening(self) -> bool:
        """Whether the session should LISTEN for it (it has readers, or a position)."""

    def resolve(self, session: ListeningSession, conn: psycopg.Connection[Any]) -> None:
        """Find its table and channel on the session's connection ``conn``."""

    def begin(self, session: ListeningSession, conn: psycopg.Connection[Any]) -> None:
        """Take its position on a connection that now LISTENs on its channel."""

    def catch_up(self, session: ListeningSession, conn: psycopg.Connection[Any]) -> None:
        """Fetch what it missed (after a wake-up or a silence)."""

    def fetch_next(self, session: ListeningSession, conn: psycopg.Connection[Any]) -> None:
        """Fetch its next page (it was behind)."""

    def on_notify(self, payload: str, pid: int = 0) -> bool:
        """Take a notification of its channel: whether to fetch."""

    def fail(self, exc: BaseException) -> None:
        """Its own step failed with ``exc`` (the session goes on)."""

    def lose(self, generation: int) -> None:
        """The session's connection ``generation`` broke."""

    def release(self) -> None:
        """The session stopped listening for it."""


#: Marks the threads of the listening sessions (see :meth:`ListeningSession.in_a_thread`).
_THREAD = threading.local()


class ListeningSession:
    """The thread and Postgres session that listen for every broadcaster of a process on
    one connection string. Get it with :meth:`attach`; safe from any thread.

    Args:
        conninfo: the connection string (the registry key, with the process id).
        where: the server, for messages.
        tick: how often the round-trip watchdog checks, seconds.
    """

    _registry: ClassVar[dict[tuple[int, str], ListeningSession]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, conninfo: str, where: str, tick: float) -> None:
        """Create the session's state and thread; the first reader starts it (:meth:`want`)."""
        self.conninfo = conninfo
        self.where = where
        self._tick = tick
        self.deadlines: IoWatchdog | None = None
        """The round-trip watchdog, while the thread runs."""
        self.io_timeout = 1.0
        """Bound of one round trip: the longest ``io_timeout`` of the listeners."""
        self.generation = 0
        """Bumped by every connect: listeners resolved on an older one resolve again."""
        self._state = threading.Lock()  # guards _listeners and _started
        self._listeners: list[Listener] = []
        self._started = False
        self._stop = threading.Event()
        self._conn_lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._listened: set[str] = set()  # NOTIFY channels LISTENed on the connection
        # Wakes the thread from its wait on the session's socket.
        self._wakeup = Wakeup()
        self._wakeup.open()
        self.thread = threading.Thread(
            target=self._run, name="rselection-broadcast-listen", daemon=True
        )

    # -- listeners -----------------------------------------------------------------------

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child (see :mod:`rselection.forks`): the registry's lock is made
        anew (a parent's thread may have held it). The parent's sessions stay in the
        registry, under its process id, and their listeners forget them: their sockets
        (the Postgres session and the wake-up pair) are never used here."""
        cls._registry_lock = threading.Lock()

    @classmethod
    def attach(cls, listener: Listener) -> ListeningSession:
        """The session of this process and ``listener``'s conninfo, with it attached."""
        sessions = listener.sessions
        key = (os.getpid(), sessions.conninfo)
        with cls._registry_lock:
            session = cls._registry.get(key)
            if session is None:
                tick = min(0.5, sessions.settings.io_timeout / 4)
                session = cls._registry[key] = cls(sessions.conninfo, sessions.where, tick)
            with session._state:
                session._listeners.append(listener)
        session.wake()
        return session

    def detach(self, listener: Listener) -> bool:
        """Forget ``listener``; return whether it was the last (the session then stops)."""
        key = (os.getpid(), self.conninfo)
        with self._registry_lock, self._state:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)
            last = not self._listeners and not self._stop.is_set()
            if last:
                if self._registry.get(key) is self:
                    del self._registry[key]
                self._stop.set()
            started = self._started
        if last and not started:
            self._close_wake_pair()  # no thread ever ran: nothing else to end
        elif last:
            self.wake()
            with self._conn_lock:
                if self._conn is not None:
                    abort_socket(self._conn)
        else:
            # It may have held the process's last reader: the thread looks again now,
            # and closes its Postgres session if no listener left has readers.
            self.wake()
        return last

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (not when called from it, nor if it never ran)."""
        with self._state:
            started = self._started
        if started and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def want(self) -> None:
        """A listener has readers: start the thread (it connects) if it is not running,
        else wake it to LISTEN for them."""
        with self._state:
            if not self._started and not self._stop.is_set():
                self._started = True
                self.thread.start()
        self.wake()

    def wake(self) -> None:
        """Make the thread look at its listeners now (a reader arrived, or one left)."""
        self._wakeup.wake()

    @staticmethod
    def in_a_thread() -> bool:
        """Whether the caller runs in the thread of a listening session (a receiver, an
        ``on_gap`` hook), which delivers every broadcaster's messages of its process
        and connection string: it must not wait for anything that takes a round trip."""
        return bool(getattr(_THREAD, "listening", False))

    def position(self, listener: Listener) -> None:
        """Start ``listener`` now, from the session's own thread: a receiver subscribed
        to a broadcaster that had no reader. Resolve its table, LISTEN, take its
        position, so that every message committed after the subscription returns is
        delivered (the thread cannot wait for itself). A failed round trip is logged;
        the thread's loop then goes on as usual (it reconnects when the connection
        broke, and starts the listener from the newest row then)."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken or self._stop.is_set():
            return
        try:
            if listener.generation != self.generation:
                self._step(conn, listener, listener.resolve)
            if listener.generation != self.generation:
                return  # failed on its own (logged): retried by the loop
            self._listen(conn, listener.channel)
            if not listener.listening:
                self._step(conn, listener, listener.begin)
        except ROUND_TRIP_ERRORS as exc:
            logger.warning(
                "broadcast: a subscription made in the listener thread could not start "
                "listening on %s (%s); messages are delivered from when it reconnects",
                self.where,
                listener.sessions.error_text(exc),
            )

    def _listen(self, conn: psycopg.Connection[Any], channel: str) -> None:
        if channel not in self._listened:
            with self.guard(conn):
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            self._listened.add(channel)

    def guard(self, conn: psycopg.Connection[Any]) -> contextlib.AbstractContextManager[list[bool]]:
        """Bound a round trip on ``conn`` by :attr:`io_timeout` (see :data:`~.sessions.DEADLINES`);
        from the session's thread."""
        assert self.deadlines is not None, "round trips run in the session's thread"
        return self.deadlines.guard(conn, self.io_timeout)

    def _attached(self) -> list[Listener]:
        with self._state:
            return list(self._listeners)

    def _close_wake_pair(self) -> None:
        self._wakeup.close()

    @staticmethod
    def _reading(listeners: list[Listener]) -> list[Listener]:
        """The listeners whose broadcasters have readers (the others forget their
        position, see :meth:`Listener.keep_listening`)."""
        return [listener for listener in listeners if listener.keep_listening()]

    def _idle(self) -> None:
        """Wait, with no session, until :meth:`wake` is called (a reader or a detach)."""
        wake = self._wakeup.socket
        if wake is not None and not self._wakeup.pending:
            select.select([wake], [], [])
        self._wakeup.clear()

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        down_since: float | None = None
        last_error = ""

        def healthy() -> None:
            nonlocal failures, down_since, last_error
            if down_since is not None:
                logger.info(
                    "broadcast listener reconnected to %s after %.1f s",
                    self.where,
                    time.monotonic() - down_since,
                )
            failures, down_since, last_error = 0, None, ""

        _THREAD.listening = True
        self.deadlines = IoWatchdog(DEADLINES, tick=self._tick)
        try:
            while not self._stop.is_set():
                listeners = self._attached()
                if not listeners:
                    break
                if not self._reading(listeners):
                    # Nobody in the process reads: hold no session until someone does.
                    self._idle()
                    continue
                # The session of the most patient broadcaster: its timeouts bound all.
                chosen = max(listeners, key=lambda each: each.settings.io_timeout).sessions
                self.io_timeout = chosen.settings.io_timeout
                conn: psycopg.Connection[Any] | None = None
                released = False
                try:
                    conn = chosen.connect("listen for broadcasts", deadlines=self.deadlines)
                    with self._conn_lock:
                        if self._stop.is_set():
                            break
                        self._conn = conn
                    self.generation += 1
                    released = self._serve(conn, healthy)
                except ROUND_TRIP_ERRORS as exc:
                    if self._stop.is_set():
                        break
                    failures += 1
                    detail = chosen.error_text(exc)
                    if down_since is None:
                        down_since = time.monotonic()
                        logger.warning(
                            "broadcast listener lost its connection to %s (%s); reconnecting "
                            "with backoff, messages published meanwhile are fetched afterwards",
                            self.where,
                            detail,
                        )
                    elif detail != last_error:
                        logger.warning(
                            "broadcast listener cannot reconnect to %s: %s", self.where, detail
                        )
                    last_error = detail
                except Exception:
                    # A bug must not silently end delivery: log it and start over.
                    failures += 1
                    if down_since is None:
                        down_since = time.monotonic()
                    logger.exception("broadcast listener failed; restarting it")
                finally:
                    for listener in self._attached():
                        if released:
                            listener.release()
                        else:
                            listener.lose(self.generation)
                    with self._conn_lock:
                        self._conn = None
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            conn.close()
                if failures:
                    self._stop.wait(backoff(failures))
        finally:
            self.deadlines.close()
            self._close_wake_pair()

    def _serve(self, conn: psycopg.Connection[Any], healthy: Callable[[], None]) -> bool:
        """LISTEN for the tables whose listeners have readers, hand them their NOTIFYs,
        poll on silence. Returns ``True`` once no listener has readers (the session is
        then closed), ``False`` when the session stops; raises when the connection fails.
        """
        generation = self.generation
        listened = self._listened
        listened.clear()  # a new connection LISTENs on nothing yet
        quiet_since = time.monotonic()
        first = True
        while not self._stop.is_set():
            listeners = self._attached()
            if not listeners:
                return False
            reading = self._reading(listeners)
            if not reading:
                # The last reader of the process has gone (it woke this thread): release
                # the session now rather than LISTEN for nobody.
                return True
            self.io_timeout = max(each.settings.io_timeout for each in listeners)
            probe = min(each.settings.probe_interval for each in listeners)
            now = time.monotonic()
            for listener in listeners:
                if listener.generation != generation and now >= listener.retry_at:
                    self._step(conn, listener, listener.resolve)
            wanted: dict[str, list[Listener]] = {}
            for listener in reading:
                if listener.generation == generation:
                    wanted.setdefault(listener.channel, []).append(listener)
            for channel in sorted(wanted.keys() - listened):
                self._listen(conn, channel)
            for channel in sorted(listened - wanted.keys()):
                # No reader of that table is left: stop waking for its every message.
                with self.guard(conn):
                    conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
                listened.discard(channel)
            for group in wanted.values():
                for listener in group:
                    if not listener.listening:
                        # LISTEN came first: nothing committed after its fetch is missed.
                        self._step(conn, listener, listener.begin)
            if first:
                healthy()
                first = False
            # Listeners left behind by their last page fetch their next one this turn,
            # without waiting: one page each per turn, so a new reader (above) starts
            # within a turn however long another listener's catch-up is.
            fetch: list[Listener] = [
                each
                for group in wanted.values()
                for each in group
                if each.listening and each.behind
            ]
            wait = 0.0 if fetch else max(0.0, quiet_since + probe - time.monotonic())
            retry = [each.retry_at for each in listeners if each.generation != generation]
            if retry:
                wait = min(wait, max(0.0, min(retry) - time.monotonic()))
            notes, woken = self._next(conn, wait)
            if self._stop.is_set():
                return False
            if notes or fetch:
                for note in notes:
                    for listener in wanted.get(note.channel, ()):
                        if (
                            listener.listening
                            and listener.on_notify(note.payload, note.pid)
                            and listener not in fetch
                        ):
                            fetch.append(listener)
                for listener in fetch:
                    self._step(conn, listener, listener.fetch_next)
                quiet_since = time.monotonic()
            elif not woken and time.monotonic() >= quiet_since + probe:
                # Silence: poll. The round trips are bounded by the watchdog, so a
                # half-open connection fails here instead of waiting forever.
                polled = [each for group in wanted.values() for each in group if each.listening]
                for listener in polled:
                    self._step(conn, listener, listener.catch_up)
                if not polled:
                    with self.guard(conn):
                        conn.execute("SELECT 1")
                quiet_since = time.monotonic()
        return False

    def _step(self, conn: psycopg.Connection[Any], listener: Listener, step: Step) -> None:
        """Run one listener's step; a failure of its own (its table is missing, a
        statement timed out) is its alone, a broken connection ends the session."""
        try:
            step(self, conn)
        except ROUND_TRIP_ERRORS as exc:
            if conn.broken or conn.closed or self._stop.is_set():
                raise
            listener.fail(exc)

    def _next(self, conn: psycopg.Connection[Any], wait: float) -> tuple[list[Any], bool]:
        """The NOTIFYs that arrive within ``wait`` seconds, and whether :meth:`wake` was
        called meanwhile (then it returns at once)."""
        notes = list(conn.notifies(timeout=0.0))  # received during the last statements
        if notes:
            return notes, False
        fd = conn.fileno()
        wake = self._wakeup.socket
        wake_fd = wake.fileno() if wake is not None else None
        ready, _, _ = select.select([fd] if wake_fd is None else [fd, wake_fd], [], [], wait)
        woken = wake_fd is not None and wake_fd in ready
        if woken:
            self._wakeup.clear()
        if fd in ready:
            notes = list(conn.notifies(timeout=0.0))
        return notes, woken


forks.register(ListeningSession)
