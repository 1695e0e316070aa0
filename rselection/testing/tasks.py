"""A user's test kit: run a handler's tasks under a real single-node leader
(:func:`run_tasks`), fire one task now (:func:`fire_once`, :func:`afire_once`), and
compute fire instants without waiting (:func:`fires`, :class:`FakeClock`). See
:mod:`rselection.testing` and the how-to "Test your tasks"."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import signals
from ..context import TaskContext, Term
from ..schedules import Schedule, aware_utc, format_fire_key
from ..single_node import SingleNodeLeader
from ..specs import TaskSpec, TaskType
from ..tasks import TaskHandler

if TYPE_CHECKING:
    from ..abc import CheckpointStore
    from ..broadcast import Broadcaster
    from ..claiming import FireClaimer

__all__ = [
    "FakeClock",
    "Fire",
    "RunningTasks",
    "TaskFailures",
    "afire_once",
    "fire_once",
    "fires",
    "run_tasks",
]

_MAX_FIRES = 100_000  # a runaway loop guard for fires() and FakeClock.advance()


class TaskFailures(AssertionError):
    """Tasks raised while :func:`run_tasks` ran them.

    Attributes:
        failures: ``(task name, exception)`` in the order they happened.
    """

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = failures
        lines = "; ".join(f"{name}: {type(err).__name__}: {err}" for name, err in failures)
        super().__init__(f"{len(failures)} task run(s) failed: {lines}")


@dataclass
class RunningTasks:
    """What :func:`run_tasks` yields: the live leader and what its tasks did so far.

    Attributes:
        leader: the running :class:`~rselection.SingleNodeLeader`.
        handler: the task handler it runs.
        failures: ``(task name, exception)`` of every failed run, in order.
        stuck: names of tasks that ignored cancellation past ``stop_grace``.
    """

    leader: SingleNodeLeader
    handler: TaskHandler
    failures: list[tuple[str, BaseException]]
    stuck: list[str]
    timeout: float

    @property
    def term(self) -> int | None:
        """The current term number, ``None`` between terms."""
        return self.leader.term

    def step_down(self, *, hold: float = 0.0) -> int:
        """End the term now (tasks are cancelled and joined), then wait for the next one.

        Call it from the test, never from inside a task (a task would wait for itself).

        Args:
            hold: seconds to stay a follower before leading again.

        Returns:
            The new term's number (the old one plus one).

        Raises:
            TimeoutError: no new term began within ``hold`` plus the run's ``timeout``.
        """
        self.leader.step_down(hold=hold, wait=True)
        if not self.leader.wait_until_leader(hold + self.timeout):
            raise TimeoutError(f"no new term within {hold + self.timeout:g} s of stepping down")
        term = self.leader.term
        assert term is not None
        return term

    def health(self) -> dict[str, dict[str, Any]]:
        """The handler's :meth:`~rselection.TaskHandler.health` report."""
        return self.handler.health()

    def wait_runs(self, name: str, runs: int, timeout: float | None = None) -> None:
        """Block until task ``name`` has started at least ``runs`` runs.

        Raises:
            KeyError: no task of that name.
            TimeoutError: it had not within ``timeout`` seconds (default: the run's).
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while self.handler.health()[name]["runs"] < runs:
            if time.monotonic() > deadline:
                have = self.handler.health()[name]["runs"]
                raise TimeoutError(f"task {name!r} ran {have} time(s), not {runs}, in {limit:g} s")
            time.sleep(0.005)


@contextmanager
def run_tasks(
    handler: TaskHandler,
    *,
    broadcaster: Broadcaster | None = None,
    claimer: FireClaimer | None = None,
    checkpoint_store: CheckpointStore | None = None,
    timeout: float = 10.0,
    raise_failures: bool = True,
) -> Iterator[RunningTasks]:
    """Run ``handler``'s tasks under a :class:`~rselection.SingleNodeLeader` for a block.

    The block starts once term 1 began; leaving it stops the leader (cancelling and
    joining every task). Task failures are collected; unless ``raise_failures=False``
    they are raised as :class:`TaskFailures` when the block ends without an exception
    of its own, so a task that raised never goes unnoticed.

    Example::

        with run_tasks(tasks) as running:
            running.wait_runs("purge", 2)
            assert running.step_down() == 2   # term 1 cancelled and joined
            running.wait_runs("purge", 3)

    Args:
        handler: the tasks to run (registration closes while the block runs).
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        claimer: claims each scheduled fire (see :class:`~rselection.MemoryClaimer`).
        checkpoint_store: keeps ``ctx.checkpoint`` (default: a new
            :class:`~rselection.MemoryCheckpointStore`); pass one to seed or inspect task
            state.
        timeout: seconds to wait for a term to begin, and the default of
            :meth:`RunningTasks.wait_runs`.
        raise_failures: raise :class:`TaskFailures` at the end if a task failed.

    Raises:
        TimeoutError: the leader did not lead within ``timeout`` seconds.
        TaskFailures: a task failed (with ``raise_failures``).
    """
    leader = SingleNodeLeader(
        handler, broadcaster=broadcaster, claimer=claimer, checkpoint_store=checkpoint_store
    )
    running = RunningTasks(leader, handler, [], [], timeout)
    lock = threading.Lock()

    def failed(sender: object, **kw: Any) -> None:
        with lock:
            running.failures.append((kw["task"], kw["error"]))

    def stuck(sender: object, **kw: Any) -> None:
        with lock:
            running.stuck.append(kw["task"])

    signals.task_failed.connect(failed, sender=handler, weak=False)
    signals.task_stuck.connect(stuck, sender=handler, weak=False)
    try:
        leader.start()
        try:
            if not leader.wait_until_leader(timeout):
                raise TimeoutError(f"the single-node leader did not lead within {timeout:g} s")
            yield running
        finally:
            leader.stop(timeout=timeout + leader.stop_grace)
    finally:
        signals.task_failed.disconnect(failed, sender=handler)
        signals.task_stuck.disconnect(stuck, sender=handler)
    if raise_failures and running.failures:
        raise TaskFailures(list(running.failures))


def fires(
    schedule: Schedule,
    start: datetime,
    count: int | None = None,
    *,
    until: datetime | None = None,
) -> list[datetime]:
    """The fire instants of ``schedule`` after ``start``: the next ``count``, or up to ``until``.

    A pure computation (no clock, no waiting), the instants a leader would fire at.

    Example::

        >>> from datetime import UTC, datetime
        >>> import rselection as rs
        >>> [t.minute for t in fires(rs.IntervalSchedule(900), datetime(2030, 1, 1, tzinfo=UTC), 3)]
        [15, 30, 45]

    Args:
        schedule: any :class:`~rselection.Schedule`.
        start: an aware datetime; fires strictly after it are listed.
        count: how many fires (fewer if the schedule ends).
        until: list every fire up to and including this instant instead.

    Raises:
        ValueError: neither or both of ``count`` and ``until``, or a negative count.
        ConfigError: a naive datetime.
    """
    if (count is None) == (until is None):
        raise ValueError("pass either count or until")
    if count is not None and count < 0:
        raise ValueError(f"count must be >= 0, got {count!r}")
    limit = count if count is not None else _MAX_FIRES
    found: list[datetime] = []
    at: datetime | None = start
    while len(found) < limit and at is not None:
        at = schedule.next_fire(at)
        if at is None or (until is not None and at > until):
            break
        found.append(at)
    else:
        if count is None and at is not None:
            raise ValueError(f"more than {_MAX_FIRES} fires before {until!r}; narrow the window")
    return found


class Fire(NamedTuple):
    """One fire that came due on a :class:`FakeClock`: task name, instant and fire key."""

    task: str
    at: datetime
    fire_key: str


class FakeClock:
    """A clock that tests move by hand, telling which scheduled fires come due.

    It tracks named schedules (every scheduled task of the handlers given, plus any
    added with :meth:`add`) from ``start``; :meth:`advance` moves time forward and
    returns the fires passed, in time order. It drives computations only: it does not
    change the time a running leader sees. Pair it with :func:`fire_once` to run what
    came due.

    Example::

        clock = FakeClock(datetime(2030, 1, 1, tzinfo=UTC), tasks)
        for fire in clock.advance(timedelta(minutes=10)):
            fire_once(tasks, fire.task, at=fire.at)

    Args:
        start: the initial instant (aware; default: now, in UTC).
        handlers: task handlers whose scheduled tasks to track.
    """

    def __init__(self, start: datetime | None = None, *handlers: TaskHandler) -> None:
        self._now = datetime.now(UTC) if start is None else aware_utc(start, "start")
        self._next: dict[str, tuple[Schedule, datetime | None]] = {}
        for handler in handlers:
            for spec in handler.specs():
                if spec.type is TaskType.SCHEDULED and spec.schedule is not None:
                    self.add(spec.name, spec.schedule)

    @property
    def now(self) -> datetime:
        """The clock's current instant (aware, UTC)."""
        return self._now

    def time(self) -> float:
        """The current instant as seconds since the epoch, like :func:`time.time`."""
        return self._now.timestamp()

    def add(self, name: str, schedule: Schedule) -> None:
        """Track ``schedule`` under ``name``, from the current instant on.

        Raises:
            ValueError: ``name`` is already tracked.
        """
        if name in self._next:
            raise ValueError(f"a schedule named {name!r} is already tracked")
        self._next[name] = (schedule, schedule.next_fire(self._now))

    def next_fires(self) -> dict[str, datetime | None]:
        """Each tracked name's next fire after the current instant (``None``: no more)."""
        return {name: at for name, (_, at) in self._next.items()}

    def advance(self, by: float | timedelta) -> list[Fire]:
        """Move forward by ``by`` (seconds or a timedelta, >= 0); return the fires passed.

        A fire exactly at the new instant counts as passed. Fires are in time order
        (ties in the order the schedules were added).
        """
        step = by if isinstance(by, timedelta) else timedelta(seconds=by)
        if step < timedelta(0):
            raise ValueError(f"a FakeClock only moves forward, got {by!r}")
        return self.advance_to(self._now + step)

    def advance_to(self, instant: datetime) -> list[Fire]:
        """Move forward to ``instant`` (aware, not before :attr:`now`); return the fires passed."""
        target = aware_utc(instant, "instant")
        if target < self._now:
            raise ValueError(f"a FakeClock only moves forward: {target} is before {self._now}")
        passed: list[tuple[datetime, int, Fire]] = []
        for order, (name, (schedule, at)) in enumerate(self._next.items()):
            count = 0
            while at is not None and at <= target:
                passed.append((at, order, Fire(name, at, format_fire_key(name, at))))
                count += 1
                if count > _MAX_FIRES:
                    raise ValueError(
                        f"more than {_MAX_FIRES} fires of {name!r} in one step; advance less"
                    )
                at = schedule.next_fire(at)
            self._next[name] = (schedule, at)
        self._now = target
        passed.sort(key=lambda item: (item[0], item[1]))
        return [fire for _, _, fire in passed]

    def __repr__(self) -> str:
        return f"FakeClock({self._now.isoformat()!r}, tracking={list(self._next)!r})"


def _prepare(
    handler: TaskHandler,
    name: str,
    at: datetime | None,
    term: int,
    node_id: str,
    broadcaster: Broadcaster | None,
) -> tuple[TaskSpec, Term, TaskContext]:
    spec = handler.spec(name)
    if spec.type is TaskType.PERSISTENT:
        if at is not None:
            raise ValueError(f"task {name!r} is persistent: it has no fires, so pass no at=")
        scheduled_at = None
    else:
        schedule = spec.schedule
        assert schedule is not None
        if at is None:
            # The fire a leader would run next, so ctx looks as it would in production.
            scheduled_at = schedule.next_fire(datetime.now(UTC))
            if scheduled_at is None:
                raise ValueError(f"task {name!r} has no fire left; pass at=")
        else:
            scheduled_at = aware_utc(at, "at")
    live = Term(
        term,
        node_id,
        "testing",
        broadcaster=broadcaster if broadcaster is not None else handler.broadcaster,
    )
    ctx = TaskContext(
        name,
        live,
        scheduled_at=scheduled_at,
        fire_key=format_fire_key(name, scheduled_at) if scheduled_at is not None else None,
    )
    return spec, live, ctx


def fire_once(
    handler: TaskHandler,
    name: str,
    at: datetime | None = None,
    *,
    cancel_after: float | None = None,
    term: int = 1,
    node_id: str = "test",
    broadcaster: Broadcaster | None = None,
) -> Any:
    """Run task ``name`` once, now, in this thread, and return what it returned.

    The task gets a real :class:`~rselection.TaskContext` under a live term: ``ctx.term``,
    ``ctx.scheduled_at`` and ``ctx.fire_key`` are set as a leader would set them,
    ``ctx.sleep`` waits, and ``ctx.broadcaster`` is ``broadcaster`` or the handler's.
    There is no lease: ``ctx.fence`` and ``ctx.checkpoint`` raise
    :class:`~rselection.ConfigError` (run the task under :func:`run_tasks` for a
    checkpoint kept in memory). An exception the task
    raises propagates. The run does not count in :meth:`~rselection.TaskHandler.health`,
    and is neither claimed nor subject to overlap or misfire rules.

    ``async def`` tasks run on a new event loop; from a coroutine use :func:`afire_once`.

    Example::

        assert fire_once(tasks, "purge", at=datetime(2030, 1, 1, tzinfo=UTC)) == 3
        fire_once(tasks, "monitor", cancel_after=0.2)  # a persistent task, then "lose" it

    Args:
        handler: the handler the task is registered on.
        name: the task name.
        at: the fire instant of a scheduled task (aware; default: its next fire after
            now). Must be ``None`` for a persistent task.
        cancel_after: end the term after this many seconds, as a lost leadership does
            (``ctx.cancelled`` is set, ``ctx.sleep`` returns ``False``, an ``async def``
            task is cancelled). Without it a task that runs for the whole term never
            returns.
        term: the term number the task sees.
        node_id: the node id the task sees.
        broadcaster: handed to the task as ``ctx.broadcaster``.

    Raises:
        KeyError: no task of that name.
        ValueError: ``at`` given for a persistent task.
        RuntimeError: an ``async def`` task called from a running event loop.
    """
    spec, live, ctx = _prepare(handler, name, at, term, node_id, broadcaster)
    if spec.is_async:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop running here: the usual case
            return asyncio.run(_run_async(spec, live, ctx, cancel_after))
        raise RuntimeError(
            f"task {name!r} is async and an event loop is running here: "
            "use 'await afire_once(...)' instead"
        )
    timer: threading.Timer | None = None
    if cancel_after is not None:
        timer = threading.Timer(cancel_after, live.cancel)
        timer.daemon = True
        timer.start()
    try:
        result = spec.task.run(ctx)
        if inspect.isawaitable(result):
            raise TypeError(f"task {name!r} returned an awaitable from a plain function")
        return result
    finally:
        if timer is not None:
            timer.cancel()
        live.cancel()  # the term ends with the run, as the leader's would


async def afire_once(
    handler: TaskHandler,
    name: str,
    at: datetime | None = None,
    *,
    cancel_after: float | None = None,
    term: int = 1,
    node_id: str = "test",
    broadcaster: Broadcaster | None = None,
) -> Any:
    """:func:`fire_once` for coroutines: an ``async def`` task runs on the caller's loop.

    A plain ``def`` task runs in a worker thread, so the loop is never blocked.
    """
    spec, live, ctx = _prepare(handler, name, at, term, node_id, broadcaster)
    if spec.is_async:
        return await _run_async(spec, live, ctx, cancel_after)
    loop = asyncio.get_running_loop()
    handle = loop.call_later(cancel_after, live.cancel) if cancel_after is not None else None
    try:
        return await asyncio.to_thread(spec.task.run, ctx)
    finally:
        if handle is not None:
            handle.cancel()
        live.cancel()


async def _run_async(
    spec: TaskSpec, live: Term, ctx: TaskContext, cancel_after: float | None
) -> Any:
    task: asyncio.Task[Any] = asyncio.ensure_future(spec.task.run(ctx))
    loop = asyncio.get_running_loop()
    lost = False

    def lose() -> None:
        # What the runtime does on a loss: set the flag, then cancel the coroutine.
        nonlocal lost
        lost = True
        live.cancel()
        task.cancel()

    handle = loop.call_later(cancel_after, lose) if cancel_after is not None else None
    try:
        return await task
    except asyncio.CancelledError:
        if not lost:
            raise
        return None  # cancelled by the simulated loss, as a leader would end it
    finally:
        if handle is not None:
            handle.cancel()
        live.cancel()
