"""What the end of a term waits for: its units of work, and its tasks' running slots.

A unit is anything started for a term that its ``stop()`` joins: a persistent task's
thread or coroutine, a run of scheduled fires, or their claim in flight. One lock
guards the units and the tasks' statistics, so that a unit's end and the release of
its task's running slot are one step.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable

from ..event_loops import LoopGuard
from ..specs import TaskSpec, TaskType

__all__ = ["TermUnits"]

_LOOP_HEALTH_POLL = 0.05  # seconds between looks at the shared loop while waiting on it


class TermUnits:
    """The units of one term, by id, with the task each runs."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        """Guards the units and the statistics of the term's tasks (reentrant)."""
        self._units: dict[int, str] = {}
        self._async: set[int] = set()  # those of _units that run on the event loop
        self._ids = itertools.count()

    def enter(self, name: str) -> int:
        """Add a unit of the task ``name``; return its id."""
        with self.cond:
            unit = next(self._ids)
            self._units[unit] = name
            return unit

    def leave(self, unit: int) -> None:
        """The unit ended (or never started)."""
        with self.cond:
            self._units.pop(unit, None)
            self._async.discard(unit)
            self.cond.notify_all()

    def on_loop(self, units: Iterable[int]) -> None:
        """The ``units`` run on the event loop."""
        with self.cond:
            self._async.update(units)

    def name_of(self, unit: int) -> str | None:
        """The task that ``unit`` runs, while it runs."""
        return self._units.get(unit)

    def running(self) -> list[str]:
        """The tasks of the units still there, sorted."""
        with self.cond:
            return sorted(set(self._units.values()))

    def only_on_loop(self) -> tuple[set[str], set[str]]:
        """The tasks with units on the event loop only, and those with units elsewhere."""
        with self.cond:
            on_loop = {self._units[u] for u in self._async if u in self._units}
            elsewhere = {n for u, n in self._units.items() if u not in self._async}
        return on_loop - elsewhere, elsewhere

    def wait(self, deadline: float, guard: LoopGuard | None) -> None:
        """Wait until every unit has left, or ``deadline``; on a shared loop that does not
        answer (a task blocks it), not for the units on it: they cannot run."""

        def done() -> bool:
            if not self._units:
                return True
            return guard is not None and not guard.answers() and self._async.issuperset(self._units)

        with self.cond:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(min(left, _LOOP_HEALTH_POLL) if guard is not None else left)

    def reserve(self, spec: TaskSpec) -> bool:
        """Take a running slot; with overlap="skip" refuse while a fire of it is running."""
        with self.cond:
            stats = spec.stats
            if spec.overlap == "skip" and spec.type is TaskType.SCHEDULED and stats.running:
                return False
            stats.running += 1
            stats.state = "running"
            return True

    def release(self, spec: TaskSpec, unit: int | None = None) -> None:
        """Give the running slot back (and leave ``unit``, if given: one lock for both)."""
        with self.cond:
            stats = spec.stats
            stats.running -= 1
            if not stats.running:
                stats.state = "failed" if stats.last_failed else "idle"
                self.cond.notify_all()  # a trigger may wait for the slot
            if unit is not None:
                self.leave(unit)
