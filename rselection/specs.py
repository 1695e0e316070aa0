"""What a registered task is: the :class:`Task` protocol, its type, run options and counters.

Shared by the registration (:mod:`rselection.tasks`), the runner of a term's tasks
(:mod:`rselection.runtime`) and the misfire rules (:mod:`rselection.misfire`), which
import it and not each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from .task_runs import TaskEntry

if TYPE_CHECKING:
    from .context import TaskContext
    from .schedules import Schedule

__all__ = [
    "DEFAULT_MISFIRE_GRACE",
    "MISFIRE_POLICIES",
    "OVERLAP_POLICIES",
    "RESTART_POLICIES",
    "STUCK_POLICIES",
    "MisfirePolicy",
    "OverlapPolicy",
    "RestartPolicy",
    "StuckPolicy",
    "Task",
    "TaskSpec",
    "TaskStats",
    "TaskType",
]

RestartPolicy = Literal["on-failure", "always", "never"]
"""When a persistent task is started again within its term."""

OverlapPolicy = Literal["skip", "allow"]
"""Whether a scheduled fire may start while the previous run is still going."""

MisfirePolicy = Literal["latest", "all", "skip"]
"""Which missed fires of a scheduled task run."""

StuckPolicy = Literal["log", "exit"]
"""What happens when a task is still running ``stop_grace`` after cancellation."""

RESTART_POLICIES: tuple[RestartPolicy, ...] = ("on-failure", "always", "never")
OVERLAP_POLICIES: tuple[OverlapPolicy, ...] = ("skip", "allow")
MISFIRE_POLICIES: tuple[MisfirePolicy, ...] = ("latest", "all", "skip")
STUCK_POLICIES: tuple[StuckPolicy, ...] = ("log", "exit")

DEFAULT_MISFIRE_GRACE = 60.0
"""Seconds after its instant a missed fire may still run (the default ``misfire_grace``)."""


class TaskType(enum.Enum):
    """How a task runs: for the whole term, or on a schedule."""

    PERSISTENT = "persistent"
    SCHEDULED = "scheduled"


@runtime_checkable
class Task(Protocol):
    """What :meth:`~rselection.TaskHandler.register` accepts (Go-style task objects).

    ``run(ctx)`` may be a plain method (run in a worker thread) or ``async def`` (run on
    the leader's event loop). ``schedule`` is required for scheduled tasks.
    """

    name: str
    type: TaskType
    schedule: Schedule | None

    def run(self, ctx: TaskContext) -> Any:
        """Do the work; return when done or when ``ctx`` is cancelled."""


@dataclass
class TaskStats:
    """Counters kept per task across terms, reported by :meth:`TaskHandler.health`."""

    state: str = "idle"
    runs: int = 0
    failures: int = 0
    skipped: int = 0
    running: int = 0
    last_failed: bool = False
    last_error: str | None = None
    last_fire: datetime | None = None
    next_fire: datetime | None = None


@dataclass
class TaskSpec:
    """A registered task with its run options (what the runner of a term needs)."""

    name: str
    task: Task
    is_async: bool
    restart: RestartPolicy = "on-failure"
    overlap: OverlapPolicy = "skip"
    misfire: MisfirePolicy = "latest"
    misfire_grace: float = DEFAULT_MISFIRE_GRACE
    stats: TaskStats = field(default_factory=TaskStats)

    @property
    def type(self) -> TaskType:
        """Persistent or scheduled."""
        return self.task.type

    @property
    def schedule(self) -> Schedule | None:
        """The task's schedule (``None`` for persistent tasks)."""
        return self.task.schedule


def _duration(value: timedelta) -> str:
    seconds = value.total_seconds()
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def entry_of(spec: TaskSpec) -> TaskEntry:
    """How the registered task ``spec`` is published in its lease's list of tasks (see
    :class:`~rselection.task_runs.TaskEntry`)."""
    from .schedules import CronSchedule, IntervalSchedule

    schedule = spec.schedule
    if schedule is None:
        return TaskEntry(spec.name, "persistent", None, None)
    # The library's own schedules are quick to ask (a term's first fires may not be
    # known yet when it publishes its tasks); a user's is not asked here.
    next_fire = spec.stats.next_fire
    if isinstance(schedule, IntervalSchedule | CronSchedule) and next_fire is None:
        next_fire = schedule.next_fire(datetime.now(UTC))
    if isinstance(schedule, IntervalSchedule):
        text = f"every {_duration(schedule.every)}"
        if schedule.jitter:
            text += f" (jitter {_duration(schedule.jitter)})"
        return TaskEntry(spec.name, "interval", text, next_fire)
    if isinstance(schedule, CronSchedule):
        text = f"cron {schedule.expr}"
        if schedule.tz.key != "UTC":
            text += f" ({schedule.tz.key})"
        return TaskEntry(spec.name, "cron", text, next_fire)
    return TaskEntry(spec.name, "scheduled", repr(schedule)[:200], next_fire)
