"""Which fires run when some were missed: pure functions of a schedule and the time.

A fire is *missed* when it came due while no node led (found by a new leader) or while
this node's scheduler fell behind by whole periods. The task's policy decides which of
them run: ``"latest"`` the newest once, ``"all"`` each (at most :data:`MAX_CATCH_UP`),
``"skip"`` none. A fire is missed only when it is a whole period behind: of the fires a
scheduler that fell behind finds due, the newest is on time (its successor is not due
yet) and runs whatever the policy. A fire older than the task's ``misfire_grace`` never
starts: each one is checked when it is about to start, also one by one in a catch-up.
The runner (:mod:`rselection.runtime`) reports every fire these functions leave out.
"""

from __future__ import annotations

from collections import deque
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .schedules import Schedule
    from .specs import MisfirePolicy

__all__ = [
    "MAX_CATCH_UP",
    "MAX_SCAN",
    "due_fires",
    "scan_due",
    "split_behind",
    "split_by_policy",
    "too_old",
    "window",
]

MAX_SCAN = 1000
"""Missed fires examined one by one; older ones are dropped in bulk."""

MAX_CATCH_UP = 100
"""With ``misfire="all"``, the most missed fires one catch-up runs."""

_TICK = timedelta(microseconds=1)


def due_fires(
    schedule: Schedule, first: datetime, now: datetime
) -> tuple[list[datetime], list[datetime]]:
    """``first`` and every later fire due by ``now``, oldest first, at most
    :data:`MAX_SCAN` of them; and the older ones beyond that cap (dropped)."""
    due, dropped, _ = scan_due(schedule, first, now)
    return due, dropped


def scan_due(
    schedule: Schedule, first: datetime, now: datetime
) -> tuple[list[datetime], list[datetime], datetime | None]:
    """What :func:`due_fires` returns, and the first fire after them (not due by
    ``now``; ``None`` when the schedule has none): a scheduler's next wake-up for the
    task, found by the same scan."""
    nxt = schedule.next_fire(first)
    if nxt is None or nxt > now:  # the usual case: one fire due, on time
        return [first], [], nxt
    due: deque[datetime] = deque([first])
    dropped: list[datetime] = []
    while nxt is not None and nxt <= now:
        due.append(nxt)
        if len(due) > MAX_SCAN:
            dropped.append(due.popleft())
        nxt = schedule.next_fire(nxt)
    return list(due), dropped, nxt


def window(schedule: Schedule, started: datetime, grace: float) -> list[datetime]:
    """The fires due at ``started`` that are at most ``grace`` seconds old, oldest first
    (the newest :data:`MAX_SCAN`): what a leader that starts then may have missed."""
    found: deque[datetime] = deque(maxlen=MAX_SCAN)
    nxt = schedule.next_fire(started - timedelta(seconds=grace) - _TICK)
    while nxt is not None and nxt <= started:
        found.append(nxt)
        nxt = schedule.next_fire(nxt)
    return list(found)


def split_by_policy(
    policy: MisfirePolicy, missed: list[datetime]
) -> tuple[list[datetime], list[datetime]]:
    """Split missed fires (oldest first) into those ``policy`` runs and those it skips."""
    keep = {"latest": 1, "all": MAX_CATCH_UP, "skip": 0}[policy]
    cut = max(0, len(missed) - keep)
    return missed[cut:], missed[:cut]


def split_behind(
    policy: MisfirePolicy, due: list[datetime]
) -> tuple[list[datetime], list[datetime]]:
    """Split the fires a scheduler finds due at once (oldest first) into those to run and
    those ``policy`` skips.

    The newest is on time and always runs; the older ones are missed (each is a whole
    period behind: its successor is due). ``"all"`` runs them too (the newest
    :data:`MAX_CATCH_UP` in all); ``"latest"`` and ``"skip"`` skip them, as the on-time
    fire is newer than any of them.
    """
    if not due:
        return [], []
    if policy == "all":
        return split_by_policy(policy, due)
    return due[-1:], due[:-1]


def too_old(at: datetime, now: datetime, grace: float) -> bool:
    """Whether a fire scheduled ``at`` is more than ``grace`` seconds old at ``now``."""
    return now - at > timedelta(seconds=grace)
