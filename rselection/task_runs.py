"""Task controls and run history: what an operator sees and does to a lease's tasks.

An operator pauses, resumes or triggers a task of a lease (``rselection task pause|
resume|trigger NAME TASK``, or an admin API's :meth:`~rselection.admin.LeaseAdmin.
pause_task` and friends); the controls are stored beside the lease, wake its leader,
and last across failover. Every run of a task (a fire that ran, failed, was cancelled,
skipped or missed; a persistent task's run) is a :class:`RunRecord` of the task's run
history, the last :data:`RUN_HISTORY_LIMIT` kept per task; the leader also publishes the
list of its tasks (:class:`TaskInfo`). See ``docs/explanation/how-it-works.md`` ("Task
controls and run history").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Final

__all__ = [
    "OUTCOMES",
    "RUN_HISTORY_LIMIT",
    "RunRecord",
    "TaskControlChange",
    "TaskInfo",
    "Trigger",
]

OUTCOMES: Final = ("ok", "failed", "cancelled", "skipped", "missed")
"""How a run ended: it returned (``ok``), raised (``failed``, with the exception's first
line), was cancelled (its term ended, or an operator paused the persistent task), was
skipped (with its ``reason``) or missed (its instant passed while nobody led)."""

RUN_HISTORY_LIMIT: Final = 100
"""Runs kept per task by default (and returned by a read unless told otherwise)."""


def _iso(value: datetime | None) -> str | None:
    """``value`` as RFC 3339 in UTC (``...Z``), ``None`` as is."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class RunRecord:
    """One run of a task, as its run history keeps it.

    Attributes:
        lease: the lease name.
        task: the task's name.
        scheduled_at: the fire's instant; ``None`` for a persistent task's run.
        started_at: when it started; ``None`` when it never did (skipped, missed).
        ended_at: when it ended; ``None`` when it never started.
        outcome: one of :data:`OUTCOMES`.
        reason: why it was skipped or cancelled (``paused``, ``misfire``,
            ``overlap``, ...), else ``None``.
        node_id: the node that ran (or skipped) it.
        term: the term it ran in.
        error: the exception's first line when it failed, else ``None``.
        by: ``"operator"`` for a triggered fire, or one skipped or cancelled because
            an operator paused the task; else ``None``.
    """

    lease: str
    task: str
    scheduled_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    outcome: str
    reason: str | None
    node_id: str
    term: int
    error: str | None
    by: str | None

    def as_json(self) -> dict[str, Any]:
        """The record as JSON-ready values, times as RFC 3339 in UTC (``...Z``)."""
        item = asdict(self)
        for field in ("scheduled_at", "started_at", "ended_at"):
            item[field] = _iso(item[field])
        return item


@dataclass(frozen=True)
class TaskInfo:
    """One task of a lease, as its leader last published the list of its tasks.

    Attributes:
        lease: the lease name.
        task: the task's name.
        kind: ``"persistent"``, ``"interval"`` or ``"cron"``.
        schedule: the schedule as text (``"every 5s"``, ``"cron */5 * * * *"``);
            ``None`` for a persistent task.
        next_fire: its next fire when the list was published; ``None`` for a
            persistent task, or a schedule with no more fires.
        paused: whether an operator paused it (and did not resume it since).
        paused_at: when it was paused (the server's clock), else ``None``.
        last_run: its newest run, ``None`` when none is recorded.
        node_id: the leader that last published the list of tasks.
        term: that leader's term.
    """

    lease: str
    task: str
    kind: str
    schedule: str | None
    next_fire: datetime | None
    paused: bool
    paused_at: datetime | None
    last_run: RunRecord | None
    node_id: str | None
    term: int | None

    def as_json(self) -> dict[str, Any]:
        """The task as JSON-ready values, times as RFC 3339 in UTC (``...Z``)."""
        return {
            "lease": self.lease,
            "task": self.task,
            "kind": self.kind,
            "schedule": self.schedule,
            "next_fire": _iso(self.next_fire),
            "paused": self.paused,
            "paused_at": _iso(self.paused_at),
            "last_run": None if self.last_run is None else self.last_run.as_json(),
            "node_id": self.node_id,
            "term": self.term,
        }


@dataclass(frozen=True)
class TaskControlChange:
    """What an admin API's ``pause_task`` or ``resume_task`` did.

    Attributes:
        lease: the lease name.
        task: the task's name.
        paused: whether the task is paused now.
        changed: ``False`` when it already was (paused, or not) before the call.
    """

    lease: str
    task: str
    paused: bool
    changed: bool

    def as_json(self) -> dict[str, Any]:
        """The change as JSON-ready values."""
        return asdict(self)


@dataclass(frozen=True)
class Trigger:
    """A fire an operator asked for (an admin API's ``trigger_task``).

    Attributes:
        lease: the lease name.
        task: the task's name.
        fire_key: the fire's own key (``"<task>@trigger:<id>"``), claimed like any
            other fire's so that it runs once across the fleet.
        requested_at: when it was asked for (the server's clock).
    """

    lease: str
    task: str
    fire_key: str
    requested_at: datetime

    def as_json(self) -> dict[str, Any]:
        """The trigger as JSON-ready values, times as RFC 3339 in UTC (``...Z``)."""
        return {
            "lease": self.lease,
            "task": self.task,
            "fire_key": self.fire_key,
            "requested_at": _iso(self.requested_at),
        }
