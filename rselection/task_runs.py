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

import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from .errors import ConfigError

__all__ = [
    "MAX_RUN_HISTORY_LIMIT",
    "OUTCOMES",
    "PAUSED",
    "RUN_HISTORY_LIMIT",
    "TRIGGER_MARK",
    "RunRecord",
    "TaskControlChange",
    "TaskControls",
    "TaskEntry",
    "TaskInfo",
    "Trigger",
    "check_run_limit",
    "error_line",
    "new_trigger_key",
]

OUTCOMES: Final = ("ok", "failed", "cancelled", "skipped", "missed")
"""How a run ended: it returned (``ok``), raised (``failed``, with the exception's first
line), was cancelled (its term ended, or an operator paused the persistent task), was
skipped (with its ``reason``) or missed (its instant passed while nobody led)."""

RUN_HISTORY_LIMIT: Final = 100
"""Runs kept per task by default (and returned by a read unless told otherwise)."""

MAX_RUN_HISTORY_LIMIT: Final = 10_000
"""The most runs a task's history may keep (and a read may ask for)."""

PAUSED: Final = "paused"
"""The ``reason`` of a fire skipped, or a persistent run cancelled, because an operator
paused its task (its ``by`` is ``"operator"``)."""

TRIGGER_MARK: Final = "@trigger:"
"""What a triggered fire's key holds between the task's name and the trigger's id
(``"<task>@trigger:<16 hex digits>"``): never an instant, so the claims of a task's
scheduled fires (and the look-back that reads them) never mistake one for a fire."""

_ERROR_CHARS = 500  # longest error line kept in a run record


def check_run_limit(value: object, what: str = "limit") -> int:
    """Return ``value`` if it is a count of runs (an int from 1 to
    :data:`MAX_RUN_HISTORY_LIMIT`), else raise.

    Raises:
        ConfigError: not an int, or out of range (the message names ``what``).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_RUN_HISTORY_LIMIT
    ):
        raise ConfigError(
            f"{what} must be an int from 1 to {MAX_RUN_HISTORY_LIMIT:,}, got {value!r:.40}"
        )
    return value


def error_line(error: BaseException) -> str:
    """What a run record keeps of the exception a run failed with: its type and the
    first line of its message, at most 500 characters."""
    text = str(error).strip()
    line = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    return line[:_ERROR_CHARS]


def new_trigger_key(task: str) -> str:
    """A new fire key for one triggered fire of ``task`` (see :data:`TRIGGER_MARK`)."""
    return f"{task}{TRIGGER_MARK}{secrets.token_hex(8)}"


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
        for name in ("scheduled_at", "started_at", "ended_at"):
            item[name] = _iso(item[name])
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


@dataclass(frozen=True)
class TaskEntry:
    """One task of a leader's list of tasks, as it publishes it when a term begins.

    Attributes:
        task: the task's name.
        kind: ``"persistent"``, ``"interval"``, ``"cron"`` (or ``"scheduled"`` for a
            schedule of the user's own).
        schedule: the schedule as text; ``None`` for a persistent task.
        next_fire: its next fire, when known.
    """

    task: str
    kind: str
    schedule: str | None
    next_fire: datetime | None


@dataclass(frozen=True)
class TaskControls:
    """A lease's task controls as its store holds them.

    Attributes:
        paused: the paused tasks, each with when it was paused.
        triggers: the fires asked for and not taken yet, oldest first.
        read_at: the store's clock when they were read (a trigger's age is judged on
            the clock that stamped it); ``None``: unknown, the node's clock is used.
    """

    paused: Mapping[str, datetime] = field(default_factory=dict)
    triggers: tuple[Trigger, ...] = ()
    read_at: datetime | None = None
