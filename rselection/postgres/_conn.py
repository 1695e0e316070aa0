"""Connection helpers shared by the Postgres backends.

Nothing here is public API; the names are stable enough for the CLI and the other
Postgres modules of this package to use them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..errors import BackendUnavailable, ConfigError

__all__ = [
    "IoWatchdog",
    "Keepalives",
    "check_conninfo",
    "describe_conninfo",
    "redact",
    "server_keepalives",
    "server_user_timeout",
    "unavailable",
]

logger = logging.getLogger(__name__)

#: Linux refuses more keepalive probes than this (``TCP_KEEPCNT``).
_MAX_PROBES = 100

#: How much longer than a leader's wind-down the server keeps its silent session: covers
#: the time a renewal spends on the way to the server and the granularity of the timers.
SESSION_MARGIN = 1.0


@dataclass(frozen=True)
class Keepalives:
    """TCP keepalive settings, in whole seconds: first probe, probe interval, probes."""

    idle: int
    interval: int
    count: int

    @property
    def total(self) -> int:
        """Seconds of silence after which the peer is declared dead."""
        return self.idle + self.interval * self.count


def server_keepalives(hold: float) -> Keepalives:
    """Server-side keepalives that never drop a live leader's session too early.

    The server may end a session whose client went silent after ``idle + interval *
    count`` seconds (counted from the last thing it received). A cut-off leader ends its
    term ``renew_deadline`` after it *sent* its last successful renewal, and its tasks
    are joined within ``stop_grace`` after that; the server received that renewal later
    than it was sent. So with ``hold = renew_deadline + stop_grace``, ``idle + interval *
    count > hold + SESSION_MARGIN`` guarantees that the leader's tasks have ended before
    the server frees its advisory lock. The total is kept just above that bound so a
    vanished host (no FIN) still frees the lock as early as is safe.

    Args:
        hold: seconds the session must outlive a silent leader's last renewal
            (``renew_deadline + stop_grace``).
    """
    idle = max(1, math.ceil(hold / 2))
    need = hold + SESSION_MARGIN - idle  # interval * count must exceed this
    interval = max(1, math.ceil(need / _MAX_PROBES))
    count = max(1, math.floor(need / interval) + 1)
    ka = Keepalives(idle, interval, count)
    assert ka.total > hold + SESSION_MARGIN, ka
    return ka


def server_user_timeout(hold: float) -> int:
    """The server-side ``tcp_user_timeout`` of a keeper session, in milliseconds.

    It bounds how long the server's kernel keeps retrying data that the client does not
    acknowledge (a NOTIFY sent into a partition) before it drops the connection, and,
    with keepalives on, how long unanswered probes may go on. It equals the keepalive
    total of :func:`server_keepalives`, so both ways of losing a silent client end the
    session at the same, safe, time: later than ``hold + SESSION_MARGIN`` after the
    leader's last renewal, and independent of the kernel's ``tcp_retries2`` (which
    administrators lower for faster failure detection; 0 would leave the bound to it).

    Args:
        hold: as for :func:`server_keepalives`.
    """
    return server_keepalives(hold).total * 1000


def _params(conninfo: str) -> dict[str, Any]:
    try:
        return dict(conninfo_to_dict(conninfo))
    except psycopg.Error:
        return {}


def check_conninfo(conninfo: str) -> None:
    """Raise :class:`ConfigError` when ``conninfo`` is not a valid libpq string or URI.

    The message never repeats the string, which may hold a password.

    Args:
        conninfo: a libpq ``key=value`` string or ``postgresql://`` URI.
    """
    if not isinstance(conninfo, str):
        raise ConfigError(f"conninfo must be a str, got {type(conninfo).__name__}")
    try:
        conninfo_to_dict(conninfo)
    except psycopg.Error:
        raise ConfigError(
            "the connection string cannot be parsed; write it as 'host=... port=... "
            "dbname=... user=...' or 'postgresql://user@host:port/dbname'"
        ) from None


def describe_conninfo(conninfo: str) -> str:
    """Name the server a connection string points at, without its password.

    Returns ``"host=H port=P dbname=D user=U"`` (defaults from the ``PG*`` environment
    variables and libpq's own defaults), suitable for error messages and logs.

    Args:
        conninfo: a libpq ``key=value`` string or ``postgresql://`` URI.
    """
    params = _params(conninfo)
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST")
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = params.get("dbname") or os.environ.get("PGDATABASE")
    user = params.get("user") or os.environ.get("PGUSER")
    parts = [f"host={host or 'localhost (default socket)'}", f"port={port}"]
    if dbname:
        parts.append(f"dbname={dbname}")
    if user:
        parts.append(f"user={user}")
    return " ".join(parts)


def redact(text: str, conninfo: str) -> str:
    """Return ``text`` with the password of ``conninfo`` (if any) replaced by ``***``.

    Args:
        text: a message that may quote the connection string (a driver error).
        conninfo: the connection string whose password must not leak.
    """
    password = _params(conninfo).get("password") or os.environ.get("PGPASSWORD")
    if password:
        text = text.replace(str(password), "***")
    return text


def unavailable(what: str, conninfo: str, exc: BaseException) -> BackendUnavailable:
    """Build the :class:`BackendUnavailable` for a failed ``what`` against ``conninfo``.

    The message names the server (never the password) and the driver's first line.

    Args:
        what: what was attempted, e.g. ``"connect"``.
        conninfo: the connection string used.
        exc: the driver error; chain it with ``raise ... from exc``.
    """
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return BackendUnavailable(
        f"cannot {what} ({describe_conninfo(conninfo)}): {redact(detail, conninfo)}"
    )


class IoWatchdog:
    """Bounds blocking round trips by shutting a connection's socket down when they overrun.

    TCP keepalives and ``tcp_user_timeout`` bound a silent *network*, but not a peer
    that accepts bytes and never answers (a stuck proxy or pooler): a query could then
    block forever, and with it the thread that must stop the leader. Each guarded call
    registers a deadline; one thread (started on first use, ended by :meth:`close`)
    shuts the socket down when a deadline passes, so the blocked call fails at once with
    a connection error instead.

    Args:
        name: used in the thread name.
    """

    def __init__(self, name: str) -> None:
        """Create an idle watchdog; its thread starts on the first :meth:`guard`."""
        self._name = name
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, int, Callable[[], bool] | None]] = {}
        self._fired: set[int] = set()
        self._next = 0
        self._thread: threading.Thread | None = None
        self._generation = 0  # bumped by close(): tells the current thread to end

    @contextlib.contextmanager
    def guard(
        self,
        conn: psycopg.Connection[Any],
        seconds: float,
        *,
        held: Callable[[], bool] | None = None,
    ) -> Iterator[list[bool]]:
        """Abort ``conn``'s socket if the ``with`` body runs longer than ``seconds``.

        Yields a one-element list that holds ``True`` afterwards when the watchdog fired
        (the body then failed with a connection error).

        Args:
            conn: the connection whose round trip is bounded.
            seconds: the bound.
            held: while this returns ``True`` an overrun round trip is left alone (its
                session must not end yet); it is aborted once ``held()`` turns false and
                :meth:`recheck` is called.
        """
        fired = [False]
        fd = conn.pgconn.socket
        with self._cond:
            token = self._next
            self._next += 1
            self._armed[token] = (time.monotonic() + seconds, fd, held)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run,
                    args=(self._generation,),
                    name=f"rselection-io-{self._name}",
                    daemon=True,
                )
                self._thread.start()
            self._cond.notify_all()
        try:
            yield fired
        finally:
            # The watchdog shuts sockets down while holding the condition, and the
            # socket cannot be closed before this disarm: no risk of hitting a reused fd.
            with self._cond:
                self._armed.pop(token, None)
                if token in self._fired:
                    self._fired.discard(token)
                    fired[0] = True

    def recheck(self) -> None:
        """Look at overrun round trips again (a ``held`` guard may be released now)."""
        with self._cond:
            self._cond.notify_all()

    def _run(self, generation: int) -> None:
        with self._cond:
            while generation == self._generation:
                now = time.monotonic()
                wait = 3600.0
                for token, (deadline, fd, held) in list(self._armed.items()):
                    if deadline > now:
                        wait = min(wait, deadline - now)
                    elif held is None or not held():
                        del self._armed[token]
                        self._fired.add(token)
                        _shutdown(fd)
                    # else overrun but held: parked until recheck()
                self._cond.wait(wait)

    def close(self) -> None:
        """Stop the thread (idempotent); a later :meth:`guard` starts a new one."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._generation += 1
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)


def _shutdown(fd: int) -> None:
    """Shut the socket behind ``fd`` down (both ways) without closing ``fd`` itself."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()
    logger.debug("aborted a round trip that overran its bound (fd %s)", fd)
