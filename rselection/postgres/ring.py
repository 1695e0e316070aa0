"""The ring of keeper sessions: one watcher session per process sees a dead keeper at once.

Every process's shared keeper session (:mod:`rselection.postgres.keeper`) holds a *ring
lock* (:func:`ring_key`). The sessions that hold one and whose role may update the lease
table form a ring, in the order of their backend pids. Each process's
:class:`RingWatcher` waits on the ring lock of the next member; when the server grants
it (that keeper's session ended), the watcher announces ``down`` on the ring channel and
every follower attempts at once. A keeper that connects announces ``up``.

See ``docs/explanation/how-it-works.md``, "Fast failover after a crash", for the design
and what a client without privileges can do to the ring.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import secrets
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from ..backoff import backoff
from ..errors import BackendUnavailable
from ._conn import open_session, unavailable

__all__ = [
    "RING_POLL",
    "RING_RECHECK",
    "RingWatcher",
    "members_sql",
    "new_ring_key",
    "ring_channel",
    "ring_class",
]

logger = logging.getLogger(__name__)

RING_RECHECK = 30.0
"""Seconds a watcher waits on one keeper before reading the ring again."""

RING_POLL = 0.25
"""Seconds a watcher waits on one keeper before reading the ring again while the wait is
contested: a session without privileges queued on the same lock, or an ``up`` that
changed nothing moved the watcher less than :data:`RING_RECHECK` ago."""

_RECONNECT_FIRST = 0.2
_RECONNECT_CAP = 5.0


def ring_class(table_oid: int) -> int:
    """The upper 32 bits of the ring locks of the lease table ``table_oid`` (unsigned)."""
    digest = hashlib.blake2b(f"rselection-ring:{table_oid}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


def ring_key(table_oid: int, tag: int) -> int:
    """The ring lock of the lease table ``table_oid`` with the tag ``tag`` (its lower 32
    bits, unsigned), as a signed bigint.

    One-key advisory locks show as ``objsubid = 1`` in ``pg_locks``; per-lease locks use
    the two-key form (``objsubid = 2``), so the two never collide.
    """
    key = (ring_class(table_oid) << 32) | (tag & 0xFFFFFFFF)
    return key - 2**64 if key >= 2**63 else key


def new_ring_key(table_oid: int) -> int:
    """A ring lock for a keeper session that connects: a random tag, so that nobody can
    hold it before the session takes it."""
    return ring_key(table_oid, secrets.randbits(32))


def ring_channel(qualified_table: str) -> str:
    """The channel on which keepers of ``qualified_table`` announce ``up`` and ``down``."""
    digest = hashlib.blake2b(qualified_table.encode(), digest_size=12).hexdigest()
    return f"rselection-ring:{digest}"


#: The ring-class locks of the lease table ``{oid}`` (ring class ``{cls}``) held by a
#: session whose role may update the table: the members (pid, tag). Only such roles are
#: trusted peers; anyone can hold an advisory lock.
_MEMBERS = (
    "SELECT l.pid, l.objid::bigint AS tag FROM pg_catalog.pg_locks l"
    " JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
    " AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d"
    " WHERE d.datname = current_database())"
    " AND l.classid::bigint = {cls} AND l.pid IS NOT NULL"
    " AND coalesce(has_table_privilege(a.usesysid, {oid}::oid, 'UPDATE'), false)"
)

#: True when a session whose role may not update the table waits for the ring lock
#: ``({cls}, m.tag)`` (``m``: a member).
_CONTESTED = (
    "EXISTS (SELECT 1 FROM pg_catalog.pg_locks w"
    " LEFT JOIN pg_catalog.pg_stat_activity wa ON wa.pid = w.pid"
    " WHERE w.locktype = 'advisory' AND w.objsubid = 1 AND NOT w.granted"
    " AND w.classid::bigint = {cls} AND w.objid::bigint = m.tag"
    " AND NOT coalesce(has_table_privilege(wa.usesysid, {oid}::oid, 'UPDATE'), false))"
)


def members_sql(table_oid: int) -> sql.Composed:
    """The backend pids of the ring's members: the keeper sessions of trusted peers."""
    cls, oid = sql.Literal(ring_class(table_oid)), sql.Literal(table_oid)
    return sql.SQL("SELECT m.pid FROM (" + _MEMBERS + ") AS m").format(cls=cls, oid=oid)


def next_keeper_sql(
    table_oid: int, own_pid: int, *, previous: int | None = None, channel: str = ""
) -> sql.Composed:
    """Read the ring from ``own_pid``: one row of the next member after it (pid, tag, and
    whether the wait for its lock is contested: all NULL when alone), having announced
    ``down`` on ``channel`` for the member ``previous`` (the one waited on last) when it
    is not a member any more.
    """
    cls, oid = sql.Literal(ring_class(table_oid)), sql.Literal(table_oid)
    gone = (
        sql.SQL(
            "SELECT pg_notify({channel}, 'down:' || {prev}::text)"
            " WHERE {prev} NOT IN (SELECT pid FROM members)"
        ).format(channel=sql.Literal(channel), prev=sql.Literal(previous))
        if previous is not None
        else sql.SQL("SELECT NULL::void WHERE false")
    )
    return sql.SQL(
        "WITH members AS MATERIALIZED (" + _MEMBERS + "),"
        " gone AS MATERIALIZED ({gone})"
        " SELECT n.pid, n.tag, n.contested, (SELECT count(*) FROM gone)"
        " FROM (SELECT 1) AS one LEFT JOIN LATERAL ("
        " SELECT m.pid, m.tag, " + _CONTESTED + " AS contested FROM members m"
        " WHERE m.pid <> {own} ORDER BY (m.pid < {own}), m.pid LIMIT 1) AS n ON true"
    ).format(cls=cls, oid=oid, own=sql.Literal(own_pid), gone=gone)


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
        self._previous: int | None = None  # waited on last, its end not announced yet
        self._announced: int | None = None  # an `up` moved us: the pid it named
        self._guarded_until = 0.0  # until then (monotonic), waits are short
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
            if pid is not None:
                self._announced = pid
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
                with self._lock:
                    before, previous = self._target, self._previous
                    announced, self._announced = self._announced, None
                query = next_keeper_sql(self._oid, own, previous=previous, channel=self._channel)
                row = conn.execute(query).fetchone()
                assert row is not None  # one row, also when alone
                if row[3]:
                    logger.info(
                        "ring watcher: keeper session %d is gone; followers attempt now", previous
                    )
                target = None if row[0] is None else int(row[0])
                now = time.monotonic()
                with self._lock:
                    if announced is not None and target == before:
                        # An `up` moved us and nothing changed: someone announces what
                        # is not (see the module docstring). Stay on guard a while.
                        self._guarded_until = now + RING_RECHECK
                    self._target = self._previous = target
                    short = bool(row[2]) or now < self._guarded_until
                if target is None:
                    self._moved.wait(RING_RECHECK)  # alone in the ring: wait for a joiner
                elif self._wait_on(conn, target, int(row[1]), short):
                    with self._lock:
                        if self._previous == target:
                            self._previous = None  # announced already
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
                self._moved.wait(
                    backoff(failures, first=_RECONNECT_FIRST, cap=_RECONNECT_CAP, jitter=False)
                )
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

    def _wait_on(self, conn: psycopg.Connection[Any], target: int, tag: int, short: bool) -> bool:
        """Block until keeper ``target``'s session ends (then announce it and return
        ``True``), the ring moves, or :data:`RING_RECHECK` passes (:data:`RING_POLL` when
        ``short``)."""
        key = sql.Literal(ring_key(self._oid, tag))
        bound = RING_POLL if short else RING_RECHECK
        query = sql.SQL(
            "SET LOCAL lock_timeout = {ms}; SELECT pg_advisory_lock({key});"
            " SELECT pg_advisory_unlock({key}),"
            " pg_notify({channel}, 'down:' || {target}::text)"
        ).format(
            ms=sql.Literal(f"{math.ceil(bound * 1000)}ms"),
            key=key,
            channel=sql.Literal(self._channel),
            target=sql.Literal(target),
        )
        with self._lock:
            if self._moved.is_set() or self._stopped:
                return False
            self._waiting = True
            self._ended.clear()
        try:
            conn.execute(query)
            logger.info("ring watcher: keeper session %d is gone; followers attempt now", target)
            return True
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled):
            # Bound reached, or the ring moved: a cancel may have landed between lock and
            # unlock, and a session lock outlives its aborted transaction.
            conn.execute("SELECT pg_advisory_unlock_all()")
            return False
        finally:
            with self._lock:
                self._waiting = False
                self._ended.set()
