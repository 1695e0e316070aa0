"""The event loop that every term's ``async def`` tasks share (rselection.event_loops).

Each term used to start an event loop thread of its own, so a process leading a
thousand leases ran a thousand loop threads. Terms now share one loop while it answers:
a loop that an async task blocks is given to no later term, so one blocking task never
keeps later terms' async tasks from running, and a loop stops once no term uses it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

import rselection as rs
from rselection.context import Term
from rselection.event_loops import UNRESPONSIVE
from tests.support.waiting import wait_until


def loop_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rselection-loop-")]


@pytest.fixture
def running() -> Iterator[list[rs.TaskHandler]]:
    handlers: list[rs.TaskHandler] = []
    yield handlers
    for handler in handlers:
        handler.end_term(2.0)


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

        handler.start_term(Term(1, "node", f"lease-{index}"))
        running.append(handler)
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


def test_a_task_that_blocks_the_loop_never_keeps_a_later_terms_async_tasks_from_running(
    running: list[rs.TaskHandler],
) -> None:
    blocking = rs.TaskHandler(stop_grace=0.5)
    let_go = threading.Event()

    @blocking.persistent("block")
    async def block(ctx: rs.TaskContext) -> None:
        let_go.wait(20)  # blocks the event loop: what an async task must never do

    blocking.start_term(Term(1, "node", "blocking"))
    running.append(blocking)
    time.sleep(UNRESPONSIVE + 0.5)
    later = rs.TaskHandler()
    ran = threading.Event()

    @later.persistent("run")
    async def run(ctx: rs.TaskContext) -> None:
        ran.set()
        await ctx.asleep(3600)

    began = time.monotonic()
    later.start_term(Term(1, "node", "later"))
    running.append(later)
    assert ran.wait(2), "the later term's async task never ran"
    assert time.monotonic() - began < 2
    assert len(loop_threads()) == 2
    assert blocking.end_term(0.5) == ["block"]  # reported stuck, as on a loop of its own
    running.remove(blocking)
    let_go.set()
    assert later.end_term(2.0) == []
    running.remove(later)
    wait_until(lambda: not loop_threads(), 5, "both loop threads to end")
