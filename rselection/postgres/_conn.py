"""Connections of the Postgres backend: where each object gets its sessions.

Every Postgres object takes a ``conninfo``: a libpq connection string or URI, a
``psycopg.Connection``, or a pool (anything with a ``connection()`` context manager,
such as ``psycopg_pool.ConnectionPool``). :class:`~.connections.Connections` lends
connections from any of the three for one call each; :func:`session_conninfo` turns any
of the three into a connection string for objects that need sessions of their own (LISTEN). Also the
server-side keepalive arithmetic of the keeper session and error texts that never show
a password (:mod:`rselection.redaction`).

Nothing here is public API; the names are stable enough for the CLI and the other
Postgres modules of this package to use them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus

from ..errors import BackendUnavailable, ConfigError, first_line
from ..redaction import check_userinfo, misread, redact, redact_dsn

__all__ = [
    "IoWatchdog",
    "Keepalives",
    "abort_socket",
    "check_conninfo",
    "conninfo_kind",
    "connection_is_usable",
    "describe_conninfo",
    "server_keepalives",
    "server_user_timeout",
    "session_conninfo",
    "open_session",
    "per_call_source",
    "shutdown_socket",
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


@functools.lru_cache(maxsize=64)
def _parsed(conninfo: str) -> tuple[tuple[str, Any], ...] | None:
    """``conninfo_to_dict``, once per string (a sharded leader builds thousands of objects
    on one); ``None`` when it cannot be parsed."""
    try:
        return tuple(conninfo_to_dict(conninfo).items())
    except (psycopg.Error, ValueError):  # ValueError: bytes that are not UTF-8 (%80)
        return None


def _params(conninfo: str) -> dict[str, Any]:
    return dict(_parsed(conninfo) or ())


def check_conninfo(conninfo: str, owner: str | None = None) -> None:
    """Raise :class:`ConfigError` when ``conninfo`` is not a valid libpq string or URI.

    A URI whose password holds an unescaped ``/`` or ``@`` is refused too: libpq would
    read pieces of the password as the host, port or database, and its messages would
    quote them. The message never shows the password, nor the string unredacted.

    Args:
        conninfo: a libpq ``key=value`` string or ``postgresql://`` URI.
        owner: the class or function that got it, for the message.
    """
    if not isinstance(conninfo, str):
        raise ConfigError(f"conninfo must be a str, got {type(conninfo).__name__}")
    check_userinfo(
        conninfo, f"{owner}: the connection string" if owner else "the connection string"
    )
    if _parsed(conninfo) is None:
        raise ConfigError(
            "the connection string cannot be parsed; write it as 'host=... port=... "
            "dbname=... user=...' or 'postgresql://user@host:port/dbname'"
        )


def describe_conninfo(conninfo: str) -> str:
    """Name the server a connection string points at, without its password.

    Returns ``"host=H port=P dbname=D user=U"`` (defaults from the ``PG*`` environment
    variables and libpq's own defaults), suitable for error messages and logs. A URI
    that libpq misreads (:func:`~rselection.redaction.misread`), whose host or port may
    be pieces of its password, is named by the URI redacted instead.

    Args:
        conninfo: a libpq ``key=value`` string or ``postgresql://`` URI.
    """
    if misread(conninfo):
        return redact_dsn(conninfo)
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


def unavailable(what: str, conninfo: str, exc: BaseException) -> BackendUnavailable:
    """Build the :class:`BackendUnavailable` for a failed ``what`` against ``conninfo``.

    The message names the server (never the password) and the driver's first line.

    Args:
        what: what was attempted, e.g. ``"connect"``.
        conninfo: the connection string used.
        exc: the driver error; chain it with ``raise ... from exc``.
    """
    detail = first_line(exc)
    return BackendUnavailable(
        f"cannot {what} ({describe_conninfo(conninfo)}): {redact(detail, conninfo)}"
    )


IDLE_EXIT = 1.0
"""Seconds an :class:`IoWatchdog` thread waits with nothing to watch before it ends."""


class IoWatchdog:
    """Bounds blocking round trips by shutting a connection's socket down when they overrun.

    TCP keepalives and ``tcp_user_timeout`` bound a silent *network*, but not a peer
    that accepts bytes and never answers (a stuck proxy or pooler): a query could then
    block forever, and with it the thread that must stop the leader. Each guarded call
    registers a deadline; one thread (started on first use, ended by :meth:`close`)
    shuts the socket down when a deadline passes, so the blocked call fails at once with
    a connection error instead. The thread ends after :data:`IDLE_EXIT` seconds with
    nothing to watch (and the next guard starts a new one), so an object nobody closed
    keeps no thread.

    By default every guard wakes the thread, which aborts a round trip right at its
    bound. With ``tick``, a guard does not wake it (no thread switch per call, which
    matters at thousands of round trips a second: the broadcaster's publishes) and the
    thread looks every ``tick`` seconds instead: a round trip is aborted between its
    bound and ``tick`` seconds later.

    Args:
        name: used in the thread name.
        tick: seconds between the thread's checks; ``None``: checks at each deadline.
    """

    def __init__(self, name: str, *, tick: float | None = None) -> None:
        """Create an idle watchdog; its thread starts on the first :meth:`guard`."""
        self._name = name
        self._tick = tick
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, psycopg.Connection[Any], Callable[[], bool] | None]]
        self._armed = {}
        self._fired: set[int] = set()
        self._next = 0
        self._thread: threading.Thread | None = None
        self._generation = 0  # bumped by close(): tells the current thread to end
        self._idle_since = time.monotonic()  # when the last guard was disarmed

    @property
    def tick(self) -> float | None:
        """Seconds between the thread's checks (``None``: it wakes at each deadline)."""
        return self._tick

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
        with self._cond:
            token = self._next
            self._next += 1
            self._armed[token] = (time.monotonic() + seconds, conn, held)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run,
                    args=(self._generation,),
                    name=f"rselection-io-{self._name}",
                    daemon=True,
                )
                self._thread.start()
            if self._tick is None:
                self._cond.notify_all()
        try:
            yield fired
        finally:
            # The watchdog aborts sockets while holding the condition, and only those of
            # guards still armed: once disarmed here, a connection is never touched
            # again (no reused socket hit).
            with self._cond:
                self._armed.pop(token, None)
                if not self._armed:
                    self._idle_since = time.monotonic()
                if token in self._fired:
                    self._fired.discard(token)
                    fired[0] = True

    def recheck(self) -> None:
        """Look at overrun round trips again (a ``held`` guard may be released now)."""
        with self._cond:
            self._cond.notify_all()

    def _run(self, generation: int) -> None:
        # A guard wakes this thread only without a tick: with one, no wait is longer.
        most = IDLE_EXIT if self._tick is None else min(IDLE_EXIT, self._tick)
        with self._cond:
            while generation == self._generation:
                now = time.monotonic()
                if not self._armed:
                    # Nothing to watch: end after a while, so an object nobody closed
                    # keeps no thread; the next guard() starts a new one.
                    idle = now - self._idle_since
                    if idle >= IDLE_EXIT:
                        self._thread = None
                        return
                    self._cond.wait(min(most, IDLE_EXIT - idle))
                    continue
                # Wake at least every IDLE_EXIT to notice that nothing is armed any
                # more (a disarm does not wake this thread: calls stay cheap).
                wait = most
                for token, (deadline, conn, held) in list(self._armed.items()):
                    if deadline > now:
                        wait = min(wait, deadline - now)
                    elif held is None or not held():
                        del self._armed[token]
                        self._fired.add(token)
                        abort_socket(conn)
                        logger.debug("%s: aborted a round trip that overran its bound", self._name)
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


def abort_socket(conn: psycopg.Connection[Any]) -> None:
    """Shut ``conn``'s socket down so a thread blocked on it wakes with an error at once.

    The descriptor itself stays open (psycopg closes it later), so it cannot be reused by
    another socket while the blocked thread still refers to it. A connection closed
    already has no socket to shut down.
    """
    try:
        fd = conn.pgconn.socket
    except (OSError, psycopg.Error):
        return
    shutdown_socket(fd)


def shutdown_socket(fd: int) -> None:
    """Shut the socket behind ``fd`` down (both ways) without closing ``fd`` itself.

    A thread blocked on it wakes with an error at once; the descriptor stays open (its
    owner closes it later), so no other socket can reuse it meanwhile.
    """
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


def conninfo_kind(source: object, owner: str) -> str:
    """``"conninfo"``, ``"connection"`` or ``"pool"``; else raise :class:`ConfigError`."""
    if source is None or (isinstance(source, str) and not source.strip()):
        raise ConfigError(
            f"{owner} needs a conninfo: a connection string (postgresql://...), a psycopg "
            f"Connection or a connection pool, got {source!r}"
        )
    if isinstance(source, str):
        check_conninfo(source, owner)
        return "conninfo"
    if isinstance(source, psycopg.Connection):
        if source.closed:
            raise ConfigError(f"{owner} was given a closed psycopg Connection")
        return "connection"
    if isinstance(source, psycopg.AsyncConnection):
        raise ConfigError(
            f"{owner} needs a synchronous psycopg Connection, got an AsyncConnection: pass "
            "a connection string instead"
        )
    if callable(getattr(source, "connection", None)):
        method = getattr(type(source), "connection", None)
        # An async pool's connection() is an async context manager (its function, once
        # unwrapped, an async generator): refused here, not at its first use.
        if method is not None and (
            inspect.iscoroutinefunction(method)
            or inspect.isasyncgenfunction(inspect.unwrap(method))
        ):
            raise ConfigError(
                f"{owner} needs a synchronous pool, got {type(source).__name__}: pass a "
                "psycopg_pool.ConnectionPool or a connection string instead"
            )
        conninfo = getattr(source, "conninfo", None)
        if isinstance(conninfo, str):
            # Its connections fail anyway, with messages quoting pieces of the password.
            check_userinfo(conninfo, f"{owner}: the pool's connection string")
        return "pool"
    raise ConfigError(
        f"{owner} needs a conninfo: a connection string, a psycopg Connection or a pool "
        f"with a connection() context manager (psycopg_pool.ConnectionPool), got "
        f"{type(source).__name__}"
    )


def _libpq_keywords() -> frozenset[str]:
    return frozenset(
        opt.keyword.decode() for opt in psycopg.pq.Conninfo.get_defaults() if opt.keyword
    )


def session_conninfo(source: object, owner: str) -> str:
    """A connection string for sessions of their own, from any kind of ``conninfo``.

    For objects that cannot borrow a connection per call (a broadcaster LISTENs on a
    session it keeps): a string is returned as is; a ``psycopg.Connection`` gives the
    parameters it connected with (its password included); a pool gives its
    ``conninfo`` and the libpq parameters among its ``kwargs``.

    Args:
        source: a connection string, a ``psycopg.Connection`` or a pool.
        owner: the class asking, for messages (``"PostgresBroadcaster"``).

    Raises:
        ConfigError: ``source`` is none of the three, or a pool without a ``conninfo``.
    """
    kind = conninfo_kind(source, owner)
    if kind == "conninfo":
        assert isinstance(source, str)
        return source
    if kind == "connection":
        assert isinstance(source, psycopg.Connection)
        used = {
            opt.keyword.decode(): opt.val.decode()
            for opt in source.pgconn.info
            if opt.keyword and opt.val
        }
        return make_conninfo("", **used)
    conninfo = getattr(source, "conninfo", None)
    if not isinstance(conninfo, str):
        raise ConfigError(
            f"{owner} opens sessions of its own and needs the pool's connection string, "
            f"but {type(source).__name__} has no str attribute 'conninfo': pass a "
            "connection string instead"
        )
    check_conninfo(conninfo, owner)
    extra = getattr(source, "kwargs", None) or {}
    known = _libpq_keywords()
    params: dict[str, str | int] = {
        key: value
        for key, value in dict(extra).items()
        if key in known and isinstance(value, str | int) and not isinstance(value, bool)
    }
    return make_conninfo(conninfo, **params) if params else conninfo


def per_call_source(source: object, sessions: str) -> object:
    """Where an object with sessions of its own borrows a connection for each call.

    The user's pool when ``source`` is one (its calls then count against that pool, not
    the process's pooled sessions); otherwise ``sessions``, the connection string of its
    own sessions (from :func:`session_conninfo`): a ``psycopg.Connection`` passed in is
    never used, only the parameters it connected with, so that the object's threads
    never run inside its owner's transactions.

    Args:
        source: the ``conninfo`` given: a connection string, a ``psycopg.Connection`` or
            a pool (checked by :func:`session_conninfo` already).
        sessions: ``session_conninfo(source, ...)``.
    """
    return sessions if isinstance(source, str | psycopg.Connection) else source


def open_session(
    conninfo: str,
    *,
    application_name: str,
    connect_timeout: float,
    keepalive_idle: float,
    user_timeout: float,
    statement_timeout: float | None = None,
    **options: Any,
) -> psycopg.Connection[Any]:
    """Open an autocommit session with every bound of the library's sessions set.

    The one place, but for the keeper's (which follows the dead-session rules of
    :func:`server_keepalives`), where the library opens a session: a connect timeout,
    client TCP keepalives (first probe after ``keepalive_idle``, then 3 a second apart),
    ``tcp_user_timeout`` (data the server does not acknowledge fails after
    ``user_timeout``) and, when given, a server-side ``statement_timeout``.

    Args:
        conninfo: a libpq connection string or URI.
        application_name: what ``pg_stat_activity`` shows for the session.
        connect_timeout: seconds to wait for the connection (libpq counts whole seconds,
            at least 2).
        keepalive_idle: seconds of silence before the first keepalive probe.
        user_timeout: seconds sent data may stay unacknowledged.
        statement_timeout: bound of one statement on the server, seconds.
        options: more libpq parameters (``client_encoding``).

    Raises:
        BackendUnavailable: the session could not be opened or prepared (the message
            never shows a password).
    """
    try:
        conn = psycopg.Connection.connect(
            conninfo,
            autocommit=True,
            connect_timeout=max(2, math.ceil(connect_timeout)),
            application_name=application_name,
            keepalives=1,
            keepalives_idle=max(1, math.ceil(keepalive_idle)),
            keepalives_interval=1,
            keepalives_count=3,
            tcp_user_timeout=math.ceil(user_timeout * 1000),
            **options,
        )
    except psycopg.Error as exc:
        raise unavailable("connect to Postgres", conninfo, exc) from exc
    if statement_timeout is None:
        return conn
    try:
        conn.execute(
            "SELECT set_config('statement_timeout', %s, false)",
            (f"{math.ceil(statement_timeout * 1000)}ms",),
        )
    except psycopg.Error as exc:
        conn.close()
        raise unavailable("prepare the session", conninfo, exc) from exc
    return conn


def connection_is_usable(conn: psycopg.Connection[Any]) -> bool:
    """False when ``conn`` is known dead: closed, broken, or the server hung up.

    An idle connection that nobody LISTENs on has nothing to read unless the server
    ended the session (an error message, then EOF): then it is replaced before use.
    """
    if conn.closed or conn.broken:
        return False
    if conn.info.transaction_status != TransactionStatus.IDLE:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable
