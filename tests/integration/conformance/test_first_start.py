"""A task's first term, on Postgres and Redis: a task that never ran anywhere has missed
nothing, so its first term starts at its next instant and reports no fire skipped; once
it ran, a later term catches up the fires missed while no node led."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import rselection as rs
from rselection import signals
from tests.support.backends import Backend
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}
PERIOD = 0.1
STEP = timedelta(seconds=PERIOD)


class Term:
    """One leader's term of the task ``tick``: its runs, its misfires, its election."""

    def __init__(self) -> None:
        self.runs: list[datetime] = []
        self.misfires: list[datetime] = []
        self.elected: datetime | None = None
        self._lock = threading.Lock()

    def tick(self, ctx: rs.TaskContext) -> None:
        assert ctx.scheduled_at is not None
        with self._lock:
            self.runs.append(ctx.scheduled_at)

    def skipped(self, sender: object, **kwargs: Any) -> None:
        if kwargs["reason"] == "misfire":
            with self._lock:
                self.misfires.append(kwargs["scheduled_at"])

    def on_elected(self, sender: object, **kwargs: Any) -> None:
        self.elected = datetime.now(UTC)

    def count(self) -> int:
        with self._lock:
            return len(self.runs)


def lead_once(backend: Backend, name: str, *, runs: int = 3) -> Term:
    """Lead lease ``name`` with the task ``tick`` until it ran ``runs`` times, then stop."""
    term = Term()
    handler = rs.TaskHandler()
    handler.interval(PERIOD, name="tick", misfire_grace=5.0)(term.tick)
    leader = backend.leader(handler, name, **FAST)
    with (
        signals.fire_skipped.connected_to(term.skipped, sender=handler),
        signals.elected.connected_to(term.on_elected, sender=leader),
    ):
        leader.start()
        try:
            wait_until(lambda: term.count() >= runs, 20.0, f"{runs} runs of tick")
        finally:
            leader.stop(timeout=10)
    assert term.elected is not None
    return term


def test_a_task_that_never_ran_starts_at_its_next_instant_and_reports_nothing(
    backend: Backend,
) -> None:
    name = f"first-{uuid.uuid4().hex[:8]}"
    first = lead_once(backend, name)
    assert first.elected is not None
    # With a 5 s grace, a catch-up would have claimed the 50 fires before the term,
    # run one, skipped 49. (A fire of the term itself may be skipped as a misfire if a
    # busy machine holds the scheduler up by a whole period.)
    assert [at for at in first.misfires if at < first.elected - STEP] == []
    assert all(at > first.elected - STEP for at in first.runs)
    # Once it ran, fires missed while no node led are caught up, as ever: no node leads
    # for 0.6 s (a gap made on purpose, not a wait for something).
    time.sleep(0.6)
    second = lead_once(backend, name)
    assert second.elected is not None
    # "latest": the fires missed in the gap (about six) were found: the newest ran (or,
    # when the next one was due already, was skipped too), the others were skipped.
    caught_up = [at for at in second.runs if at < second.elected - STEP]
    assert len(caught_up) <= 1
    assert len(caught_up) + len(second.misfires) >= 4
    assert all(at > max(first.runs) for at in caught_up + second.misfires)
