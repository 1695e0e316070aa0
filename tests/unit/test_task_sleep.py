"""``ctx.sleep`` / ``ctx.asleep``: a sleep spans renewals and ends only with the term."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import rselection as rs
from rselection import clock
from rselection.context import TaskContext, Term
from rselection.leader import LeaseLeader
from rselection.memory import MemoryLease
from rselection.timing import Timings

# Short timings: the deadline is 0.5 s after each renewal, renewals every 0.1 s.
FAST = Timings(ttl=1.6, renew_interval=0.1, renew_deadline=0.5, retry_interval=0.1)
LONG_SLEEP = 3 * FAST.renew_deadline  # spans many renewals
# Waking a sleeper on step_down takes about a millisecond (measured over 10 runs each,
# sync and async: median 0.2 ms, worst 0.5 ms); the bound leaves room for a loaded machine.
PROMPT = 1.0


@pytest.fixture
def fast_leaders() -> Iterator[list[LeaseLeader]]:
    """LeaseLeader instances over a MemoryLease, stopped at the end of the test."""
    made: list[LeaseLeader] = []
    yield made
    for leader in made:
        leader.stop(timeout=10)


def sleeper_handler(is_async: bool, results: queue.Queue[tuple[Any, ...]]) -> rs.TaskHandler:
    """One persistent task: a sleep longer than renew_deadline, then one cut short."""
    handler = rs.TaskHandler(stop_grace=0.5)
    if is_async:

        @handler.persistent("sleeper", restart="never")
        async def asleeper(ctx: rs.TaskContext) -> None:
            began = clock.monotonic()
            slept = await ctx.asleep(LONG_SLEEP)
            results.put(("long", slept, clock.monotonic() - began, ctx.term))
            try:
                slept = await ctx.asleep(60)
            except asyncio.CancelledError:
                # The runtime also cancels the coroutine when the term ends; whichever
                # comes first, the sleep is over at once.
                results.put(("cut", False, clock.monotonic()))
                raise
            results.put(("cut", slept, clock.monotonic()))

    else:

        @handler.persistent("sleeper", restart="never")
        def sleeper(ctx: rs.TaskContext) -> None:
            began = clock.monotonic()
            slept = ctx.sleep(LONG_SLEEP)
            results.put(("long", slept, clock.monotonic() - began, ctx.term))
            slept = ctx.sleep(60)
            results.put(("cut", slept, clock.monotonic()))

    return handler


@pytest.mark.parametrize("is_async", [False, True], ids=["sleep", "asleep"])
def test_sleep_longer_than_renew_deadline_returns_true_while_leading_and_false_on_step_down(
    is_async: bool, fast_leaders: list[LeaseLeader]
) -> None:
    results: queue.Queue[tuple[Any, ...]] = queue.Queue()
    leader = LeaseLeader(
        MemoryLease(name="sleep", ttl=FAST.ttl),
        sleeper_handler(is_async, results),
        node_id="n",
        timings=FAST,
    )
    fast_leaders.append(leader)
    leader.start()
    assert leader.wait_until_leader(5)

    kind, slept, took, term = results.get(timeout=LONG_SLEEP + 10)
    assert kind == "long"
    assert slept is True, f"the sleep ended after {took:.2f} s while term {term} still led"
    assert took >= LONG_SLEEP
    assert leader.term == term  # still the same term: the sleep spanned its renewals

    stepped = clock.monotonic()
    leader.step_down(hold=60, wait=False)  # no next term: its task would sleep again
    kind, slept, woke = results.get(timeout=10)
    assert kind == "cut"
    assert slept is False
    assert woke - stepped < PROMPT


def test_sleep_follows_a_deadline_moved_forward_by_renewals() -> None:
    term = Term(1, "n", deadline=clock.monotonic() + 0.2)
    ctx = TaskContext("t", term)
    stop = threading.Event()

    def renew() -> None:  # what the keeper does on every successful renewal
        while not stop.wait(0.05):
            term.extend(clock.monotonic() + 0.2)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        began = clock.monotonic()
        assert ctx.sleep(0.8) is True
        assert clock.monotonic() - began >= 0.8
        assert asyncio.run(ctx.asleep(0.8)) is True
    finally:
        stop.set()
        renewer.join(5)
    # No more renewals: the next sleep ends at the deadline, with False.
    began = clock.monotonic()
    assert ctx.sleep(30) is False
    assert clock.monotonic() - began < 0.2 + PROMPT


@pytest.mark.parametrize("is_async", [False, True], ids=["sleep", "asleep"])
def test_sleep_sees_a_suspend_that_the_wait_timeout_does_not_count(
    is_async: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A suspend moves the boot-time clock forward while the timeouts of waits (measured
    # on CLOCK_MONOTONIC) stand still: the sleeper must look at the clock again soon,
    # not only when its wait times out at the deadline it knew before the suspend.
    term = Term(1, "n", deadline=clock.monotonic() + 30)
    ctx = TaskContext("t", term)
    real = clock.monotonic
    suspended = threading.Event()

    def resumed_clock() -> float:
        return real() + (100.0 if suspended.is_set() else 0.0)

    monkeypatch.setattr(clock, "monotonic", resumed_clock)
    timer = threading.Timer(0.1, suspended.set)
    timer.start()
    began = real()
    try:
        slept = asyncio.run(ctx.asleep(60)) if is_async else ctx.sleep(60)
    finally:
        timer.cancel()
    assert slept is False
    assert real() - began < 0.1 + 1.0 + PROMPT  # one slice of at most 1 s after resuming
    assert not term.live()
