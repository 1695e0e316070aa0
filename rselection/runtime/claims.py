"""A term's claims of its fires, and its clean-ups of expired claims.

Claims run on the process's claim pool (:mod:`rselection.runtime.pools`), at most two
of a term's at once, so that one stuck on a dead connection never holds up the term's
end (nothing waits for it), nor another term's claims. The fires due at one instant
are claimed in one call; the scheduler never waits for it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime
from typing import Any, TypeVar

from ..claiming import CLEANUP_BATCH, CleanupClaimer, FireClaimer, LeaseClaims, claim_each
from ..context import Term
from ..schedules import format_fire_key
from ..specs import TaskSpec
from .pools import CLAIM_POOL, CLEANUP_POOL
from .reports import TermReports
from .units import TermUnits

__all__ = ["ClaimBatch", "Ready", "TermClaims", "cleanup_period"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_CLAIMS_PER_TERM = 2  # a term's claims running at once, at most

Ready = tuple[int, TaskSpec, list[datetime]]
"""A unit of fires ready to start: its unit id, its task, its fires (oldest first)."""


def cleanup_period(ttl: float) -> float:
    """Seconds between a leader's clean-ups of expired claims: half the claim ttl, at
    least a second unless the ttl is shorter (so at least once per ttl)."""
    return min(ttl, max(ttl / 2, 1.0))


class ClaimBatch:
    """The units of fires due at one instant, while their claim is in flight.

    Args:
        units: the units, each reserved and entered.
    """

    def __init__(self, units: list[Ready]) -> None:
        self.units = units
        self.key_of = {
            (spec.name, at): format_fire_key(spec.name, at)
            for _, spec, fires in units
            for at in fires
        }
        """The fire key of each fire, by task name and instant."""
        self.keys = list(self.key_of.values())
        """The fire keys to claim."""


class TermClaims:
    """Claims the fires of one term and cleans up expired claims.

    Args:
        term: the term (its ``claimer`` claims).
        units: the term's units; a batch's units stay entered while it is claimed.
        reports: where fires not won are reported.
        launch: starts the units whose fires were won.
    """

    def __init__(
        self,
        term: Term,
        units: TermUnits,
        reports: TermReports,
        launch: Callable[[list[Ready]], None],
    ) -> None:
        self.term = term
        self.units = units
        self.reports = reports
        self.launch = launch
        self._lane = CLAIM_POOL.lane(_CLAIMS_PER_TERM)
        self._cleanups = CLEANUP_POOL.lane(1)  # one at a time, never in a claim's way
        self._cleanup: Future[None] | None = None
        self._batches: set[ClaimBatch] = set()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the term's claim lane (a round trip of the look-back)."""
        self._lane.submit(fn)

    def close(self) -> None:
        """Start no more claims nor clean-ups (those running are not waited for)."""
        for lane in (self._lane, self._cleanups):
            lane.shutdown(wait=False, cancel_futures=True)

    def cancel(self) -> list[tuple[TaskSpec, datetime]]:
        """The term ended: settle the claims in flight, so that their units no longer
        hold up the join; return their fires (counted skipped), to report."""
        with self.units.cond:
            batches = list(self._batches)
            self._batches.clear()
            return [fire for batch in batches for fire in self._free(batch)]

    def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | None:
        """``fn(*args, **kwargs)``, on the claim pool already; ``None`` if the term ended
        before it answered (nothing waits for it: the end of a term is seen at once).

        A claim answered too late this way may still have landed: its fire then stays
        claimed but unrun, as for a node that stopped leading.
        """
        if not self.term.live():
            return None
        result = fn(*args, **kwargs)
        return result if self.term.live() else None

    def claim(self, claimer: FireClaimer, units: list[Ready]) -> None:
        """Claim every fire of ``units`` in one call on the claim pool; start the units
        with the fires won once it answers (see :meth:`_claimed`).

        The scheduler never waits for the claim: it goes on to the next instant. The
        units are joined like running ones meanwhile, and the end of the term settles
        them at once (:meth:`cancel`): nothing of theirs runs then.
        """
        batch = ClaimBatch(units)
        with self.units.cond:
            self._batches.add(batch)
        if not self.term.live():  # never claim a fire this node can no longer run
            self._settle(batch)
            return
        try:
            future = self._lane.submit(self._claim_keys, claimer, list(batch.keys))
        except RuntimeError:  # the pool is shut down: the term is over
            self._settle(batch)
            return
        future.add_done_callback(functools.partial(self._claimed, batch))

    def _claim_keys(
        self, claimer: FireClaimer, keys: list[str]
    ) -> tuple[set[str], dict[str, Exception]] | None:
        """On the claim pool: claim ``keys``; ``None`` when the term ended meanwhile."""
        if not self.term.live():
            return None
        if isinstance(claimer, LeaseClaims):
            return claimer.claim_each(keys, term=self.term.number)
        return claim_each(claimer, keys, term=self.term.number)

    def _take(self, batch: ClaimBatch) -> bool:
        """Whether this caller settles ``batch`` (the claim's answer or the term's end,
        whichever comes first)."""
        with self.units.cond:
            if batch not in self._batches:
                return False
            self._batches.discard(batch)
            return True

    def _settle(self, batch: ClaimBatch) -> None:
        """The term ended before ``batch`` was claimed: report its fires, free its units."""
        with self.units.cond:
            if batch not in self._batches:
                return
            self._batches.discard(batch)
            skipped = self._free(batch)
        self.reports.skipped(skipped, "not-leader")

    def _free(self, batch: ClaimBatch) -> list[tuple[TaskSpec, datetime]]:
        """Under the lock: give back the running slots of ``batch``'s units, leave them,
        and count their fires skipped; return the fires, to report (outside the lock)."""
        skipped: list[tuple[TaskSpec, datetime]] = []
        for unit, spec, fires in batch.units:
            spec.stats.skipped += len(fires)
            skipped.extend((spec, at) for at in fires)
            self.units.release(spec, unit)  # the lock is reentrant
        return skipped

    def _claimed(
        self,
        batch: ClaimBatch,
        future: Future[tuple[set[str], dict[str, Exception]] | None],
    ) -> None:
        """The claim of ``batch`` answered: start the fires won, report the others (held
        by another claim, a failed claim: claims fail closed, or a term that ended)."""
        if future.cancelled() or not self.term.live():
            self._settle(batch)
            return
        try:
            outcome = future.result()
        except Exception as exc:  # claim_each reports backend errors; this is anything else
            outcome = set(), dict.fromkeys(batch.keys, exc)
        if outcome is None:
            self._settle(batch)
            return
        if not self._take(batch):
            return
        won, failed = outcome
        if failed:
            key, error = next(iter(failed.items()))
            if len(failed) == 1:
                logger.warning("fire %.120s skipped: its claim failed: %s", key, error)
            else:
                logger.warning(
                    "%d fires skipped (of %.120s and others): their claims failed: %s",
                    len(failed),
                    key,
                    error,
                )
        start: list[Ready] = []
        for unit, spec, fires in batch.units:
            keep: list[datetime] = []
            for at in fires:
                key = batch.key_of[spec.name, at]
                if key in won:
                    keep.append(at)
                else:
                    self.reports.skip(
                        spec, at, "claim-error" if key in failed else "already-claimed"
                    )
            if keep:
                start.append((unit, spec, keep))
            else:
                self.units.release(spec, unit)
        self.launch(start)

    def start_cleanup(self, claimer: CleanupClaimer) -> None:
        """Delete expired claims on the clean-up pool, batch by batch while the term
        lasts; the scheduler does not wait for it, and one clean-up runs at a time."""
        if self._cleanup is not None and not self._cleanup.done():
            return
        try:
            self._cleanup = self._cleanups.submit(self._clean_up, claimer)
        except RuntimeError:  # the pool is shut down: the term is over
            self._cleanup = None

    def _clean_up(self, claimer: CleanupClaimer) -> None:
        deleted = 0
        try:
            while self.term.live():
                count = claimer.cleanup(batch=CLEANUP_BATCH)
                deleted += count
                if count < CLEANUP_BATCH:
                    break
        except Exception as exc:
            logger.warning("expired claims not deleted (tried again later): %s", exc)
        if deleted:
            logger.debug("term %d: deleted %d expired claims", self.term.number, deleted)
