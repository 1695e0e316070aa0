"""``PostgresBroadcaster``: the in-process :class:`~rselection.Broadcaster`, across nodes.

Every node of a fleet creates one on the same database and table::

    bc = PostgresBroadcaster("postgresql://...")
    sub = bc.subscribe("orders")
    bc.publish("orders", {"id": 42})  # reaches "orders" subscribers on every node

How it works
------------

**Outbox.** :meth:`PostgresBroadcaster.publish` encodes the message as JSON at once
(what JSON cannot encode raises :class:`MessageEncodeError` in the caller) and hands it
to this broadcaster's writer thread, which appends it to an outbox table (see
:mod:`rselection.postgres._outbox`) with an increasing ``id`` and sends one ``NOTIFY``
in the same transaction. ``publish`` never waits for Postgres (it is safe in ``async
def`` code); :meth:`PostgresBroadcaster.flush` waits until what was published is
committed. The writer puts every message waiting at that moment in one transaction, so
a burst costs one round trip per batch, not per message. Its statements are prepared
once per connection and run through libpq with text parameters (a lone message uses a
simpler statement than a batch), so a publish costs little more than a bare NOTIFY.

**One order for everyone.** A publish takes a transaction-level advisory lock before its
ids are drawn and holds it through its commit, so ids become visible strictly in
increasing order. Each node's listener thread keeps the last id it delivered and
fetches ``id > last`` in order: no message is skipped, none is delivered twice, and
every node delivers the messages in the same order (the order of the ids); messages of
one publisher keep the order in which it published them. The publisher's own
subscribers get its messages the same way, exactly once.

**NOTIFY is only a wake-up.** One NOTIFY channel per table (its name is a hash of the
schema-qualified table name, so logical channel names may be of any length and
characters). A batch whose rows fit in a few kilobytes travels inside the NOTIFY
payload; larger ones send only the last id and listeners fetch the rows. So a message
of any size (up to ``max_message_bytes``) is delivered whole.

**LISTEN only for readers.** The listener connects at construction but LISTENs only
while its node has subscriptions or receivers, so a node that only publishes is not
woken by every message. The first :meth:`~PostgresBroadcaster.subscribe` or
:meth:`~PostgresBroadcaster.connect` makes it LISTEN and read the newest id, and returns
once it has: every message committed after that is delivered. When the last reader has
gone, the listener UNLISTENs at its next wake-up.

**Nothing lost while disconnected.** NOTIFY is dropped for a listener that is not
connected. After every (re)connect the listener LISTENs first and then fetches every
row after its last id, so it catches up in order. Rows are kept for ``retention``
seconds (server time); the writers delete older ones now and then and record the
highest id they deleted. A listener that finds rows it never read among the deleted
ones reports a *gap*: a warning log, ``stats().gaps``, and the ``on_gap`` hook. Nothing
is dropped silently.

**Dead connections.** The listener has its own connection (never a lease's), with TCP
keepalives and ``tcp_user_timeout``. When it has heard nothing for ``probe_interval``
seconds it polls the outbox, and a round trip that overruns ``timeout`` aborts the
connection, so a half-open connection (a silent partition) is found within
``probe_interval + timeout``. It reconnects with capped exponential backoff and jitter.

**Exactly once on writer failures.** A publish whose connection breaks before the commit
was confirmed may or may not have committed. The writer then reconnects, ends the old
backend (``pg_terminate_backend``, waiting until it is gone so it cannot commit later),
and looks up the last ``origin_seq`` its origin committed before writing the batch
again, so a batch is never written twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import psycopg
from psycopg import pq, sql

from ..broadcast import (
    Broadcaster,
    BroadcasterClosed,
    BroadcastStats,
    OverflowHook,
    Receiver,
    Subscription,
)
from ..errors import BackendUnavailable, ConfigError
from ._conn import check_conninfo, describe_conninfo, redact
from ._outbox import (
    BROADCAST_TABLE,
    INLINE_LIMIT,
    Outbox,
    create_outbox,
    inline_cost,
    inline_row,
    text_array,
)

__all__ = [
    "Gap",
    "GapHook",
    "MessageEncodeError",
    "PostgresBroadcastStats",
    "PostgresBroadcaster",
    "create_broadcast_tables",
]

logger = logging.getLogger(__name__)

#: Largest ``max_message_bytes`` accepted (Postgres text holds at most 1 GB, and a whole
#: fetch batch is held in memory).
_MAX_MESSAGE_LIMIT = 256 * 1024 * 1024

#: Bytes of JSON a writer puts in one transaction at most (and rows at most).
_BATCH_BYTES = 4 * 1024 * 1024
_BATCH_ROWS = 1000

#: Bytes of rows a listener fetches per round trip at most (it fetches again for more).
_FETCH_BYTES = 16 * 1024 * 1024
_FETCH_ROWS = 1000

#: Rows a purge deletes per statement; it repeats until nothing old is left.
_PURGE_ROWS = 10_000

#: Reconnect backoff: the first wait, doubling to the cap, each jittered to 50-100%.
_BACKOFF_FIRST = 0.1
_BACKOFF_CAP = 5.0


class MessageEncodeError(ConfigError, TypeError):
    """A message cannot be published: it has no JSON form (or not one Postgres can store).

    A :class:`~rselection.errors.ConfigError` (so a ``ValueError``) and a ``TypeError``.
    """


@dataclass(frozen=True)
class Gap:
    """Messages this node can no longer deliver: they were deleted by retention unread.

    :param after_id: the last outbox id delivered before the gap.
    :param through_id: the highest id the gap may cover; ids ``after_id + 1`` through
        ``through_id`` were not delivered (some may be ids of failed publishes, which
        never held a message).
    :param missed: an upper bound of the messages lost: ``through_id - after_id``.
    """

    after_id: int
    through_id: int

    @property
    def missed(self) -> int:
        """At most this many messages were lost."""
        return self.through_id - self.after_id


GapHook = Callable[[Gap], object]
"""The ``on_gap`` hook: ``hook(gap)``, called in the listener thread for each gap."""


@dataclass(frozen=True)
class PostgresBroadcastStats(BroadcastStats):
    """A snapshot of a :class:`PostgresBroadcaster` (see :meth:`PostgresBroadcaster.stats`).

    Adds to :class:`~rselection.broadcast.BroadcastStats`:

    :param published: messages this node committed to the outbox.
    :param pending: messages published here and not committed yet.
    :param received: outbox rows this node's listener read (every channel).
    :param gaps: gaps reported (see :class:`Gap`); 0 unless a listener fell behind by more
        than the retention.
    :param missed: upper bound of the messages lost in those gaps.
    :param reconnects: times the listener lost its connection and connected again.
    :param listening: whether the listener LISTENs (this node has readers) and has
        caught up.
    :param last_id: the outbox id of the last message delivered.
    :param listener_pid: the backend pid of the listener's session (``None`` while
        disconnected), to find it in ``pg_stat_activity``.
    """

    published: int = 0
    pending: int = 0
    received: int = 0
    gaps: int = 0
    missed: int = 0
    reconnects: int = 0
    listening: bool = False
    last_id: int = 0
    listener_pid: int | None = None


def _positive(value: object, label: str, *, minimum: float = 0.0) -> float:
    """Return ``value`` as a float, or raise :class:`ConfigError` unless finite and > minimum."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{label} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= minimum:
        raise ConfigError(f"{label} must be finite and greater than {minimum:g} s, got {value!r}")
    return float(value)


def _count(value: object, label: str, *, minimum: int, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int in range, else raise :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{label} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{label} must be at most {maximum}, got {value!r}")
    return value


def _backoff(failures: int) -> float:
    """Capped exponential backoff with jitter after ``failures`` failed attempts (>= 1)."""
    base = min(_BACKOFF_CAP, _BACKOFF_FIRST * float(2 ** min(failures - 1, 16)))
    return base * random.uniform(0.5, 1.0)


def _abort_socket(conn: psycopg.Connection[Any]) -> None:
    """Shut ``conn``'s socket down so a thread blocked on it wakes with an error at once.

    The descriptor itself stays open (psycopg closes it later), so it cannot be reused by
    another socket while the blocked thread still refers to it.
    """
    try:
        fd = conn.pgconn.socket
        dup = socket.socket(fileno=os.dup(fd))
    except (OSError, psycopg.Error):
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


class _Deadlines:
    """Aborts a connection whose round trip overruns its bound, without a wake-up per call.

    Like :class:`~rselection.postgres._conn.IoWatchdog` (a peer that accepts bytes and
    never answers must not hang a thread forever), but arming is a plain assignment and
    one thread checks every ``tick`` seconds: a publish costs no extra thread switch,
    which matters at thousands of messages a second. A round trip is aborted between
    ``bound`` and ``bound + tick`` seconds after it started.

    Args:
        tick: seconds between checks.
    """

    def __init__(self, tick: float) -> None:
        self._tick = tick
        self._armed: dict[int, tuple[float, psycopg.Connection[Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="rselection-broadcast-deadlines", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
        """Abort ``conn``'s socket if the ``with`` body runs longer than about ``seconds``."""
        key = threading.get_ident()
        self._armed[key] = (time.monotonic() + seconds, conn)
        try:
            yield
        finally:
            # The checker aborts under the lock, and only connections still armed: once
            # disarmed here, a connection is never touched again (no reused socket hit).
            with self._lock:
                self._armed.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            with self._lock:
                for key, (deadline, conn) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[key]
                        logger.debug("broadcast: aborting a round trip that overran its bound")
                        _abort_socket(conn)

    def close(self) -> None:
        """Stop the checker thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self._tick + 5.0)


#: Names of the publish statements prepared on every writer connection.
_ONE_INLINE = b"rselection_bc_one_inline"
_ONE = b"rselection_bc_one"
_MANY_INLINE = b"rselection_bc_many_inline"
_MANY = b"rselection_bc_many"


def _check_result(conn: psycopg.Connection[Any], result: pq.abc.PGresult, ok: int) -> None:
    """Raise the ``psycopg.Error`` a libpq result reports unless its status is ``ok``."""
    if result.status != ok:
        raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)


def _first_line(exc: BaseException, conninfo: str) -> str:
    text = str(exc).strip()
    return redact(text.splitlines()[0], conninfo) if text else type(exc).__name__


def create_broadcast_tables(conn: psycopg.Connection[Any], *, table: str = BROADCAST_TABLE) -> None:
    """Create the outbox tables of :class:`PostgresBroadcaster` if they do not exist.

    For deployments where the application role may not run DDL: run this once with a
    privileged role, then create broadcasters with ``create_tables=False``. Safe to run
    from many processes at once (serialised by the same advisory lock as
    :func:`~rselection.postgres.migrate`).

    Args:
        conn: an open psycopg connection.
        table: the outbox table name, optionally schema-qualified.

    Raises:
        ConfigError: unsafe table name, or a newer schema version than this release knows.
        BackendUnavailable: the database refused; the message says why.
    """
    outbox = Outbox(table)
    try:
        create_outbox(conn, outbox)
    except psycopg.Error as exc:
        raise BackendUnavailable(f"cannot create the broadcast table {table!r}: {exc}") from exc


@dataclass
class _Pending:
    """A message waiting for the writer."""

    seq: int
    channel: str
    payload: bytes  # the message as UTF-8 JSON
    inline: int  # upper bound of its bytes in an inline NOTIFY

    @property
    def size(self) -> int:
        """Bytes of JSON."""
        return len(self.payload)


class PostgresBroadcaster(Broadcaster):
    """A :class:`~rselection.Broadcaster` whose messages reach every node on the database.

    ``publish(channel, message)`` on any node delivers ``message`` to the subscriptions
    and receivers of ``channel`` on every node with a broadcaster on the same table (this
    one included, once), in the same order everywhere. Local fan-out is the
    :class:`~rselection.Broadcaster`'s: bounded per-subscription buffers, overflow counted
    and reported, a slow subscriber never holds up the others. Receivers connected with
    :meth:`connect` run in the listener thread: keep them short. See the module docstring
    for how delivery, ordering, catch-up and gaps work.

    The listener connects in the background at construction, and LISTENs only while
    this node has subscriptions or receivers: a node that only publishes is not woken
    by every message. :meth:`subscribe` and :meth:`connect` return once the listener
    knows where it starts (a round trip or two when it is not listening yet, at most
    ``timeout`` seconds), so every message committed after they return is delivered.

    Args:
        conninfo: a libpq connection string or URI. The broadcaster opens two connections
            of its own (listener and writer, the writer on first publish).
        table: outbox table, optionally schema-qualified (``"ops.broadcast"``); every
            node that should hear each other uses the same one.
        retention: seconds a message stays in the outbox (server time), i.e. how long a
            node may be disconnected and still catch up without a gap. Default 600.
        create_tables: create the tables on first connect; else run
            :func:`create_broadcast_tables` once with a role that may run DDL.
        probe_interval: seconds of silence after which the listener polls the outbox,
            which also checks that its connection is alive.
        timeout: bound of one round trip (connect, write, fetch, probe), seconds; a
            connection that overruns it is dropped and reconnected.
        max_message_bytes: largest message accepted, as UTF-8 JSON (default 1 MiB).
        max_pending: messages that may wait for the writer; when that many wait,
            :meth:`publish` waits for room, and raises
            :class:`~rselection.errors.BackendUnavailable` after ``timeout`` seconds.
        synchronous_commit: wait for the WAL flush on every publish. Off by default: a
            Postgres crash may then lose the last fraction of a second of messages
            (NOTIFY itself keeps nothing across a crash), and publishes are about twice
            as fast. Disconnected listeners never lose messages either way.
        close_timeout: seconds :meth:`close` waits for pending messages to be written.
        on_overflow: see :class:`~rselection.Broadcaster`.
        on_gap: optional ``hook(gap)`` called in the listener thread for each
            :class:`Gap`; an exception it raises is logged and ignored.

    Raises:
        ConfigError: bad connection string, unsafe table name, non-positive or non-finite
            timings, bad limits, or hooks that are not callable.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        table: str = BROADCAST_TABLE,
        retention: float = 600.0,
        create_tables: bool = True,
        probe_interval: float = 5.0,
        timeout: float = 10.0,
        max_message_bytes: int = 1024 * 1024,
        max_pending: int = 10_000,
        synchronous_commit: bool = False,
        close_timeout: float = 5.0,
        on_overflow: OverflowHook | None = None,
        on_gap: GapHook | None = None,
    ) -> None:
        if conninfo is None or (isinstance(conninfo, str) and not conninfo.strip()):
            raise ConfigError(
                "PostgresBroadcaster needs a connection string (postgresql://...), "
                f"got {conninfo!r}"
            )
        check_conninfo(conninfo)
        self._outbox = Outbox(table)  # validates the name
        self.table = table
        self.retention = _positive(retention, "retention")
        self.probe_interval = _positive(probe_interval, "probe_interval")
        self.timeout = _positive(timeout, "timeout")
        self.close_timeout = _positive(close_timeout, "close_timeout")
        self.max_message_bytes = _count(
            max_message_bytes, "max_message_bytes", minimum=1, maximum=_MAX_MESSAGE_LIMIT
        )
        self.max_pending = _count(max_pending, "max_pending", minimum=1)
        self.create_tables = bool(create_tables)
        self.synchronous_commit = bool(synchronous_commit)
        if on_gap is not None and not callable(on_gap):
            raise ConfigError(f"on_gap must be callable or None, got {on_gap!r}")
        super().__init__(on_overflow=on_overflow)
        self._conninfo = conninfo
        self._where = describe_conninfo(conninfo)
        self._on_gap = on_gap
        # Purge often enough that the table holds little more than the retention, but
        # at most once a second and at least once a minute.
        self._purge_every = min(60.0, max(1.0, self.retention / 10))
        self._fetch_rows = max(1, min(_FETCH_ROWS, _FETCH_BYTES // self.max_message_bytes))
        self._origin = secrets.randbits(63)

        # State shared by the publisher, the writer and close(); guarded by _cond.
        self._cond = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._seq = 0  # seq of the last message accepted by publish()
        self._committed = 0  # seq of the last message committed
        self._committed_count = 0  # messages committed
        self._closing = False
        self._stop = threading.Event()

        # Listener state (written by the listener thread only, read by stats()).
        self._connected = threading.Event()  # the listener connected once (wait_ready)
        # Set while the listener LISTENs (or reconnects to LISTEN again) from a known
        # position; cleared, under _lstate, only when this node has no readers left.
        self._positioned = threading.Event()
        self._lstate = threading.Lock()
        self._wake = threading.Event()  # a reader arrived: the idle listener starts
        self._last_id = 0
        self._received = 0
        self._gaps = 0
        self._missed = 0
        self._reconnects = 0
        self._listening = False
        self._listener_pid: int | None = None

        # Connections other threads may need to abort on close.
        self._conn_lock = threading.Lock()
        self._listen_conn: psycopg.Connection[Any] | None = None
        self._write_conn: psycopg.Connection[Any] | None = None
        self._watchdog = _Deadlines(min(0.5, self.timeout / 4))
        self._resolved_cache: tuple[str, int] | None = None  # (notify channel, lock key)
        self._written_id = 0  # the last outbox id this writer committed
        self._fixed_params: list[bytes] = []  # lock key, origin, NOTIFY channel

        self._listener = threading.Thread(
            target=self._listen_loop, name="rselection-broadcast-listen", daemon=True
        )
        self._writer = threading.Thread(
            target=self._write_loop, name="rselection-broadcast-write", daemon=True
        )
        self._listener.start()
        self._writer.start()

    # -- public API -----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (publishing is refused from that moment)."""
        return self._closing or super().closed

    def publish(self, channel: str, message: object) -> int:
        """Publish ``message`` on ``channel`` to every node, this one included.

        Encodes the message as JSON now and returns without waiting for Postgres (unless
        ``max_pending`` messages already wait); the writer thread commits it shortly (see
        :meth:`flush`). Subscribers receive the
        decoded JSON: tuples come back as lists, and dict keys must be strings to come
        back unchanged.

        :param channel: a non-empty str of any length (no NUL characters: Postgres text
            cannot hold them).
        :param message: anything :func:`json.dumps` encodes (no NaN or infinities).
        :returns: how many messages of this broadcaster wait to be written, this one
            included (local deliveries happen later, when the message comes back from
            Postgres).
        :raises ConfigError: bad channel, or the message is larger than
            ``max_message_bytes``.
        :raises MessageEncodeError: the message has no JSON form.
        :raises BroadcasterClosed: the broadcaster is closed.
        :raises BackendUnavailable: ``max_pending`` messages still wait to be written
            after ``timeout`` seconds (Postgres is unreachable or too slow). Until then
            a full queue makes this call wait: the only case where it blocks.
        """
        self._check_pg_channel(channel)
        if self.closed:
            raise self._closed_error("publish")
        payload = self._encode(channel, message)
        data = payload.encode()
        size = len(data)
        if size > self.max_message_bytes:
            raise ConfigError(
                f"message on channel {channel!r:.80} is {size} bytes as JSON, more than "
                f"max_message_bytes={self.max_message_bytes}: send less (a key to the "
                "data rather than the data), or raise the limit"
            )
        item = _Pending(0, channel, data, inline_cost(channel, payload))
        with self._cond:
            deadline = None
            while len(self._pending) >= self.max_pending and not self.closed:
                # Backpressure: a burst larger than the queue waits for the writer.
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout
                if now >= deadline:
                    break
                self._cond.wait(deadline - now)
            if self.closed:
                raise self._closed_error("publish")
            if len(self._pending) >= self.max_pending:
                raise BackendUnavailable(
                    f"cannot publish on channel {channel!r:.80}: {len(self._pending)} "
                    f"messages have waited {self.timeout:g} s to be written to Postgres "
                    f"({self._where}); the database is unreachable or too slow. Retry "
                    "later, or raise max_pending"
                )
            self._seq += 1
            item.seq = self._seq
            self._pending.append(item)
            waiting = len(self._pending)
            self._cond.notify_all()
        return waiting

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message published so far is committed to the outbox.

        :param timeout: seconds to wait at most; ``None`` waits as long as it takes.
        :returns: ``True`` when they are committed, ``False`` on timeout or when the
            broadcaster closed with messages unwritten.
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

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the broadcaster has connected to Postgres once (its tables ready)
        and, while this node has subscriptions or receivers, until its listener LISTENs.

        Subscribing needs no ``wait_ready()`` first: :meth:`subscribe` itself waits
        until messages published from then on are delivered.

        :param timeout: seconds to wait at most; ``None`` waits as long as it takes.
        :returns: whether the broadcaster is ready.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._connected.wait(timeout):
            return False
        if not self._has_any_readers():
            return True
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._positioned.wait(remaining)

    def subscribe(self, channel: str, *, maxsize: int = 1000) -> Subscription:
        """Open a subscription to ``channel``: the messages published on it by every node.

        Same as :meth:`rselection.Broadcaster.subscribe`, except that when this node's
        listener is not LISTENing yet (no subscription or receiver before), it waits
        until the listener knows where it starts: every message committed after this
        returns is delivered. That takes a round trip or two (plus connecting, right
        after construction); while Postgres cannot be reached it waits at most
        ``timeout`` seconds, logs a warning and returns, and messages are then delivered
        from the moment the listener connects. Later calls do not wait while the
        listener LISTENs.

        :raises ConfigError: bad ``channel`` or ``maxsize``.
        :raises BroadcasterClosed: the broadcaster is closed.
        """
        sub = super().subscribe(channel, maxsize=maxsize)
        self._await_listener("subscribe")
        return sub

    def connect(self, channel: str, receiver: Receiver) -> Callable[[], None]:
        """Call ``receiver(channel, message)`` in the listener thread for each message.

        Same as :meth:`rselection.Broadcaster.connect`; like :meth:`subscribe`, it
        starts the listener and waits until it knows where it starts.
        """
        disconnect = super().connect(channel, receiver)
        self._await_listener("connect")
        return disconnect

    def purge(self) -> int:
        """Delete the messages older than ``retention`` now; return how many.

        The writer does this on its own every ``retention / 10`` seconds (1 to 60 s) while
        it has a connection; call it to purge from a node that never publishes.

        :raises BackendUnavailable: the database could not be reached.
        """
        conn = self._connect("purge the broadcast table", listen=False)
        try:
            return self._purge(conn)
        except psycopg.Error as exc:
            raise BackendUnavailable(
                f"cannot purge the broadcast table {self.table!r} ({self._where}): "
                f"{_first_line(exc, self._conninfo)}"
            ) from exc
        finally:
            conn.close()

    def stats(self) -> PostgresBroadcastStats:
        """Return local fan-out counts plus the cross-node counters (see the class)."""
        base = super().stats()
        with self._cond:
            pending = len(self._pending)
            published = self._committed_count
        common = {f.name: getattr(base, f.name) for f in fields(BroadcastStats)}
        common["closed"] = self.closed
        return PostgresBroadcastStats(
            **common,
            published=published,
            pending=pending,
            received=self._received,
            gaps=self._gaps,
            missed=self._missed,
            reconnects=self._reconnects,
            listening=self._listening,
            last_id=self._last_id,
            listener_pid=self._listener_pid,
        )

    def close(self) -> None:
        """Write what is pending (up to ``close_timeout``), stop, close every subscription.

        Calling it again does nothing. Messages still unwritten after ``close_timeout``
        are dropped with a warning log that says how many.
        """
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        if not self.flush(self.close_timeout):
            with self._cond:
                lost = len(self._pending)
            if lost:
                logger.warning(
                    "broadcaster closed with %d message(s) not written to %s within "
                    "close_timeout=%s s; they are dropped",
                    lost,
                    self._where,
                    self.close_timeout,
                )
        self._stop.set()
        self._wake.set()  # an idle listener waits on it, not on its socket
        with self._cond:
            self._cond.notify_all()
        with self._conn_lock:
            for conn in (self._listen_conn, self._write_conn):
                if conn is not None:
                    _abort_socket(conn)
        for thread in (self._listener, self._writer):
            if thread is not threading.current_thread():
                thread.join(self.timeout + 5.0)
        self._watchdog.close()
        super().close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("listening" if self._listening else "connecting")
        return f"<PostgresBroadcaster {self.table!r} {state} {self._where} last_id={self._last_id}>"

    # -- validation -------------------------------------------------------------------

    @staticmethod
    def _check_pg_channel(channel: object) -> None:
        if not isinstance(channel, str) or not channel:
            raise ConfigError(f"channel must be a non-empty str, got {channel!r:.80}")
        if "\x00" in channel:
            raise ConfigError(
                f"channel {channel!r:.80} holds a NUL character, which Postgres text "
                "cannot store; use another name"
            )
        try:
            channel.encode()
        except UnicodeEncodeError as exc:
            raise ConfigError(
                f"channel {channel!r:.80} is not valid Unicode (a lone surrogate): {exc}"
            ) from None

    @staticmethod
    def _encode(channel: str, message: object) -> str:
        try:
            text = json.dumps(message, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
        except TypeError as exc:
            raise MessageEncodeError(
                f"message on channel {channel!r:.80} cannot be sent as JSON: {exc}; publish "
                "dict (str keys), list, str, int, float, bool and None, and convert other "
                "values (datetimes, sets, objects) first"
            ) from exc
        except (ValueError, RecursionError) as exc:
            raise MessageEncodeError(
                f"message on channel {channel!r:.80} cannot be sent as JSON: {exc} "
                "(NaN and infinities, circular or too deeply nested structures are refused)"
            ) from exc
        try:
            text.encode()
        except UnicodeEncodeError:
            # A lone surrogate has no UTF-8 form; JSON can still carry it as an escape.
            text = json.dumps(message, allow_nan=False, ensure_ascii=True, separators=(",", ":"))
        return text

    # -- connections -------------------------------------------------------------------

    def _connect(self, what: str, *, listen: bool) -> psycopg.Connection[Any]:
        """Open an autocommit connection with keepalives and timeouts, tables ready."""
        bound = self.probe_interval + self.timeout if listen else self.timeout
        try:
            conn = psycopg.Connection.connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=max(2, math.ceil(self.timeout)),
                application_name="rselection:broadcast",
                # Publish parameters are sent as UTF-8 bytes (see _write).
                client_encoding="UTF8",
                # A silent network ends a blocked call within about `bound` seconds even
                # where the watchdog is not armed (the listener's idle wait).
                keepalives=1,
                keepalives_idle=max(1, math.ceil(bound / 2)),
                keepalives_interval=1,
                keepalives_count=3,
                tcp_user_timeout=math.ceil(self.timeout * 1000) + 1000,
            )
        except psycopg.Error as exc:
            raise BackendUnavailable(
                f"cannot {what}: cannot connect ({self._where}): {_first_line(exc, self._conninfo)}"
            ) from exc
        try:
            with self._watchdog.guard(conn, self.timeout):
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, false),"
                    " set_config('idle_session_timeout', '0', false),"
                    " set_config('synchronous_commit', %s, false)",
                    (
                        f"{math.ceil(self.timeout * 1000)}ms",
                        "on" if self.synchronous_commit else "off",
                    ),
                )
                if self.create_tables:
                    create_outbox(conn, self._outbox)
        except BaseException:
            conn.close()
            raise
        return conn

    # -- listener ------------------------------------------------------------------------

    def _has_any_readers(self) -> bool:
        """Whether this node has an open subscription or a connected receiver."""
        with self._lock:
            return any(self._subs.values()) or any(
                signal.receivers for signal in self._signals.values()
            )

    def _keep_listening(self) -> bool:
        """Whether the listener should LISTEN; forget the position when it should not.

        Checked and cleared under ``_lstate``, which :meth:`_await_listener` also holds
        to read the position: a reader added before this check keeps the listener, one
        added after it finds the position cleared and waits for a new one.
        """
        if self._subs:
            return True  # the common case, checked per message: no lock, nothing changes
        with self._lstate:
            if self._has_any_readers():
                return True
            self._positioned.clear()
            self._listening = False
            return False

    def _await_listener(self, action: str) -> None:
        """Start the listener for a new reader and wait until it knows its position."""
        with self._lstate:
            if self._positioned.is_set():
                return
        self._wake.set()
        if threading.current_thread() is self._listener:
            return  # a receiver subscribing: the listener starts after it returns
        deadline = time.monotonic() + self.timeout
        while not self._positioned.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self._stop.is_set() or self.closed:
                return
            if time.monotonic() >= deadline:
                logger.warning(
                    "broadcast: %s() returns before the listener could LISTEN on %s (not "
                    "within timeout=%s s); messages are delivered from when it connects",
                    action,
                    self._where,
                    self.timeout,
                )
                return

    def _listen_loop(self) -> None:
        failures = 0
        down_since: float | None = None
        last_error = ""

        def healthy() -> None:
            nonlocal failures, down_since, last_error
            if down_since is not None:
                self._reconnects += 1
                logger.info(
                    "broadcast listener reconnected to %s after %.1f s; caught up to id %d",
                    self._where,
                    time.monotonic() - down_since,
                    self._last_id,
                )
            failures, down_since, last_error = 0, None, ""

        while not self._stop.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = self._connect("listen for broadcasts", listen=True)
                with self._conn_lock:
                    if self._stop.is_set():
                        break
                    self._listen_conn = conn
                with self._watchdog.guard(conn, self.timeout):
                    channel, _ = self._outbox.resolve(conn)
                self._listener_pid = conn.info.backend_pid
                self._connected.set()
                self._serve(conn, channel, healthy)
            except (psycopg.Error, OSError, BackendUnavailable, ConfigError) as exc:
                if self._stop.is_set():
                    break
                failures += 1
                detail = _first_line(exc, self._conninfo)
                if down_since is None:
                    down_since = time.monotonic()
                    logger.warning(
                        "broadcast listener lost its connection to %s (%s); reconnecting "
                        "with backoff, messages published meanwhile are fetched afterwards",
                        self._where,
                        detail,
                    )
                elif detail != last_error:
                    logger.warning(
                        "broadcast listener cannot reconnect to %s: %s", self._where, detail
                    )
                last_error = detail
            except Exception:
                # A bug must not silently end delivery: log it and start over.
                failures += 1
                if down_since is None:
                    down_since = time.monotonic()
                logger.exception("broadcast listener failed; restarting it")
            finally:
                self._listening = False
                self._listener_pid = None
                with self._conn_lock:
                    self._listen_conn = None
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
            if failures:
                self._stop.wait(_backoff(failures))

    def _serve(
        self, conn: psycopg.Connection[Any], channel: str, healthy: Callable[[], None]
    ) -> None:
        """LISTEN while this node has readers, deliver NOTIFYs, poll on silence; idle
        otherwise. Returns when we stop; raises when the connection fails."""
        listen = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
        unlisten = sql.SQL("UNLISTEN {}").format(sql.Identifier(channel))
        listening = False
        quiet_since = time.monotonic()
        if not self._has_any_readers():
            healthy()  # connected; nothing to catch up on for nobody
        while not self._stop.is_set():
            wait = max(0.0, quiet_since + self.probe_interval - time.monotonic())
            if not listening:
                self._wake.clear()
                if not self._keep_listening():
                    # Idle: no NOTIFY wakes this node. Wait for a reader; probe the
                    # connection on silence so a dead one is replaced before it is needed.
                    if not self._wake.wait(wait):
                        with self._watchdog.guard(conn, self.timeout):
                            conn.execute("SELECT 1")
                        quiet_since = time.monotonic()
                    continue
                with self._watchdog.guard(conn, self.timeout):
                    conn.execute(listen)
                    if not self._positioned.is_set():
                        # A new start: from the newest row (older ones had no reader here).
                        row = conn.execute(self._outbox.start_position()).fetchone()
                        self._last_id = int(row[0]) if row else 0
                # Catch up on what was published while not listening (LISTEN came first,
                # so nothing committed after this fetch's snapshot can be missed).
                self._catch_up(conn)
                listening = True
                self._listening = True
                self._positioned.set()
                quiet_since = time.monotonic()
                healthy()
                continue
            notes = list(conn.notifies(timeout=wait, stop_after=1))
            if self._stop.is_set():
                return
            if not notes:
                # Silence: poll. The round trip is bounded by the watchdog, so a
                # half-open connection fails here instead of waiting forever.
                self._catch_up(conn)
            else:
                fetch = False
                for note in notes:
                    fetch = self._on_notify(note.payload) or fetch
                if fetch:
                    self._catch_up(conn)
            quiet_since = time.monotonic()
            if not self._keep_listening():
                # The last reader left: stop waking for every message.
                with self._watchdog.guard(conn, self.timeout):
                    conn.execute(unlisten)
                listening = False

    def _on_notify(self, payload: str) -> bool:
        """Deliver the rows a NOTIFY carries; return whether a fetch is needed."""
        if payload.startswith("["):
            try:
                rows = json.loads(payload)
            except ValueError:
                logger.warning("broadcast: ignoring a malformed NOTIFY payload %r", payload[:80])
                return True
            for row in rows:
                row_id = int(row[0])
                if row_id <= self._last_id:
                    continue
                if row_id != self._last_id + 1:
                    # An id in between is unused (a failed publish) or was not seen: the
                    # table knows which; fetching also delivers the rest of this batch.
                    return True
                self._deliver(row_id, row[1], row[2])
            return False
        try:
            return int(payload) > self._last_id
        except ValueError:
            return True

    def _catch_up(self, conn: psycopg.Connection[Any]) -> None:
        """Fetch and deliver every row after the last id, in order, reporting gaps."""
        while not self._stop.is_set():
            with self._watchdog.guard(conn, self.timeout):
                cursor = conn.execute(self._outbox.fetch(), (self._last_id, self._fetch_rows))
                rows = cursor.fetchall()
            purged = int(rows[0][0]) if rows else 0
            if purged > self._last_id:
                self._report_gap(Gap(self._last_id, purged))
            got = 0
            for _, row_id, channel, payload in rows:
                if row_id is None:
                    continue
                got += 1
                if row_id > self._last_id:
                    self._deliver(int(row_id), channel, payload)
            if purged > self._last_id:
                self._last_id = purged
            if got < self._fetch_rows:
                return

    def _deliver(self, row_id: int, channel: str, payload: str) -> None:
        self._last_id = row_id
        self._received += 1
        if not self._has_readers(channel):
            return  # nobody here listens: skip decoding
        try:
            message = json.loads(payload)
        except ValueError:
            logger.warning(
                "broadcast: outbox row %d on channel %r does not hold JSON; skipped",
                row_id,
                channel[:80],
            )
            return
        with contextlib.suppress(BroadcasterClosed):
            Broadcaster.publish(self, channel, message)

    def _has_readers(self, channel: str) -> bool:
        if self._subs.get(channel):
            return True
        signal = self._signals.get(channel)
        return signal is not None and bool(signal.receivers)

    def _report_gap(self, gap: Gap) -> None:
        self._gaps += 1
        self._missed += gap.missed
        logger.warning(
            "broadcast listener fell behind by more than retention=%s s: messages with ids "
            "%d..%d were deleted before this node read them (at most %d lost); raise "
            "retention or keep nodes connected",
            self.retention,
            gap.after_id + 1,
            gap.through_id,
            gap.missed,
        )
        hook = self._on_gap
        if hook is not None:
            try:
                hook(gap)
            except Exception:
                logger.exception("on_gap hook %r raised; ignored", hook)

    # -- writer --------------------------------------------------------------------------

    def _write_loop(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        identity: tuple[int, Any] | None = None  # (backend pid, backend_start) of conn
        doubtful: tuple[_Pending, ...] = ()  # a batch whose commit is unknown
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
                            _first_line(exc, self._conninfo),
                            len(self._pending),
                        )
                    self._stop.wait(_backoff(failures))
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

    def _take_batch(self) -> tuple[_Pending, ...]:
        """The oldest pending messages that fit in one transaction (caller holds _cond)."""
        batch: list[_Pending] = []
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

    def _write(self, conn: psycopg.Connection[Any], batch: Iterable[_Pending]) -> None:
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
        batch: tuple[_Pending, ...],
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
