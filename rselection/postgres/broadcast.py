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

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import psycopg

from ..broadcast import BroadcastStats, OverflowHook, Receiver, Subscription
from ..errors import BackendUnavailable, ConfigError
from ._broadcast_base import Pending
from ._broadcast_conn import abort_socket, first_line
from ._broadcast_listener import BroadcastListener, Gap, GapHook
from ._broadcast_writer import BroadcastWriter
from ._conn import check_conninfo, describe_conninfo
from ._outbox import BROADCAST_TABLE, Outbox, create_outbox, inline_cost

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


class MessageEncodeError(ConfigError, TypeError):
    """A message cannot be published: it has no JSON form (or not one Postgres can store).

    A :class:`~rselection.errors.ConfigError` (so a ``ValueError``) and a ``TypeError``.
    """


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


# The writer thread (_broadcast_writer.py) and the listener thread
# (_broadcast_listener.py) are mixins on the state they share (_broadcast_base.py); this
# class validates the configuration, starts them, and holds the public API.
class PostgresBroadcaster(BroadcastListener, BroadcastWriter):
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
        self._init_shared()
        self._init_listener(on_gap)
        self._init_writer()
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
        item = Pending(0, channel, data, inline_cost(channel, payload))
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
                f"{first_line(exc, self._conninfo)}"
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
                    abort_socket(conn)
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
