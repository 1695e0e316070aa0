"""Task controls and run history on a SingleNodeLeader (its MemoryTaskStore): pause,
resume and trigger through the leader's API, and the run records every run, skip and
cancellation leaves; the task desk's batches, bound and failures. No server."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

import rselection as rs
from rselection import signals
from rselection.admin import Refused
from rselection.claiming import series_of
from rselection.specs import TaskSpec
from rselection.task_desk import BATCH, MAX_PENDING, Noted, TaskDesk
from rselection.task_runs import (
    OUTCOMES,
    TRIGGER_MARK,
    RunRecord,
    TaskControls,
    TaskEntry,
    TaskInfo,
    Trigger,
    check_run_limit,
    error_line,
)
from tests.support.waiting import wait_until

Make = Callable[..., rs.SingleNodeLeader]


def runs_of(leader: rs.SingleNodeLeader, task: str, limit: int = 100) -> list[RunRecord]:
    """The runs of ``task`` written so far (what waits on the desk written first)."""
    assert TaskDesk.shared().flush(5)
    return leader.task_runs(task, limit=limit)


def test_a_paused_scheduled_task_skips_its_fires_as_runs_by_the_operator(leaders: Make) -> None:
    handler = rs.TaskHandler()
    fired: list[str] = []
    skipped: list[dict[str, Any]] = []

    @handler.interval(0.05, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        fired.append(ctx.fire_key or "")

    def on_skip(sender: object, **kw: Any) -> None:
        skipped.append(kw)

    signals.fire_skipped.connect(on_skip)
    try:
        leader = leaders(handler)
        leader.start()
        wait_until(lambda: len(fired) >= 2, 5, "two fires")
        change = leader.pause_task("tick")
        assert (change.paused, change.changed) == (True, True)
        assert leader.pause_task("tick").changed is False  # pausing again changes nothing
        wait_until(lambda: any(s["reason"] == "paused" for s in skipped), 2, "a paused skip")
        count = len(fired)
        wait_until(lambda: sum(s["reason"] == "paused" for s in skipped) >= 3, 2, "3 skips")
        assert len(fired) == count  # no fire ran while paused
        assert leader.resume_task("tick").changed is True
        wait_until(lambda: len(fired) > count, 2, "a fire after the resume")
    finally:
        signals.fire_skipped.disconnect(on_skip)
    runs = runs_of(leader, "tick")
    paused = [run for run in runs if run.reason == "paused"]
    assert paused and all(
        (run.outcome, run.by, run.started_at) == ("skipped", "operator", None) for run in paused
    )
    ok = [run for run in runs if run.outcome == "ok"]
    assert ok and all(run.by is None and run.started_at and run.ended_at for run in ok)
    assert all(run.outcome in OUTCOMES and run.term == 1 for run in runs)
    # Newest first: by when each was recorded.
    assert runs[0].scheduled_at is not None and runs[-1].scheduled_at is not None
    assert runs[0].scheduled_at > runs[-1].scheduled_at


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_paused_persistent_task_stops_and_starts_again_once_resumed(
    leaders: Make, kind: str
) -> None:
    handler = rs.TaskHandler()
    starts: list[float] = []
    ends: list[float] = []

    if kind == "sync":

        @handler.persistent(name="work")
        def work(ctx: rs.TaskContext) -> None:
            starts.append(time.monotonic())
            try:
                while ctx.sleep(0.01):
                    pass
            finally:
                ends.append(time.monotonic())

    else:

        @handler.persistent(name="work")
        async def awork(ctx: rs.TaskContext) -> None:
            starts.append(time.monotonic())
            try:
                await asyncio.sleep(3600)  # not ctx.asleep: cancelled all the same
            finally:
                ends.append(time.monotonic())

    leader = leaders(handler)
    leader.start()
    wait_until(lambda: starts, 5, "the task to start")
    paused_at = time.monotonic()
    leader.pause_task("work")
    took = wait_until(lambda: ends, 1.0, "the paused task to stop")
    print(f"\npaused {kind} persistent task stopped in {took * 1000:.1f} ms")
    assert leader.is_leader and leader.term == 1  # the term goes on
    time.sleep(0.3)  # a restart would come within 0.1 s (its first backoff)
    assert len(starts) == 1
    leader.resume_task("work")
    took = wait_until(lambda: len(starts) == 2, 1.0, "the resumed task to start")
    print(f"resumed {kind} persistent task started in {took * 1000:.1f} ms")
    assert starts[1] > paused_at
    runs = runs_of(leader, "work")
    assert [(r.outcome, r.reason, r.by, r.scheduled_at) for r in runs] == [
        ("cancelled", "paused", "operator", None)
    ]


def test_a_paused_task_stays_paused_in_the_next_term_and_a_resume_during_the_pause_ends_it(
    leaders: Make,
) -> None:
    handler = rs.TaskHandler()
    terms: list[int] = []

    @handler.persistent(name="work")
    def work(ctx: rs.TaskContext) -> None:
        terms.append(ctx.term)
        while ctx.sleep(0.01):
            pass

    leader = leaders(handler)
    leader.start()
    wait_until(lambda: terms == [1], 5, "term 1's run")
    leader.pause_task("work")
    leader.step_down()
    wait_until(lambda: leader.term == 2, 5, "term 2")
    time.sleep(0.3)
    assert terms == [1]  # read before the term's tasks start: not run in term 2
    leader.resume_task("work")
    wait_until(lambda: terms == [1, 2], 1.0, "the resumed task in term 2")


def test_a_trigger_runs_one_extra_fire_with_its_own_key_even_while_paused(leaders: Make) -> None:
    handler = rs.TaskHandler()
    fired: list[tuple[str, datetime | None]] = []

    @handler.cron("0 0 1 1 *", name="yearly")  # never due during the test
    def yearly(ctx: rs.TaskContext) -> None:
        fired.append((ctx.fire_key or "", ctx.scheduled_at))

    @handler.persistent(name="steady")
    def steady(ctx: rs.TaskContext) -> None:
        ctx.sleep(3600)

    leader = leaders(handler)
    leader.start()
    leader.pause_task("yearly")
    trigger = leader.trigger_task("yearly")
    assert trigger.fire_key.startswith("yearly" + TRIGGER_MARK)
    assert series_of(trigger.fire_key) is None  # never read as a scheduled fire's key
    wait_until(lambda: fired, 2.0, "the triggered fire")
    assert fired == [(trigger.fire_key, trigger.requested_at)]
    time.sleep(0.2)
    assert len(fired) == 1  # once
    [run] = runs_of(leader, "yearly")
    assert (run.outcome, run.by, run.scheduled_at) == ("ok", "operator", trigger.requested_at)
    with pytest.raises(Refused, match="only scheduled tasks can be triggered"):
        leader.trigger_task("steady")
    with pytest.raises(Refused, match="no task 'nope'"):
        leader.pause_task("nope")
    with pytest.raises(rs.ConfigError):
        leader.task_runs("yearly", limit=0)


def test_a_failed_run_keeps_the_first_line_of_its_error(leaders: Make) -> None:
    handler = rs.TaskHandler()
    failures: list[int] = []

    @handler.interval(0.05, name="flaky")
    def flaky(ctx: rs.TaskContext) -> None:
        failures.append(1)
        raise ValueError("bad input\nsecond line")

    leader = leaders(handler)
    leader.start()
    wait_until(lambda: failures, 5, "a failed run")
    wait_until(lambda: runs_of(leader, "flaky"), 2, "its record")
    run = runs_of(leader, "flaky")[-1]
    assert (run.outcome, run.error) == ("failed", "ValueError: bad input")
    assert error_line(RuntimeError()) == "RuntimeError"
    assert len(error_line(ValueError("x" * 2000))) == 500


def test_a_task_keeps_its_newest_runs_up_to_the_limit() -> None:
    handler = rs.TaskHandler()
    count = [0]

    @handler.interval(0.01, name="fast")
    def fast(ctx: rs.TaskContext) -> None:
        count[0] += 1

    limited = rs.LeaseLeader(
        rs.MemoryLease(name="limited"),
        handler,
        task_store=rs.MemoryTaskStore(),
        run_history_limit=5,
    )
    limited.start()
    try:
        wait_until(lambda: count[0] >= 12, 5, "twelve fires")
    finally:
        limited.stop(timeout=10)
    assert TaskDesk.shared().flush(5)
    runs = limited.task_runs("fast")
    assert len(runs) == 5
    with pytest.raises(rs.ConfigError, match="run_history_limit"):
        rs.LeaseLeader(
            rs.MemoryLease(), handler, task_store=rs.MemoryTaskStore(), run_history_limit=0
        )


def test_the_leader_publishes_its_tasks_with_their_schedules(leaders: Make) -> None:
    handler = rs.TaskHandler()

    @handler.interval(300, name="purge")
    def purge(ctx: rs.TaskContext) -> None: ...

    @handler.cron("*/5 * * * *", name="report")
    def report(ctx: rs.TaskContext) -> None: ...

    @handler.persistent(name="watch")
    def watch(ctx: rs.TaskContext) -> None:
        ctx.sleep(3600)

    leader = leaders(handler)
    leader.start()
    leader.pause_task("report")
    wait_until(leader.tasks, 2, "the leader to publish its tasks")
    found = {info.task: info for info in leader.tasks()}
    assert [info.task for info in leader.tasks()] == ["purge", "report", "watch"]
    assert (found["purge"].kind, found["purge"].schedule) == ("interval", "every 5m")
    assert (found["report"].kind, found["report"].schedule) == ("cron", "cron */5 * * * *")
    assert (found["watch"].kind, found["watch"].schedule) == ("persistent", None)
    assert found["report"].paused and found["report"].paused_at is not None
    assert found["purge"].next_fire is not None and found["watch"].next_fire is None
    assert {info.node_id for info in found.values()} == {"local"}
    item = found["report"].as_json()
    assert item["paused"] is True and item["paused_at"].endswith("Z")


def test_a_leader_without_a_task_store_says_so() -> None:
    leader = rs.LeaseLeader(rs.MemoryLease(), rs.TaskHandler())
    with pytest.raises(rs.ConfigError, match="keeps no task controls"):
        leader.pause_task("x")


def test_the_shapes_serialise_to_json() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    run = RunRecord("l", "t", at, at, at, "ok", None, "n", 3, None, None)
    assert run.as_json()["scheduled_at"] == "2026-01-02T03:04:05Z"
    info = TaskInfo("l", "t", "cron", "cron * * * * *", at, False, None, run, "n", 3)
    assert info.as_json()["last_run"]["term"] == 3
    assert Trigger("l", "t", "t@trigger:00", at).as_json()["requested_at"].endswith("Z")
    with pytest.raises(rs.ConfigError):
        check_run_limit(True)


# -- the task desk --------------------------------------------------------------------


class SlowStore(rs.MemoryTaskStore):
    """A memory store whose writes wait for a gate, or fail."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.batches: list[int] = []

    def write_runs(
        self,
        runs: Sequence[RunRecord],
        *,
        next_fires: Mapping[tuple[str, str], datetime | None],
        limit: int,
    ) -> None:
        assert self.gate.wait(10)
        if self.fail:
            raise rs.BackendUnavailable("the store is down")
        self.batches.append(len(runs))
        super().write_runs(runs, next_fires=next_fires, limit=limit)


SPECS = [TaskSpec(f"t{i}", rs.GenericTask(f"t{i}"), False) for i in range(7)]


def noted(i: int) -> Noted:
    """A run as the runtime notes it: task ``t<i % 7>``, skipped."""
    at = datetime.now(UTC)
    return (SPECS[i % 7], "desk", at, None, None, "skipped", "overlap", "n", 1, None, None)


def test_the_desk_writes_in_batches_and_drops_the_oldest_past_its_bound() -> None:
    desk = TaskDesk.shared()
    store = SlowStore()
    desk.use(store)
    try:
        store.gate.clear()  # the first write waits: everything else queues
        queue = desk.queue(store, 100)
        queue.add(noted(0))
        wait_until(lambda: desk.pending() == 0, 2, "the first batch to be taken")
        before = desk.counts.dropped
        for i in range(1, MAX_PENDING + 11):
            queue.add(noted(i))
        assert desk.counts.dropped - before == 10  # the oldest went first
        store.gate.set()
        assert desk.flush(10)
        assert store.batches[0] == 1 and max(store.batches) == BATCH
        assert sum(store.batches) == MAX_PENDING + 1
    finally:
        desk.drain(store, 5)


def test_a_failing_store_loses_its_batch_says_so_once_and_tasks_run_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    desk = TaskDesk.shared()
    store = SlowStore()
    store.fail = True
    desk.use(store)
    lost = desk.counts.lost
    try:
        with caplog.at_level(logging.WARNING, logger="rselection.task_desk"):
            for _ in range(3):
                desk.queue(store, 100).add(noted(1))
                assert desk.flush(5)
        assert desk.counts.lost - lost == 3
        said = [r for r in caplog.records if "not written" in r.getMessage()]
        assert len(said) == 1
        store.fail = False
        desk.queue(store, 100).add(noted(1))
        assert desk.flush(5) and store.batches == [1]
    finally:
        desk.drain(store, 5)


def test_a_term_whose_controls_were_never_read_starts_no_task_until_they_are(
    leaders: Make,
) -> None:
    down = [True]

    class Unreadable(rs.MemoryTaskStore):
        def read_controls(self, name: str) -> TaskControls:
            if down[0]:
                raise rs.BackendUnavailable("down")
            return super().read_controls(name)

        def publish_tasks(
            self, name: str, node_id: str, term: int, tasks: Sequence[TaskEntry]
        ) -> None:
            raise rs.BackendUnavailable("down")

    handler = rs.TaskHandler()
    fired: list[int] = []

    @handler.interval(0.05, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        fired.append(1)

    leader = leaders(handler, task_store=Unreadable())
    leader.start()
    assert leader.wait_until_leader(5)
    time.sleep(1.5)  # a first retry comes after 1 s
    assert not fired, "a task ran before its controls were read"
    down[0] = False
    wait_until(lambda: len(fired) >= 3, 10, "fires once the controls were read")
