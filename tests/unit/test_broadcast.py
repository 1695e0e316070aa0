"""Tests for the in-process broadcaster: bounded fan-out, receivers, async reads, close."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable

import pytest

from rselection import broadcast
from rselection.broadcast import (
    Broadcaster,
    BroadcasterClosed,
    Subscription,
    SubscriptionClosed,
)
from rselection.errors import ConfigError, RSelectionError
from tests.support.waiting import wait_until

LOGGER = "rselection.broadcast"


def start(target: Callable[[], None]) -> threading.Thread:
    """Start a daemon thread running ``target``."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def join_all(threads: list[threading.Thread], timeout: float) -> None:
    """Join every thread within one shared deadline; fail if one is still alive."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} thread(s) still running after {timeout} s"


def test_slow_subscriber_drops_only_its_own_messages(caplog: pytest.LogCaptureFixture) -> None:
    n = 10_000
    hook_calls: list[tuple[str, Subscription]] = []
    b = Broadcaster(on_overflow=lambda ch, sub: hook_calls.append((ch, sub)))
    readers = [b.subscribe("events", maxsize=n) for _ in range(2)]
    slow = b.subscribe("events", maxsize=100)
    received: list[list[object]] = [[], []]

    def read(i: int) -> None:
        for _ in range(n):
            received[i].append(readers[i].get(timeout=10))

    threads = [start(functools.partial(read, i)) for i in range(2)]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    began = time.monotonic()
    deliveries = sum(b.publish("events", i) for i in range(n))
    elapsed = time.monotonic() - began
    join_all(threads, 10)

    assert received[0] == list(range(n))
    assert received[1] == list(range(n))
    assert elapsed < 5.0
    assert deliveries == 3 * 100 + 2 * (n - 100)
    assert slow.overflowed == n - 100
    assert slow.pending == 100
    assert [slow.get_nowait() for _ in range(100)] == list(range(100))
    assert readers[0].overflowed == readers[1].overflowed == 0
    assert b.stats().overflowed == n - 100

    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert warnings, "overflow was not logged"
    assert "events" in warnings[0].getMessage()
    # Rate-limited: the first drop, then once per 1000 drops (10 s cannot pass here
    # without failing the elapsed check above).
    assert 1 <= len(warnings) <= 20
    assert hook_calls and len(hook_calls) == len(warnings)
    assert all(ch == "events" and sub is slow for ch, sub in hook_calls)


def test_overflow_report_rate_limited_by_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(broadcast, "_clock", lambda: now[0])
    hooks: list[int] = []
    b = Broadcaster(on_overflow=lambda ch, sub: hooks.append(sub.overflowed))
    sub = b.subscribe("c", maxsize=1)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for i in range(6):
        b.publish("c", i)  # first fills the buffer, then 5 drops
    assert hooks == [1]
    now[0] += 10.5
    b.publish("c", "late")
    assert hooks == [1, 6]
    assert sub.overflowed == 6
    assert len([r for r in caplog.records if r.name == LOGGER]) == 2


def test_overflow_hook_error_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    def bad_hook(channel: str, sub: Subscription) -> None:
        raise RuntimeError("hook broke")

    b = Broadcaster(on_overflow=bad_hook)
    b.subscribe("c", maxsize=1)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert b.publish("c", 1) == 1
    assert b.publish("c", 2) == 0
    assert any(r.exc_info and "hook" in r.getMessage() for r in caplog.records)


def test_async_iteration_receives_from_other_thread() -> None:
    n = 200
    b = Broadcaster()
    sub = b.subscribe("jobs")
    acked = threading.Event()
    publisher_error: list[BaseException] = []

    def publish_all() -> None:
        try:
            for i in range(n):
                acked.clear()
                b.publish("jobs", i)
                if not acked.wait(5):
                    raise AssertionError(f"message {i} not acknowledged")
        except BaseException as exc:
            publisher_error.append(exc)

    async def main() -> tuple[list[object], int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.create_task(ticker())
        got: list[object] = []
        thread = start(publish_all)

        async def consume() -> None:
            async for message in sub:
                got.append(message)
                acked.set()
                if len(got) == n:
                    break

        await asyncio.wait_for(consume(), timeout=10)
        stop.set()
        await tick_task
        await asyncio.to_thread(thread.join, 5)
        return got, ticks

    got, ticks = asyncio.run(main())
    assert not publisher_error
    assert got == list(range(n))
    assert ticks > 0, "the event loop was blocked while waiting for messages"


def test_aget_timeout_and_cancel_leave_no_waiter() -> None:
    b = Broadcaster()
    sub = b.subscribe("c")

    async def main() -> None:
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            await sub.aget(timeout=0.05)
        assert time.monotonic() - began < 2
        task = asyncio.create_task(sub.aget())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sub._async_waiters == []
        b.publish("c", "x")
        assert await asyncio.wait_for(sub.aget(), 5) == "x"

    asyncio.run(main())


def test_receiver_that_raises_does_not_stop_others(caplog: pytest.LogCaptureFixture) -> None:
    b = Broadcaster()
    seen: list[tuple[str, object]] = []

    def bad(channel: str, message: object) -> None:
        raise ValueError("receiver broke")

    b.connect("c", bad)
    b.connect("c", lambda ch, msg: seen.append((ch, msg)))
    sub = b.subscribe("c")
    caplog.set_level(logging.ERROR, logger=LOGGER)

    assert b.publish("c", 1) == 3
    assert b.publish("c", 2) == 3
    assert seen == [("c", 1), ("c", 2)]
    assert [sub.get_nowait(), sub.get_nowait()] == [1, 2]
    errors = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert errors[0].exc_info is not None
    assert isinstance(errors[0].exc_info[1], ValueError)


def test_connect_keeps_lambda_alive_and_disconnect_works() -> None:
    b = Broadcaster()
    seen: list[object] = []
    disconnect = b.connect("c", lambda ch, msg: seen.append(msg))
    import gc

    gc.collect()
    assert b.publish("c", 1) == 1
    assert b.stats().receivers == {"c": 1}
    disconnect()
    disconnect()  # idempotent
    assert b.publish("c", 2) == 0
    assert seen == [1]
    assert b.stats().receivers == {}


def test_connect_rejects_bad_receivers() -> None:
    b = Broadcaster()

    async def coro(channel: str, message: object) -> None:
        return None

    with pytest.raises(TypeError):
        b.connect("c", coro)
    with pytest.raises(TypeError):
        b.connect("c", 42)  # type: ignore[arg-type]


def test_close_never_hangs() -> None:
    b = Broadcaster()
    sub_get = b.subscribe("c")
    sub_iter = b.subscribe("c")
    sub_async = b.subscribe("c")
    outcome: dict[str, object] = {}

    def blocked_get() -> None:
        try:
            sub_get.get()
        except SubscriptionClosed as exc:
            outcome["get"] = exc

    def blocked_iter() -> None:
        outcome["iter"] = list(sub_iter)

    def blocked_async() -> None:
        async def main() -> list[object]:
            return [m async for m in sub_async]

        outcome["async"] = asyncio.run(main())

    threads = [start(blocked_get), start(blocked_iter), start(blocked_async)]
    wait_until(
        lambda: (
            sub_get._readers_waiting == sub_iter._readers_waiting == sub_async._readers_waiting == 1
        )
    )

    began = time.monotonic()
    b.close()
    join_all(threads, 1.0)
    assert time.monotonic() - began < 1.0
    assert isinstance(outcome["get"], SubscriptionClosed)
    assert outcome["iter"] == []
    assert outcome["async"] == []
    assert sub_get.closed and sub_iter.closed and sub_async.closed
    assert b.closed

    began = time.monotonic()
    with pytest.raises(BroadcasterClosed, match="closed"):
        b.publish("c", 1)
    with pytest.raises(RuntimeError):
        b.subscribe("c")
    with pytest.raises(BroadcasterClosed):
        b.connect("c", lambda ch, msg: None)
    assert time.monotonic() - began < 1.0
    b.close()  # second close is a no-op
    sub_get.close()  # closing an already closed subscription is a no-op
    assert b.stats().closed


def test_closed_subscription_drains_then_ends() -> None:
    b = Broadcaster()
    sub = b.subscribe("c")
    b.publish("c", 1)
    b.publish("c", 2)
    sub.close()
    assert b.publish("c", 3) == 0
    assert list(sub) == [1, 2]
    with pytest.raises(SubscriptionClosed):
        sub.get(timeout=5)
    with pytest.raises(SubscriptionClosed):
        sub.get_nowait()
    assert isinstance(SubscriptionClosed("x"), RSelectionError)


def test_subscription_close_wakes_blocked_reader_and_unsubscribes() -> None:
    b = Broadcaster()
    sub = b.subscribe("c")
    other = b.subscribe("c")
    done = threading.Event()

    def reader() -> None:
        list(sub)
        done.set()

    thread = start(reader)
    wait_until(lambda: sub._readers_waiting == 1)
    sub.close()
    assert done.wait(1.0)
    join_all([thread], 1.0)
    assert b.stats().subscribers == {"c": 1}
    assert b.publish("c", "x") == 1
    assert other.get_nowait() == "x"


def test_context_managers() -> None:
    with Broadcaster() as b:
        with b.subscribe("c") as sub:
            b.publish("c", 1)
            assert sub.get(timeout=1) == 1
        assert sub.closed
        assert b.stats().subscribers == {}
    assert b.closed


def test_get_timeout_and_nowait() -> None:
    b = Broadcaster()
    sub = b.subscribe("c")
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        sub.get(timeout=0.05)
    assert time.monotonic() - began < 2
    with pytest.raises(TimeoutError):
        sub.get_nowait()
    with pytest.raises(ValueError):
        sub.get(timeout=-1)


def test_channel_isolation() -> None:
    b = Broadcaster()
    a = b.subscribe("a")
    z = b.subscribe("z")
    seen: list[object] = []
    b.connect("a", lambda ch, msg: seen.append(msg))
    assert b.publish("a", "for-a") == 2
    assert b.publish("z", "for-z") == 1
    assert b.publish("nobody", "lost") == 0
    assert a.get_nowait() == "for-a"
    assert z.get_nowait() == "for-z"
    assert a.pending == z.pending == 0
    assert seen == ["for-a"]
    assert b.stats().subscribers == {"a": 1, "z": 1}


@pytest.mark.parametrize("maxsize", [0, -1, True, 1.5, "10"])
def test_maxsize_validation(maxsize: object) -> None:
    b = Broadcaster()
    with pytest.raises(ConfigError, match="maxsize"):
        b.subscribe("c", maxsize=maxsize)  # type: ignore[arg-type]
    assert b.subscribe("c", maxsize=1).maxsize == 1


@pytest.mark.parametrize("channel", ["", None, 5, b"bytes"])
def test_bad_channel_is_config_error(channel: object) -> None:
    b = Broadcaster()
    with pytest.raises(ConfigError, match="channel"):
        b.publish(channel, 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        b.subscribe(channel)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        b.connect(channel, lambda ch, msg: None)  # type: ignore[arg-type]
    assert issubclass(ConfigError, ValueError)


def test_bad_overflow_hook() -> None:
    with pytest.raises(ConfigError):
        Broadcaster(on_overflow=3)  # type: ignore[arg-type]


def test_concurrent_publishers_lose_nothing() -> None:
    per_thread = 2500
    b = Broadcaster()
    sub = b.subscribe("c", maxsize=4 * per_thread)
    barrier = threading.Barrier(4, timeout=5)

    def publisher(tid: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            assert b.publish("c", (tid, i)) == 1

    threads = [start(functools.partial(publisher, t)) for t in range(4)]
    got: list[tuple[int, int]] = []
    for _ in range(4 * per_thread):
        message = sub.get(timeout=10)
        assert isinstance(message, tuple)
        got.append(message)
    join_all(threads, 10)
    assert sub.overflowed == 0
    assert sorted(got) == sorted((t, i) for t in range(4) for i in range(per_thread))
    for t in range(4):
        assert [i for tid, i in got if tid == t] == list(range(per_thread))


def test_subscribe_and_unsubscribe_during_publish() -> None:
    b = Broadcaster()
    stop = threading.Event()
    errors: list[BaseException] = []
    steady = b.subscribe("c", maxsize=100_000)

    def churn() -> None:
        try:
            while not stop.is_set():
                with b.subscribe("c", maxsize=5) as sub:
                    assert sub.channel == "c"
                disconnect = b.connect("c", lambda ch, msg: None)
                disconnect()
        except BaseException as exc:
            errors.append(exc)

    def publish() -> None:
        try:
            for i in range(5000):
                b.publish("c", i)
        except BaseException as exc:
            errors.append(exc)

    churners = [start(churn) for _ in range(2)]
    publishers = [start(publish) for _ in range(2)]
    join_all(publishers, 20)
    stop.set()
    join_all(churners, 5)
    assert not errors
    assert steady.pending == 10_000
    assert b.stats().subscribers == {"c": 1}
    assert b.stats().receivers == {}


def test_has_readers_sees_subscriptions_and_receivers() -> None:
    b = Broadcaster()
    assert not b.has_readers() and not b.has_readers("a")
    sub = b.subscribe("a")
    assert b.has_readers() and b.has_readers("a") and not b.has_readers("b")
    disconnect = b.connect("b", lambda channel, message: None)
    assert b.has_readers("b")
    sub.close()
    assert not b.has_readers("a") and b.has_readers()
    disconnect()
    assert not b.has_readers()
    with b:
        b.subscribe("c")
    assert b.closed and not b.has_readers()


def _python_events(call: Callable[[], object]) -> int:
    """How many Python-level trace events (calls, lines, returns) ``call()`` causes."""
    events = 0

    def tracer(frame: object, event: str, arg: object) -> Callable[..., object]:
        nonlocal events
        events += 1
        return tracer

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return events


def test_channels_used_once_cost_no_memory_and_no_work_per_wake_up() -> None:
    b = Broadcaster()
    # What the Postgres listener asks on every wake-up, before any channel was used.
    idle = _python_events(b.has_readers)

    def use_channels(first: int, count: int) -> None:
        for i in range(first, first + count):
            b.connect(f"once-{i}", lambda channel, message: None)()
            b.subscribe(f"sub-once-{i}").close()

    use_channels(0, 100)  # warm-up: caches, interned code, the dicts' first growth
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        use_channels(100, 20_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert b.stats().receivers == {} and b.stats().subscribers == {}
    # An idle node's listener asks on every probe; one with a reader on every message.
    after = _python_events(b.has_readers)
    assert after <= idle + 5, f"has_readers() ran {after} trace events, {idle} before"
    disconnect = b.connect("late", lambda channel, message: None)
    with_reader = _python_events(b.has_readers)
    assert with_reader <= idle + 10, f"has_readers() ran {with_reader} trace events"
    assert b.has_readers() and not b.has_readers("once-7")
    disconnect()
    assert not b.has_readers()
    # 20,000 forgotten channels kept about 24 MB before; a handful of bytes is noise.
    assert grown < 64 * 1024, f"{grown} bytes kept for channels nobody reads"


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ('"$user", public', ("pg_catalog", "alice", "public")),
        ("$user,public", ("pg_catalog", "alice", "public")),
        ('a, "My ""S""", B ,c', ("pg_catalog", "a", 'My "S"', "b", "c")),
        ('"a,b", x', ("pg_catalog", "a,b", "x")),
        ("x, pg_catalog", ("x", "pg_catalog")),
        ("", ("pg_catalog",)),
    ],
)
def test_search_path_is_read_as_postgres_reads_it(setting: str, expected: tuple[str, ...]) -> None:
    from rselection.postgres.broadcast.location import parse_search_path

    assert parse_search_path(setting, "alice") == expected
