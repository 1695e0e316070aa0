"""The sessions of :class:`~rselection.postgres.PostgresBroadcaster`: opened and bounded.

The writer keeps one session of its own, and the listeners of a process share one per
connection string (:mod:`.listening`); :class:`Sessions` opens them (keepalives,
timeouts, tables ready). What they need around them lives here too: bounding each round
trip (:class:`Deadlines`), aborting a socket a thread is blocked on, reconnect backoff,
and error text safe to log.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from ...errors import BackendUnavailable
from .._conn import describe_conninfo, open_session, redact, shutdown_socket
from ..schema import create_tables
from .outbox import Outbox
from .settings import Settings

__all__ = ["Deadlines", "Sessions", "abort_socket", "backoff", "first_line"]

logger = logging.getLogger(__name__)

#: Reconnect backoff: the first wait, doubling to the cap, each jittered to 50-100%.
_BACKOFF_FIRST = 0.1
_BACKOFF_CAP = 5.0


def backoff(failures: int) -> float:
    """Capped exponential backoff with jitter after ``failures`` failed attempts (>= 1)."""
    base = min(_BACKOFF_CAP, _BACKOFF_FIRST * float(2 ** min(failures - 1, 16)))
    return base * random.uniform(0.5, 1.0)


def abort_socket(conn: psycopg.Connection[Any]) -> None:
    """Shut ``conn``'s socket down so a thread blocked on it wakes with an error at once.

    The descriptor itself stays open (psycopg closes it later), so it cannot be reused by
    another socket while the blocked thread still refers to it.
    """
    try:
        fd = conn.pgconn.socket
    except (OSError, psycopg.Error):
        return
    shutdown_socket(fd)


class Deadlines:
    """Aborts a connection whose round trip overruns its bound, without a wake-up per call.

    Like :class:`~rselection.postgres._conn.IoWatchdog` (a peer that accepts bytes and
    never answers must not hang a thread forever), but arming is a plain assignment and
    one thread checks every ``tick`` seconds: a publish costs no extra thread switch,
    which matters at thousands of messages a second. A round trip is aborted between
    ``bound`` and ``bound + tick`` seconds after it started.

    Args:
        tick: seconds between checks.
    """

    def __init__(self, tick: float) -> None:
        self._tick = tick
        self._armed: dict[int, tuple[float, psycopg.Connection[Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="rselection-broadcast-deadlines", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
        """Abort ``conn``'s socket if the ``with`` body runs longer than about ``seconds``."""
        key = threading.get_ident()
        self._armed[key] = (time.monotonic() + seconds, conn)
        try:
            yield
        finally:
            # The checker aborts under the lock, and only connections still armed: once
            # disarmed here, a connection is never touched again (no reused socket hit).
            with self._lock:
                self._armed.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            with self._lock:
                for key, (deadline, conn) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[key]
                        logger.debug("broadcast: aborting a round trip that overran its bound")
                        abort_socket(conn)

    def close(self) -> None:
        """Stop the checker thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self._tick + 5.0)


def first_line(exc: BaseException, conninfo: str) -> str:
    """The first line of an error, without the password of ``conninfo``, for logs."""
    text = str(exc).strip()
    return redact(text.splitlines()[0], conninfo) if text else type(exc).__name__


class Sessions:
    """Opens the broadcaster's sessions and bounds their round trips.

    Args:
        conninfo: the connection string every session uses.
        outbox: the outbox tables (created on connect with ``create_tables``).
        settings: the broadcaster's settings (timeouts, ``synchronous_commit``).
    """

    def __init__(self, conninfo: str, outbox: Outbox, settings: Settings) -> None:
        """Start the round-trip watchdog; opens nothing yet."""
        self.conninfo = conninfo
        self.where = describe_conninfo(conninfo)
        self.outbox = outbox
        self.settings = settings
        self.deadlines = Deadlines(min(0.5, settings.timeout / 4))

    def error_text(self, exc: BaseException) -> str:
        """The first line of ``exc``, without the password, for logs and messages."""
        return first_line(exc, self.conninfo)

    def connect(
        self,
        what: str,
        *,
        listen: bool,
        tables: bool = True,
        deadlines: Deadlines | None = None,
    ) -> psycopg.Connection[Any]:
        """Open an autocommit session with keepalives and timeouts, tables ready.

        Args:
            what: what the session is for, for messages (``"publish broadcasts"``).
            listen: whether it will wait for NOTIFYs (its idle waits are longer).
            tables: create the tables (with ``create_tables``); the shared listening
                session prepares each broadcaster's tables itself (:meth:`prepare`).
            deadlines: the watchdog that bounds the session's first round trips; this
                broadcaster's own by default.

        Raises:
            BackendUnavailable: the server cannot be reached.
            ConfigError: the tables are missing or newer than this release.
            psycopg.Error: preparing the session failed.
        """
        settings = self.settings
        bound = settings.probe_interval + settings.timeout if listen else settings.timeout
        try:
            conn = open_session(
                self.conninfo,
                application_name="rselection:broadcast",
                connect_timeout=settings.timeout,
                # A silent network ends a blocked call within about `bound` seconds even
                # where the watchdog is not armed (the listener's idle wait).
                keepalive_idle=bound / 2,
                user_timeout=settings.timeout + 1.0,
                # Publish parameters are sent as UTF-8 bytes (see Writer.write).
                client_encoding="UTF8",
            )
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"cannot {what}: {exc}") from exc
        try:
            with (deadlines or self.deadlines).guard(conn, settings.timeout):
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, false),"
                    " set_config('idle_session_timeout', '0', false),"
                    " set_config('synchronous_commit', %s, false)",
                    (
                        f"{math.ceil(settings.timeout * 1000)}ms",
                        "on" if settings.synchronous_commit else "off",
                    ),
                )
                if tables:
                    self.prepare(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def prepare(self, conn: psycopg.Connection[Any]) -> None:
        """Create (or upgrade) the outbox tables on ``conn`` when ``create_tables`` is set.

        Raises:
            ConfigError: the tables are newer than this release.
            BackendUnavailable: the migration could not run within ``timeout``.
        """
        if self.settings.create_tables:
            create_tables(conn, broadcast=self.outbox.table, timeout=self.settings.timeout)

    def close(self) -> None:
        """Stop the round-trip watchdog."""
        self.deadlines.close()
