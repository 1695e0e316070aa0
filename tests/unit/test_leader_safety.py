"""The leader's safety rules over an in-memory lease: the lease passes on only after the
old term's tasks are joined, receivers and callers cannot break the machinery, and bad
input is refused at construction.

Each test drives a :class:`LeaseLeader` over a :class:`MemoryLease` subclass that injects
one fault (a late renewal, a failing renewal, an unexpected error) and records, with this
process's monotonic clock, when the lease was released or the session closed, so the
check compares that instant with when the old term's task really finished.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import rselection as rs
from rselection import signals
from rselection.errors import BackendUnavailable, ConfigError
from rselection.leader import LeaseLeader
from rselection.memory import MemoryLease
from rselection.timing import Timings
from tests.support.waiting import wait_until

# ttl 3 s, deadline 1 s: a renewal may be late by up to 2 s before the lease expires.
FAST = Timings(ttl=3.0, renew_interval=0.2, renew_deadline=1.0, retry_interval=0.2)


class FaultyLease(MemoryLease):
    """A memory lease that can answer one renewal late or fail it, and records events."""

    def __init__(self, ttl: float = FAST.ttl) -> None:
        super().__init__(name="safety", ttl=ttl)
        self.renew_delay = 0.0  # next renewal answers this late (then back to 0)
        self.renew_error: BaseException | None = None  # next renewal raises this
        self.acquire_error: BaseException | None = None  # next try_acquire raises this
        self.released_at: list[float] = []
        self.closed_at: list[float] = []
        self.renewing = threading.Event()

    def try_acquire(self, node_id: str) -> Any:
        error, self.acquire_error = self.acquire_error, None
        if error is not None:
            raise error
        return super().try_acquire(node_id)

    def renew(self, node_id: str, term: int) -> bool:
        delay, self.renew_delay = self.renew_delay, 0.0
        error, self.renew_error = self.renew_error, None
        if delay or error:
            self.renewing.set()
        if delay:
            time.sleep(delay)
        if error is not None:
            raise error
        return super().renew(node_id, term)

    def release(self, node_id: str, term: int) -> None:
        self.released_at.append(time.monotonic())
        super().release(node_id, term)

    def close(self) -> None:
        self.closed_at.append(time.monotonic())
        super().close()


class Activity:
    """When the persistent task of each term started and finished (monotonic)."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.lock = threading.Lock()


def stubborn_handler(activity: Activity, linger: float, stop_grace: float) -> rs.TaskHandler:
    """A persistent task that keeps running ``linger`` seconds after cancellation."""
    handler = rs.TaskHandler(stop_grace=stop_grace)

    @handler.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        with activity.lock:
            activity.started[ctx.term] = time.monotonic()
        try:
            ctx.cancelled.wait()
            time.sleep(linger)  # cleanup that takes a while, within stop_grace
        finally:
            with activity.lock:
                activity.finished[ctx.term] = time.monotonic()

    return handler


@pytest.fixture
def made() -> Iterator[list[LeaseLeader]]:
    leaders: list[LeaseLeader] = []
    yield leaders
    for leader in leaders:
        leader.stop(timeout=10)


def build(
    made: list[LeaseLeader], lease: MemoryLease, handler: rs.TaskHandler, **kwargs: Any
) -> LeaseLeader:
    kwargs.setdefault("timings", FAST)
    leader = LeaseLeader(lease, handler, node_id=kwargs.pop("node_id", "n1"), **kwargs)
    made.append(leader)
    return leader


# -- 1. the lease passes on only after the old term's tasks are joined -----------------


def test_a_late_renewal_does_not_release_before_the_old_tasks_are_joined(
    made: list[LeaseLeader],
) -> None:
    activity = Activity()
    lease = FaultyLease()
    leader = build(made, lease, stubborn_handler(activity, linger=1.0, stop_grace=1.5))
    demoted: list[str] = []
    leader_ref = leader

    def on_demoted(sender: Any, **kw: Any) -> None:
        if sender is leader_ref:
            demoted.append(kw["reason"])

    signals.demoted.connect(on_demoted)
    try:
        leader.start()
        assert leader.wait_until_leader(5)
        lease.renew_delay = 1.6  # answers after the 1 s deadline, well before the ttl
        wait_until(lambda: 1 in activity.finished, 6, "the old task to finish")
        wait_until(lambda: lease.released_at, 6, "the release")
        assert demoted and demoted[0] == "deadline"
        assert lease.released_at[0] >= activity.finished[1], (
            f"released {activity.finished[1] - lease.released_at[0]:.3f} s before the old "
            "term's task finished"
        )
    finally:
        signals.demoted.disconnect(on_demoted)


def test_a_failed_renewal_closes_the_session_only_after_the_old_tasks_are_joined(
    made: list[LeaseLeader],
) -> None:
    activity = Activity()
    lease = FaultyLease()
    leader = build(made, lease, stubborn_handler(activity, linger=0.5, stop_grace=1.0))
    leader.start()
    assert leader.wait_until_leader(5)
    closed_before = len(lease.closed_at)
    lease.renew_error = BackendUnavailable("renewal failed")
    wait_until(lambda: 1 in activity.finished, 5, "the old task to finish")
    wait_until(lambda: len(lease.closed_at) > closed_before, 5, "the close")
    assert lease.closed_at[closed_before] >= activity.finished[1]


# -- the stop_grace bound --------------------------------------------------------------


def test_stop_grace_that_outlives_the_lease_is_refused_with_the_math() -> None:
    handler = rs.TaskHandler(stop_grace=5.0)
    with pytest.raises(ConfigError) as err:
        LeaseLeader(MemoryLease(name="x"), handler, timings=Timings())
    message = str(err.value)
    assert "renew_deadline + stop_grace + 0.5" in message
    assert "10 + 5 + 0.5 = 15.5" in message and "15" in message


def test_default_stop_grace_takes_what_the_timings_allow() -> None:
    handler = rs.TaskHandler()
    assert handler.stop_grace is None
    assert Timings().stop_grace(None) == 4.5  # 15 - 10 - 0.5
    assert FAST.stop_grace(None) == 1.5  # 3 - 1 - 0.5
    assert Timings(ttl=60, renew_deadline=30).stop_grace(None) == 5.0  # capped
    assert FAST.stop_grace(1.0) == 1.0


def test_stop_grace_is_honoured_with_default_timings(made: list[LeaseLeader]) -> None:
    activity = Activity()
    stuck: list[Any] = []

    def on_stuck(sender: Any, **kw: Any) -> None:
        stuck.append(kw)

    # 10 + 4.5 + 0.5 = 15: the longest stop_grace the default timings allow is taken.
    handler = stubborn_handler(activity, linger=1.0, stop_grace=4.5)
    leader = build(made, MemoryLease(), handler, timings=Timings())
    assert leader.stop_grace == 4.5
    rs.signals.task_stuck.connect(on_stuck)
    try:
        leader.start()
        assert leader.wait_until_leader(5)
        term = leader.term
        wait_until(lambda: term in activity.started, 5, "the task to start")
        leader.stop(timeout=10)
        # A clean-up of 1 s, well inside the grace, is waited for: the task finished
        # before stop() returned, and nobody reported it stuck.
        assert term in activity.finished
        assert activity.finished[term] - activity.started[term] >= 1.0
    finally:
        rs.signals.task_stuck.disconnect(on_stuck)
    assert stuck == []


# -- 3. receivers and callers cannot break the machinery --------------------------------


def _raise(sender: Any, **kw: Any) -> None:
    raise RuntimeError("a receiver that raises")


LEADERSHIP_SIGNALS = ["elected", "demoted", "leader_changed", "lease_renewed"]
TASK_SIGNALS = ["task_started", "task_finished", "task_failed", "fire_skipped", "task_stuck"]


@pytest.mark.parametrize("name", LEADERSHIP_SIGNALS + TASK_SIGNALS)
def test_a_raising_receiver_is_logged_and_ignored(
    made: list[LeaseLeader], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    activity = Activity()
    # For task_stuck, the persistent task outlives stop_grace so the signal is sent.
    linger = 1.2 if name == "task_stuck" else 0.0
    handler = stubborn_handler(activity, linger=linger, stop_grace=1.0)
    fires: list[float] = []

    @handler.interval(0.05, name="tick", overlap="skip")
    def tick(ctx: rs.TaskContext) -> None:
        fires.append(time.monotonic())
        if name == "task_failed":
            raise ValueError("a failing fire")
        if name == "fire_skipped":
            time.sleep(0.12)  # overlaps the next fire, which is skipped

    lease = FaultyLease()
    leader = build(made, lease, handler)
    receiver = _raise
    getattr(signals, name).connect(receiver)
    try:
        leader.start()
        assert leader.wait_until_leader(5)
        # The scheduler keeps firing in spite of the receiver.
        wait_until(lambda: len(fires) >= 5, 5, "five fires")
        # The watchdog still ends a term whose renewal is late.
        lease.renew_delay = 1.6
        wait_until(lambda: 1 in activity.finished, 5, "term 1 to end at its deadline")
        # The keeper is alive: it leads again after the late renewal.
        wait_until(lambda: leader.term is not None and leader.term > 1, 8, "a next term")
        before = len(fires)
        wait_until(lambda: len(fires) >= before + 3, 5, "fires in the next term")
        assert not leader._driven.done.is_set()  # the keeper goes on
    finally:
        getattr(signals, name).disconnect(receiver)
    assert any("receiver" in r.getMessage() and r.exc_info for r in caplog.records)


def test_an_unexpected_keeper_error_ends_the_term_and_the_keeper_retries(
    made: list[LeaseLeader],
) -> None:
    activity = Activity()
    lease = FaultyLease()
    leader = build(made, lease, stubborn_handler(activity, linger=0.0, stop_grace=1.0))
    reasons: list[str] = []

    def on_demoted(sender: Any, **kw: Any) -> None:
        if sender is leader:
            reasons.append(kw["reason"])

    signals.demoted.connect(on_demoted)
    try:
        lease.acquire_error = KeyError("surprise while following")
        leader.start()
        assert leader.wait_until_leader(5)
        lease.renew_error = ZeroDivisionError("surprise while leading")
        wait_until(lambda: "error" in reasons, 5, "a demotion with reason 'error'")
        wait_until(lambda: leader.term is not None and leader.term > 1, 8, "a next term")
    finally:
        signals.demoted.disconnect(on_demoted)


class FailingHook(FaultyLease):
    """A backend of one's own whose ``interrupt()`` or ``term_ended()`` raises (without
    doing its work). Its lease lasts 15 s, so a lease left to expire shows."""

    def __init__(self, hook: str) -> None:
        super().__init__(ttl=15.0)
        self.hook = hook

    def interrupt(self) -> None:
        if self.hook == "interrupt":
            raise RuntimeError("interrupt failed")
        super().interrupt()

    def term_ended(self, term: int) -> None:
        if self.hook == "term_ended":
            raise RuntimeError("term_ended failed")
        super().term_ended(term)


@pytest.fixture
def demotions() -> Iterator[list[tuple[Any, int, str]]]:
    seen: list[tuple[Any, int, str]] = []

    def on_demoted(sender: Any, **kw: Any) -> None:
        seen.append((sender, kw["term"], kw["reason"]))

    signals.demoted.connect(on_demoted)
    yield seen
    signals.demoted.disconnect(on_demoted)


@pytest.mark.parametrize("hook", ["interrupt", "term_ended"])
def test_a_backend_hook_that_raises_does_not_break_stop(
    made: list[LeaseLeader], demotions: list[tuple[Any, int, str]], hook: str
) -> None:
    activity = Activity()
    lease = FailingHook(hook)
    leader = build(made, lease, stubborn_handler(activity, linger=0.3, stop_grace=1.0))
    leader.start()
    assert leader.wait_until_leader(5)
    wait_until(lambda: 1 in activity.started, 5, "the task")
    leader.stop(timeout=10)  # neither raises nor returns before the task is joined
    assert 1 in activity.finished
    assert [(term, reason) for sender, term, reason in demotions if sender is leader] == [
        (1, "stopped")
    ]
    assert lease.current() is None and len(lease.released_at) == 1  # released, not expiring
    assert leader._driven.done.is_set()  # the keeper is done


def test_a_step_down_goes_on_when_the_backends_term_ended_raises(
    made: list[LeaseLeader], demotions: list[tuple[Any, int, str]]
) -> None:
    lease = FailingHook("term_ended")
    leader = build(made, lease, rs.TaskHandler())
    leader.start()
    assert leader.wait_until_leader(5)
    leader.step_down()
    # Released at once (not left to expire 15 s later), so the node leads again soon.
    wait_until(lambda: leader.term == 2, 2, "term 2")
    assert len(lease.released_at) == 1
    assert [(term, reason) for sender, term, reason in demotions if sender is leader] == [
        (1, "step_down")
    ]


def test_leader_after_stop_closes_the_backend_also_when_the_read_fails(
    made: list[LeaseLeader],
) -> None:
    class Unreadable(FaultyLease):
        def current(self) -> rs.LeaderInfo | None:
            super().current()  # as a real backend would, it connected to read
            raise BackendUnavailable("the read failed")

    lease = Unreadable()
    leader = build(made, lease, rs.TaskHandler())
    leader.start()
    assert leader.wait_until_leader(5)
    leader.stop(timeout=10)
    closed = len(lease.closed_at)
    with pytest.raises(BackendUnavailable):
        leader.leader()
    assert len(lease.closed_at) == closed + 1


def test_lead_returns_only_after_stop(made: list[LeaseLeader]) -> None:
    lease = FaultyLease()
    lease.acquire_error = RuntimeError("boom")
    leader = build(made, lease, stubborn_handler(Activity(), linger=0.0, stop_grace=1.0))
    done = threading.Event()
    threading.Thread(target=lambda: (leader.lead(), done.set()), daemon=True).start()
    assert leader.wait_until_leader(5)
    assert not done.wait(0.5), "lead() returned although nobody called stop()"
    leader.stop(timeout=5)
    assert done.wait(5)


def test_a_config_error_from_the_backend_makes_lead_raise(made: list[LeaseLeader]) -> None:
    class Refusing(FaultyLease):
        def connect(self) -> None:
            raise ConfigError("the pooler is not in session mode")

    ran: list[int] = []
    handler = rs.TaskHandler()

    @handler.persistent("never")
    def never(ctx: rs.TaskContext) -> None:
        ran.append(ctx.term)

    leader = build(made, Refusing(), handler)
    with pytest.raises(ConfigError, match="session mode"):
        leader.lead()
    assert ran == []


@pytest.mark.parametrize("signal_name", ["elected", "demoted"])
def test_stop_from_a_receiver_on_the_keeper_thread_does_not_deadlock(
    made: list[LeaseLeader], signal_name: str
) -> None:
    lease = FaultyLease()
    leader = build(made, lease, stubborn_handler(Activity(), linger=0.0, stop_grace=1.0))
    stopped = threading.Event()

    def stop_it(sender: Any, **kw: Any) -> None:
        if sender is leader:
            leader.stop()
            stopped.set()

    getattr(signals, signal_name).connect(stop_it)
    try:
        leader.start()
        if signal_name == "demoted":
            # (with "elected" the term may already be over when we would look)
            assert leader.wait_until_leader(5)
            leader.step_down(wait=False)
        assert stopped.wait(5), "stop() from a receiver did not return"
        assert leader._driven.done.wait(5), "the keeper did not end"
    finally:
        getattr(signals, signal_name).disconnect(stop_it)


def test_stop_from_a_sync_task_does_not_wait_for_itself(made: list[LeaseLeader]) -> None:
    handler = rs.TaskHandler(stop_grace=1.5)
    returned = threading.Event()
    holder: list[LeaseLeader] = []

    @handler.persistent("stopper")
    def stopper(ctx: rs.TaskContext) -> None:
        holder[0].stop()
        returned.set()

    leader = build(made, FaultyLease(), handler)
    holder.append(leader)
    began = time.monotonic()
    leader.start()
    assert returned.wait(5)
    assert leader._driven.done.wait(5), "the keeper did not end"
    took = time.monotonic() - began
    assert took < 1.0, f"stop() from a task took {took:.2f} s (it waited for itself)"


def test_stop_from_an_async_task_does_not_block_its_loop(made: list[LeaseLeader]) -> None:
    handler = rs.TaskHandler(stop_grace=1.5)
    stuck: list[str] = []
    holder: list[LeaseLeader] = []

    @handler.persistent("stopper")
    async def stopper(ctx: rs.TaskContext) -> None:
        holder[0].stop()
        await asyncio.sleep(10)  # cancelled by the stop it asked for

    def on_stuck(sender: Any, **kw: Any) -> None:
        stuck.append(kw["task"])

    signals.task_stuck.connect(on_stuck)
    try:
        leader = build(made, FaultyLease(), handler)
        holder.append(leader)
        began = time.monotonic()
        leader.start()
        assert leader._driven.done.wait(5), "the keeper did not end"
        took = time.monotonic() - began
    finally:
        signals.task_stuck.disconnect(on_stuck)
    assert stuck == []
    assert took < 1.0, f"stop() from an async task took {took:.2f} s"


def test_stop_timeout_bounds_the_whole_call(made: list[LeaseLeader]) -> None:
    handler = rs.TaskHandler(stop_grace=1.5)

    @handler.persistent("deaf")
    def deaf(ctx: rs.TaskContext) -> None:
        time.sleep(3.0)  # ignores cancellation

    lease = FaultyLease()
    leader = build(made, lease, handler)
    leader.start()
    assert leader.wait_until_leader(5)
    began = time.monotonic()
    leader.stop(timeout=0.3)
    took = time.monotonic() - began
    assert took < 0.6, f"stop(timeout=0.3) took {took:.2f} s"


def test_stop_from_a_signal_handler(made: list[LeaseLeader]) -> None:
    leader = build(made, FaultyLease(), stubborn_handler(Activity(), linger=0.0, stop_grace=1.0))
    previous = signal.signal(signal.SIGUSR1, lambda *_: leader.stop())
    try:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        began = time.monotonic()
        leader.lead()  # returns once the handler's stop() ran
        assert time.monotonic() - began < 3.0
        timer.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)


# -- bad input at construction ---------------------------------------------------------


@pytest.mark.parametrize("node_id", ["x" * 1001, "", "   ", "a\x00b", 42])
def test_bad_node_ids_are_refused_at_construction(node_id: Any) -> None:
    handler = rs.TaskHandler()
    with pytest.raises(ConfigError, match="node_id"):
        LeaseLeader(MemoryLease(name="x"), handler, node_id=node_id, timings=FAST)
    with pytest.raises(ConfigError, match="node_id"):
        rs.SingleNodeLeader(handler, node_id=node_id)


@pytest.mark.parametrize("name", ["x" * 1001, "", "  ", None])
def test_bad_lease_names_are_refused_at_construction(name: Any) -> None:
    with pytest.raises(ConfigError, match="name"):
        rs.SingleNodeLeader(rs.TaskHandler(), name=name)


def test_a_1000_character_node_id_is_fine(made: list[LeaseLeader]) -> None:
    leader = build(made, MemoryLease(), rs.TaskHandler(), node_id="x" * 1000)
    leader.start()
    assert leader.wait_until_leader(5)


# -- 4. a pending step-down belongs to its term ------------------------------------------


def test_a_step_down_pending_when_its_term_ended_otherwise_does_not_end_the_next(
    made: list[LeaseLeader],
) -> None:
    lease = FaultyLease()
    leader = build(made, lease, stubborn_handler(Activity(), linger=0.0, stop_grace=1.0))
    leader.start()
    assert leader.wait_until_leader(5)
    # The keeper is busy in a late renewal, so the step-down stays pending while the
    # watchdog ends the term at its deadline.
    lease.renew_delay = 1.6
    assert lease.renewing.wait(5)
    leader.step_down(wait=False)
    wait_until(lambda: leader.term is not None and leader.term >= 2, 8, "term 2")
    time.sleep(1.0)  # a pending step-down would end term 2 at its first keeper step
    assert leader.term == 2


# -- on_stuck="exit" ----------------------------------------------------------------------


# -- found by review: the watchdog, a passed deadline, waiting after stop ----------------


def test_a_demoted_receiver_calling_sys_exit_does_not_switch_off_the_watchdog(
    made: list[LeaseLeader],
) -> None:
    lease = FaultyLease()
    leader = build(made, lease, stubborn_handler(Activity(), linger=0.0, stop_grace=1.0))
    reasons: list[tuple[int, str]] = []

    def exit_on_demoted(sender: Any, **kw: Any) -> None:
        if sender is leader:
            reasons.append((kw["term"], kw["reason"]))
            sys.exit(1)  # "exit when we lose leadership": it must not end our threads

    signals.demoted.connect(exit_on_demoted)
    try:
        leader.start()
        assert leader.wait_until_leader(5)
        lease.renew_delay = 1.6
        wait_until(lambda: (1, "deadline") in reasons, 6, "term 1 to end at its deadline")
        wait_until(lambda: leader.term == 2, 6, "term 2")
        lease.renew_delay = 1.6
        wait_until(lambda: (2, "deadline") in reasons, 6, "term 2 to end at its deadline too")
    finally:
        signals.demoted.disconnect(exit_on_demoted)


def test_a_renewal_that_returns_after_the_deadline_does_not_revive_the_term(
    made: list[LeaseLeader],
) -> None:
    # Renewals every 1 s, deadline 2 s: a renewal sent at L + 1 that answers after 1.5 s
    # comes back at L + 2.5, after the deadline (L + 2), but would extend it to L + 3.
    timings = Timings(ttl=6.0, renew_interval=1.0, renew_deadline=2.0, retry_interval=0.2)
    lease = FaultyLease(ttl=6.0)
    handler = stubborn_handler(Activity(), linger=0.0, stop_grace=1.0)
    leader = build(made, lease, handler, timings=timings)
    reasons: list[tuple[int, str]] = []

    def on_demoted(sender: Any, **kw: Any) -> None:
        if sender is leader:
            reasons.append((kw["term"], kw["reason"]))

    signals.demoted.connect(on_demoted)
    try:
        leader.start()
        assert leader.wait_until_leader(5)
        lease.renew_delay = 1.5
        assert lease.renewing.wait(5)
        # Keep the watchdog from looking until the late renewal has come back: the term's
        # deadline passed meanwhile, and that must be final.
        with leader._state.cond:
            time.sleep(1.6)
        wait_until(lambda: (1, "deadline") in reasons, 5, "term 1 to end at its deadline")
    finally:
        signals.demoted.disconnect(on_demoted)


def test_wait_until_leader_returns_false_once_the_leader_stopped(made: list[LeaseLeader]) -> None:
    lease = FaultyLease()
    lease.try_acquire("someone-else")  # held for the whole ttl: this node only follows
    leader = build(made, lease, stubborn_handler(Activity(), linger=0.0, stop_grace=1.0))
    leader.start()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(leader.wait_until_leader()))
    waiter.start()
    leader.stop(timeout=5)
    waiter.join(5)
    assert result == [False]


def test_a_handler_runs_under_one_leader_at_a_time(made: list[LeaseLeader]) -> None:
    handler = stubborn_handler(Activity(), linger=0.0, stop_grace=1.0)
    first = build(made, MemoryLease(name="a"), handler)
    second = build(made, MemoryLease(name="b"), handler, node_id="n2")
    first.start()
    with pytest.raises(RuntimeError, match="TaskHandler of its own"):
        second.start()
    first.stop(timeout=5)
    third = build(made, MemoryLease(name="c"), handler, node_id="n3")
    third.start()  # free again once the first leader stopped
    assert third.wait_until_leader(5)
