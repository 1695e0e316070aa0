"""The writer of :class:`~rselection.postgres.PostgresBroadcaster`: the outbox's one writer.

The writer owns the queue that :meth:`~rselection.postgres.PostgresBroadcaster.publish`
fills and a thread, but no session: each round (a batch, a purge, settling a batch in
doubt) borrows one of the process's pooled sessions, or a connection of the user's pool
(:meth:`~.sessions.Sessions.borrow`), and gives it back at once. It appends every
message waiting at that moment in one transaction, through statements prepared once
per lent session; it purges old rows now and then; and when a session breaks before a
commit was confirmed, it finds out whether the batch committed before writing it
again, so no batch is written twice. :mod:`rselection.postgres.broadcast` explains the
design.
"""

from __future__ import annotations

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

from ...backoff import backoff
from ...broadcast import BroadcasterClosed
from ...errors import BackendUnavailable, ConfigError
from .._conn import abort_socket
from ..session_pool import IDLE_CLOSE, SessionPool
from .listener import Listener
from .location import Locator, Relocated
from .outbox import Outbox, text_array
from .sessions import Sessions, query_one
from .statements import MANY, ONE, PublishStatements
from .turns import Turn

__all__ = ["Pending", "Writer"]

logger = logging.getLogger(__name__)

#: Bytes of JSON a writer puts in one transaction at most (and rows at most).
_BATCH_BYTES = 4 * 1024 * 1024
_BATCH_ROWS = 1000

#: Rows a purge deletes per statement; it repeats until nothing old is left.
_PURGE_ROWS = 10_000

#: How often a writer applies the pool's idle rule (:data:`IDLE_CLOSE`), seconds.
_IDLE_CHECK = IDLE_CLOSE / 4

#: Seconds a writer keeps a lent session waiting for its next batch, and (at most, and
#: at most a quarter of ``io_timeout``) that it keeps one for consecutive batches, before
#: giving it back to the other users of the pool.
_LINGER = 0.02
_LOAN_MAX = 1.0

#: Seconds after a "cannot write" warning within which a new failure with the same error
#: is the same outage (logged at debug level).
_WARN_AGAIN = 60.0


@dataclass
class Pending:
    """A message waiting for the writer."""

    seq: int
    channel: str
    payload: bytes  # the message as UTF-8 JSON

    @property
    def size(self) -> int:
        """Bytes of JSON."""
        return len(self.payload)


class Writer:
    """Commits the messages a broadcaster publishes to the outbox, from a thread of its own,
    on sessions it borrows for one round at a time.

    The thread starts by checking the tables (``create_tables``) on a borrowed session,
    which sets :attr:`ready`, and retries that with backoff while it fails.

    Args:
        sessions: lends the writer its sessions.
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
        # Well inside the pool's bound of a loan (its connect_timeout + statement_timeout).
        self._loan_max = min(_LOAN_MAX, self._settings.io_timeout / 4)
        self._origin = secrets.randbits(63)
        # A batch whose commit is unknown and the session it was sent on (to end, when
        # it broke): kept on the writer, so that rounds started again after an error
        # nobody foresaw settle it first. The batch is found by its own identity (origin
        # and origin_seq), never by ids, which go back when the table is created again.
        self._doubtful: tuple[Pending, ...] = ()
        self._doubtful_from: tuple[int, Any] | None = None
        self._doubtful_in = 0  # the oid of the table the batch in doubt was sent to
        self._statements = PublishStatements(
            self._outbox,
            sessions.locator,
            self._origin,
            self._settings.synchronous_commit,
            self._deadlines,
            self._settings.io_timeout,
        )
        self._not_ready = ""  # the last error of the table check, logged once
        self._warned: tuple[str, float] = ("", 0.0)  # last "cannot write": error, when
        # The writers of the process take turns on one session of their pool.
        self._turn = Turn.of(sessions.pool_key)
        self.ready = threading.Event()
        """Set once the tables were found ready (created with ``create_tables``)."""
        self.refused: ConfigError | None = None
        """Why publishes are refused (a pooler in transaction mode), while they are."""
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

    def submit(self, channel: str, payload: bytes) -> int:
        """Queue one message; return how many wait to be written, this one included.

        Waits for room while ``max_pending`` messages wait, at most ``io_timeout`` seconds.

        Args:
            channel: the logical channel.
            payload: the message as UTF-8 JSON.

        Raises:
            BroadcasterClosed: the broadcaster is closing.
            BackendUnavailable: no room within ``io_timeout`` (Postgres unreachable or slow).
            ConfigError: the sessions go through a pooler in transaction mode.
        """
        settings = self._settings
        refused = self.refused
        if refused is not None:
            raise ConfigError(str(refused))
        item = Pending(0, channel, payload)
        with self._cond:
            deadline = None
            while len(self._pending) >= settings.max_pending and not self._refusing():
                # Backpressure: a burst larger than the queue waits for the writer.
                now = time.monotonic()
                if deadline is None:
                    deadline = now + settings.io_timeout
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
                    f"messages have waited {settings.io_timeout:g} s to be written to Postgres "
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
        self._turn.wake()
        with self._conn_lock:
            if self._conn is not None:
                abort_socket(self._conn)

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (not when called from it)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------

    def _write_loop(self) -> None:
        # The writer thread never ends before stop(): an error nobody foresaw is logged
        # and the rounds start again after a backoff (publish must not start refusing,
        # as if closed, while the broadcaster is open).
        failures = 0
        try:
            while True:
                try:
                    self._write_rounds()
                    return
                except Exception:
                    failures += 1
                    logger.exception("broadcast writer failed; starting again with backoff")
                    if self._stop.wait(backoff(failures)):
                        return
        finally:
            with self._conn_lock:
                self._conn = None

    def _write_rounds(self) -> None:
        identity: tuple[int, Any] | None = None  # (backend pid, backend_start) of the loan
        failures = 0
        next_purge: float | None = None  # purges start with the first write
        next_idle_check = time.monotonic() + _IDLE_CHECK
        down_since: float | None = None
        warned = False  # whether the outage since down_since was warned of
        relocations = 0  # publishes in a row that found the table elsewhere
        try:
            while True:
                ready = self.ready.is_set()
                with self._cond:
                    idle = ready and not self._doubtful
                    while idle and not self._pending and not self._stop.is_set():
                        due = min(t for t in (next_purge, next_idle_check) if t is not None)
                        wait = due - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    if self._stop.is_set():
                        return
                    batch = self._take_batch() if ready and not self._doubtful else ()
                if batch and not self._await_listener():
                    return
                in_flight: psycopg.Connection[Any] | None = None
                try:
                    if not ready:
                        self._check_tables()
                        failures = 0
                        continue
                    if not self._statements.resolved and (batch or self._doubtful):
                        # The table is not where it was: find it (and create it, with
                        # create_tables) on a session of the broadcaster's own.
                        self._find_tables()
                    now = time.monotonic()
                    if now >= next_idle_check:
                        # A process that only publishes has no keeper to apply the
                        # pool's idle rule: a quiet publisher gives its sessions back.
                        next_idle_check = now + _IDLE_CHECK
                        if not self._sessions.user_pool:
                            SessionPool.close_idle(self._sessions.conninfo)
                    purge_due = next_purge is not None and now >= next_purge
                    if not (batch or self._doubtful or purge_due):
                        continue
                    with (
                        self._turn.held(self._stop.is_set),
                        self._sessions.borrow("publish broadcasts") as conn,
                    ):
                        loan_ends = time.monotonic() + self._loan_max
                        while self._arm(conn):
                            # Armed: close() aborts a round trip in flight; it never
                            # aborts a lingering session, which goes back intact.
                            try:
                                identity = self._statements.lent(conn).identity
                                if self._doubtful:
                                    self._settle(conn, self._doubtful, self._doubtful_from)
                                    self._doubtful, self._doubtful_from = (), None
                                elif batch:
                                    in_flight = conn
                                    self.write(conn, batch)
                                    # Confirmed and counted: a failure from here on (the
                                    # purge) leaves nothing in doubt, so the batch is never
                                    # settled and counted again.
                                    batch, in_flight = (), None
                                    if next_purge is None:
                                        next_purge = time.monotonic() + self._purge_every * (
                                            random.uniform(0.5, 1.0)
                                        )
                                if (
                                    next_purge is not None
                                    and time.monotonic() >= next_purge
                                    and self._statements.resolved
                                ):
                                    next_purge = time.monotonic() + self._purge_every * (
                                        random.uniform(0.8, 1.2)
                                    )
                                    self.purge(conn)
                            finally:
                                self._disarm()
                            if time.monotonic() >= loan_ends:
                                break
                            if self._turn.waiting or self._sessions.waiting():
                                # Another writer, a claim or a checkpoint waits: the
                                # session goes back between two batches.
                                break
                            # A steady stream keeps the session for its next batches
                            # (a loan per batch would add to every message's latency);
                            # a pause of _LINGER gives it back.
                            batch = self._next_batch(_LINGER)
                            if not batch:
                                break
                            if not self._listener_ready():
                                batch = ()  # taken again once the listener is ready
                                break
                    if down_since is not None:
                        logger.log(
                            logging.INFO if warned else logging.DEBUG,
                            "broadcast writer reconnected to %s after %.1f s",
                            self._sessions.where,
                            time.monotonic() - down_since,
                        )
                    failures, down_since, relocations = 0, None, 0
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    if isinstance(exc, Relocated):
                        # Nothing was written: write the batch where the table is now
                        # (at once; with backoff if the table keeps changing).
                        logger.info("broadcast writer: %s; finding it again", exc)
                        relocations += 1
                        if relocations > 1:
                            self._stop.wait(backoff(relocations - 1))
                        continue
                    if isinstance(exc, psycopg.errors.UndefinedTable):
                        self._statements.forget()  # found again (or created) next round
                    expected = isinstance(
                        exc, psycopg.Error | OSError | BackendUnavailable | ConfigError
                    )
                    broke = in_flight is not None and (in_flight.broken or in_flight.closed)
                    if (
                        in_flight is not None
                        and batch
                        and not self._doubtful
                        and (broke or not expected)
                    ):
                        # The session broke while the batch was in flight, or something
                        # failed that nobody foresaw: it may have committed. Settle that
                        # before writing anything again (a session still intact has no
                        # statement left running: no backend to end).
                        self._doubtful = batch
                        self._doubtful_from = identity if broke else None
                        location = self._statements.location
                        self._doubtful_in = 0 if location is None else location.oid
                    if not expected:
                        logger.exception("broadcast writer: unexpected error; retrying")
                    failures += 1
                    if down_since is None and ready:
                        down_since = time.monotonic()
                        warned = self._report_down(exc, down_since)
                    elif not ready:
                        self._report_not_ready(exc)
                    self._stop.wait(backoff(failures))
        finally:
            with self._conn_lock:
                self._conn = None

    def _arm(self, conn: psycopg.Connection[Any]) -> bool:
        """Let :meth:`stop` abort ``conn`` until :meth:`_disarm`; ``False`` (not armed)
        once the writer stops."""
        with self._conn_lock:
            # stop() sets _stop before it takes the lock: either it is seen here, or
            # stop() sees the connection armed and aborts the round trip.
            if self._stop.is_set():
                return False
            self._conn = conn
            return True

    def _disarm(self) -> None:
        with self._conn_lock:
            self._conn = None

    def _next_batch(self, linger: float) -> tuple[Pending, ...]:
        """The next batch, waiting at most ``linger`` seconds for one; ``()`` if none came
        or the writer stops."""
        deadline = time.monotonic() + linger
        with self._cond:
            while not self._pending and not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if self._stop.is_set():
                return ()
            return self._take_batch()

    def _listener_ready(self) -> bool:
        """Whether the writer may write now (see :meth:`_await_listener`)."""
        return self._listener.positioned.is_set() or not self._has_readers()

    def _await_listener(self) -> bool:
        """Own messages must reach own subscribers: while this node has some, wait until
        the listener knows where it starts. ``False`` when the writer stops meanwhile."""
        positioned = self._listener.positioned
        while not positioned.is_set() and self._has_readers():
            if positioned.wait(0.5):
                break
            if self._stop.is_set():
                return False
        return True

    def _check_tables(self) -> None:
        """Make the tables ready (``create_tables``) and resolve the table's NOTIFY
        channel, on a borrowed session; then :attr:`ready` is set."""
        with self._sessions.borrow("check the broadcast tables", check=True) as conn:
            try:
                self._sessions.check_pooling(conn)
            except ConfigError as exc:
                self.refused = exc
                raise
            self.refused = None
            with self._deadlines.guard(conn, self._settings.io_timeout):
                self._sessions.prepare(conn)
            self._statements.resolve(conn)
        self._not_ready = ""
        self.ready.set()

    def _find_tables(self) -> None:
        """Find the table again after a publish found it gone or elsewhere, on a session
        of the broadcaster's own (``create_tables`` creates it again there)."""
        with self._sessions.borrow("find the broadcast tables", check=True) as conn:
            with self._deadlines.guard(conn, self._settings.io_timeout):
                self._sessions.prepare(conn)
            self._statements.resolve(conn)

    def _report_down(self, exc: BaseException, now: float) -> bool:
        """Warn that the writer cannot write: once per outage, where rounds that fail
        with the same error between short successes are one outage; ``False`` when
        that was done already (logged at debug level)."""
        detail = self._sessions.error_text(exc)
        last_detail, last_at = self._warned
        self._warned = (detail, now)
        if detail == last_detail and now - last_at < _WARN_AGAIN:
            logger.debug("broadcast writer cannot write to %s (%s)", self._sessions.where, detail)
            return False
        logger.warning(
            "broadcast writer cannot write to %s (%s); %d message(s) wait, retrying with backoff",
            self._sessions.where,
            detail,
            len(self._pending),
        )
        return True

    def _report_not_ready(self, exc: BaseException) -> None:
        detail = self._sessions.error_text(exc)
        if detail != self._not_ready:
            logger.warning(
                "broadcaster cannot use broadcast table %r on %s: %s; retrying with backoff",
                self._outbox.table,
                self._sessions.where,
                detail,
            )
        self._not_ready = detail

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

    def write(self, conn: psycopg.Connection[Any], batch: Iterable[Pending]) -> None:
        """Commit ``batch`` to the outbox in one statement and wake flush() waiters.

        Args:
            conn: a lent session (see :meth:`Sessions.borrow`).
            batch: the messages, in publishing order.
        """
        items = tuple(batch)
        if len(items) == 1:
            item = items[0]
            kind = ONE
            params = [item.channel.encode(), item.payload, str(item.seq).encode()]
        else:
            kind = MANY
            params = [
                text_array(i.channel.encode() for i in items),
                text_array(i.payload for i in items),
                b"{" + ",".join(str(i.seq) for i in items).encode() + b"}",
            ]
        result = self._statements.run(conn, kind, params)
        if result.ntuples == 0:
            # The name finds another table now, or none: nothing was inserted.
            where = self._statements.outbox.ident.as_string(conn)
            self._statements.forget()
            raise Relocated(
                f"broadcast table {self._outbox.table!r} is no longer {where}, or its state "
                "table lost its row"
            )
        self._committed_through(items[-1].seq, len(items))

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
    ) -> None:
        """Find out whether a batch whose commit was never confirmed did commit: whether
        the outbox holds its last message (its origin and origin_seq; a batch commits
        whole or not at all)."""
        if old is not None:
            # The old session may still hold the batch (its client gave up, the server
            # did not): end it and wait until it is gone, so it cannot commit later.
            deadline = time.monotonic() + self._settings.io_timeout
            with self._deadlines.guard(conn, self._settings.io_timeout + 1.0):
                query_one(
                    conn,
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE pid = %s AND backend_start IS NOT DISTINCT FROM %s",
                    old,
                )
                while query_one(
                    conn,
                    "SELECT 1 FROM pg_stat_activity"
                    " WHERE pid = %s AND backend_start IS NOT DISTINCT FROM %s",
                    old,
                ):
                    if time.monotonic() > deadline:
                        raise BackendUnavailable(
                            f"the broadcast writer's previous session (pid {old[0]}) did "
                            "not end; retrying"
                        )
                    time.sleep(0.02)
        with self._deadlines.guard(conn, self._settings.io_timeout):
            # Wherever the table the batch was sent to is now; none: it was dropped,
            # with the batch if it had committed.
            table = Locator.at(conn, self._doubtful_in) if self._doubtful_in else None
            row = (
                None
                if table is None
                else query_one(conn, Outbox.committed(table), (self._origin, batch[-1].seq))
            )
        if row is not None and row[0]:
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
            with self._deadlines.guard(conn, self._settings.io_timeout):
                row = query_one(conn, self._statements.outbox.purge(), (retention, _PURGE_ROWS))
            deleted = 0 if row is None else int(row[0])
            total += deleted
            if deleted < _PURGE_ROWS or self._stop.is_set():
                break
        if total:
            logger.debug("broadcast: purged %d message(s) older than %s s", total, retention)
        return total
