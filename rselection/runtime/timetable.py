"""One term's scheduled tasks, as the process's scheduler fires them.

The scheduler (:mod:`rselection.scheduler`) drives every term's timetable from one
thread. A timetable whose schedules are the library's own is prepared on that thread;
any other on the term's lane of the claim pool (a user's ``next_fire`` may be slow).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from ..abc import claimer_ability
from ..context import Term
from ..misfire import scan_due, split_behind, too_old
from ..scheduler import MAX_LEAD, SCHEDULER, Prepared
from ..schedules import CronSchedule, IntervalSchedule
from ..specs import TaskSpec
from .catch_up import CatchUp, schedule_of
from .claims import TermClaims, cleanup_period
from .pools import CLAIM_POOL
from .reports import TermReports, surviving

__all__ = ["TermTimetable"]

logger = logging.getLogger(__name__)

# Schedules whose next_fire is the library's own (fast, never blocks): their fires are
# prepared on the scheduler's thread; any other schedule's on its term's lane.
_OWN_SCHEDULES = (IntervalSchedule, CronSchedule)

_Fires = list[tuple[TaskSpec, list[datetime]]]


@dataclass(eq=False)
class TermTimetable:
    """One term's scheduled tasks and their next fires, by instant (a
    :class:`~rselection.scheduler.Timetable`).

    Args:
        term: the term.
        specs: its scheduled tasks.
        reports: where skipped fires are reported.
        claims: the term's claims (its clean-ups).
        dispatch: the lock held while fires start from elsewhere than a unit.
        start: starts the fires due at one instant.
        catch_up: the look-back for missed fires, on a term with a claimer.
    """

    term: Term
    specs: list[TaskSpec]
    reports: TermReports
    claims: TermClaims
    dispatch: threading.Lock
    start: Callable[[_Fires], None]
    catch_up: CatchUp | None

    def __post_init__(self) -> None:
        self.heap: list[tuple[datetime, int, TaskSpec]] = []
        self.order = itertools.count()
        self.inline = all(type(spec.schedule) in _OWN_SCHEDULES for spec in self.specs)
        self.lead = 0.0
        self.cleaning = claimer_ability(self.term.claimer, "cleanup")
        self._next_cleanup = time.monotonic()  # at the start of the term, then every period
        self.started = datetime.now(UTC)
        self._preps = CLAIM_POOL.lane(1)  # preparations off the scheduler, in order

    def begin(self) -> None:
        """Look back for missed fires (on a term with a claimer), then fire."""
        if self.catch_up is not None:
            # Fires that came due while no node led, found through the claims (round
            # trips: on the claim pool), before any newer fire, so they run in order.
            self.claims.submit(self.recover)
        elif self.inline:
            SCHEDULER.add(self, setup=True)
        else:
            self._preps.submit(self.set_up_elsewhere)

    def close(self) -> None:
        """Prepare nothing more."""
        self._preps.shutdown(wait=False, cancel_futures=True)

    def live(self) -> bool:
        """Whether the term may still fire."""
        return self.term.live()

    def recover(self) -> None:
        """On the claim pool, at the start of a term with claims: run the fires missed
        while no node led (see :meth:`CatchUp.recover`); then fire the rest."""
        assert self.catch_up is not None
        try:
            self.catch_up.recover(self.specs, self.started)
        except Exception:  # the newer fires still run
            logger.exception("term %d: looking for missed fires failed", self.term.number)
        if not self.term.live():
            return
        if self.inline:
            SCHEDULER.add(self, setup=True)
        else:
            self.set_up_elsewhere()

    def set_up_elsewhere(self) -> None:
        """Off the scheduler's thread: :meth:`setup`, then fire."""
        self.setup()
        if self.term.live():
            SCHEDULER.add(self)

    def setup(self) -> None:
        """Compute each task's first fire."""
        with self.reports.deferring():
            for spec in self.specs:
                with surviving(spec, self.term):
                    self._push(spec, schedule_of(spec).next_fire(self.started))

    def _push(self, spec: TaskSpec, at: datetime | None) -> None:
        spec.stats.next_fire = at
        if at is not None:
            heapq.heappush(self.heap, (at, next(self.order), spec))

    def head(self) -> float | None:
        """The next instant a fire is due (``time.time()`` seconds)."""
        return self.heap[0][0].timestamp() if self.heap else None

    def prepare(self, lead: float) -> Prepared | None:
        """The fires due at the next instant, if it is at most ``lead`` seconds away."""
        heap = self.heap
        if not heap or not self.term.live():
            return None
        at = heap[0][0]
        delay = at.timestamp() - time.time()
        if delay > lead:  # the clock stepped back
            return None
        # Every fire due at the instant, of every task, in one go: epoch-aligned
        # intervals make all of a period's fires due at the same instant.
        now = at if delay > 0 else datetime.now(UTC)
        due = [heapq.heappop(heap)]  # due by time.time(), even if the clock stepped
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap))
        with self.reports.deferring():
            ready = self._due(due, now)
        return (at.timestamp(), ready) if ready else None

    def _due(self, due: list[tuple[datetime, int, TaskSpec]], now: datetime) -> _Fires:
        """The fires to start at ``now`` (each task's first one given), by task; put each
        task's next fire on the heap.

        Of each task, the newest fire due is on time (its successor is not due yet) and
        runs whatever the policy; the older ones mean this node fell behind by whole
        periods: they are missed, and the policy decides (see
        :func:`~rselection.misfire.split_behind`). Fires older than the grace are skipped.
        """
        ready: _Fires = []
        for first, _, spec in due:
            with surviving(spec, self.term):
                fires, dropped, following = scan_due(schedule_of(spec), first, now)
                if following is not None and following.timestamp() <= time.time():
                    # The scan itself took a period or more (a slow schedule): the fires
                    # that came due meanwhile belong to this unit, in order.
                    fires, dropped, following = scan_due(
                        schedule_of(spec), first, datetime.now(UTC)
                    )
                if len(fires) == 1 and not dropped:  # on time: no policy to apply
                    run, skipped = fires, dropped
                else:
                    run, skipped = split_behind(spec.misfire, fires)
                    skipped = dropped + skipped
                stale = [at for at in run if too_old(at, now, spec.misfire_grace)]
                for at in sorted(skipped + stale):
                    self.reports.skip(spec, at, "misfire")
                fresh = [at for at in run if at not in stale] if stale else run
                if fresh:
                    ready.append((spec, fresh))
                self._push(spec, following)
        return ready

    def prepare_elsewhere(self, lead: float, done: Callable[[Prepared | None], None]) -> None:
        """:meth:`prepare` on the term's lane of the claim pool (a schedule that is not
        the library's own may be slow); the time it took is the next :attr:`lead`."""
        began = time.perf_counter()

        def prepare() -> None:
            try:
                prepared = self.prepare(lead)
            except Exception:
                logger.exception(
                    "term %d: preparing its fires failed; its tasks fire no more",
                    self.term.number,
                )
                SCHEDULER.remove(self)
                return
            self.lead = min(MAX_LEAD, 2 * (time.perf_counter() - began))
            done(prepared)

        try:
            self._preps.submit(prepare)
        except RuntimeError:  # the term is over
            done(None)

    def launch(self, prepared: Prepared) -> None:
        """Start fires prepared for their instant, which has come."""
        with self.dispatch:  # stop() waits for the units entered here
            if self.term.live():
                with self.reports.deferring():
                    self.start(prepared[1])

    def next_cleanup(self) -> float | None:
        """When (:func:`time.monotonic`) :meth:`clean_up` is due; ``None``: never."""
        return None if self.cleaning is None else self._next_cleanup

    def clean_up(self) -> None:
        """Start a clean-up of expired claims."""
        if self.cleaning is not None:
            self.claims.start_cleanup(self.cleaning)
            self._next_cleanup = time.monotonic() + cleanup_period(self.cleaning.ttl)
