"""Fires due at one instant start together: claimed in one call, started in one go.

What the scheduler promises when many fires are due at once (epoch-aligned intervals
make all of a period's fires due at the same instant): ``async def`` fires start on the
term's loop without a detour through the default executor; ``def`` fires run on threads
that are reused from one instant to the next; with a claimer, the fires are claimed in
one call, and a claim that fails, or is lost to another node, or is still in flight when
the term ends, never runs a fire (claims fail closed) and is reported per fire.
"""

from __future__ import annotations

import asyncio
import contextvars
import decimal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest

import rselection as rs
from rselection import signals
from rselection.claiming import (
    MAX_FIRE_KEY_BYTES,
    ClaimsPartlyFailed,
    check_fire_keys,
    claim_each,
)
from rselection.context import running_term
from rselection.daemon_pool import DaemonExecutor, SharedPool
from rselection.errors import BackendUnavailable
from rselection.task_threads import TaskThreads
from tests.support.recording import Recorder
from tests.support.waiting import wait_until

EVERY = 0.2


class Ran:
    """Each fire that ran: (task, instant, thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fires: list[tuple[str, datetime, threading.Thread]] = []

    def add(self, ctx: rs.TaskContext) -> None:
        assert ctx.scheduled_at is not None
        with self.lock:
            self.fires.append((ctx.name, ctx.scheduled_at, threading.current_thread()))

    def __len__(self) -> int:
        with self.lock:
            return len(self.fires)

    def names(self) -> set[str]:
        with self.lock:
            return {name for name, _, _ in self.fires}


def tasks(ran: Ran, count: int, *, every: float = EVERY) -> rs.TaskHandler:
    """``count`` interval tasks, even ones ``def``, odd ones ``async def``."""
    handler = rs.TaskHandler(stop_grace=2.0)
    for i in range(count):
        if i % 2:

            async def run_async(ctx: rs.TaskContext) -> None:
                ran.add(ctx)

            handler.interval(every, name=f"task-{i}")(run_async)
        else:

            def run_sync(ctx: rs.TaskContext) -> None:
                ran.add(ctx)

            handler.interval(every, name=f"task-{i}")(run_sync)
    return handler


class NoHistory:
    """Tells the leader that no task ran before: no look-back for missed fires."""

    ttl = 600.0

    def ran_before(self, series: str) -> bool:
        return False


class FailingBatch(NoHistory):
    """A batch claimer whose backend is down."""

    def __init__(self) -> None:
        self.calls = 0

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        raise BackendUnavailable("the claims server is down")

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        self.calls += 1
        raise BackendUnavailable("the claims server is down")


class OneByOne(NoHistory):
    """A claimer without claim_many: one key always fails, one is always held."""

    def __init__(self, failing: str, held: str) -> None:
        self.failing = failing
        self.held = held
        self.inner = rs.MemoryClaimer()

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        if self.failing in fire_key:
            raise BackendUnavailable("this key's shard is down")
        if self.held in fire_key:
            return False
        return self.inner.claim(fire_key, term=term)


class Stalled(NoHistory):
    """A batch claimer whose claims hang until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        return self.claim_many([fire_key], term=term) == {fire_key}

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        self.entered.set()
        self.release.wait(30)
        return set(fire_keys)


def test_async_fires_start_while_the_loops_default_executor_is_busy() -> None:
    """A fire of an ``async def`` task is started on the loop itself: application code
    that fills the loop's default executor never holds fires up."""
    ran = Ran()
    handler = rs.TaskHandler(stop_grace=2.0)

    @handler.interval(0.05, name="tick")
    async def tick(ctx: rs.TaskContext) -> None:
        ran.add(ctx)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        gate = threading.Event()
        busy = loop.run_in_executor(None, gate.wait, 30)  # the executor's one thread
        try:
            async with rs.SingleNodeLeader(handler):
                deadline = time.monotonic() + 10
                while len(ran) < 5 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                count = len(ran)
                gate.set()  # before the leader stops: stopping may use the executor too
                await busy
                return count
        finally:
            gate.set()

    assert asyncio.run(main()) >= 5


def test_a_failed_batch_claim_runs_none_of_the_instants_fires_and_reports_each(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    ran = Ran()
    claimer = FailingBatch()
    handler = tasks(ran, 20)
    skipped = Recorder()
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        leaders(handler, claimer=claimer).start()
        wait_until(
            lambda: all(len(skipped.of(f"task-{i}", reason="claim-error")) >= 2 for i in range(20)),
            10,
            "two instants of fires skipped for their failed claims",
        )
    assert len(ran) == 0
    # One call per instant, not one per fire.
    instants = {c["scheduled_at"] for c in skipped.calls if c["reason"] == "claim-error"}
    assert claimer.calls <= len(instants) + 1


def test_a_claimer_without_claim_many_is_called_fire_by_fire(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    ran = Ran()
    handler = tasks(ran, 10)
    skipped = Recorder()
    claimer = OneByOne(failing="task-3@", held="task-4@")
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        leaders(handler, claimer=claimer).start()
        wait_until(
            lambda: (
                len(skipped.of("task-3", reason="claim-error")) >= 2
                and len(skipped.of("task-4", reason="already-claimed")) >= 2
                and ran.names() >= {f"task-{i}" for i in range(10)} - {"task-3", "task-4"}
            ),
            10,
            "fires claimed one by one",
        )
    # A failed claim or one held elsewhere keeps only its own fire from running.
    assert not ran.names() & {"task-3", "task-4"}


def test_claim_each_falls_back_to_one_claim_per_key() -> None:
    claimer = OneByOne(failing="b@", held="c@")
    won, failed = claim_each(claimer, ["a@1", "b@1", "c@1", "d@1"], term=1)
    assert won == {"a@1", "d@1"}
    assert set(failed) == {"b@1"} and isinstance(failed["b@1"], BackendUnavailable)


def test_fires_whose_claim_is_in_flight_when_the_term_ends_never_run(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    ran = Ran()
    claimer = Stalled()
    handler = tasks(ran, 10, every=0.1)
    skipped = Recorder()
    stuck = Recorder()
    with (
        signals.fire_skipped.connected_to(skipped, sender=handler),
        signals.task_stuck.connected_to(stuck, sender=handler),
    ):
        leader = leaders(handler, claimer=claimer)
        leader.start()
        assert claimer.entered.wait(10)
        began = time.monotonic()
        leader.stop(timeout=10)
        took = time.monotonic() - began
        claimer.release.set()  # the claim lands after the term: still nothing runs
        # Nothing to poll for: give a late answer the time it would need to start fires.
        time.sleep(0.3)
    assert took < 1.5, f"stop() waited {took:.2f}s for a claim in flight"
    assert len(ran) == 0
    assert not stuck.calls
    assert all(skipped.of(f"task-{i}", reason="not-leader") for i in range(10))


def test_def_fires_of_successive_instants_reuse_their_threads(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    ran = Ran()
    handler = rs.TaskHandler(stop_grace=2.0)
    for i in range(20):

        def run(ctx: rs.TaskContext) -> None:
            ran.add(ctx)

        handler.interval(EVERY, name=f"task-{i}")(run)
    leaders(handler).start()
    wait_until(lambda: len(ran) >= 100, 20, "five instants of fires")
    with ran.lock:
        threads = {id(thread) for _, _, thread in ran.fires}
        names = {thread.name for _, _, thread in ran.fires}
    assert len(threads) <= 40, f"{len(threads)} threads for 20 tasks"
    assert all(name.startswith("rselection-task-task-") for name in names)


def test_task_threads_start_a_thread_when_none_is_idle_and_end_idle_ones_on_close() -> None:
    threads = TaskThreads("rselection-test-threads", idle_timeout=30)
    gate = threading.Event()
    started = threading.Semaphore(0)

    def block() -> None:
        started.release()
        gate.wait(10)

    try:
        for _ in range(3):  # a busy thread never holds up new work
            threads.run(block)
        for _ in range(3):
            assert started.acquire(timeout=5)
        assert threads.count() == 3
        gate.set()
        done = threading.Event()
        wait_until(lambda: threads.idle() == 3, 5, "the three threads to be idle")
        threads.run(done.set)  # an idle thread takes it: no fourth thread
        assert done.wait(5)
        assert threads.count() == 3
    finally:
        gate.set()
        threads.close(5)
    assert threads.count() == 0
    assert not [t for t in threading.enumerate() if t.name == "rselection-test-threads"]


def test_task_threads_end_when_idle_for_their_timeout() -> None:
    threads = TaskThreads("rselection-test-idle", idle_timeout=0.1)
    done = threading.Event()
    threads.run(done.set)
    assert done.wait(5)
    wait_until(lambda: threads.count() == 0, 5, "the idle thread to end")
    again = threading.Event()
    threads.run(again.set)  # a new one starts
    assert again.wait(5)
    threads.close(5)


def test_a_slow_fire_skipped_receiver_never_holds_up_the_end_of_a_term(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    """The fires of a claim still in flight when the term ends are reported off the
    thread that ends it: the term's async tasks are cancelled at once."""
    claimer = Stalled()
    handler = rs.TaskHandler(stop_grace=1.0)
    cancelled = threading.Event()
    in_receiver = threading.Event()

    @handler.interval(EVERY, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        pass

    @handler.persistent(name="forever")
    async def forever(ctx: rs.TaskContext) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def slow(sender: object, **kwargs: object) -> None:
        in_receiver.set()
        time.sleep(2)

    signals.fire_skipped.connect(slow, sender=handler)
    try:
        leader = leaders(handler, claimer=claimer)
        leader.start()
        assert claimer.entered.wait(10)
        began = time.monotonic()
        leader.step_down()
        assert cancelled.wait(5)
        took = time.monotonic() - began
        assert in_receiver.wait(5)  # the fires were reported, elsewhere
    finally:
        claimer.release.set()
        signals.fire_skipped.disconnect(slow, sender=handler)
    assert took < 0.5, f"the async task was cancelled {took:.2f}s after the term ended"


def refuse_task_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make starting a def fire's thread fail, as when the process is out of threads."""
    start = threading.Thread.start

    def failing_start(self: threading.Thread) -> None:
        if self.name.startswith("rselection-task-term-") or self.name == "rselection-test":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", failing_start)


def test_task_threads_forget_a_thread_that_could_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = TaskThreads("rselection-test")
    refuse_task_threads(monkeypatch)
    with pytest.raises(RuntimeError, match="can't start"):
        threads.run(lambda: None)
    assert threads.count() == 0
    assert not threads.closed
    threads.close(1)  # nothing to join, and no error
    assert threads.closed


def test_def_fires_without_a_thread_are_reported_and_the_term_still_ends_cleanly(
    leaders: Callable[..., rs.SingleNodeLeader], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = Ran()
    handler = tasks(ran, 4)
    skipped = Recorder()
    refuse_task_threads(monkeypatch)
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        leader = leaders(handler)
        leader.start()
        wait_until(
            lambda: all(len(skipped.of(f"task-{i}", reason="no-thread")) >= 2 for i in (0, 2)),
            10,
            "def fires reported for want of a thread",
        )
        leader.stop(timeout=10)
    # The async fires ran; the def ones did not, and nothing else was reported of them.
    assert ran.names() >= {"task-1", "task-3"}
    assert not ran.names() & {"task-0", "task-2"}
    assert not skipped.of("task-0", reason="not-leader")
    # The term's end went all the way: its private loop stopped.
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("rselection-loop-")],
        5,
        "the term's event loop to stop",
    )


def test_a_def_fire_on_a_reused_thread_sees_none_of_the_previous_fires_context(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    """Context variables (and the decimal context) one fire sets never reach the next
    fire that its thread runs; the term is still known to each."""
    user: contextvars.ContextVar[str | None] = contextvars.ContextVar("user", default=None)
    handler = rs.TaskHandler(stop_grace=2.0)
    lock = threading.Lock()
    threads: list[threading.Thread] = []
    readings: list[tuple[str | None, int, int | None]] = []

    @handler.interval(EVERY, name="writer")
    def writer(ctx: rs.TaskContext) -> None:
        user.set("the writer's secret")
        decimal.getcontext().prec = 3
        with lock:
            threads.append(threading.current_thread())

    @handler.interval(EVERY, name="reader")
    def reader(ctx: rs.TaskContext) -> None:
        term = running_term.get()
        with lock:
            threads.append(threading.current_thread())
            readings.append(
                (user.get(), decimal.getcontext().prec, None if term is None else term.number)
            )

    leaders(handler).start()

    def reused() -> bool:
        with lock:
            return len(threads) > len(set(threads)) + 6

    wait_until(reused, 20, "fires on reused threads")
    with lock:
        assert readings
        assert set(readings) == {(None, 28, 1)}


def test_claim_each_fails_a_bad_key_alone_and_claims_the_others() -> None:
    claimer = rs.MemoryClaimer()
    long = "x" * (MAX_FIRE_KEY_BYTES + 1)
    won, failed = claim_each(claimer, ["a@1", long, "b@1"], term=1)
    assert won == {"a@1", "b@1"}
    assert set(failed) == {long} and isinstance(failed[long], rs.ConfigError)
    with pytest.raises(rs.ConfigError, match="twice"):
        claim_each(claimer, ["c@1", "c@1"], term=1)


def test_one_task_with_a_fire_key_too_long_keeps_only_its_own_fires_from_running(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    """A lease name and a task name each within the 1,000 bytes allowed can make a
    claim key over the bytes a claimer takes (the key writes a lease name's ``%`` as
    three bytes): that task's fires fail their claims, and the other tasks' fires due at
    the same instants still run."""
    ran = Ran()
    handler = rs.TaskHandler(stop_grace=2.0)
    long_name = "é" * 500

    @handler.interval(EVERY, name="normal")
    def normal(ctx: rs.TaskContext) -> None:
        ran.add(ctx)

    @handler.interval(EVERY, name=long_name)
    def long(ctx: rs.TaskContext) -> None:
        ran.add(ctx)

    skipped = Recorder()
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        # 1,000 bytes, 1,800 in a claim key: the normal task's keys fit, the long one's not.
        lease = "%" * 400 + "L" * 600
        leaders(handler, claimer=rs.MemoryClaimer(), name=lease).start()
        wait_until(
            lambda: len(ran) >= 3 and len(skipped.of(long_name, reason="claim-error")) >= 3,
            10,
            "fires of the normal task run, those of the long one fail their claims",
        )
    assert ran.names() == {"normal"}
    assert not skipped.of("normal", reason="claim-error")


class HalfDown(NoHistory):
    """A batch claimer whose claims of some tasks' fires fail (their master is down),
    and which says so key by key."""

    def __init__(self, down: set[str]) -> None:
        self.down = down
        self.inner = rs.MemoryClaimer()

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        return self.claim_many([fire_key], term=term) == {fire_key}

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        failed = [key for key in fire_keys if key.split("/")[-1].split("@")[0] in self.down]
        won = self.inner.claim_many([k for k in fire_keys if k not in failed], term=term)
        if failed:
            error = BackendUnavailable("that master is down")
            raise ClaimsPartlyFailed(
                "some claims failed", won=won, failed=dict.fromkeys(failed, error)
            )
        return won


def test_a_batch_claim_that_fails_in_part_runs_the_fires_won_and_skips_the_others(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    ran = Ran()
    handler = tasks(ran, 10)
    skipped = Recorder()
    claimer = HalfDown({"task-3", "task-4"})
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        leaders(handler, claimer=claimer).start()
        wait_until(
            lambda: (
                all(len(skipped.of(f"task-{i}", reason="claim-error")) >= 2 for i in (3, 4))
                and ran.names() == {f"task-{i}" for i in range(10)} - {"task-3", "task-4"}
            ),
            10,
            "the fires won run, the failed ones are skipped",
        )
    assert not ran.names() & {"task-3", "task-4"}
    assert not [
        c
        for c in skipped.calls
        if c["reason"] == "claim-error" and c["task"] not in ("task-3", "task-4")
    ]


class CheckingSeries(rs.MemoryClaimer):
    """Refuses a bad series in ``ran_before_many``, as the Postgres and Redis claimers
    do."""

    def ran_before_many(self, series: list[str]) -> set[str]:
        return super().ran_before_many(check_fire_keys(series))


def test_a_task_with_a_fire_key_too_long_never_keeps_the_others_missed_fires_from_recovery(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    """A new leader looks back for every task's missed fires in one call: a task whose
    claim keys no claimer takes is left out of it, and the others' are recovered."""
    claimer = CheckingSeries()
    long_name = "é" * 500  # 1,000 bytes, the longest task name
    # 1,000 bytes, 1,800 in a claim key: the normal task's keys fit, the long one's not.
    lease = "%" * 400 + "L" * 600
    every = 0.5

    def handler_of(ran: Ran) -> rs.TaskHandler:
        handler = rs.TaskHandler(stop_grace=2.0)

        @handler.interval(every, name="normal")
        def normal(ctx: rs.TaskContext) -> None:
            ran.add(ctx)

        @handler.interval(every, name=long_name)
        def long(ctx: rs.TaskContext) -> None:
            ran.add(ctx)

        return handler

    first = Ran()
    leader = leaders(handler_of(first), claimer=claimer, name=lease)
    leader.start()
    wait_until(lambda: len(first) >= 1, 10, "a fire of the first leader")
    leader.stop(timeout=10)
    time.sleep(2 * every)  # fires due while no node leads: nothing to poll for
    second = Ran()
    started = datetime.now(UTC)
    leaders(handler_of(second), claimer=claimer, name=lease).start()
    wait_until(lambda: len(second) >= 1, 10, "a fire of the second leader")
    with second.lock:
        caught_up = [at for name, at, _ in second.fires if name == "normal" and at <= started]
    assert caught_up, "the normal task's missed fire was not recovered"
    assert second.names() == {"normal"}


def test_the_daemon_executor_runs_calls_hands_back_errors_and_cancels_the_rest() -> None:
    pool = DaemonExecutor(2, "test-daemon")
    release = threading.Event()
    blocked = [pool.submit(release.wait, 10) for _ in range(2)]  # both workers busy
    queued = pool.submit(lambda: "never")
    wait_until(lambda: all(f.running() for f in blocked), 5, "both workers to run")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    release.set()
    assert [f.result(5) for f in blocked] == [True, True]
    failing = DaemonExecutor(1, "test-daemon-fail")
    with pytest.raises(ZeroDivisionError):
        failing.submit(lambda: 1 / 0).result(5)
    assert failing.submit(lambda: 42).result(5) == 42  # the worker survived
    failing.shutdown()
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-daemon"))


def test_a_lane_whose_calls_hang_holds_only_its_limit_of_the_pools_workers() -> None:
    pool = SharedPool("test-shared", 2, most=4, stuck_after=0.2, idle_timeout=1.0)
    release = threading.Event()
    stuck, other = pool.lane(1), pool.lane(1)
    try:
        hung = [stuck.submit(release.wait, 30) for _ in range(3)]  # one runs, two wait
        wait_until(lambda: hung[0].running(), 5.0, "the first hanging call to run")
        assert not hung[1].running() and not hung[2].running()
        assert [other.submit(lambda i=i: i).result(5) for i in range(5)] == list(range(5))
        # A second lane that hangs too: the pool starts workers past the two that count
        # once those calls count as stuck, so a third lane still gets served.
        more = pool.lane(1)
        more.submit(release.wait, 30)
        third = pool.lane(1)
        assert third.submit(lambda: "served").result(5) == "served"
        assert pool.threads() <= 4
    finally:
        release.set()
        for lane in (stuck, other):
            lane.shutdown()
    assert [f.result(5) for f in hung] == [True, True, True]  # in order, one at a time
    more.shutdown()
    third.shutdown()
    wait_until(lambda: pool.threads() == 0, 5.0, "the workers to end once no lane is open")


def test_a_worker_that_steps_aside_no_longer_holds_up_other_lanes() -> None:
    # A wait worker about to run a new term's receivers (a user's code) steps aside:
    # the next call gets a worker at once, not once the first counts as stuck.
    pool = SharedPool("test-aside", 1, most=4, stuck_after=5.0, idle_timeout=1.0)
    release = threading.Event()
    slow, other = pool.lane(1), pool.lane(1)

    def receivers() -> bool:
        pool.step_aside()
        return release.wait(10)

    try:
        pool.step_aside()  # not a worker of this pool: changes nothing
        assert pool.threads() == 0
        running = slow.submit(receivers)
        wait_until(running.running, 5.0, "the slow call to run")
        began = time.monotonic()
        assert other.submit(lambda: "served").result(2.0) == "served"
        assert time.monotonic() - began < 1.0  # not the 5 s until the first is stuck
    finally:
        release.set()
        for lane in (slow, other):
            lane.shutdown()
    assert running.result(5) is True
    wait_until(lambda: pool.threads() == 0, 5.0, "the workers to end once no lane is open")
