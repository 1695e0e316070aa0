"""Tests for task registration, validation and the TaskContext a task receives."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import rselection as rs
from rselection import clock
from rselection.context import NoTransactionFence, TaskContext, Term
from rselection.errors import ConfigError, LeadershipLost, StaleLeaderError
from rselection.memory import MemoryLease
from rselection.schedules import format_fire_key


def noop(ctx: rs.TaskContext) -> None:
    """A sync task that does nothing."""


async def anoop(ctx: rs.TaskContext) -> None:
    """An async task that does nothing."""


class RunnerObject:
    """A Go-style task object that does not inherit from GenericTask."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.type = rs.TaskType.PERSISTENT
        self.schedule: rs.Schedule | None = None

    def run(self, ctx: rs.TaskContext) -> None:
        """Do nothing."""


class AsyncRunnerObject(RunnerObject):
    """A Go-style task object with an async run."""

    async def run(self, ctx: rs.TaskContext) -> None:  # type: ignore[override]
        """Do nothing."""


# -- registration ---------------------------------------------------------------------


def test_decorators_register_in_order_and_return_the_function() -> None:
    h = rs.TaskHandler()
    assert h.persistent("a")(noop) is noop
    assert h.interval(5, name="b")(anoop) is anoop
    assert h.cron("*/5 * * * *", name="c")(noop) is noop
    assert h.names == ["a", "b", "c"]


def test_default_name_is_the_function_name() -> None:
    h = rs.TaskHandler()
    h.persistent()(noop)
    h.interval(timedelta(seconds=1))(anoop)
    assert h.names == ["noop", "anoop"]


def test_sync_and_async_are_classified_at_registration() -> None:
    h = rs.TaskHandler()
    h.persistent("sync")(noop)
    h.persistent("async")(anoop)
    h.register("object", RunnerObject("object"))
    h.register("async-object", AsyncRunnerObject("async-object"))
    specs = h._specs
    assert not specs["sync"].is_async
    assert specs["async"].is_async
    assert not specs["object"].is_async
    assert specs["async-object"].is_async


def test_go_style_objects_are_tasks() -> None:
    class Purge(rs.GenericTask):
        def run(self, ctx: rs.TaskContext) -> None:
            pass

    purge = Purge("purge", rs.TaskType.SCHEDULED, rs.IntervalSchedule(30))
    assert isinstance(purge, rs.Task)
    assert isinstance(RunnerObject("x"), rs.Task)
    h = rs.TaskHandler()
    h.register("purge", purge)
    assert h.health()["purge"]["type"] == "scheduled"


def test_generic_task_without_override_says_what_is_missing() -> None:
    task = rs.GenericTask("bare")
    with pytest.raises(NotImplementedError, match=r"GenericTask.run is not implemented"):
        task.run(TaskContext("bare", Term(1, "n")))


def test_health_before_any_run() -> None:
    h = rs.TaskHandler()
    h.persistent("p")(noop)
    h.interval(1, name="i")(noop)
    report = h.health()
    assert report["p"] == {
        "type": "persistent",
        "state": "idle",
        "runs": 0,
        "failures": 0,
        "skipped": 0,
        "last_failed": False,
        "last_error": None,
        "last_fire": None,
        "next_fire": None,
    }
    assert report["i"]["type"] == "scheduled"
    assert not h.verify()


def test_handler_repr_names_its_tasks() -> None:
    h = rs.TaskHandler(stop_grace=2)
    h.persistent("p")(noop)
    assert repr(h) == "TaskHandler(tasks=['p'], stop_grace=2.0)"


# -- bad input --------------------------------------------------------------------------


def test_duplicate_name_is_a_value_error() -> None:
    h = rs.TaskHandler()
    h.persistent("job")(noop)
    with pytest.raises(ValueError, match="a task named 'job' is already registered"):
        h.interval(1, name="job")(noop)
    with pytest.raises(ConfigError, match="'job' is already registered"):
        h.register("job", RunnerObject("job"))
    assert h.names == ["job"]


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_empty_or_non_string_name(name: Any) -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError, match="task name must be a non-blank string"):
        h.register(name, RunnerObject("x"))


def test_registration_while_running_is_a_runtime_error() -> None:
    h = rs.TaskHandler()
    h.persistent("p")(noop)
    leader = rs.SingleNodeLeader(h)
    with leader:
        with pytest.raises(RuntimeError) as info:
            h.persistent("late")(noop)
        assert "cannot register task 'late' while the handler is running" in str(info.value)
        assert "before starting the leader" in str(info.value)
        with pytest.raises(RuntimeError, match="while the handler is running"):
            h.register("late2", RunnerObject("late2"))
    # Once the leader stopped, the handler is open for registration again.
    h.persistent("after")(noop)
    assert h.names == ["p", "after"]


@pytest.mark.parametrize("every", [0, -1, 0.0, -0.5, timedelta(0), timedelta(seconds=-1)])
def test_non_positive_interval(every: Any) -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError, match="every must be a positive number of seconds"):
        h.interval(every)


@pytest.mark.parametrize("every", [float("nan"), float("inf"), "5", True, None])
def test_interval_that_is_not_a_duration(every: Any) -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError, match="every must be a positive number"):
        h.interval(every)


def test_jitter_not_below_every() -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError, match="jitter must be smaller than every"):
        h.interval(1, jitter=1)


@pytest.mark.parametrize("expr", ["not a cron", "61 * * * *", "* * * *", ""])
def test_bad_cron_expression(expr: str) -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError, match=re.escape(f"invalid cron expression {expr!r}")):
        h.cron(expr)


def test_cron_that_never_matches() -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError, match="never matches any date"):
        h.cron("0 0 30 2 *")


def test_cron_unknown_time_zone() -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError, match="unknown time zone 'Mars/Olympus'"):
        h.cron("* * * * *", tz="Mars/Olympus")


@pytest.mark.parametrize("overlap", ["queue", "", None, "SKIP"])
def test_bad_overlap(overlap: Any) -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError) as info:
        h.interval(1, overlap=overlap)
    assert "overlap must be one of 'skip', 'allow'" in str(info.value)
    assert repr(overlap) in str(info.value)
    with pytest.raises(ConfigError, match="overlap must be one of"):
        h.cron("* * * * *", overlap=overlap)


@pytest.mark.parametrize("restart", ["sometimes", "", None, "on_failure"])
def test_bad_restart(restart: Any) -> None:
    h = rs.TaskHandler()
    with pytest.raises(ConfigError) as info:
        h.persistent("p", restart=restart)
    msg = str(info.value)
    assert "restart must be one of 'on-failure', 'always', 'never'" in msg
    assert repr(restart) in msg


@pytest.mark.parametrize("on_stuck", ["kill", "", None, "EXIT"])
def test_bad_on_stuck(on_stuck: Any) -> None:
    with pytest.raises(ConfigError, match="on_stuck must be one of 'log', 'exit'"):
        rs.TaskHandler(on_stuck=on_stuck)


@pytest.mark.parametrize("grace", [0, -1, 0.0, float("nan"), float("inf"), True, "5"])
def test_bad_stop_grace(grace: Any) -> None:
    with pytest.raises(ConfigError) as info:
        rs.TaskHandler(stop_grace=grace)
    assert "stop_grace must be" in str(info.value)
    assert repr(grace) in str(info.value)


def test_task_object_without_run() -> None:
    class NoRun:
        name = "norun"
        type = rs.TaskType.PERSISTENT
        schedule = None

    h = rs.TaskHandler()
    with pytest.raises(ConfigError, match=r"task 'norun' has no callable run\(ctx\) method"):
        h.register("norun", NoRun())  # type: ignore[arg-type]


def test_task_object_with_a_non_callable_run() -> None:
    obj = RunnerObject("x")
    obj.run = "not callable"  # type: ignore[assignment, method-assign]
    with pytest.raises(ConfigError, match="has no callable run"):
        rs.TaskHandler().register("x", obj)


def test_task_object_with_a_bad_type() -> None:
    obj = RunnerObject("x")
    obj.type = "persistent"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="type must be a TaskType, got 'persistent'"):
        rs.TaskHandler().register("x", obj)


def test_scheduled_generic_task_without_schedule() -> None:
    task = rs.GenericTask("report", rs.TaskType.SCHEDULED)
    with pytest.raises(ConfigError, match="scheduled task 'report' needs a schedule"):
        rs.TaskHandler().register("report", task)


def test_schedule_without_next_fire() -> None:
    task = rs.GenericTask("report", rs.TaskType.SCHEDULED, object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"schedule has no next_fire\(after\) method"):
        rs.TaskHandler().register("report", task)


# -- TaskContext ------------------------------------------------------------------------


def test_context_reports_its_term() -> None:
    b = rs.Broadcaster()
    term = Term(7, "node-a", "lease", broadcaster=b)
    at = datetime(2026, 11, 30, 2, 40, tzinfo=UTC)
    ctx = TaskContext("purge", term, scheduled_at=at, fire_key=format_fire_key("purge", at))
    assert (ctx.name, ctx.term, ctx.node_id) == ("purge", 7, "node-a")
    assert ctx.scheduled_at == at
    assert ctx.fire_key == "purge@2026-11-30T02:40:00.000000000Z"
    assert ctx.broadcaster is b
    assert ctx.cancelled is term.cancelled
    assert ctx.is_live()
    assert "purge" in repr(ctx) and "term=7" in repr(ctx)


def test_fire_key_format() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    key = format_fire_key("report", at)
    assert key == "report@2026-01-02T03:04:05.678901000Z"
    assert re.fullmatch(r"report@\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", key)


def test_sleep_runs_the_full_time_while_live() -> None:
    ctx = TaskContext("t", Term(1, "n"))
    began = time.monotonic()
    assert ctx.sleep(0.05) is True
    assert time.monotonic() - began >= 0.05
    assert ctx.sleep(0) is True
    with pytest.raises(ValueError, match="sleep seconds must be >= 0"):
        ctx.sleep(-1)


def test_sleep_returns_false_at_once_on_cancel() -> None:
    term = Term(1, "n")
    ctx = TaskContext("t", term)
    result: list[tuple[bool, float]] = []

    def sleeper() -> None:
        result.append((ctx.sleep(30), time.monotonic()))

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.05)
    cancelled_at = time.monotonic()
    term.cancel()
    thread.join(5)
    assert not thread.is_alive()
    slept, woke = result[0]
    assert slept is False
    assert woke - cancelled_at < 0.1
    began = time.monotonic()
    assert ctx.sleep(30) is False  # already cancelled: no wait at all
    assert time.monotonic() - began < 0.05


def test_sleep_stops_at_the_local_deadline() -> None:
    ctx = TaskContext("t", Term(1, "n", deadline=clock.monotonic() + 0.05))
    began = time.monotonic()
    assert ctx.sleep(30) is False
    assert 0.04 <= time.monotonic() - began < 5
    assert not ctx.is_live()


def test_asleep_returns_false_at_once_on_cancel() -> None:
    term = Term(1, "n")
    ctx = TaskContext("t", term)

    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, threading.Thread(target=term.cancel).start)
        began = time.monotonic()
        slept = await ctx.asleep(30)
        return slept, time.monotonic() - began

    slept, took = asyncio.run(main())
    assert slept is False
    assert took < 1.0
    assert asyncio.run(ctx.asleep(30)) is False


def test_asleep_full_time() -> None:
    ctx = TaskContext("t", Term(1, "n"))
    assert asyncio.run(ctx.asleep(0.02)) is True
    with pytest.raises(ValueError, match="sleep seconds must be >= 0"):
        asyncio.run(ctx.asleep(-0.1))


def test_check_raises_leadership_lost_after_cancel() -> None:
    term = Term(3, "node-a")
    ctx = TaskContext("job", term)
    ctx.check()
    term.cancel()
    with pytest.raises(LeadershipLost) as info:
        ctx.check()
    assert "task 'job': term 3 of node 'node-a' has ended" in str(info.value)


def test_check_raises_after_the_local_deadline() -> None:
    ctx = TaskContext("job", Term(1, "n", deadline=clock.monotonic() - 1))
    with pytest.raises(LeadershipLost):
        ctx.check()


def test_fence_without_a_transaction_fence_is_refused_naming_what_to_call() -> None:
    """A leader whose lease cannot fence a transaction refuses ctx.fence instead of
    only checking that the term is live (which would protect no write)."""
    term = Term(2, "n")
    ctx = TaskContext("job", term)
    with pytest.raises(ConfigError, match=r"cannot fence a transaction.*ctx\.check\(\)"):
        ctx.fence(object())
    with pytest.raises(ConfigError, match="cannot fence a transaction"):
        asyncio.run(ctx.afence(object()))
    term.cancel()  # the same answer once the term ended: it never depended on liveness
    with pytest.raises(ConfigError, match="cannot fence a transaction"):
        ctx.fence(object())


class RecordingFence:
    """A transaction fence that records what it was asked to fence."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, int]] = []

    def fence(self, conn: Any, term: int) -> None:
        self.calls.append(("fence", conn, term))

    async def afence(self, conn: Any, term: int) -> None:
        self.calls.append(("afence", conn, term))


class AsyncConnection:
    """Looks like a connection whose queries are coroutines."""

    async def execute(self, query: str) -> None: ...


def test_fence_and_afence_use_the_leaders_transaction_fence() -> None:
    fence = RecordingFence()
    conn, aconn = object(), AsyncConnection()
    ctx = TaskContext("job", Term(5, "n", fence=fence))
    ctx.fence(conn)
    asyncio.run(ctx.afence(aconn))
    assert fence.calls == [("fence", conn, 5), ("afence", aconn, 5)]
    with pytest.raises(ConfigError, match=r"await ctx\.afence\(conn\)"):
        ctx.fence(aconn)


class BlockingConnection:
    """Looks like a connection whose queries block."""

    def execute(self, query: str) -> None: ...


def test_a_fence_that_refuses_names_a_call_that_works_whatever_the_connection() -> None:
    """Under a lease that cannot fence a transaction (Redis), ctx.fence(async conn) and
    ctx.afence(blocking conn) never send the task to the other call, refused as well."""
    ctx = TaskContext("job", Term(5, "n", fence=NoTransactionFence("call fenced() instead")))
    for conn in (BlockingConnection(), AsyncConnection(), object()):
        with pytest.raises(ConfigError) as refused:
            ctx.fence(conn)
        assert str(refused.value) == "ctx.fence(): call fenced() instead"
        with pytest.raises(ConfigError) as refused:
            asyncio.run(ctx.afence(conn))
        assert str(refused.value) == "ctx.afence(): call fenced() instead"


def test_checkpoint_needs_a_store() -> None:
    ctx = TaskContext("job", Term(1, "n"))
    with pytest.raises(ConfigError, match="checkpoint_store=") as refused:
        _ = ctx.checkpoint
    # A RedisLeader takes no checkpoint_store=: the message says what to do there.
    assert r"A RedisLeader takes none" in str(refused.value)
    assert "leader.fence.call(ctx.term, 'SET'" in str(refused.value)


def test_checkpoint_is_the_task_key_fenced_to_its_term_and_lease() -> None:
    lease = MemoryLease(name="billing")
    holder = lease.try_acquire("n").holder
    assert holder is not None
    store = rs.MemoryCheckpointStore(leases=[lease])
    ctx = TaskContext("job", Term(holder.term, "n", "billing", checkpoint_store=store))
    assert ctx.checkpoint is ctx.checkpoint
    assert (ctx.checkpoint.key, ctx.checkpoint.term, ctx.checkpoint.name) == (
        "billing/job",
        holder.term,
        "billing",
    )
    saved = ctx.checkpoint.save({"n": 1})
    assert saved.term == holder.term and store.load("billing/job") == saved
    assert store.load("job") is None
    lease.release("n", holder.term)
    with pytest.raises(StaleLeaderError):
        ctx.checkpoint.save({"n": 2})


def test_interval_jitter_is_seeded_by_the_task_name() -> None:
    handler = rs.TaskHandler()

    @handler.interval(60, name="a", jitter=30)
    def a(ctx: rs.TaskContext) -> None: ...

    @handler.interval(60, name="b", jitter=30)
    def b(ctx: rs.TaskContext) -> None: ...

    after = datetime(2026, 1, 1, tzinfo=UTC)
    fires = {}
    for name in ("a", "b"):
        schedule = handler._specs[name].schedule
        assert schedule is not None
        fires[name] = schedule.next_fire(after)
    assert fires["a"] != fires["b"], "same period and jitter must not mean the same instants"
    again = rs.IntervalSchedule(60, jitter=30, seed="a").next_fire(after)
    assert fires["a"] == again, "every node computes the same jittered instant"
