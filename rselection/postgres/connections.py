"""Where a Postgres object gets a connection for each call: :class:`Connections`.

Nothing here is public API; the other Postgres modules of this package use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from .. import forks
from ..errors import BackendUnavailable, RSelectionError, first_line
from ..redaction import redact
from ._conn import (
    IoWatchdog,
    connection_is_usable,
    conninfo_kind,
    describe_conninfo,
    open_session,
    unavailable,
)
from .session_pool import SessionPool

__all__ = ["Connections"]

logger = logging.getLogger(__name__)


class Connections:
    """Where an object gets a connection for each call, from any kind of ``conninfo``.

    * a connection string: with ``pooled=True``, the process's pooled sessions for that
      string (:class:`~.session_pool.SessionPool`, shared with every other pooled object
      of the process); otherwise a connection of its own, opened on first use
      (:func:`open_session`), one call at a time. Either way one that failed is closed
      and replaced by the next call, and idle ones are kept for the next calls;
    * a pool (anything with a ``connection()`` context manager, such as
      ``psycopg_pool.ConnectionPool``): each call borrows a connection;
    * a ``psycopg.Connection``: calls take turns on it under a lock. A call that runs
      ``with conn.transaction()`` inside the caller's open transaction joins it as a
      savepoint, and commits or rolls back with it.

    Args:
        source: the ``conninfo``: a connection string, a pool or a ``psycopg.Connection``.
        owner: the class using it, for messages (``"PostgresClaimer"``).
        application_name: ``application_name`` of connections it opens itself.
        connect_timeout: seconds to wait for a connection it opens itself.
        statement_timeout: bound of one statement on connections it opens itself; a call
            on one of them is aborted after ``statement_timeout + connect_timeout``.
        pooled: borrow the process's pooled sessions instead of opening its own.

    Raises:
        ConfigError: ``source`` is none of the three (the message says what is).
    """

    def __init__(
        self,
        source: object,
        *,
        owner: str,
        application_name: str,
        connect_timeout: float = 5.0,
        statement_timeout: float = 10.0,
        pooled: bool = False,
    ) -> None:
        """Check ``source`` (raises :class:`ConfigError`); opens nothing yet."""
        self.kind = conninfo_kind(source, owner)
        self._pooled = pooled and isinstance(source, str)
        self._sessions: SessionPool | None = None  # attached on first use, until close()
        self._conninfo: str | None = None
        self._pool: Any = None
        self._shared: psycopg.Connection[Any] | None = None
        if isinstance(source, str):
            self._conninfo = source
            self.where = describe_conninfo(source)
        elif isinstance(source, psycopg.Connection):
            self._shared = source
            self.where = describe_conninfo(source.info.dsn)
        else:
            self._pool = source
            conninfo = getattr(source, "conninfo", None)
            self.where = (
                describe_conninfo(conninfo)
                if isinstance(conninfo, str)
                else f"pool {type(source).__name__}"
            )
        self.owner = owner
        self._app = application_name
        self._connect_timeout = connect_timeout
        self._statement_timeout = statement_timeout
        self._slots = threading.BoundedSemaphore(1)
        self._shared_lock = threading.Lock()
        self._lock = threading.Lock()  # guards what follows
        self._idle: list[psycopg.Connection[Any]] = []
        self._busy = 0
        self._generation = 0  # bumped by close(): connections of older ones are closed
        self._closing = False  # close() ran while calls were in flight
        # Keepalives and tcp_user_timeout cannot see a peer that accepts bytes and never
        # answers (a stuck proxy or pooler): bound each call on our own connections.
        self._io = IoWatchdog(application_name)
        self._inherited: str | None = None  # the parent's connection or pool, in a child
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): forget the parent's sessions
        (kept open and unused: closing one would end the parent's session) and open new
        ones on the next call; the locks and the watchdog are made anew (a parent's
        thread may have held them). A ``psycopg.Connection`` or a pool passed in is the
        parent's: every call refuses it from now on."""
        forks.keep_inherited(self._sessions, self._io, *self._idle)
        self._sessions = None
        self._idle = []
        self._busy = 0
        self._closing = False
        self._generation += 1
        self._slots = threading.BoundedSemaphore(1)
        self._shared_lock = threading.Lock()
        self._lock = threading.Lock()
        self._io = IoWatchdog(self._app)
        if self._shared is not None or self._pool is not None:
            self._inherited = "psycopg Connection" if self._shared is not None else "pool"

    def _open(self) -> psycopg.Connection[Any]:
        assert self._conninfo is not None
        return open_session(
            self._conninfo,
            application_name=self._app,
            connect_timeout=self._connect_timeout,
            # A silent network ends a call within about statement_timeout too.
            keepalive_idle=self._statement_timeout / 2,
            user_timeout=self._statement_timeout + 1.0,
            statement_timeout=self._statement_timeout,
        )

    @staticmethod
    def usable(conn: psycopg.Connection[Any]) -> bool:
        """False when ``conn`` is known dead (see :func:`connection_is_usable`)."""
        return connection_is_usable(conn)

    def idle_connections(self) -> list[psycopg.Connection[Any]]:
        """The connections kept for the next calls, its own or pooled (for tests)."""
        with self._lock:
            sessions, idle = self._sessions, list(self._idle)
        return sessions.idle_connections() if sessions is not None else idle

    def waiting(self) -> int:
        """Callers waiting now for a connection of the pool this lends from: the
        process's pooled sessions, or a ``psycopg_pool`` pool (its ``requests_waiting``);
        0 when that cannot be known."""
        if self._pool is not None:
            get_stats = getattr(self._pool, "get_stats", None)
            if not callable(get_stats):
                return 0
            try:
                waiting = get_stats().get("requests_waiting", 0)
            except Exception:
                return 0
            return waiting if isinstance(waiting, int) else 0
        with self._lock:
            sessions = self._sessions
        return sessions.waiting if sessions is not None else 0

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """Lend a connection for one call.

        Driver errors are left to the caller (see :meth:`wrap`); a connection of its own
        that failed is closed, and a later call opens a new one.

        Raises:
            RSelectionError: in a forked child, for a ``psycopg.Connection`` or a pool
                passed in (they are the parent's).
        """
        if self._inherited is not None:
            raise RSelectionError(
                f"{self.owner} was given a {self._inherited} in the process this one "
                f"({os.getpid()}) was forked from: it is that process's, and a statement "
                f"on it would run in its sessions; {forks.FORK_ADVICE}, on a connection "
                "string or a connection (or pool) opened there"
            )
        if self._pool is not None:
            with self._pool.connection() as lent:
                yield lent
            return
        if self._shared is not None:
            with self._shared_lock:
                yield self._shared
            return
        if self._pooled:
            with self._lock:
                if self._sessions is None:
                    assert self._conninfo is not None
                    self._sessions = SessionPool.attach(self._conninfo)
                sessions = self._sessions
            with sessions.connection(
                owner=self.owner,
                connect_timeout=self._connect_timeout,
                statement_timeout=self._statement_timeout,
            ) as lent:
                yield lent
            return
        with self._slots:
            conn: psycopg.Connection[Any] | None
            with self._lock:
                conn = self._idle.pop() if self._idle else None
                generation = self._generation
                self._busy += 1
            try:
                if conn is not None and not self.usable(conn):
                    logger.debug("%s: replacing a dead connection (%s)", self.owner, self.where)
                    with contextlib.suppress(Exception):
                        conn.close()
                    conn = None
                if conn is None:
                    conn = self._open()
                with self._io.guard(conn, self._statement_timeout + self._connect_timeout):
                    yield conn
            finally:
                self._give_back(conn, generation)

    def _give_back(self, conn: psycopg.Connection[Any] | None, generation: int) -> None:
        with self._lock:
            self._busy -= 1
            keep = (
                conn is not None
                and generation == self._generation
                and not conn.closed
                and not conn.broken
                and conn.info.transaction_status == TransactionStatus.IDLE
            )
            if keep:
                assert conn is not None
                self._idle.append(conn)
            if self._closing and self._busy == 0:
                # Under the lock: no call arms a guard while the watchdog stops.
                self._closing = False
                self._io.close()
        if conn is not None and not keep:
            with contextlib.suppress(Exception):
                conn.close()

    def wrap(self, what: str, exc: psycopg.Error) -> BackendUnavailable:
        """The :class:`BackendUnavailable` for a failed ``what`` (never shows a password).

        Args:
            what: what was attempted, e.g. ``"claim 'purge@...'"``.
            exc: the driver error; chain it with ``raise ... from exc``.
        """
        if self._conninfo is not None:
            return unavailable(what, self._conninfo, exc)
        detail = first_line(exc)
        # A pool's errors may be about its connection string.
        conninfo = getattr(self._pool, "conninfo", None)
        known = [conninfo] if isinstance(conninfo, str) else []
        return BackendUnavailable(f"cannot {what} ({self.where}): {redact(detail, *known)}")

    def close(self) -> None:
        """Close the connections it opened itself (idempotent; a later call opens new ones).

        A pool or connection passed in stays open. Never waits for a call in flight (it
        may be stuck on a silent link until its bound): its connection is closed when
        that call ends.
        """
        with self._lock:
            sessions, self._sessions = self._sessions, None
            self._generation += 1
            idle, self._idle = self._idle, []
            if self._busy:
                self._closing = True
            else:
                self._io.close()
        if sessions is not None:
            sessions.detach()
        for conn in idle:
            with contextlib.suppress(Exception):
                conn.close()
