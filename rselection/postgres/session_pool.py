"""The pooled sessions of a process: at most two per connection string, for every object.

Claims, checkpoint saves and loads, ``leader()`` and ``nodes()`` reads, handover
requests and electors given a connection string borrow, for one call at a time, one of
at most :data:`POOL_SIZE` sessions that the process keeps per connection string, so
their sessions do not grow with the number of objects. Each call brings its own bounds
(``statement_timeout``, the wait for a free session, an :class:`~._conn.IoWatchdog`).
Never for the keeper, nor for work that waits on the server (a lock wait, ``LISTEN``).
See ``docs/explanation/sessions.md``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg
from psycopg.pq import TransactionStatus

from .. import forks
from ..errors import BackendUnavailable
from ._conn import IoWatchdog, connection_is_usable, describe_conninfo, open_session, unavailable

__all__ = ["APPLICATION_NAME", "POOL_SIZE", "SessionPool"]

logger = logging.getLogger(__name__)

POOL_SIZE = 2
"""Sessions a process keeps at most per connection string for pooled calls."""

APPLICATION_NAME = "rselection:pool"
"""``application_name`` of the pooled sessions, as ``pg_stat_activity`` shows it."""

# Bounds of the pooled sessions' sockets, whoever borrows them: a silent link is
# noticed within about KEEPALIVE_IDLE + 3 s while idle, and data the server does not
# acknowledge fails after USER_TIMEOUT; every call is also bounded by its own timeouts.
_KEEPALIVE_IDLE = 5.0
_USER_TIMEOUT = 10.0


IDLE_CLOSE = 60.0
"""Seconds an idle pooled session is kept: a process that led and now only follows goes
back to the sessions of a follower (see :meth:`SessionPool.close_idle`)."""


@dataclass
class _Session:
    conn: psycopg.Connection[Any]
    statement_timeout_ms: int
    idle_since: float = 0.0


class SessionPool:
    """The pooled sessions of one process and connection string.

    Get it with :meth:`attach` and give it back with :meth:`detach`; the last detach
    closes its idle sessions (a session lent at that moment is closed when it comes
    back). Safe from any thread.
    """

    _registry: ClassVar[dict[tuple[int, str], SessionPool]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self.where = describe_conninfo(conninfo)
        self._slots = threading.BoundedSemaphore(POOL_SIZE)
        self._lock = threading.Lock()  # guards what follows
        self._users = 0
        self._idle: list[_Session] = []
        self._busy = 0
        self._generation = 0  # bumped when the last user detaches
        self._waiting = 0  # callers waiting for a session to come free
        self._io = IoWatchdog(APPLICATION_NAME)

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child (see :mod:`rselection.forks`): the registry's lock is made
        anew (a parent's thread may have held it). The parent's pools stay in the
        registry, under its process id: never used here, never closed."""
        cls._registry_lock = threading.Lock()

    @classmethod
    def attach(cls, conninfo: str) -> SessionPool:
        """The pool of this process for ``conninfo``, with one more user."""
        key = (os.getpid(), conninfo)  # a forked child gets sessions of its own
        with cls._registry_lock:
            pool = cls._registry.get(key)
            if pool is None:
                pool = cls._registry[key] = SessionPool(conninfo)
            with pool._lock:
                pool._users += 1
        return pool

    def detach(self) -> None:
        """One user fewer; the last one closes the idle sessions."""
        with SessionPool._registry_lock:
            with self._lock:
                self._users -= 1
                if self._users > 0:
                    return
                self._generation += 1
                idle, self._idle = self._idle, []
                if not self._busy:
                    self._io.close()
            key = (os.getpid(), self._conninfo)
            if SessionPool._registry.get(key) is self:
                del SessionPool._registry[key]
        for session in idle:
            with contextlib.suppress(Exception):
                session.conn.close()

    @property
    def open_sessions(self) -> int:
        """Sessions open now, idle or lent."""
        with self._lock:
            return len(self._idle) + self._busy

    @classmethod
    def close_idle(cls, conninfo: str, older_than: float = IDLE_CLOSE) -> None:
        """Close the sessions of this process's pool for ``conninfo`` that were idle for
        more than ``older_than`` seconds (the keeper calls it now and then)."""
        with cls._registry_lock:
            pool = cls._registry.get((os.getpid(), conninfo))
        if pool is None:
            return
        cutoff = time.monotonic() - older_than
        with pool._lock:
            stale = [s for s in pool._idle if s.idle_since < cutoff]
            if not stale:
                return
            pool._idle = [s for s in pool._idle if s.idle_since >= cutoff]
        for session in stale:
            with contextlib.suppress(Exception):
                session.conn.close()

    @property
    def waiting(self) -> int:
        """Callers waiting now for a session to come free (a holder that could give its
        session back early, such as a broadcast writer, does so when this is not 0)."""
        with self._lock:
            return self._waiting

    def idle_connections(self) -> list[psycopg.Connection[Any]]:
        """The sessions kept for the next calls (for checks and tests)."""
        with self._lock:
            return [session.conn for session in self._idle]

    @contextlib.contextmanager
    def connection(
        self, *, owner: str, connect_timeout: float, statement_timeout: float
    ) -> Iterator[psycopg.Connection[Any]]:
        """Lend a session for one call, with ``statement_timeout`` set on it.

        Args:
            owner: who asks, for messages.
            connect_timeout: bound of opening a session, seconds.
            statement_timeout: bound of the call on the server, seconds.

        Raises:
            BackendUnavailable: no session came free in time, or none could be opened
                or prepared.
        """
        wait = connect_timeout + statement_timeout
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self._waiting += 1
            try:
                acquired = self._slots.acquire(timeout=wait)
            finally:
                with self._lock:
                    self._waiting -= 1
        else:
            acquired = True
        if not acquired:
            raise BackendUnavailable(
                f"{owner}: all {POOL_SIZE} pooled sessions ({self.where}) stayed busy for {wait:g}s"
            )
        try:
            with self._lock:
                session = self._idle.pop() if self._idle else None
                generation = self._generation
                self._busy += 1
            try:
                if session is not None and not connection_is_usable(session.conn):
                    logger.debug("%s: replacing a dead pooled session (%s)", owner, self.where)
                    with contextlib.suppress(Exception):
                        session.conn.close()
                    session = None
                if session is None:
                    session = self._open(connect_timeout)
                self._set_statement_timeout(session, statement_timeout)
                with self._io.guard(session.conn, wait):
                    yield session.conn
            finally:
                self._give_back(session, generation)
        finally:
            self._slots.release()

    def _open(self, connect_timeout: float) -> _Session:
        conn = open_session(
            self._conninfo,
            application_name=APPLICATION_NAME,
            connect_timeout=connect_timeout,
            keepalive_idle=_KEEPALIVE_IDLE,
            user_timeout=_USER_TIMEOUT,
        )
        return _Session(conn, -1)

    def _set_statement_timeout(self, session: _Session, seconds: float) -> None:
        millis = math.ceil(seconds * 1000)
        if session.statement_timeout_ms == millis:
            return
        try:
            with self._io.guard(session.conn, seconds + 1.0):
                session.conn.execute(
                    "SELECT set_config('statement_timeout', %s, false)", (f"{millis}ms",)
                )
        except psycopg.Error as exc:
            raise unavailable("prepare a pooled session", self._conninfo, exc) from exc
        session.statement_timeout_ms = millis

    def _give_back(self, session: _Session | None, generation: int) -> None:
        with self._lock:
            self._busy -= 1
            keep = (
                session is not None
                and generation == self._generation
                and not session.conn.closed
                and not session.conn.broken
                and session.conn.info.transaction_status == TransactionStatus.IDLE
            )
            if keep:
                assert session is not None
                session.idle_since = time.monotonic()
                self._idle.append(session)
            if self._users == 0 and self._busy == 0:
                self._io.close()
        if session is not None and not keep:
            with contextlib.suppress(Exception):
                session.conn.close()


forks.register(SessionPool)
