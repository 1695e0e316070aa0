"""Which fires run when some were missed: pure functions of a schedule and the time.

A fire is *missed* when it came due while no node led (found by a new leader) or while
this node's scheduler fell behind by whole periods. The task's policy decides which of
them run: ``"latest"`` the newest once, ``"all"`` each (at most :data:`MAX_CATCH_UP`),
``"skip"`` none. A fire older than the task's ``misfire_grace`` never runs. The runner
(:mod:`rselection.runtime`) reports every fire these functions leave out.
"""

from __future__ import annotations

from collections import deque
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .schedules import Schedule
    from .specs import MisfirePolicy

__all__ = ["MAX_CATCH_UP", "MAX_SCAN", "due_fires", "split_by_policy", "window"]

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
    due: deque[datetime] = deque([first])
    dropped: list[datetime] = []
    nxt = schedule.next_fire(first)
    while nxt is not None and nxt <= now:
        due.append(nxt)
        if len(due) > MAX_SCAN:
            dropped.append(due.popleft())
        nxt = schedule.next_fire(nxt)
    return list(due), dropped


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
