"""In-process fan-out of messages to bounded subscriptions and synchronous receivers.

A :class:`Broadcaster` delivers each published message to every :class:`Subscription`
and every connected receiver of a channel. Publishing never blocks: each subscription
owns a bounded buffer, and when that buffer is full the message is dropped for that
subscription only, counted in :attr:`Subscription.overflowed` and reported (a warning
log, rate-limited, plus an optional ``on_overflow`` hook).

Receivers connected with :meth:`Broadcaster.connect` are called synchronously in the
publisher's thread through a blinker signal per channel; a receiver that raises is
logged and never disturbs the publisher or the other receivers.

:meth:`Broadcaster.close` ends everything at once: blocked readers wake up, iterators
end, and later calls to :meth:`Broadcaster.publish` or :meth:`Broadcaster.subscribe`
raise :class:`BroadcasterClosed`. Nothing ever waits on a slow reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from blinker import Namespace, Signal

from rselection import forks
from rselection.closeable import Closeable
from rselection.errors import ConfigError, RSelectionError

__all__ = [
    "BroadcastStats",
    "Broadcaster",
    "BroadcasterClosed",
    "OverflowHook",
    "Receiver",
    "Subscription",
    "SubscriptionClosed",
]

logger = logging.getLogger(__name__)

Receiver = Callable[[str, Any], object]
"""A callback connected with :meth:`Broadcaster.connect`: ``receiver(channel, message)``."""

OverflowHook = Callable[[str, "Subscription"], object]
"""The ``on_overflow`` hook: ``hook(channel, subscription)``, called on a reported overflow."""

# Overflow reporting: the first drop of a subscription is reported, then at most once per
# this many further drops or once per this many seconds, whichever comes first.
_REPORT_EVERY = 1000
_REPORT_INTERVAL = 10.0

# Clock used for overflow rate limiting (a module attribute so tests can replace it).
_clock = time.monotonic

_WAIT = object()  # what a reader finds when it must wait for a message


class SubscriptionClosed(RSelectionError):
    """Raised by :meth:`Subscription.get` once the subscription is closed and drained."""


class BroadcasterClosed(RSelectionError, RuntimeError):
    """Raised by :class:`Broadcaster` methods called after :meth:`Broadcaster.close`."""


def _check_channel(channel: object) -> str:
    """Return ``channel`` if it is a non-empty str, else raise :class:`ConfigError`."""
    if not isinstance(channel, str) or not channel:
        raise ConfigError(f"channel must be a non-empty str, got {channel!r}")
    return channel


def _wake(fut: asyncio.Future[None]) -> None:
    """Resolve an async waiter's future unless it is already done (runs on its loop)."""
    if not fut.done():
        fut.set_result(None)


@dataclass(frozen=True)
class BroadcastStats:
    """A snapshot of a :class:`Broadcaster`, returned by :meth:`Broadcaster.stats`.

    :param subscribers: open subscriptions per channel (channels with none are omitted).
    :param receivers: connected receivers per channel (channels with none are omitted).
    :param overflowed: messages dropped so far across every subscription, closed ones too.
    :param closed: whether :meth:`Broadcaster.close` was called.
    """

    subscribers: dict[str, int] = field(default_factory=dict)
    receivers: dict[str, int] = field(default_factory=dict)
    overflowed: int = 0
    closed: bool = False


class Subscription(Closeable):
    """A bounded buffer of the messages published on one channel; read it, then close it.

    Create one with :meth:`Broadcaster.subscribe`, never directly. Read with
    :meth:`get`, :meth:`get_nowait`, :meth:`aget`, ``for message in sub`` or
    ``async for message in sub``. Any number of threads and event loops may read the
    same subscription; each message goes to exactly one reader.

    After :meth:`close` (or :meth:`Broadcaster.close`) no new message is accepted;
    messages already buffered can still be read, then readers get
    :class:`SubscriptionClosed` and iterators end.

    :param broadcaster: the broadcaster that feeds this subscription.
    :param channel: the channel subscribed to.
    :param maxsize: how many unread messages to buffer before dropping new ones.
    """

    def __init__(self, broadcaster: Broadcaster, channel: str, maxsize: int) -> None:
        self._broadcaster = broadcaster
        self._channel = channel
        self._maxsize = maxsize
        self._buffer: deque[object] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._async_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._overflowed = 0
        self._reported_at_count = 0
        self._reported_at_time = 0.0
        self._readers_waiting = 0  # readers blocked in get/aget (for tests and repr)

    # -- properties ----------------------------------------------------------------

    @property
    def channel(self) -> str:
        """The channel this subscription receives."""
        return self._channel

    @property
    def maxsize(self) -> int:
        """How many unread messages are buffered before new ones are dropped."""
        return self._maxsize

    @property
    def overflowed(self) -> int:
        """How many messages were dropped because the buffer was full."""
        return self._overflowed

    @property
    def pending(self) -> int:
        """How many messages are buffered and not read yet."""
        return len(self._buffer)

    @property
    def closed(self) -> bool:
        """Whether the subscription (or its broadcaster) was closed."""
        return self._closed

    # -- producer side (called by Broadcaster.publish) ------------------------------

    def _offer(self, message: object) -> bool:
        """Buffer ``message`` without blocking; return whether it was accepted."""
        with self._cond:
            if self._closed:
                return False
            if len(self._buffer) >= self._maxsize:
                self._overflowed += 1
                count = self._overflowed
                now = _clock()
                report = (
                    count == 1
                    or count - self._reported_at_count >= _REPORT_EVERY
                    or now - self._reported_at_time >= _REPORT_INTERVAL
                )
                if report:
                    self._reported_at_count = count
                    self._reported_at_time = now
                accepted = False
                waiters: list[asyncio.Future[None]] = []
            else:
                self._buffer.append(message)
                self._cond.notify()
                waiters = self._async_waiters
                if waiters:
                    self._async_waiters = []
                accepted = True
                report = False
        if accepted:
            self._wake_async(waiters)
        else:
            self._broadcaster._overflow(self, report)
        return accepted

    @staticmethod
    def _wake_async(waiters: list[asyncio.Future[None]]) -> None:
        """Resolve each async waiter's future on its own loop, from any thread."""
        for fut in waiters:
            # RuntimeError: the waiter's event loop is closed, nobody is left to wake.
            with contextlib.suppress(RuntimeError):
                fut.get_loop().call_soon_threadsafe(_wake, fut)

    # -- reading --------------------------------------------------------------------

    def _next(self, remaining: float | None, timeout: float | None) -> object:
        """Under the lock: the next buffered message, or :data:`_WAIT` when a reader
        waits ``remaining`` seconds (``None``: no bound) for one.

        Raises:
            SubscriptionClosed: closed, and every buffered message was read.
            TimeoutError: none buffered and no time left (of ``timeout``).
        """
        if self._buffer:
            return self._buffer.popleft()
        if self._closed:
            raise SubscriptionClosed(
                f"subscription to channel {self._channel!r} is closed; "
                "subscribe again to receive more messages"
            )
        if remaining is not None and remaining <= 0:
            raise TimeoutError(f"no message on channel {self._channel!r} within {timeout} s")
        return _WAIT

    def get(self, timeout: float | None = None) -> object:
        """Return the next message, waiting for one if none is buffered.

        :param timeout: seconds to wait at most; ``None`` waits until a message arrives
            or the subscription closes, ``0`` does not wait.
        :raises TimeoutError: no message arrived within ``timeout``.
        :raises SubscriptionClosed: the subscription is closed and every buffered
            message was read.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                message = self._next(remaining, timeout)
                if message is not _WAIT:
                    return message
                self._readers_waiting += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._readers_waiting -= 1

    def get_nowait(self) -> object:
        """Return the next buffered message without waiting.

        :raises TimeoutError: no message is buffered (same as ``get(timeout=0)``).
        :raises SubscriptionClosed: the subscription is closed and drained.
        """
        return self.get(0)

    async def aget(self, timeout: float | None = None) -> object:
        """Return the next message, awaiting one without blocking the event loop.

        The publisher wakes this coroutine with ``loop.call_soon_threadsafe``, so it may
        publish from any thread.

        :param timeout: seconds to wait at most; ``None`` waits until a message arrives
            or the subscription closes.
        :raises TimeoutError: no message arrived within ``timeout``.
        :raises SubscriptionClosed: the subscription is closed and drained.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._cond:
                remaining = None if deadline is None else deadline - loop.time()
                message = self._next(remaining, timeout)
                if message is not _WAIT:
                    return message
                fut: asyncio.Future[None] = loop.create_future()
                self._async_waiters.append(fut)
                self._readers_waiting += 1
            try:
                await asyncio.wait((fut,), timeout=remaining)
            finally:
                with self._cond:
                    self._readers_waiting -= 1
                    # ValueError: a publisher already took the waiter and will wake it.
                    if not fut.done():
                        with contextlib.suppress(ValueError):
                            self._async_waiters.remove(fut)
                if not fut.done():
                    fut.cancel()

    def __iter__(self) -> Subscription:
        """Iterate over messages, blocking for each; ends when the subscription closes."""
        return self

    def __next__(self) -> object:
        """Return the next message, blocking; stop once closed and drained."""
        try:
            return self.get()
        except SubscriptionClosed:
            raise StopIteration from None

    def __aiter__(self) -> Subscription:
        """Iterate asynchronously; never blocks the event loop; ends on close."""
        return self

    async def __anext__(self) -> object:
        """Await the next message; stop once closed and drained."""
        try:
            return await self.aget()
        except SubscriptionClosed:
            raise StopAsyncIteration from None

    # -- closing --------------------------------------------------------------------

    def close(self) -> None:
        """Unsubscribe and wake every blocked reader; calling it again does nothing."""
        if self._close():
            self._broadcaster._discard(self)

    def _close(self) -> bool:
        """Mark closed and wake readers; return whether this call closed it."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        self._wake_async(waiters)
        return True

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<Subscription channel={self._channel!r} {state} pending={self.pending} "
            f"maxsize={self._maxsize} overflowed={self._overflowed}>"
        )


class Broadcaster(Closeable):
    """Fan messages out to the subscriptions and receivers of a channel without blocking.

    Thread-safe: any thread may publish, subscribe, connect or close at any time,
    including while other threads publish.

    :param on_overflow: optional ``hook(channel, subscription)``, called in the
        publisher's thread each time an overflow is reported (the same rate-limited
        moments as the warning log: the first drop of a subscription, then at most
        once per 1000 drops or per 10 s). Read ``subscription.overflowed`` for the
        count. An exception raised by the hook is logged and ignored.
    """

    def __init__(self, *, on_overflow: OverflowHook | None = None) -> None:
        if on_overflow is not None and not callable(on_overflow):
            raise ConfigError(f"on_overflow must be callable or None, got {on_overflow!r}")
        self._on_overflow = on_overflow
        self._lock = threading.Lock()
        self._closed = False
        self._subs: dict[str, tuple[Subscription, ...]] = {}
        self._signals = Namespace()
        self._overflow_total = 0
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): the locks of the broadcaster
        and of its subscriptions are made anew (a parent's thread, a publisher, may have
        held one); subscriptions and receivers carry on in the child."""
        self._lock = threading.Lock()
        for subs in self._subs.values():
            for sub in subs:
                sub._cond = threading.Condition(threading.Lock())

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _closed_error(self, action: str) -> BroadcasterClosed:
        """Build the error raised when ``action`` is attempted after close."""
        return BroadcasterClosed(
            f"broadcaster is closed: cannot {action}; create a new Broadcaster instead"
        )

    def publish(self, channel: str, message: object) -> int:
        """Deliver ``message`` to every subscription and receiver of ``channel``.

        Never blocks on a reader: a subscription whose buffer is full drops the message
        (see :attr:`Subscription.overflowed`). Receivers run here, in this thread; one
        that raises is logged and the others still run.

        :param channel: a non-empty channel name.
        :param message: any object; it is passed as is (not copied) to every reader.
        :returns: the number of deliveries: subscriptions that buffered the message plus
            receivers called (a receiver that raised still counts).
        :raises ConfigError: ``channel`` is not a non-empty str.
        :raises BroadcasterClosed: the broadcaster is closed.
        """
        _check_channel(channel)
        with self._lock:
            if self._closed:
                raise self._closed_error("publish")
            subs = self._subs.get(channel, ())
            signal = self._signals.get(channel)
        delivered = 0
        for sub in subs:
            if sub._offer(message):
                delivered += 1
        if signal is not None and signal.receivers:
            delivered += len(signal.send(channel, message=message))
        return delivered

    def subscribe(self, channel: str, *, maxsize: int = 1000) -> Subscription:
        """Open a subscription that buffers up to ``maxsize`` unread messages of ``channel``.

        :param channel: a non-empty channel name.
        :param maxsize: buffer size, at least 1; when full, new messages are dropped
            for this subscription only.
        :raises ConfigError: bad ``channel`` or ``maxsize``.
        :raises BroadcasterClosed: the broadcaster is closed.
        """
        _check_channel(channel)
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ConfigError(f"maxsize must be an int >= 1, got {maxsize!r}")
        sub = Subscription(self, channel, maxsize)
        with self._lock:
            if self._closed:
                raise self._closed_error("subscribe")
            self._subs[channel] = (*self._subs.get(channel, ()), sub)
        return sub

    def connect(self, channel: str, receiver: Receiver) -> Callable[[], None]:
        """Call ``receiver(channel, message)`` in the publisher's thread on each publish.

        The broadcaster keeps a strong reference to ``receiver`` (lambdas and closures
        stay connected) until the returned function is called or the broadcaster is
        closed. Connecting the same callable twice calls it twice. The order in which
        receivers of one channel run is not specified. Keep receivers short: they run
        inside :meth:`publish`; use :meth:`subscribe` to process messages elsewhere.

        :param channel: a non-empty channel name.
        :param receiver: a plain (not ``async def``) callable.
        :returns: a function that disconnects the receiver; calling it again does nothing.
        :raises ConfigError: ``channel`` is not a non-empty str.
        :raises TypeError: ``receiver`` is not callable or is a coroutine function.
        :raises BroadcasterClosed: the broadcaster is closed.
        """
        _check_channel(channel)
        if not callable(receiver):
            raise TypeError(f"receiver must be callable, got {receiver!r}")
        if inspect.iscoroutinefunction(receiver):
            raise TypeError(
                f"receiver {receiver!r} is a coroutine function; receivers run synchronously "
                "in the publisher's thread: use subscribe() with 'async for' instead"
            )

        def deliver(sender: object, *, message: object) -> None:
            try:
                receiver(channel, message)
            except Exception:
                logger.exception(
                    "broadcast receiver %r on channel %r raised; "
                    "the publisher and the other receivers continue",
                    receiver,
                    channel,
                )

        with self._lock:
            if self._closed:
                raise self._closed_error("connect")
            signal: Signal = self._signals.signal(channel)
            signal.connect(deliver, weak=False)

        def disconnect() -> None:
            with self._lock:
                signal.disconnect(deliver)
                # A channel nobody reads costs nothing: forget its signal (a later
                # connect makes a new one), so channels used once do not pile up.
                if not signal.receivers and self._signals.get(channel) is signal:
                    del self._signals[channel]

        return disconnect

    def close(self) -> None:
        """Close every subscription and disconnect every receiver; calling it again does nothing.

        Blocked readers wake at once: ``get`` raises :class:`SubscriptionClosed` once
        drained and iterators end. Later ``publish``, ``subscribe`` and ``connect`` raise
        :class:`BroadcasterClosed`.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            subs = [sub for group in self._subs.values() for sub in group]
            self._subs = {}
            signals = list(self._signals.values())
            self._signals = Namespace()
        for sub in subs:
            sub._close()
        for signal in signals:
            for receiver in list(signal.receivers.values()):
                signal.disconnect(receiver)

    def stats(self) -> BroadcastStats:
        """Return subscriber and receiver counts per channel and the total overflow."""
        with self._lock:
            return BroadcastStats(
                subscribers={ch: len(group) for ch, group in self._subs.items() if group},
                receivers={
                    ch: len(sig.receivers) for ch, sig in self._signals.items() if sig.receivers
                },
                overflowed=self._overflow_total,
                closed=self._closed,
            )

    def has_readers(self, channel: str | None = None) -> bool:
        """Whether ``channel`` has an open subscription or a connected receiver.

        :param channel: the channel; ``None`` asks about every channel.
        """
        if channel is not None:
            # Read without the lock: a concurrent subscribe may or may not be seen, as
            # with any check made just before it.
            if self._subs.get(channel):
                return True
            signal = self._signals.get(channel)
            return signal is not None and bool(signal.receivers)
        with self._lock:
            return any(self._subs.values()) or any(
                signal.receivers for signal in self._signals.values()
            )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Broadcaster {state} channels={len(self._subs)}>"

    # -- internal callbacks from Subscription ---------------------------------------

    def _discard(self, sub: Subscription) -> None:
        """Forget a subscription that closed itself."""
        with self._lock:
            group = self._subs.get(sub.channel)
            if group is None or sub not in group:
                return
            rest = tuple(s for s in group if s is not sub)
            if rest:
                self._subs[sub.channel] = rest
            else:
                del self._subs[sub.channel]

    def _overflow(self, sub: Subscription, report: bool) -> None:
        """Count a dropped message and, when ``report`` is true, log it and call the hook."""
        with self._lock:
            self._overflow_total += 1
        if not report:
            return
        logger.warning(
            "broadcast subscriber on channel %r is not keeping up: %d message(s) dropped "
            "so far (maxsize=%d); read faster or subscribe with a larger maxsize",
            sub.channel,
            sub.overflowed,
            sub.maxsize,
        )
        hook = self._on_overflow
        if hook is not None:
            try:
                hook(sub.channel, sub)
            except Exception:
                logger.exception(
                    "on_overflow hook %r raised for channel %r; ignored", hook, sub.channel
                )
