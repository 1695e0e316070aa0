"""rselection.testing: run_tasks, fires, FakeClock and fire_once, as users' tests use them."""

from __future__ import annotations

import asyncio
import inspect
import textwrap
import threading
import time
from datetime import UTC, datetime, timedelta, timezone
from types import ModuleType

import pytest

import rselection as rs
import rselection.metrics
import rselection.testing
from rselection.testing import (
    FakeClock,
    Fire,
    TaskFailures,
    afire_once,
    fire_once,
    fires,
    run_tasks,
)
from tests.support.waiting import wait_until

T0 = datetime(2030, 1, 1, tzinfo=UTC)


# --------------------------------------------------------------------------- run_tasks


def test_run_tasks_leads_steps_down_and_cancels_each_term() -> None:
    tasks = rs.TaskHandler(stop_grace=2.0)
    terms: list[int] = []
    ended: list[int] = []

    @tasks.persistent("worker", restart="never")
    def worker(ctx: rs.TaskContext) -> None:
        terms.append(ctx.term)
        while ctx.sleep(0.01):
            pass
        ended.append(ctx.term)

    with run_tasks(tasks) as running:
        assert running.term == 1
        running.wait_runs("worker", 1)
        assert running.step_down() == 2
        # The step-down cancelled and joined term 1's run before term 2 began.
        assert ended == [1]
        running.wait_runs("worker", 2)
        assert running.health()["worker"]["runs"] == 2
    assert terms == [1, 2]
    assert ended == [1, 2]
    assert not running.leader.is_leader


def test_run_tasks_step_down_with_hold_waits_for_the_next_term() -> None:
    tasks = rs.TaskHandler()
    with run_tasks(tasks) as running:
        began = time.monotonic()
        assert running.step_down(hold=0.3) == 2
        assert time.monotonic() - began >= 0.25


def test_run_tasks_raises_task_failures_at_the_end() -> None:
    tasks = rs.TaskHandler()

    @tasks.persistent("broken", restart="never")
    def broken(ctx: rs.TaskContext) -> None:
        raise KeyError("missing")

    with (
        pytest.raises(TaskFailures, match="broken: KeyError") as caught,
        run_tasks(tasks) as running,
    ):
        running.wait_runs("broken", 1)
        deadline = time.monotonic() + 5
        while not running.failures and time.monotonic() < deadline:
            time.sleep(0.005)
    assert [name for name, _ in caught.value.failures] == ["broken"]
    assert isinstance(caught.value.failures[0][1], KeyError)


def test_run_tasks_can_keep_failures_to_itself() -> None:
    tasks = rs.TaskHandler()

    @tasks.persistent("broken", restart="never")
    def broken(ctx: rs.TaskContext) -> None:
        raise ValueError("nope")

    with run_tasks(tasks, raise_failures=False) as running:
        running.wait_runs("broken", 1)
        deadline = time.monotonic() + 5
        while not running.failures and time.monotonic() < deadline:
            time.sleep(0.005)
    assert [type(err) for _, err in running.failures] == [ValueError]


def test_run_tasks_an_error_in_the_block_wins_and_the_leader_stops() -> None:
    tasks = rs.TaskHandler()
    with pytest.raises(RuntimeError, match="from the test"), run_tasks(tasks) as running:
        raise RuntimeError("from the test")
    assert not running.leader.is_leader
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("rselection-wait-")],
        5,
        "the leader's waiting thread to end",
    )


def test_run_tasks_wait_runs_times_out_with_a_clear_message() -> None:
    tasks = rs.TaskHandler()

    @tasks.interval(3600, name="hourly")
    def hourly(ctx: rs.TaskContext) -> None:
        pass

    with run_tasks(tasks) as running, pytest.raises(TimeoutError, match="'hourly' ran 0"):
        running.wait_runs("hourly", 1, timeout=0.2)


def test_run_tasks_with_a_claimer_runs_each_fire_once_across_terms() -> None:
    tasks = rs.TaskHandler()
    keys: list[str] = []

    @tasks.interval(0.05, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        assert ctx.fire_key is not None
        keys.append(ctx.fire_key)

    claimer = rs.MemoryClaimer(ttl=60)
    with run_tasks(tasks, claimer=claimer) as running:
        running.wait_runs("tick", 2)
        running.step_down()
        running.wait_runs("tick", 4)
    assert len(keys) == len(set(keys))
    assert {f"{running.leader.name}/{key}" for key in keys} <= set(claimer.claims())


# --------------------------------------------------------------------------- fires


def test_fires_lists_the_next_instants() -> None:
    every_15_min = rs.IntervalSchedule(timedelta(minutes=15))
    assert fires(every_15_min, T0, 3) == [
        T0 + timedelta(minutes=15),
        T0 + timedelta(minutes=30),
        T0 + timedelta(minutes=45),
    ]
    assert fires(every_15_min, T0, 0) == []


def test_fires_until_includes_the_end_and_reads_other_time_zones() -> None:
    weekdays_9am = rs.CronSchedule("0 9 * * 1-5", tz="Europe/Berlin")
    start = datetime(2030, 1, 4, 12, tzinfo=timezone(timedelta(hours=1)))  # Friday noon
    got = fires(weekdays_9am, start, until=datetime(2030, 1, 8, 8, tzinfo=UTC))
    # Monday and Tuesday 09:00 in Berlin (UTC+1 in winter); the weekend is skipped.
    assert got == [datetime(2030, 1, 7, 8, tzinfo=UTC), datetime(2030, 1, 8, 8, tzinfo=UTC)]


def test_fires_refuses_unclear_arguments() -> None:
    schedule = rs.IntervalSchedule(60)
    with pytest.raises(ValueError, match="either count or until"):
        fires(schedule, T0)
    with pytest.raises(ValueError, match="either count or until"):
        fires(schedule, T0, 2, until=T0)
    with pytest.raises(ValueError, match=">= 0"):
        fires(schedule, T0, -1)
    with pytest.raises(rs.ConfigError, match="timezone-aware"):
        fires(schedule, datetime(2030, 1, 1), 1)
    with pytest.raises(ValueError, match="narrow the window"):
        fires(rs.IntervalSchedule(0.001), T0, until=T0 + timedelta(hours=1))


# --------------------------------------------------------------------------- FakeClock


def test_fake_clock_reports_fires_of_a_handler_in_time_order() -> None:
    tasks = rs.TaskHandler()

    @tasks.interval(timedelta(minutes=20), name="sync")
    def sync(ctx: rs.TaskContext) -> None:
        pass

    @tasks.cron("0 * * * *", name="hourly")
    def hourly(ctx: rs.TaskContext) -> None:
        pass

    @tasks.persistent("monitor")
    def monitor(ctx: rs.TaskContext) -> None:
        pass

    clock = FakeClock(T0, tasks)
    assert clock.next_fires() == {
        "sync": T0 + timedelta(minutes=20),
        "hourly": T0 + timedelta(hours=1),
    }
    assert clock.advance(timedelta(minutes=10)) == []
    due = clock.advance(3000)  # to 01:00: the fire at exactly the new instant counts
    assert clock.now == T0 + timedelta(hours=1)
    assert clock.time() == (T0 + timedelta(hours=1)).timestamp()
    assert [(f.task, f.at.minute) for f in due] == [
        ("sync", 20),
        ("sync", 40),
        ("sync", 0),
        ("hourly", 0),
    ]
    assert due[0] == Fire("sync", T0 + timedelta(minutes=20), "sync@2030-01-01T00:20:00.000000000Z")
    assert clock.advance(0) == []


def test_fake_clock_tracks_added_schedules_and_only_moves_forward() -> None:
    clock = FakeClock(T0)
    clock.add("daily", rs.CronSchedule("@daily"))
    with pytest.raises(ValueError, match="already tracked"):
        clock.add("daily", rs.CronSchedule("@daily"))
    due = clock.advance_to(T0 + timedelta(days=3, hours=1))
    assert [f.at.day for f in due] == [2, 3, 4]
    with pytest.raises(ValueError, match="only moves forward"):
        clock.advance(-1)
    with pytest.raises(ValueError, match="only moves forward"):
        clock.advance_to(T0)
    with pytest.raises(rs.ConfigError, match="timezone-aware"):
        FakeClock(datetime(2030, 1, 1))


def test_fake_clock_and_fire_once_replay_a_day_of_fires() -> None:
    tasks = rs.TaskHandler()
    seen: list[str] = []

    @tasks.cron("30 */6 * * *", name="report")
    def report(ctx: rs.TaskContext) -> None:
        assert ctx.fire_key is not None
        seen.append(ctx.fire_key)

    clock = FakeClock(T0, tasks)
    for fire in clock.advance(timedelta(days=1)):
        fire_once(tasks, fire.task, at=fire.at)
    assert seen == [
        "report@2030-01-01T00:30:00.000000000Z",
        "report@2030-01-01T06:30:00.000000000Z",
        "report@2030-01-01T12:30:00.000000000Z",
        "report@2030-01-01T18:30:00.000000000Z",
    ]


# --------------------------------------------------------------------------- fire_once


def test_fire_once_returns_what_the_task_returned_with_a_real_context() -> None:
    tasks = rs.TaskHandler()
    bus = rs.Broadcaster()
    tasks.handle(bus)

    @tasks.interval(60, name="purge")
    def purge(ctx: rs.TaskContext) -> tuple[object, ...]:
        ctx.check()  # the term is live
        with pytest.raises(rs.ConfigError, match="cannot fence a transaction"):
            ctx.fence(None)  # no lease: nothing to fence a transaction against
        return (ctx.term, ctx.node_id, ctx.scheduled_at, ctx.fire_key, ctx.broadcaster)

    at = T0 + timedelta(minutes=5)
    assert fire_once(tasks, "purge", at=at, term=7, node_id="n1") == (
        7,
        "n1",
        at,
        "purge@2030-01-01T00:05:00.000000000Z",
        bus,
    )
    # Without at=: the next fire after now, as a leader would run it.
    term, _, scheduled_at, _, _ = fire_once(tasks, "purge")
    assert term == 1
    now = datetime.now(UTC)
    assert now < scheduled_at <= now + timedelta(seconds=60)
    assert scheduled_at.timestamp() % 60 == 0


def test_fire_once_raises_what_the_task_raised() -> None:
    tasks = rs.TaskHandler()

    @tasks.cron("* * * * *", name="fails")
    def fails(ctx: rs.TaskContext) -> None:
        raise ZeroDivisionError("bad math")

    with pytest.raises(ZeroDivisionError, match="bad math"):
        fire_once(tasks, "fails", at=T0)
    assert tasks.health()["fails"]["runs"] == 0  # outside the runtime: not counted


def test_fire_once_runs_a_persistent_task_until_cancel_after() -> None:
    tasks = rs.TaskHandler()

    @tasks.persistent("loop")
    def loop(ctx: rs.TaskContext) -> int:
        laps = 0
        while ctx.sleep(0.01):
            laps += 1
        assert ctx.cancelled.is_set()
        with pytest.raises(rs.LeadershipLost):
            ctx.check()
        return laps

    began = time.monotonic()
    laps = fire_once(tasks, "loop", cancel_after=0.2)
    assert 0.15 <= time.monotonic() - began < 5
    assert laps >= 1
    with pytest.raises(ValueError, match="persistent"):
        fire_once(tasks, "loop", at=T0)


def test_fire_once_async_task_is_cancelled_like_a_lost_term() -> None:
    tasks = rs.TaskHandler()
    events: list[str] = []

    @tasks.persistent("listener")
    async def listener(ctx: rs.TaskContext) -> None:
        try:
            await asyncio.sleep(30)  # not ctx.asleep: only the cancellation stops it
        except asyncio.CancelledError:
            events.append(f"cancelled, live={ctx.is_live()}")
            raise

    @tasks.interval(10, name="quick")
    async def quick(ctx: rs.TaskContext) -> str:
        await asyncio.sleep(0)
        assert ctx.fire_key is not None
        return ctx.fire_key

    assert fire_once(tasks, "listener", cancel_after=0.1) is None
    assert events == ["cancelled, live=False"]
    assert fire_once(tasks, "quick", at=T0) == "quick@2030-01-01T00:00:00.000000000Z"


def test_afire_once_on_the_callers_loop() -> None:
    tasks = rs.TaskHandler()

    @tasks.interval(10, name="a")
    async def a(ctx: rs.TaskContext) -> str:
        return f"async {ctx.term}"

    @tasks.interval(10, name="s")
    def s(ctx: rs.TaskContext) -> str:
        return f"sync in {threading.current_thread().name}"

    async def main() -> tuple[str, str]:
        with pytest.raises(RuntimeError, match="afire_once"):
            fire_once(tasks, "a", at=T0)
        return await afire_once(tasks, "a", at=T0, term=3), await afire_once(tasks, "s", at=T0)

    got_async, got_sync = asyncio.run(main())
    assert got_async == "async 3"
    assert got_sync.startswith("sync in ") and "MainThread" not in got_sync


def test_fire_once_unknown_name_lists_the_registered_ones() -> None:
    tasks = rs.TaskHandler()

    @tasks.persistent("known")
    def known(ctx: rs.TaskContext) -> None:
        pass

    with pytest.raises(KeyError, match="registered: known"):
        fire_once(tasks, "unknown")


def test_go_style_task_objects_work_too() -> None:
    class Report(rs.GenericTask):
        def run(self, ctx: rs.TaskContext) -> str | None:
            return ctx.fire_key

    tasks = rs.TaskHandler()
    tasks.register("report", Report("report", rs.TaskType.SCHEDULED, rs.IntervalSchedule(30)))
    clock = FakeClock(T0, tasks)
    [first, second] = clock.advance(60)
    assert fire_once(tasks, "report", at=second.at) == second.fire_key
    assert first.at == T0 + timedelta(seconds=30)


# --------------------------------------------------------------------------- the module


def test_the_module_docstring_example_runs() -> None:
    doc = rselection.testing.__doc__
    assert doc is not None
    example = textwrap.dedent(doc.split("Example::\n", 1)[1])
    exec(compile(example, "rselection.testing example", "exec"), {})


@pytest.mark.parametrize("module", [rselection.testing, rselection.metrics])
def test_every_public_name_has_a_docstring(module: ModuleType) -> None:
    assert inspect.getdoc(module)
    missing = [name for name in module.__all__ if not inspect.getdoc(getattr(module, name))]
    assert missing == []
