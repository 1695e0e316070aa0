"""Task registration: the :class:`TaskHandler`, the :class:`Task` protocol and its helpers."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import ConfigError
from .runtime import TermRunner
from .schedules import CronSchedule, IntervalSchedule, Schedule
from .specs import (
    DEFAULT_MISFIRE_GRACE,
    MISFIRE_POLICIES,
    OVERLAP_POLICIES,
    RESTART_POLICIES,
    STUCK_POLICIES,
    MisfirePolicy,
    OverlapPolicy,
    RestartPolicy,
    StuckPolicy,
    Task,
    TaskSpec,
    TaskStats,
    TaskType,
)
from .timing import STOP_GRACE_CAP
from .validation import check_name, check_seconds

if TYPE_CHECKING:
    import asyncio

    from .broadcast import Broadcaster
    from .context import TaskContext, Term

__all__ = ["GenericTask", "Task", "TaskHandler", "TaskType"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class GenericTask:
    """A convenience base for :class:`Task` objects: subclass it and override :meth:`run`.

    Args:
        name: the task name.
        type: persistent or scheduled.
        schedule: when a scheduled task fires.
    """

    def __init__(
        self,
        name: str,
        type: TaskType = TaskType.PERSISTENT,
        schedule: Schedule | None = None,
    ) -> None:
        self.name = name
        self.type = type
        self.schedule = schedule

    def run(self, ctx: TaskContext) -> Any:
        """Override with the task's work."""
        raise NotImplementedError(f"{type(self).__name__}.run is not implemented")


class _FunctionTask:
    """Adapts a decorated function to the :class:`Task` protocol."""

    def __init__(
        self, name: str, fn: Callable[..., Any], type: TaskType, schedule: Schedule | None
    ) -> None:
        self.name = name
        self.type = type
        self.schedule = schedule
        self.run = fn


def _is_async_callable(fn: Any) -> bool:
    # Callable objects with an ``async def __call__`` count as async too.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


def _check_choice(what: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{what} must be one of {allowed}, got {value!r}")


def _check_fire_options(
    overlap: object, misfire: object, misfire_grace: object
) -> tuple[OverlapPolicy, MisfirePolicy, float]:
    _check_choice("overlap", overlap, OVERLAP_POLICIES)
    _check_choice("misfire", misfire, MISFIRE_POLICIES)
    grace = check_seconds(misfire_grace, "misfire_grace")
    return overlap, misfire, grace  # type: ignore[return-value]  # checked just above


class TaskHandler:
    """Holds the tasks a leader runs, and runs one term of them at a time.

    Args:
        stop_grace: seconds to wait for tasks to finish after cancelling them. ``None``
            (the default) takes as long as the leader's timings allow
            (``ttl - renew_deadline - 0.5 s``, at most 5 s); a leader refuses an explicit
            value for which ``renew_deadline + stop_grace + 0.5 s > ttl``.
        on_stuck: ``"log"`` reports a task still running after ``stop_grace``;
            ``"exit"`` also ends the process (``os._exit(70)``), like a watchdog.
    """

    def __init__(self, *, stop_grace: float | None = None, on_stuck: StuckPolicy = "log") -> None:
        self.stop_grace = None if stop_grace is None else check_seconds(stop_grace, "stop_grace")
        _check_choice("on_stuck", on_stuck, STUCK_POLICIES)
        self.on_stuck: StuckPolicy = on_stuck
        self._specs: dict[str, TaskSpec] = {}
        self._lock = threading.RLock()
        self._attached = 0
        self._runner: TermRunner | None = None
        self._broadcaster: Broadcaster | None = None

    # -- registration -------------------------------------------------------------

    def register(
        self,
        name: str,
        task: Task,
        *,
        overlap: OverlapPolicy = "skip",
        misfire: MisfirePolicy = "latest",
        misfire_grace: float | timedelta = DEFAULT_MISFIRE_GRACE,
    ) -> None:
        """Register a :class:`Task` object under ``name``.

        ``overlap``, ``misfire`` and ``misfire_grace`` apply to scheduled tasks, as for
        :meth:`interval`.

        Raises:
            ConfigError: empty or duplicate name, or a task without ``run``/``type``,
                or a scheduled task without a schedule, or a bad option.
            RuntimeError: the handler is already running under a leader.
        """
        options = _check_fire_options(overlap, misfire, misfire_grace)
        self._add(name, task, fire_options=options)

    def _add(
        self,
        name: str,
        task: Task,
        *,
        restart: RestartPolicy = "on-failure",
        fire_options: tuple[OverlapPolicy, MisfirePolicy, float] = (
            "skip",
            "latest",
            DEFAULT_MISFIRE_GRACE,
        ),
    ) -> TaskSpec:
        check_name(name, "task name")
        if not callable(getattr(task, "run", None)):
            raise ConfigError(f"task {name!r} has no callable run(ctx) method")
        task_type = getattr(task, "type", None)
        if not isinstance(task_type, TaskType):
            raise ConfigError(f"task {name!r}: type must be a TaskType, got {task_type!r}")
        schedule = getattr(task, "schedule", None)
        if task_type is TaskType.SCHEDULED and schedule is None:
            raise ConfigError(f"scheduled task {name!r} needs a schedule")
        if schedule is not None and not callable(getattr(schedule, "next_fire", None)):
            raise ConfigError(f"task {name!r}: schedule has no next_fire(after) method")
        with self._lock:
            if self._attached:
                raise RuntimeError(
                    f"cannot register task {name!r} while the handler is running; "
                    "register every task before starting the leader"
                )
            if name in self._specs:
                raise ConfigError(f"a task named {name!r} is already registered")
            spec = TaskSpec(name, task, _is_async_callable(task.run), restart, *fire_options)
            self._specs[name] = spec
            return spec

    def persistent(
        self, name: str | None = None, *, restart: RestartPolicy = "on-failure"
    ) -> Callable[[F], F]:
        """Decorator: run the function for the whole term.

        Args:
            name: task name (default: the function's ``__name__``).
            restart: ``"on-failure"`` (default) restarts after an exception with capped
                exponential backoff; ``"always"`` also after a normal return;
                ``"never"`` runs it once per term.
        """
        _check_choice("restart", restart, RESTART_POLICIES)

        def decorate(fn: F) -> F:
            task_name = name if name is not None else fn.__name__
            self._add(
                task_name,
                _FunctionTask(task_name, fn, TaskType.PERSISTENT, None),
                restart=restart,
            )
            return fn

        return decorate

    def interval(
        self,
        every: float | timedelta,
        *,
        name: str | None = None,
        jitter: float | timedelta = 0,
        overlap: OverlapPolicy = "skip",
        misfire: MisfirePolicy = "latest",
        misfire_grace: float | timedelta = DEFAULT_MISFIRE_GRACE,
    ) -> Callable[[F], F]:
        """Decorator: run the function every ``every`` seconds (epoch-aligned, no drift).

        Args:
            every: seconds or a ``timedelta``; must be positive.
            name: task name (default: the function's ``__name__``).
            jitter: a deterministic offset in ``[0, jitter)`` added to each fire.
            overlap: ``"skip"`` (default) skips a fire while the previous run is still
                going; ``"allow"`` runs them side by side.
            misfire: what to do with fires whose instant passed while they could not
                run (no node led, or this one fell behind by a whole period):
                ``"latest"`` (default) runs the newest of them once, ``"all"`` runs each
                of them, oldest first, one after another (at most 100), ``"skip"`` runs
                none. Every fire not run is sent on ``signals.fire_skipped``.
            misfire_grace: seconds (or a ``timedelta``) after its instant a fire may
                still start; an older one is skipped whatever the policy. Default 60; at
                most the claim ttl of a leader that claims fires.
        """
        options = _check_fire_options(overlap, misfire, misfire_grace)
        IntervalSchedule(every, jitter=jitter)  # bad input fails here, not at decoration

        def schedule(task_name: str) -> Schedule:
            # The task name seeds the jitter, so tasks sharing a period spread apart.
            return IntervalSchedule(every, jitter=jitter, seed=task_name)

        return self._scheduled(schedule, name, options)

    def cron(
        self,
        expr: str,
        *,
        name: str | None = None,
        tz: str = "UTC",
        overlap: OverlapPolicy = "skip",
        misfire: MisfirePolicy = "latest",
        misfire_grace: float | timedelta = DEFAULT_MISFIRE_GRACE,
    ) -> Callable[[F], F]:
        """Decorator: run the function on a cron schedule (croniter syntax).

        Args:
            expr: the cron expression, e.g. ``"*/5 * * * *"``.
            name: task name (default: the function's ``__name__``).
            tz: the time zone the expression is read in (default UTC).
            overlap, misfire, misfire_grace: as for :meth:`interval`.
        """
        options = _check_fire_options(overlap, misfire, misfire_grace)
        cron = CronSchedule(expr, tz=tz)
        return self._scheduled(lambda _name: cron, name, options)

    def _scheduled(
        self,
        make_schedule: Callable[[str], Schedule],
        name: str | None,
        fire_options: tuple[OverlapPolicy, MisfirePolicy, float],
    ) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            task_name = name if name is not None else fn.__name__
            task = _FunctionTask(task_name, fn, TaskType.SCHEDULED, make_schedule(task_name))
            self._add(task_name, task, fire_options=fire_options)
            return fn

        return decorate

    def copy(self) -> TaskHandler:
        """A new handler with the same tasks, options and broadcaster, and counters of
        its own (a sharded leader runs one per shard).

        The tasks themselves (functions or :class:`Task` objects) are shared, not copied.
        """
        copy = TaskHandler(stop_grace=self.stop_grace, on_stuck=self.on_stuck)
        with self._lock:
            specs = list(self._specs.values())
        copy._broadcaster = self._broadcaster
        for spec in specs:
            copy._specs[spec.name] = dataclasses.replace(spec, stats=TaskStats())
        return copy

    # -- observation ----------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Registered task names, in registration order."""
        with self._lock:
            return list(self._specs)

    def specs(self) -> list[TaskSpec]:
        """The registered tasks with their run options, in registration order (for
        tools that run tasks themselves, such as :mod:`rselection.testing`)."""
        with self._lock:
            return list(self._specs.values())

    def spec(self, name: str) -> TaskSpec:
        """The registered task ``name`` with its run options.

        Raises:
            KeyError: no task of that name.
        """
        with self._lock:
            spec = self._specs.get(name)
        if spec is None:
            registered = ", ".join(self._specs) or "none"
            raise KeyError(f"no task named {name!r}; registered: {registered}")
        return spec

    @property
    def broadcaster(self) -> Broadcaster | None:
        """The broadcaster given to :meth:`handle`, if any."""
        return self._broadcaster

    def handle(self, broadcaster: Broadcaster) -> None:
        """Hand ``broadcaster`` to tasks as ``ctx.broadcaster`` (Go parity).

        A broadcaster given to the leader takes precedence.
        """
        self._broadcaster = broadcaster

    def check_claims(self, claim_ttl: float) -> None:
        """Check that every scheduled task can be claimed fire by fire.

        A leader that claims fires calls this before it starts. Every node must compute
        the same instants, and a claim must outlive the latest start a fire may have.

        Raises:
            ConfigError: an interval schedule that is not aligned (its instants depend
                on when each node started), or a ``misfire_grace`` above ``claim_ttl``.
        """
        with self._lock:
            specs = [s for s in self._specs.values() if s.type is TaskType.SCHEDULED]
        for spec in specs:
            if getattr(spec.schedule, "aligned", True) is False:
                raise ConfigError(
                    f"task {spec.name!r}: its interval schedule is not aligned, so every "
                    "node would compute different fire instants and the claims could not "
                    "tell a fire already run elsewhere; use align=True (the default) or "
                    "give every node the same start=, or build the leader with claimer=None"
                )
            if spec.misfire_grace > claim_ttl:
                raise ConfigError(
                    f"task {spec.name!r}: misfire_grace ({spec.misfire_grace:g} s) exceeds "
                    f"the claim ttl ({claim_ttl:g} s): a fire started that late could run "
                    "again after its claim expired; lower misfire_grace or raise the ttl"
                )

    def verify(self) -> bool:
        """True while a term is running and still live (Go parity)."""
        runner = self._runner
        return runner is not None and runner.term.live()

    def health(self) -> dict[str, dict[str, Any]]:
        """Per task: state, runs, failures, skipped, whether the last finished run
        failed (``last_failed``, which a health probe should read: ``state`` is
        ``"running"`` while the next run goes on), last error, last and next fire."""
        with self._lock:
            specs = list(self._specs.values())
        report: dict[str, dict[str, Any]] = {}
        for spec in specs:
            s = spec.stats
            report[spec.name] = {
                "type": spec.type.value,
                "state": s.state,
                "runs": s.runs,
                "failures": s.failures,
                "skipped": s.skipped,
                "last_failed": s.last_failed,
                "last_error": s.last_error,
                "last_fire": s.last_fire,
                "next_fire": s.next_fire,
            }
        return report

    # -- used by leaders ----------------------------------------------------------

    def attach(self) -> None:
        """Mark the handler as in use by a leader: registration is closed until detach.

        Raises:
            RuntimeError: another leader runs this handler (one term at a time is all a
                handler can run: give each leader a handler of its own).
        """
        with self._lock:
            if self._attached:
                raise RuntimeError(
                    "this TaskHandler already runs under another leader that has not been "
                    "stopped; give each leader a TaskHandler of its own"
                )
            self._attached += 1

    def detach(self) -> None:
        """Undo :meth:`attach`."""
        with self._lock:
            self._attached = max(0, self._attached - 1)

    def start_term(self, term: Term, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start every task for ``term``; ``loop`` runs async tasks (else a private one)."""
        with self._lock:
            if self._runner is not None:
                raise RuntimeError("a term is already running; end it first")
            if term.broadcaster is None:
                term.broadcaster = self._broadcaster
            runner = TermRunner(self, self.on_stuck, list(self._specs.values()), term, loop)
            self._runner = runner
        runner.start()

    def end_term(self, grace: float | None = None) -> list[str]:
        """Cancel the running term's tasks and join them; return the names still stuck.

        Args:
            grace: seconds to wait for them (default: ``stop_grace``, else
                :data:`~rselection.timing.STOP_GRACE_CAP`).
        """
        with self._lock:
            runner, self._runner = self._runner, None
        if runner is None:
            return []
        if grace is None:
            grace = self.stop_grace if self.stop_grace is not None else STOP_GRACE_CAP
        return runner.stop(grace)

    def stop(self) -> None:
        """Cancel and join the running term's tasks, if any (the leader keeps running)."""
        self.end_term()

    def __repr__(self) -> str:
        return f"TaskHandler(tasks={self.names!r}, stop_grace={self.stop_grace})"
