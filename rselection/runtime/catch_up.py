"""The look-back at the start of a term: fires that came due while no node led.

Found through the claims (see :meth:`CatchUp.recover`), on the claim pool, before any
newer fire, so that they run in order; the misfire policy picks which run
(:mod:`rselection.misfire`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from ..claiming import (
    FireClaimer,
    LeaseClaims,
    check_fire_key,
    claim_missed_each,
    ran_before_each,
)
from ..context import Term
from ..errors import ConfigError
from ..history import OPERATOR
from ..misfire import split_by_policy, window
from ..schedules import fire_series, format_fire_key
from ..specs import TaskSpec
from ..task_runs import PAUSED
from .claims import TermClaims
from .reports import TermReports, surviving

if TYPE_CHECKING:
    from ..schedules import Schedule

__all__ = ["CatchUp", "schedule_of"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def schedule_of(spec: TaskSpec) -> Schedule:
    """The schedule of the scheduled task ``spec``."""
    schedule = spec.schedule
    assert schedule is not None
    return schedule


@dataclass(eq=False)
class CatchUp:
    """Finds and runs the fires of one term's tasks that no node ran while none led.

    Args:
        term: the term (it has a claimer).
        claims: the term's claims.
        reports: where skipped fires are reported.
        dispatch: the lock held while fires start from elsewhere than a unit.
        fire: starts fires of a task (already claimed) in one unit.
    """

    term: Term
    claims: TermClaims
    reports: TermReports
    dispatch: threading.Lock
    fire: Callable[[TaskSpec, list[datetime]], None]

    def recover(self, specs: list[TaskSpec], started: datetime) -> None:
        """At the start of a term: find and handle fires no node ran while none led.

        A task that never ran anywhere (the claimer's ``ran_before`` says so) has missed
        nothing: it starts at its next instant, with no catch-up and nothing reported.
        Else claims the fires due at ``started`` (within the grace) newer than the newest
        one already claimed: up to there the previous leader got. The fires won are
        missed; the policy picks which to run, the rest stay claimed so that no node
        runs them late. Every task is asked about, and looked back for, in one call
        each when the claimer can (``ran_before_many``, ``claim_missed_many``), so a
        term with a thousand tasks starts after two round trips, not two thousand.
        """
        claimer = self.term.claimer
        assert claimer is not None
        found: list[tuple[TaskSpec, list[datetime]]] = []
        for spec in specs:
            with surviving(spec, self.term):
                candidates = window(schedule_of(spec), started, spec.misfire_grace)
                if candidates and self._claimable(claimer, spec, candidates[-1]):
                    found.append((spec, candidates))
        if not found:
            return
        series = {fire_series(spec.name): spec for spec, _ in found}
        failed = "their claims could not be read"
        ran = self._call(found, failed, ran_before_each, claimer, list(series))
        if ran is None:
            return
        for one in set(series) - ran:
            logger.debug("task %r never ran before: no fire was missed", series[one].name)
        found = [(spec, candidates) for spec, candidates in found if fire_series(spec.name) in ran]
        if not found:
            return
        groups = [
            {format_fire_key(spec.name, at): at for at in candidates} for spec, candidates in found
        ]
        keys_of, term = [list(keys) for keys in groups], self.term.number
        failed = "claiming them failed"
        won = self._call(found, failed, claim_missed_each, claimer, keys_of, term=term)
        if won is None:
            return
        for (spec, _), keys, won_keys in zip(found, groups, won, strict=True):
            with surviving(spec, self.term):
                self._catch_up(spec, [keys[key] for key in won_keys])

    def _call(
        self,
        found: list[tuple[TaskSpec, list[datetime]]],
        failed: str,
        fn: Callable[..., _T],
        *args: Any,
        **kwargs: Any,
    ) -> _T | None:
        """A call of :meth:`recover` (see :meth:`TermClaims.call`); ``None`` when the
        term ended meanwhile, or when it failed: then the missed fires of the tasks
        ``found`` are not recovered, and a warning says why (``failed``)."""
        try:
            return self.claims.call(fn, *args, **kwargs)
        except Exception as exc:
            logger.warning(
                "missed fires of %d tasks (%r...) not recovered: %s: %s",
                len(found),
                found[0][0].name,
                failed,
                exc,
            )
            return None

    def _claimable(self, claimer: FireClaimer, spec: TaskSpec, at: datetime) -> bool:
        """Whether the claimer takes the fire keys of ``spec`` (their claim key is within
        the bytes allowed); a task whose keys it refuses is not looked back for, so that
        it never keeps the other tasks' missed fires from being recovered."""
        key = format_fire_key(spec.name, at)
        if isinstance(claimer, LeaseClaims):
            key = claimer.prefix + key
        try:
            check_fire_key(key)
        except ConfigError as exc:
            logger.warning("task %.120r: missed fires not looked for: %s", spec.name, exc)
            return False
        return True

    def _catch_up(self, spec: TaskSpec, won: list[datetime]) -> None:
        """Run the missed fires ``won`` (claimed, oldest first) as the policy says (a
        paused task's are skipped, as its fires when due)."""
        board = self.term.tasks
        if board is not None and board.paused(spec.name):
            for at in won:
                self.reports.skip(spec, at, PAUSED, by=OPERATOR)
            return
        run, skipped = split_by_policy(spec.misfire, won)
        # Their instants passed while no node led: missed, in the run history.
        for at in skipped:
            self.reports.skip(spec, at, "misfire", outcome="missed")
        if run and spec.misfire == "latest":
            following = schedule_of(spec).next_fire(run[-1])
            if following is not None and following <= datetime.now(UTC):
                # A newer fire is already due and the scheduler runs it next: the
                # catch-up would only hold it up (or get it skipped as an overlap).
                self.reports.skip(spec, run.pop(), "misfire", outcome="missed")
        with self.dispatch:  # stop() waits for the units entered here
            if run and self.term.live():
                self.fire(spec, run)
                return
        for at in run:
            self.reports.skip(spec, at, "not-leader")
