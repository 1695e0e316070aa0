"""A leader claims every fire due at one instant in one round trip, on Postgres and Redis.

Epoch-aligned intervals make all of a period's fires due at the same instant. The
scheduler claims them together (``claim_many``), through a real claimer: one call per
instant, whatever the number of tasks; each fire runs once across two leaders that
share the claims, none is lost.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest

import rselection as rs
from tests.support.backends import Backend
from tests.support.waiting import wait_until

TASKS = 1000
EVERY = 1.0


class CountingClaimer:
    """A real claimer underneath; records every call the leader makes through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ttl = inner.ttl
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int]] = []  # (method, number of keys)

    def _note(self, method: str, count: int) -> None:
        with self.lock:
            self.calls.append((method, count))

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        self._note("claim", 1)
        return bool(self.inner.claim(fire_key, term=term))

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        self._note("claim_many", len(fire_keys))
        return set(self.inner.claim_many(fire_keys, term=term))

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        self._note("claim_missed", len(fire_keys))
        return list(self.inner.claim_missed(fire_keys, term=term))

    def ran_before(self, series: str) -> bool:
        self._note("ran_before", 1)
        return bool(self.inner.ran_before(series))

    def ran_before_many(self, series: list[str]) -> set[str]:
        self._note("ran_before_many", len(series))
        return set(self.inner.ran_before_many(series))

    def claim_missed_many(
        self, fire_keys: list[list[str]], *, term: int | None = None
    ) -> list[list[str]]:
        self._note("claim_missed_many", len(fire_keys))
        return [list(won) for won in self.inner.claim_missed_many(fire_keys, term=term)]

    def of(self, method: str) -> list[int]:
        with self.lock:
            return [count for name, count in self.calls if name == method]

    def cleanup(self, *, batch: int | None = None) -> int:
        cleanup = getattr(self.inner, "cleanup", None)
        return int(cleanup(batch=batch)) if cleanup is not None else 0

    def batches(self) -> list[int]:
        with self.lock:
            return [count for method, count in self.calls if method == "claim_many"]

    def single_claims(self) -> int:
        with self.lock:
            return sum(1 for method, _ in self.calls if method == "claim")


class Runs:
    """Every fire that ran: (task, instant, leader)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fires: list[tuple[str, datetime, str]] = []

    def add(self, task: str, at: datetime, who: str) -> None:
        with self.lock:
            self.fires.append((task, at, who))

    def instants(self) -> Counter[datetime]:
        with self.lock:
            return Counter(at for _, at, _ in self.fires)

    def snapshot(self) -> list[tuple[str, datetime, str]]:
        with self.lock:
            return list(self.fires)


def handler_of(runs: Runs, who: str) -> rs.TaskHandler:
    """``TASKS`` interval tasks, half ``async def``, half ``def``, all due together."""
    handler = rs.TaskHandler()
    for i in range(TASKS):
        if i % 2:

            async def run_async(ctx: rs.TaskContext) -> None:
                assert ctx.scheduled_at is not None
                runs.add(ctx.name, ctx.scheduled_at, who)

            handler.interval(EVERY, name=f"task-{i}")(run_async)
        else:

            def run_sync(ctx: rs.TaskContext) -> None:
                assert ctx.scheduled_at is not None
                runs.add(ctx.name, ctx.scheduled_at, who)

            handler.interval(EVERY, name=f"task-{i}")(run_sync)
    return handler


@pytest.fixture
def make_claimer(backend: Backend) -> Iterator[Callable[..., CountingClaimer]]:
    made: list[Any] = []

    def make() -> CountingClaimer:
        inner = backend.claimer()
        made.append(inner)
        return CountingClaimer(inner)

    yield make
    for claimer in made:
        claimer.close()


def complete_instants(runs: Runs, count: int) -> list[datetime]:
    """Instants at which every task ran (at least once)."""
    return sorted(at for at, n in runs.instants().items() if n >= count)


def test_the_fires_due_at_one_instant_are_claimed_in_one_call(
    make_claimer: Callable[..., CountingClaimer],
) -> None:
    claimer = make_claimer()
    runs = Runs()
    leader = rs.SingleNodeLeader(handler_of(runs, "a"), claimer=claimer)
    with leader:
        wait_until(lambda: len(complete_instants(runs, TASKS)) >= 3, 60, "three whole instants")
    batches = claimer.batches()
    # One call per instant with every task's fire (the first, partial instant may have
    # found some tasks' start still going on).
    assert batches.count(TASKS) >= 2, batches
    assert claimer.single_claims() == 0
    instants = complete_instants(runs, TASKS)
    assert len(batches) <= len(runs.instants()) + 1
    for at in instants:
        assert runs.instants()[at] == TASKS  # each task once, none doubled


def test_two_leaders_sharing_the_claims_run_each_fire_exactly_once(
    make_claimer: Callable[..., CountingClaimer],
) -> None:
    runs = Runs()
    a = rs.SingleNodeLeader(handler_of(runs, "a"), claimer=make_claimer(), node_id="a")
    b = rs.SingleNodeLeader(handler_of(runs, "b"), claimer=make_claimer(), node_id="b")
    with a, b:
        wait_until(lambda: len(complete_instants(runs, TASKS)) >= 4, 90, "four whole instants")
    fires = runs.snapshot()
    instants = complete_instants(runs, TASKS)
    # Whole instants after both leaders were running: every task's fire ran exactly
    # once, by one leader or the other.
    for at in instants[1:]:
        ran = Counter(task for task, when, _ in fires if when == at)
        assert len(ran) == TASKS and set(ran.values()) == {1}, at
    winners = {who for _, when, who in fires if when in instants[1:]}
    assert winners <= {"a", "b"}


def test_a_leader_with_many_tasks_starts_after_one_look_back_for_all(
    make_claimer: Callable[..., CountingClaimer],
) -> None:
    """A new leader asks whether its tasks ran before, and claims their missed fires,
    in one call each for all its tasks, not one per task."""
    runs = Runs()
    with rs.SingleNodeLeader(handler_of(runs, "a"), claimer=make_claimer(), node_id="a"):
        wait_until(lambda: len(complete_instants(runs, TASKS)) >= 1, 60, "a whole instant")
    claimer = make_claimer()
    with rs.SingleNodeLeader(handler_of(runs, "b"), claimer=claimer, node_id="b"):
        wait_until(
            lambda: any(who == "b" for _, _, who in runs.snapshot()), 60, "a fire of the new leader"
        )
    assert claimer.of("ran_before_many") == [TASKS]
    assert claimer.of("claim_missed_many") == [TASKS]
    assert claimer.of("ran_before") == [] and claimer.of("claim_missed") == []
