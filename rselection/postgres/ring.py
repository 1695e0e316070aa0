"""The ring of keeper sessions: one watcher session per process sees a dead keeper at once.

Every process's shared keeper session (:mod:`rselection.postgres.keeper`) holds one
session advisory lock, its *ring lock*: the bigint key ``ring_class << 32 | pid``, where
``ring_class`` is derived from the lease table and ``pid`` is the keeper's backend pid.
The live keepers of a lease table are thus listed in ``pg_locks``, in the order of their
pids, and form a ring. Each process's :class:`RingWatcher` blocks on the ring lock of the
next keeper after its own (wrapping around) with a server-side bound. When that keeper's
session ends (its process died, its connection closed, an administrator terminated it)
the server grants the lock at once; the watcher frees it and sends ``down`` on the ring
channel, which every keeper session listens to, and every follower then attempts its
leases at once (an attempt takes only leases whose holder's per-lease lock is gone, see
:func:`rselection.postgres._lease_sql.free_condition`, so a false alarm costs one round
trip and never a leader).

A keeper that connects announces ``up`` on the ring channel: the watchers whose arc it
falls into move on to it, so each keeper is watched by its predecessor. Each watcher's
wait is bounded (:data:`RING_RECHECK`), after which it reads the ring again: a watcher
that missed an announcement covers the new keeper within that bound; until then, and
while a watcher reconnects, a dead keeper's leases are taken when followers next attempt
them (at the latest when they expire).

One session per process, whatever the number of leases: the watcher takes and frees
only transient locks and holds none between waits.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
from typing import Any

import psycopg
from psycopg import sql

from ..errors import BackendUnavailable
from ._conn import open_session, unavailable

__all__ = ["RING_RECHECK", "RingWatcher", "ring_channel", "ring_class", "ring_key"]

logger = logging.getLogger(__name__)

RING_RECHECK = 30.0
"""Seconds a watcher waits on one keeper before reading the ring again."""

_RECONNECT_FIRST = 0.2
_RECONNECT_CAP = 5.0


def ring_class(table_oid: int) -> int:
    """The upper 32 bits of the ring locks of the lease table ``table_oid`` (unsigned)."""
    digest = hashlib.blake2b(f"rselection-ring:{table_oid}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


def ring_key(table_oid: int, pid: int) -> int:
    """The ring lock of the keeper session with backend pid ``pid`` (a signed bigint).

    One-key advisory locks show as ``objsubid = 1`` in ``pg_locks``; per-lease locks use
    the two-key form (``objsubid = 2``), so the two never collide.
    """
    key = (ring_class(table_oid) << 32) | (pid & 0xFFFFFFFF)
    return key - 2**64 if key >= 2**63 else key


def ring_channel(qualified_table: str) -> str:
    """The channel on which keepers of ``qualified_table`` announce ``up`` and ``down``."""
    digest = hashlib.blake2b(qualified_table.encode(), digest_size=12).hexdigest()
    return f"rselection-ring:{digest}"


def next_keeper_sql(table_oid: int, own_pid: int) -> sql.Composed:
    """The backend pid of the next keeper after ``own_pid`` in the ring (no row: alone)."""
    return sql.SQL(
        "SELECT l.objid::bigint FROM pg_catalog.pg_locks l"
        " WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
        " AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d"
        " WHERE d.datname = current_database())"
        " AND l.classid::bigint = {cls} AND l.objid::bigint <> {own}"
        " ORDER BY (l.objid::bigint < {own}), l.objid::bigint LIMIT 1"
    ).format(cls=sql.Literal(ring_class(table_oid)), own=sql.Literal(own_pid))


def between(own: int, target: int, pid: int) -> bool:
    """True when ``pid`` lies after ``own`` and before ``target`` going round the ring."""
    if own < target:
        return own < pid < target
    return pid > own or pid < target  # the arc wraps around (or a ring of one)


class RingWatcher:
    """The watcher session of one process and lease table, and its thread.

    Args:
        conninfo: the connection string of the keeper's database.
        table_oid: the lease table's OID (names the ring).
        channel: the ring channel (see :func:`ring_channel`).
        connect_timeout: seconds to wait for a connection.
        name: for thread names and logs.
    """

    def __init__(
        self, conninfo: str, *, table_oid: int, channel: str, connect_timeout: float, name: str
    ) -> None:
        self._conninfo = conninfo
        self._oid = table_oid
        self._channel = channel
        self._connect_timeout = connect_timeout
        self._name = name
        self._lock = threading.Lock()  # guards the fields below
        self._own_pid: int | None = None  # the keeper's pid: where this watcher sits
        self._target: int | None = None  # the keeper waited on now
        self._waiting = False  # a lock wait is in flight on _conn
        self._moved = threading.Event()  # the ring changed near us: look again
        self._ended = threading.Event()  # the lock wait in flight ended
        self._cancelling = False  # a thread sends cancel requests for the wait
        self._stopped = False
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> int | None:
        """The backend pid of the keeper watched now, or ``None``."""
        with self._lock:
            return self._target

    def watch_from(self, own_pid: int | None) -> None:
        """Sit in the ring after the keeper session ``own_pid`` (``None``: not connected,
        watch nothing); starts the thread on first use."""
        with self._lock:
            if self._stopped:
                return
            self._own_pid = own_pid
            start = self._thread is None
            if start:
                self._thread = threading.Thread(
                    target=self._run, name=f"rselection-watcher-{self._name}", daemon=True
                )
        self.ring_changed(None)
        if start:
            assert self._thread is not None
            self._thread.start()

    def ring_changed(self, pid: int | None) -> None:
        """A keeper ``pid`` joined (``None``: anything changed): look again when it now
        sits between this watcher and the keeper it waits on."""
        with self._lock:
            own, target = self._own_pid, self._target
            known = pid is not None and own is not None and target is not None
            if known and not between(own, target, pid):  # type: ignore[arg-type]
                return  # it joined elsewhere in the ring: this watch stands
            self._moved.set()
            cancel = self._waiting and not self._cancelling
            self._cancelling = self._cancelling or cancel
        if cancel:
            # A cancel request is a network round trip of its own (not a session): never
            # make the caller, perhaps a notification handler, wait for it.
            threading.Thread(target=self._cancel_wait, name="rselection-ring-cancel").start()

    def _cancel_wait(self) -> None:
        """Cancel the lock wait until it has ended: a request that reaches the backend
        before the wait's statement does is ignored, so it is sent again, with backoff."""
        pause = 0.02
        try:
            while True:
                with self._lock:
                    conn = self._conn if self._waiting else None
                if conn is None:
                    return
                try:
                    conn.cancel_safe(timeout=self._connect_timeout)
                except Exception as exc:  # the wait ends at its own bound anyway
                    logger.debug("ring watcher: cancel request failed: %s", exc)
                    return
                if self._ended.wait(pause):
                    return
                pause = min(2 * pause, 0.5)
        finally:
            with self._lock:
                self._cancelling = False

    def stop(self) -> None:
        """End the wait and the thread, and close the session."""
        with self._lock:
            self._stopped = True
        self.ring_changed(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._connect_timeout + 1.0)
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while True:
            with self._lock:
                if self._stopped:
                    return
                own = self._own_pid
            try:
                if own is None:
                    self._moved.wait(RING_RECHECK)
                    self._moved.clear()
                    continue
                conn = self._connection()
                self._moved.clear()  # before reading: a change after it is seen next time
                row = conn.execute(next_keeper_sql(self._oid, own)).fetchone()
                target = None if row is None else int(row[0])
                with self._lock:
                    self._target = target
                if target is None:
                    self._moved.wait(RING_RECHECK)  # alone in the ring: wait for a joiner
                else:
                    self._wait_on(conn, own, target)
                failures = 0
            except (psycopg.Error, BackendUnavailable) as exc:
                failures += 1
                with self._lock:
                    self._target = None
                    conn_, self._conn = self._conn, None
                if conn_ is not None:
                    with contextlib.suppress(Exception):
                        conn_.close()
                log = logger.warning if failures == 1 else logger.debug
                why = (
                    exc
                    if isinstance(exc, BackendUnavailable)
                    else unavailable("watch the ring", self._conninfo, exc)
                )
                log("ring watcher: %s", why)
                self._moved.wait(min(_RECONNECT_CAP, _RECONNECT_FIRST * 2 ** (failures - 1)))
            except Exception:  # never let the watcher die: it only speeds failover up
                failures += 1
                logger.exception("ring watcher: unexpected error; it goes on")
                self._moved.wait(_RECONNECT_CAP)

    def _connection(self) -> psycopg.Connection[Any]:
        with self._lock:
            conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        # Its lock wait sends nothing for long: a dead server is found by keepalives.
        conn = open_session(
            self._conninfo,
            application_name="rselection:watcher",
            connect_timeout=self._connect_timeout,
            keepalive_idle=10,
            user_timeout=16,
        )
        with self._lock:
            if self._stopped:
                conn.close()
                raise psycopg.OperationalError("the ring watcher is stopping")
            self._conn = conn
        return conn

    def _wait_on(self, conn: psycopg.Connection[Any], own: int, target: int) -> None:
        """Block until keeper ``target``'s session ends (then announce it), the ring
        moves, or :data:`RING_RECHECK` passes."""
        key = sql.Literal(ring_key(self._oid, target))
        query = sql.SQL(
            "SET LOCAL lock_timeout = {ms}; SELECT pg_advisory_lock({key});"
            " SELECT pg_advisory_unlock({key}),"
            " pg_notify({channel}, 'down:' || {target}::text)"
        ).format(
            ms=sql.Literal(f"{math.ceil(RING_RECHECK * 1000)}ms"),
            key=key,
            channel=sql.Literal(self._channel),
            target=sql.Literal(target),
        )
        with self._lock:
            if self._moved.is_set() or self._stopped:
                return
            self._waiting = True
            self._ended.clear()
        try:
            conn.execute(query)
            logger.info("ring watcher: keeper session %d is gone; followers attempt now", target)
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled):
            # Bound reached, or the ring moved: a cancel may have landed between lock and
            # unlock, and a session lock outlives its aborted transaction.
            conn.execute("SELECT pg_advisory_unlock_all()")
        finally:
            with self._lock:
                self._waiting = False
                self._ended.set()
