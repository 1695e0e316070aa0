"""The writer of :class:`~rselection.postgres.PostgresBroadcaster`: the outbox's one writer.

The writer owns the queue that :meth:`~rselection.postgres.PostgresBroadcaster.publish`
fills, a thread and a session. It appends every message waiting at that moment in one
transaction, through statements prepared once per session; it purges old rows now and
then; and when a session breaks before a commit was confirmed, it finds out whether the
batch committed before writing it again, so no batch is written twice.
:mod:`rselection.postgres.broadcast` explains the design.
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq

from ...broadcast import BroadcasterClosed
from ...errors import BackendUnavailable, ConfigError
from .listener import Listener
from .outbox import INLINE_LIMIT, inline_row, text_array
from .sessions import Sessions, abort_socket, backoff

__all__ = ["Pending", "Writer"]

logger = logging.getLogger(__name__)

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


@dataclass
class Pending:
    """A message waiting for the writer."""

    seq: int
    channel: str
    payload: bytes  # the message as UTF-8 JSON
    inline: int  # upper bound of its bytes in an inline NOTIFY

    @property
    def size(self) -> int:
        """Bytes of JSON."""
        return len(self.payload)


class Writer:
    """Commits the messages a broadcaster publishes to the outbox, from a thread of its own.

    Args:
        sessions: opens the writer's session.
        listener: this node's listener: while the node has readers, the writer writes
            only once the listener knows where it starts (own messages must reach own
            subscribers), and the listener's position bounds the committed ids.
        has_readers: whether this node has any subscription or receiver.
    """

    def __init__(
        self, sessions: Sessions, listener: Listener, has_readers: Callable[[], bool]
    ) -> None:
        """Create the writer's state and thread (:meth:`start` starts it)."""
        self._sessions = sessions
        self._settings = sessions.settings
        self._outbox = sessions.outbox
        self._deadlines = sessions.deadlines
        self._listener = listener
        self._has_readers = has_readers
        # Shared by publish(), flush(), close() and the thread; guarded by _cond.
        self._cond = threading.Condition()
        self._pending: deque[Pending] = deque()
        self._seq = 0  # seq of the last message accepted by submit()
        self._committed = 0  # seq of the last message committed
        self._committed_count = 0  # messages committed
        self._closing = False
        self._stop = threading.Event()
        self._conn_lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        # Purge often enough that the table holds little more than the retention, but
        # at most once a second and at least once a minute.
        self._purge_every = min(60.0, max(1.0, self._settings.retention / 10))
        self._origin = secrets.randbits(63)
        self._resolved_cache: tuple[str, int] | None = None  # (notify channel, lock key)
        self._written_id = 0  # the last outbox id this writer committed
        self._fixed_params: list[bytes] = []  # lock key, origin, NOTIFY channel
        self._thread = threading.Thread(
            target=self._write_loop, name="rselection-broadcast-write", daemon=True
        )

    # -- what the broadcaster calls --------------------------------------------------

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    @property
    def closing(self) -> bool:
        """Whether :meth:`begin_close` was called: no message is accepted any more."""
        return self._closing

    @property
    def pending(self) -> int:
        """Messages accepted and not committed yet."""
        with self._cond:
            return len(self._pending)

    @property
    def published(self) -> int:
        """Messages this writer committed to the outbox."""
        with self._cond:
            return self._committed_count

    def submit(self, channel: str, payload: bytes, inline: int) -> int:
        """Queue one message; return how many wait to be written, this one included.

        Waits for room while ``max_pending`` messages wait, at most ``timeout`` seconds.

        Args:
            channel: the logical channel.
            payload: the message as UTF-8 JSON.
            inline: upper bound of its bytes in an inline NOTIFY.

        Raises:
            BroadcasterClosed: the broadcaster is closing.
            BackendUnavailable: no room within ``timeout`` (Postgres unreachable or slow).
        """
        settings = self._settings
        item = Pending(0, channel, payload, inline)
        with self._cond:
            deadline = None
            while len(self._pending) >= settings.max_pending and not self._refusing():
                # Backpressure: a burst larger than the queue waits for the writer.
                now = time.monotonic()
                if deadline is None:
                    deadline = now + settings.timeout
                if now >= deadline:
                    break
                self._cond.wait(deadline - now)
            if self._refusing():
                raise BroadcasterClosed(
                    "broadcaster is closed: cannot publish; create a new broadcaster instead"
                )
            if len(self._pending) >= settings.max_pending:
                raise BackendUnavailable(
                    f"cannot publish on channel {channel!r:.80}: {len(self._pending)} "
                    f"messages have waited {settings.timeout:g} s to be written to Postgres "
                    f"({self._sessions.where}); the database is unreachable or too slow. "
                    "Retry later, or raise max_pending"
                )
            self._seq += 1
            item.seq = self._seq
            self._pending.append(item)
            waiting = len(self._pending)
            self._cond.notify_all()
        return waiting

    def _refusing(self) -> bool:
        return self._closing or self._stop.is_set()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message accepted so far is committed; ``False`` on timeout or
        when the writer stopped with messages unwritten.

        Args:
            timeout: seconds to wait at most; ``None`` waits as long as it takes.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._seq
            while self._committed < target:
                if self._stop.is_set():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def begin_close(self) -> bool:
        """Refuse new messages from now on; ``False`` if that had been done already."""
        with self._cond:
            if self._closing:
                return False
            self._closing = True
            self._cond.notify_all()
            return True

    def stop(self) -> None:
        """Stop the thread: wake it, and abort a round trip it is blocked on."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        with self._conn_lock:
            if self._conn is not None:
                abort_socket(self._conn)

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (not when called from it)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------

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
                positioned = self._listener.positioned
                while not positioned.is_set() and self._has_readers():
                    if positioned.wait(0.5):
                        break
                    if self._stop.is_set():
                        return
                try:
                    if conn is None:
                        conn = self._sessions.connect("publish broadcasts", listen=False)
                        identity = self._identity(conn)
                        self._prepare(conn)
                        with self._conn_lock:
                            self._conn = conn
                    if doubtful:
                        self._settle(conn, doubtful, doubtful_from, floor)
                        doubtful, doubtful_from = (), None
                        continue  # the pending queue changed: take a fresh batch
                    if batch:
                        # The listener may be idle (no readers here): the writer's own
                        # last id bounds the committed ids too.
                        floor = max(floor, self._listener.last_id, self._written_id)
                        self.write(conn, batch)
                        # Confirmed and counted: a failure from here on (the purge) leaves
                        # nothing in doubt, so the batch is never settled and counted again.
                        batch = ()
                    if time.monotonic() >= next_purge:
                        next_purge = time.monotonic() + self._purge_every * random.uniform(0.8, 1.2)
                        self.purge(conn)
                    if down_since is not None:
                        logger.info(
                            "broadcast writer reconnected to %s after %.1f s",
                            self._sessions.where,
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
                            self._conn = None
                        with contextlib.suppress(Exception):
                            conn.close()
                        conn, identity = None, None
                    failures += 1
                    if down_since is None:
                        down_since = time.monotonic()
                        logger.warning(
                            "broadcast writer cannot write to %s (%s); %d message(s) wait, "
                            "retrying with backoff",
                            self._sessions.where,
                            self._sessions.error_text(exc),
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
                self._conn = None
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
        with self._deadlines.guard(conn, self._settings.timeout):
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
            with self._deadlines.guard(conn, self._settings.timeout):
                result = conn.pgconn.prepare(name, statement.as_bytes(conn))
            _check_result(conn, result, pq.ExecStatus.COMMAND_OK)

    def write(self, conn: psycopg.Connection[Any], batch: Iterable[Pending]) -> None:
        """Commit ``batch`` to the outbox in one statement and wake flush() waiters.

        Args:
            conn: a writer session (see :meth:`Sessions.connect`), prepared.
            batch: the messages, in publishing order.
        """
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
        with self._deadlines.guard(conn, self._settings.timeout):
            result = conn.pgconn.exec_prepared(name, [*self._fixed_params, *params])
        _check_result(conn, result, pq.ExecStatus.TUPLES_OK)
        last = result.get_value(0, 1)
        if last is not None:
            self._written_id = int(last)
        self._committed_through(items[-1].seq, len(items))

    def _resolved(self, conn: psycopg.Connection[Any]) -> tuple[str, int]:
        if self._resolved_cache is None:
            with self._deadlines.guard(conn, self._settings.timeout):
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
            deadline = time.monotonic() + self._settings.timeout
            with self._deadlines.guard(conn, self._settings.timeout + 1.0):
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
        with self._deadlines.guard(conn, self._settings.timeout):
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

    def purge(self, conn: psycopg.Connection[Any]) -> int:
        """Delete the messages older than ``retention``; return how many.

        Args:
            conn: a broadcaster session.
        """
        retention = self._settings.retention
        total = 0
        while True:
            with self._deadlines.guard(conn, self._settings.timeout):
                row = conn.execute(self._outbox.purge(), (retention, _PURGE_ROWS)).fetchone()
            deleted = 0 if row is None else int(row[0])
            total += deleted
            if deleted < _PURGE_ROWS or self._stop.is_set():
                break
        if total:
            logger.debug("broadcast: purged %d message(s) older than %s s", total, retention)
        return total
