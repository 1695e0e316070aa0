"""Opening the keeper session on a thread of its own (see :mod:`.session`).

Connecting and preparing a session can block up to the connect timeout on a server that
does not answer. The leases that need the session wait for one :class:`Opening` and can
give up on it (a ``stop()`` or ``step_down()`` interrupts them) while it goes on: a
leader stopping during an outage does not wait for a connect timeout, nor for each of
its shards' connects in turn. What the opening ends with is the session's, whoever still
waits: a session opened after the keeper closed is closed at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ...errors import BackendUnavailable
from .._conn import IoWatchdog, unavailable
from .._lease_sql import LeaseTable, listen_sql
from ..pooler import check_bound, check_session_pooling
from ..ring import ring_channel
from ..schema import create_tables
from .session_setup import (
    connect_kwargs,
    pin_session,
    read_server,
    refuse_standby,
    resolve_table,
    take_ring_lock,
)

__all__ = ["Opening", "OpenedSession", "open_session"]


@dataclass(frozen=True)
class OpenedSession:
    """A keeper session, connected and prepared, not yet the keeper's."""

    conn: psycopg.Connection[Any]
    pid: int
    server: str
    found: LeaseTable
    ring: str  # the ring's channel, listened to
    pinned: float  # the wind-down its keepalives are sized for


def open_session(
    conninfo: str,
    *,
    hold: float,
    timeout: float,
    io: IoWatchdog,
    where: str,
    table: str,
    create: bool,
    renew_deadline: float,
) -> OpenedSession:
    """Connect, check the server and the pooler, create or resolve the lease table, take
    a place in the ring and announce it, and size the keepalives for a wind-down of
    ``hold`` (each step bounded by ``timeout``, the table's creation by
    ``renew_deadline``).

    Raises:
        ConfigError: a pooler in transaction mode, or a table of another protocol.
        BackendUnavailable: the server cannot be reached, is a standby, or failed.
    """
    try:
        conn = psycopg.Connection.connect(conninfo, **connect_kwargs("", hold, timeout))
    except psycopg.Error as exc:
        raise unavailable("connect to the lease server", conninfo, exc) from exc
    try:
        with io.guard(conn, check_bound(timeout)):
            refuse_standby(conn, where)
            pid = check_session_pooling(
                conn,
                lambda: psycopg.Connection.connect(
                    conninfo, **connect_kwargs(":probe", hold, timeout)
                ),
                where=where,
                io=io,
                timeout=timeout,
            )
        with io.guard(conn, renew_deadline + timeout):
            if create:
                create_tables(conn, leases=table, timeout=renew_deadline)
            found = resolve_table(conn, table, where)
            server = read_server(conn, where)
            ring = ring_channel(found.qualified)
            take_ring_lock(conn, found.oid, where)
            conn.execute(
                sql.SQL("{listen}; SELECT pg_notify({ring}, 'up:' || {pid}::text)").format(
                    listen=listen_sql([ring]), ring=sql.Literal(ring), pid=sql.Literal(pid)
                )
            )
            pinned = pin_session(conn, hold)
    except psycopg.Error as exc:
        conn.close()
        raise unavailable("prepare the keeper session", conninfo, exc) from exc
    except BaseException:
        conn.close()
        raise
    return OpenedSession(conn, pid, server, found, ring, pinned)


class Opening:
    """One opening of the keeper session, run on a thread of its own; any number of
    leases wait for it, each able to give up (see :meth:`wait`)."""

    def __init__(self, changed: threading.Condition) -> None:
        self._changed = changed  # notified when an opening ends or a waiter is interrupted
        self._done = False
        self._error: BaseException | None = None

    def start(self, run: Callable[[], None], *, name: str) -> None:
        """Run ``run()`` (the opening and the keeper's adopting of its session) on a new
        daemon thread; its exception is what every waiter raises.

        Raises:
            RuntimeError: the thread could not start.
        """

        def body() -> None:
            error: BaseException | None = None
            try:
                run()
            except BaseException as exc:  # every waiter raises it
                error = exc
            with self._changed:
                self._error = error
                self._done = True
                self._changed.notify_all()

        threading.Thread(target=body, name=name, daemon=True).start()

    def wait(self, interrupted: Callable[[], bool]) -> None:
        """Wait until the opening ended; raise its error.

        Raises:
            BackendUnavailable: ``interrupted()`` turned true first (checked whenever the
                condition is notified), or the opening failed so.
            ConfigError: the opening found a configuration it cannot work with.
        """
        with self._changed:
            while not self._done:
                if interrupted():
                    raise BackendUnavailable("connecting the keeper session was interrupted")
                self._changed.wait(1.0)  # notified at the end; the timeout is a backstop
            error = self._error
        if error is not None:
            raise error
