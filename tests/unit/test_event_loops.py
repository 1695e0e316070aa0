"""The event loop that every term's ``async def`` tasks share (rselection.event_loops).

Each term used to start an event loop thread of its own, so a process leading a
thousand leases ran a thousand loop threads. Terms now share a loop, and must lose
nothing a loop of their own gave them: once a term has ended nothing of it runs on the
loop again (helper tasks, timers, tasks deaf to cancellation); a loop that a task
blocks is given to no later term and holds up no term's end; and no task can stop the
loop under the others.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

import rselection as rs
from rselection.context import Term
from rselection.event_loops import UNRESPONSIVE, SharedLoops
from tests.support.waiting import wait_until


def loop_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rselection-loop-")]


class Activity:
    """When each term's async code really ran (monotonic stamps, thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stamps: dict[str, list[float]] = {}

    def mark(self, who: str) -> None:
        with self._lock:
            self.stamps.setdefault(who, []).append(time.monotonic())

    def after(self, who: str, instant: float) -> list[float]:
        with self._lock:
            return [t for t in self.stamps.get(who, []) if t > instant]

    def count(self, who: str) -> int:
        with self._lock:
            return len(self.stamps.get(who, []))


@pytest.fixture
def running() -> Iterator[list[rs.TaskHandler]]:
    # The shared loop's thread of an earlier test in this process ends a moment after
    # its last term: counting threads before then would count it too.
    wait_until(lambda: not loop_threads(), 5, "an earlier test's loop thread to end")
    handlers: list[rs.TaskHandler] = []
    yield handlers
    for handler in handlers:
        handler.end_term(2.0)


def start(handler: rs.TaskHandler, name: str, running: list[rs.TaskHandler]) -> None:
    handler.start_term(Term(1, "node", name))
    running.append(handler)


def test_two_hundred_terms_share_one_loop_thread_which_ends_with_the_last(
    running: list[rs.TaskHandler],
) -> None:
    started: set[int] = set()
    loops: set[asyncio.AbstractEventLoop] = set()
    for index in range(200):
        handler = rs.TaskHandler()

        @handler.persistent("wait")
        async def wait(ctx: rs.TaskContext, index: int = index) -> None:
            started.add(index)
            loops.add(asyncio.get_running_loop())
            await ctx.asleep(3600)

        start(handler, f"lease-{index}", running)
    wait_until(lambda: len(started) == 200, 10, "every term's async task")
    assert len(loop_threads()) == 1, loop_threads()
    assert len(loops) == 1
    # Ending one term cancels its own tasks only.
    first = running.pop(0)
    assert first.end_term(2.0) == []
    assert len(loop_threads()) == 1
    for handler in running:
        assert handler.end_term(2.0) == []
    running.clear()
    wait_until(lambda: not loop_threads(), 5, "the shared loop's thread to end")
    assert all(loop.is_closed() for loop in loops)


def test_nothing_of_an_ended_term_runs_on_the_loop_after_its_end(
    running: list[rs.TaskHandler],
) -> None:
    """A helper task deaf to cancellation, a timer set long before and a task that
    ignores cancellation take no step once end_term() returned, while another term
    keeps the loop running."""
    activity = Activity()
    other = rs.TaskHandler()

    @other.persistent("tick")
    async def tick(ctx: rs.TaskContext) -> None:
        while True:
            activity.mark("other")
            await asyncio.sleep(0.01)

    start(other, "other", running)
    ending = rs.TaskHandler(stop_grace=0.3)

    async def deaf(who: str) -> None:
        while True:
            try:
                activity.mark(who)
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # ignores cancellation: what a task must not do

    @ending.persistent("main")
    async def main(ctx: rs.TaskContext) -> None:
        loop = asyncio.get_running_loop()
        helper = asyncio.ensure_future(deaf("helper"))
        loop.call_later(1.5, activity.mark, "timer")
        assert helper is not None
        await deaf("main")

    ending.start_term(Term(1, "node", "ending"))
    wait_until(lambda: activity.count("helper") > 5 and activity.count("main") > 5, 5, "tasks")
    stuck = ending.end_term(0.3)
    ended = time.monotonic()
    assert stuck == [], stuck  # stopped on the loop: not running any more
    # The loop runs on for the other term, past the instant of the ended term's timer.
    wait_until(lambda: activity.after("other", ended + 1.7), 10, "the other term to run on")
    for who in ("main", "helper", "timer"):
        assert activity.after(who, ended) == [], who
    assert len(loop_threads()) == 1


def test_a_task_that_blocks_the_loop_never_keeps_a_later_terms_async_tasks_from_running(
    running: list[rs.TaskHandler],
) -> None:
    blocking = rs.TaskHandler(stop_grace=0.5)
    let_go = threading.Event()
    blocked = threading.Event()

    @blocking.persistent("block")
    async def block(ctx: rs.TaskContext) -> None:
        blocked.set()
        let_go.wait(20)  # blocks the event loop: what an async task must never do

    start(blocking, "blocking", running)
    assert blocked.wait(5)
    time.sleep(UNRESPONSIVE + 0.5)  # the loop must be seen blocked for its time
    later = rs.TaskHandler()
    ran = threading.Event()

    @later.persistent("run")
    async def run(ctx: rs.TaskContext) -> None:
        ran.set()
        await ctx.asleep(3600)

    began = time.monotonic()
    start(later, "later", running)
    assert ran.wait(2), "the later term's async task never ran"
    assert time.monotonic() - began < 2
    assert len(loop_threads()) == 2
    assert blocking.end_term(0.5) == ["block"]  # reported stuck, as on a loop of its own
    running.remove(blocking)
    let_go.set()
    assert later.end_term(2.0) == []
    running.remove(later)
    wait_until(lambda: not loop_threads(), 5, "both loop threads to end")


def test_a_term_ending_on_a_blocked_loop_ends_within_a_second_and_never_runs_again(
    running: list[rs.TaskHandler],
) -> None:
    """Its tasks cannot run while another term's task blocks the loop: the end does not
    wait its whole grace for them, and once the loop is free they take no step."""
    activity = Activity()
    victim = rs.TaskHandler(stop_grace=10.0)

    @victim.persistent("work")
    async def work(ctx: rs.TaskContext) -> None:
        while True:
            activity.mark("victim")
            await asyncio.sleep(0.01)

    start(victim, "victim", running)
    wait_until(lambda: activity.count("victim") > 3, 5, "the victim's task")
    blocker = rs.TaskHandler(stop_grace=0.5)
    let_go = threading.Event()

    @blocker.persistent("block")
    async def block(ctx: rs.TaskContext) -> None:
        let_go.wait(20)

    start(blocker, "blocker", running)
    wait_until(_loop_blocked, 5, "the loop to be seen blocked")
    began = time.monotonic()
    assert victim.end_term(10.0) == []
    took = time.monotonic() - began
    running.remove(victim)
    ended = time.monotonic()
    assert took < UNRESPONSIVE + 1.5, took
    let_go.set()
    time.sleep(0.3)  # the loop runs again: the victim's steps would run now
    assert blocker.end_term(2.0) == []
    running.remove(blocker)
    assert activity.after("victim", ended) == []


def _loop_blocked() -> bool:
    loops = SharedLoops.shared()._loops
    return any(not loop.answers() for loop in loops)


def test_a_blocking_stop_of_another_leader_from_an_async_task_returns_within_seconds(
    running: list[rs.TaskHandler],
) -> None:
    """A task that calls another leader's stop() blocks the loop that leader's tasks
    run on: that stop() must not wait its whole grace for them."""
    activity = Activity()
    tasks = rs.TaskHandler(stop_grace=4.0)

    @tasks.persistent("work")
    async def work(ctx: rs.TaskContext) -> None:
        while True:
            activity.mark("b")
            await asyncio.sleep(0.01)

    with rs.SingleNodeLeader(tasks, name="b") as other:
        wait_until(lambda: activity.count("b") > 3, 5, "b's task")
        stopped: list[float] = []
        handler = rs.TaskHandler()

        @handler.persistent("stopper")
        async def stopper(ctx: rs.TaskContext) -> None:
            began = time.monotonic()
            other.stop()  # blocks the loop: should be `await asyncio.to_thread(other.stop)`
            stopped.append(time.monotonic() - began)
            await ctx.asleep(3600)

        start(handler, "a", running)
        wait_until(lambda: stopped, 10, "the blocking stop() to return")
        assert stopped[0] < UNRESPONSIVE + 2.0, stopped
        ended = time.monotonic()
        time.sleep(0.3)
        assert activity.after("b", ended) == []


def test_no_task_can_stop_the_shared_loop_or_take_its_task_factory(
    running: list[rs.TaskHandler],
) -> None:
    activity = Activity()
    survivor = rs.TaskHandler()

    @survivor.persistent("tick")
    async def tick(ctx: rs.TaskContext) -> None:
        while True:
            activity.mark("survivor")
            await asyncio.sleep(0.01)

    start(survivor, "survivor", running)
    errors: list[str] = []
    rogue = rs.TaskHandler()

    @rogue.persistent("rogue")
    async def rogue_task(ctx: rs.TaskContext) -> None:
        loop = asyncio.get_running_loop()
        for attempt in (loop.stop, lambda: loop.set_task_factory(None)):
            try:
                attempt()
            except RuntimeError as exc:
                errors.append(str(exc))
        await ctx.asleep(3600)

    start(rogue, "rogue", running)
    wait_until(lambda: len(errors) == 2, 5, "both refusals")
    before = activity.count("survivor")
    wait_until(lambda: activity.count("survivor") > before + 20, 5, "the survivor to run on")
    assert all("shared" in error for error in errors)


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["task", "helper task"])
def test_a_task_raising_systemexit_leaves_the_other_terms_tasks_running(
    running: list[rs.TaskHandler], raised: type[BaseException], where: str
) -> None:
    """Raised in a step, they leave the loop's run_forever: the loop runs on. (A helper
    task's is awaited, so that nothing logs it unretrieved during a later test.)"""
    activity = Activity()
    survivor = rs.TaskHandler()

    @survivor.persistent("tick")
    async def tick(ctx: rs.TaskContext) -> None:
        while True:
            activity.mark("survivor")
            await asyncio.sleep(0.01)

    start(survivor, "survivor", running)
    wait_until(lambda: activity.count("survivor") > 3, 5, "the survivor's task")
    exiting = rs.TaskHandler()
    went = threading.Event()

    @exiting.persistent("exit")
    async def exit_task(ctx: rs.TaskContext) -> None:
        async def raiser() -> None:
            went.set()
            raise raised()

        if where == "task":
            await raiser()
        await asyncio.ensure_future(raiser())

    start(exiting, "exiting", running)
    assert went.wait(5)
    before = activity.count("survivor")
    wait_until(lambda: activity.count("survivor") > before + 20, 5, "the survivor to run on")
    assert len(loop_threads()) == 1
