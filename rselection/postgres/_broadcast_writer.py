"""The writer thread of :class:`~rselection.postgres.PostgresBroadcaster`.

Not public API. The writer appends the messages
:meth:`~rselection.postgres.PostgresBroadcaster.publish` queued to the outbox, every
message waiting at that moment in one transaction, through statements prepared once per
connection; it purges old rows now and then; and when a connection breaks before a
commit was confirmed, it finds out whether the batch committed before writing it again,
so no batch is written twice. :mod:`rselection.postgres.broadcast` explains the design.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg import pq

from ..errors import BackendUnavailable, ConfigError
from ._broadcast_base import BroadcastBase, Pending
from ._broadcast_conn import backoff, first_line, logger
from ._outbox import INLINE_LIMIT, inline_row, text_array

__all__ = ["BroadcastWriter"]

#: Bytes of JSON a writer puts in one transaction at most (and rows at most).
_BATCH_BYTES = 4 * 1024 * 1024
_BATCH_ROWS = 1000

#: Rows a purge deletes per statement; it repeats until nothing old is left.
_PURGE_ROWS = 10_000

#: Names of the publish statements prepared on every writer connection.
_ONE_INLINE = b"rselection_bc_one_inline"
_ONE = b"rselection_bc_one"
_MANY_INLINE = b"rselection_bc_many_inline"
_MANY = b"rselection_bc_many"


def _check_result(conn: psycopg.Connection[Any], result: pq.abc.PGresult, ok: int) -> None:
    """Raise the ``psycopg.Error`` a libpq result reports unless its status is ``ok``."""
    if result.status != ok:
        raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)


class BroadcastWriter(BroadcastBase):
    """The writer thread of a broadcaster: commits the queued messages to the outbox.

    A mixin of :class:`~rselection.postgres.PostgresBroadcaster`: its state lives on the
    broadcaster, created by :meth:`_init_writer`.
    """

    # The listener's position (see BroadcastListener), read by the writer.
    _positioned: threading.Event
    _last_id: int

    def _init_writer(self) -> None:
        """Create the writer's state and thread (``PostgresBroadcaster`` starts it)."""
        # Purge often enough that the table holds little more than the retention, but
        # at most once a second and at least once a minute.
        self._purge_every = min(60.0, max(1.0, self.retention / 10))
        self._origin = secrets.randbits(63)
        self._resolved_cache: tuple[str, int] | None = None  # (notify channel, lock key)
        self._written_id = 0  # the last outbox id this writer committed
        self._fixed_params: list[bytes] = []  # lock key, origin, NOTIFY channel
        self._writer = threading.Thread(
            target=self._write_loop, name="rselection-broadcast-write", daemon=True
        )

    def _write_loop(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        identity: tuple[int, Any] | None = None  # (backend pid, backend_start) of conn
        doubtful: tuple[Pending, ...] = ()  # a batch whose commit is unknown
        doubtful_from: tuple[int, Any] | None = None
        floor = 0  # every id <= floor was committed before the doubtful batch started
        failures = 0
        next_purge = time.monotonic() + self._purge_every * random.uniform(0.5, 1.0)
        down_since: float | None = None
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._stop.is_set():
                        wait = None if conn is None else max(0.0, next_purge - time.monotonic())
                        if wait is not None and wait <= 0:
                            break
                        self._cond.wait(wait)
                    if self._stop.is_set():
                        return
                    batch = self._take_batch()
                # Own messages must reach own subscribers: while this node has some,
                # write only once the listener knows where it starts.
                while not self._positioned.is_set() and self._has_any_readers():
                    if self._positioned.wait(0.5):
                        break
                    if self._stop.is_set():
                        return
                try:
                    if conn is None:
                        conn = self._connect("publish broadcasts", listen=False)
                        identity = self._identity(conn)
                        self._prepare(conn)
                        with self._conn_lock:
                            self._write_conn = conn
                    if doubtful:
                        self._settle(conn, doubtful, doubtful_from, floor)
                        doubtful, doubtful_from = (), None
                        continue  # the pending queue changed: take a fresh batch
                    if batch:
                        # The listener may be idle (no readers here): the writer's own
                        # last id bounds the committed ids too.
                        floor = max(floor, self._last_id, self._written_id)
                        self._write(conn, batch)
                    if time.monotonic() >= next_purge:
                        next_purge = time.monotonic() + self._purge_every * random.uniform(0.8, 1.2)
                        self._purge(conn)
                    if down_since is not None:
                        logger.info(
                            "broadcast writer reconnected to %s after %.1f s",
                            self._where,
                            time.monotonic() - down_since,
                        )
                    failures, down_since = 0, None
                except (psycopg.Error, OSError, BackendUnavailable, ConfigError) as exc:
                    if self._stop.is_set():
                        return
                    if conn is not None and (conn.broken or conn.closed) and batch and not doubtful:
                        # The connection broke while the batch was in flight: it may have
                        # committed. Settle that before writing anything again.
                        doubtful, doubtful_from = batch, identity
                    if conn is not None and (conn.broken or conn.closed):
                        with self._conn_lock:
                            self._write_conn = None
                        with contextlib.suppress(Exception):
                            conn.close()
                        conn, identity = None, None
                    failures += 1
                    if down_since is None:
                        down_since = time.monotonic()
                        logger.warning(
                            "broadcast writer cannot write to %s (%s); %d message(s) wait, "
                            "retrying with backoff",
                            self._where,
                            first_line(exc, self._conninfo),
                            len(self._pending),
                        )
                    self._stop.wait(backoff(failures))
        except Exception:
            logger.exception("broadcast writer failed; messages published from now on are lost")
            with self._cond:
                self._stop.set()
                self._cond.notify_all()
        finally:
            with self._conn_lock:
                self._write_conn = None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def _take_batch(self) -> tuple[Pending, ...]:
        """The oldest pending messages that fit in one transaction (caller holds _cond)."""
        batch: list[Pending] = []
        size = 0
        for item in self._pending:
            if batch and (len(batch) >= _BATCH_ROWS or size + item.size > _BATCH_BYTES):
                break
            batch.append(item)
            size += item.size
        return tuple(batch)

    def _identity(self, conn: psycopg.Connection[Any]) -> tuple[int, Any]:
        with self._watchdog.guard(conn, self.timeout):
            row = conn.execute(
                "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone()
        if row is None:
            return conn.info.backend_pid, None
        return int(row[0]), row[1]

    def _prepare(self, conn: psycopg.Connection[Any]) -> None:
        """Prepare the publish statements on a new writer connection.

        A publish runs one of them through libpq with text parameters: no statement to
        compose, no parameter adaptation, no parsing or planning per publish, which
        saves more time than the server spends on the statement's extra work.
        """
        notify_channel, lock_key = self._resolved(conn)
        self._fixed_params = [
            str(lock_key).encode(),
            str(self._origin).encode(),
            notify_channel.encode(),
        ]
        for name, statement in (
            (_ONE_INLINE, self._outbox.insert_one(True)),
            (_ONE, self._outbox.insert_one(False)),
            (_MANY_INLINE, self._outbox.insert_many(True)),
            (_MANY, self._outbox.insert_many(False)),
        ):
            with self._watchdog.guard(conn, self.timeout):
                result = conn.pgconn.prepare(name, statement.as_bytes(conn))
            _check_result(conn, result, pq.ExecStatus.COMMAND_OK)

    def _write(self, conn: psycopg.Connection[Any], batch: Iterable[Pending]) -> None:
        items = tuple(batch)
        inline = sum(item.inline for item in items) <= INLINE_LIMIT
        if len(items) == 1:
            item = items[0]
            params = [item.channel.encode(), item.payload, str(item.seq).encode()]
            if inline:
                name = _ONE_INLINE
                params.append(inline_row(item.channel, item.payload))
            else:
                name = _ONE
        else:
            name = _MANY_INLINE if inline else _MANY
            params = [
                text_array(i.channel.encode() for i in items),
                text_array(i.payload for i in items),
                b"{" + ",".join(str(i.seq) for i in items).encode() + b"}",
            ]
        with self._watchdog.guard(conn, self.timeout):
            result = conn.pgconn.exec_prepared(name, [*self._fixed_params, *params])
        _check_result(conn, result, pq.ExecStatus.TUPLES_OK)
        last = result.get_value(0, 1)
        if last is not None:
            self._written_id = int(last)
        self._committed_through(items[-1].seq, len(items))

    def _resolved(self, conn: psycopg.Connection[Any]) -> tuple[str, int]:
        if self._resolved_cache is None:
            with self._watchdog.guard(conn, self.timeout):
                self._resolved_cache = self._outbox.resolve(conn)
        return self._resolved_cache

    def _committed_through(self, seq: int, count: int) -> None:
        """Drop messages up to ``seq`` from the queue and wake flush() waiters."""
        with self._cond:
            while self._pending and self._pending[0].seq <= seq:
                self._pending.popleft()
            self._committed = max(self._committed, seq)
            self._committed_count += count
            self._cond.notify_all()

    def _settle(
        self,
        conn: psycopg.Connection[Any],
        batch: tuple[Pending, ...],
        old: tuple[int, Any] | None,
        floor: int,
    ) -> None:
        """Find out whether a batch whose commit was never confirmed did commit."""
        if old is not None:
            # The old session may still hold the batch (its client gave up, the server
            # did not): end it and wait until it is gone, so it cannot commit later.
            deadline = time.monotonic() + self.timeout
            with self._watchdog.guard(conn, self.timeout + 1.0):
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE pid = %s AND backend_start IS NOT DISTINCT FROM %s",
                    old,
                )
                while conn.execute(
                    "SELECT 1 FROM pg_stat_activity"
                    " WHERE pid = %s AND backend_start IS NOT DISTINCT FROM %s",
                    old,
                ).fetchone():
                    if time.monotonic() > deadline:
                        raise BackendUnavailable(
                            f"the broadcast writer's previous session (pid {old[0]}) did "
                            "not end; retrying"
                        )
                    time.sleep(0.02)
        with self._watchdog.guard(conn, self.timeout):
            row = conn.execute(self._outbox.committed_seq(), (floor, self._origin)).fetchone()
        done = 0 if row is None or row[0] is None else int(row[0])
        if done >= batch[-1].seq:
            logger.info(
                "broadcast writer: a batch of %d message(s) whose commit was not confirmed "
                "was committed; not writing it again",
                len(batch),
            )
            self._committed_through(batch[-1].seq, len(batch))
        else:
            logger.info(
                "broadcast writer: a batch of %d message(s) whose commit was not confirmed "
                "was not committed; writing it again",
                len(batch),
            )

    def _purge(self, conn: psycopg.Connection[Any]) -> int:
        total = 0
        while True:
            with self._watchdog.guard(conn, self.timeout):
                row = conn.execute(self._outbox.purge(), (self.retention, _PURGE_ROWS)).fetchone()
            deleted = 0 if row is None else int(row[0])
            total += deleted
            if deleted < _PURGE_ROWS or self._stop.is_set():
                break
        if total:
            logger.debug("broadcast: purged %d message(s) older than %s s", total, self.retention)
        return total
