"""What a term reports: skipped fires and stuck tasks, off the caller's thread.

Receivers of ``fire_skipped`` and ``task_stuck`` never run on the scheduler's thread
(a slow one would hold up every term's fires), nor on the leader's keeper or watchdog
(it would hold up the term's end): they run on the term's lane of the signal pool, in
order. Skips wait there in a bounded backlog, sent by one call at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from .. import signals
from ..context import Term
from ..schedules import format_fire_key
from ..specs import StuckPolicy, TaskSpec
from .pools import SIGNAL_POOL

__all__ = ["STUCK_EXIT_CODE", "TermReports", "surviving"]

logger = logging.getLogger(__name__)

STUCK_EXIT_CODE = 70
"""Process exit code when a task is stuck and the handler was built with on_stuck="exit"."""

_MAX_PENDING_SKIPS = 10_000  # skips waiting for a slow fire_skipped receiver, at most

# Skips announced on the scheduler's thread, by the term it works for: their signals
# are sent on the term's signal lane instead (see TermReports.deferring).
_deferred = threading.local()

_Skip = tuple[TaskSpec, datetime, str, str | None]  # the task, the instant, why, fire key


@contextlib.contextmanager
def surviving(spec: TaskSpec, term: Term) -> Iterator[None]:
    """Keep the scheduler going when one task's schedule or claimer raises: that task
    fires no more this term (logged), the others go on."""
    try:
        yield
    except Exception:
        logger.exception(
            "task %r: scheduling it failed in term %d; it fires no more this term",
            spec.name,
            term.number,
        )


class TermReports:
    """Counts and sends the skips and stuck tasks of one term.

    Args:
        sender: the sender of the signals (the owning :class:`~rselection.TaskHandler`).
        term: the term.
        lock: the lock over the term's task statistics (see
            :attr:`~rselection.runtime.units.TermUnits.cond`).
    """

    def __init__(self, sender: object, term: Term, lock: threading.Condition) -> None:
        self.sender = sender
        self.term = term
        self.board = term.tasks
        self._lock = lock
        self._lane = SIGNAL_POOL.lane(1)
        self._pending: list[_Skip] = []  # to send on the lane
        self._sending = False

    def close(self) -> None:
        """Send nothing more (what was sent off is still sent)."""
        self._lane.shutdown(wait=False)

    def off_thread(self, target: Callable[..., None], *args: Any) -> bool:
        """Run ``target(*args)`` (signal receivers) on the term's signal lane, after the
        signals sent there before; when that cannot be, log it and drop them (return
        false): the caller must go on."""
        try:
            self._lane.submit(target, *args)
        except RuntimeError as exc:
            logger.error("signals of term %d not sent: %s", self.term.number, exc)
            return False
        return True

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Skips announced in this block on this thread are sent on the term's signal
        lane afterwards: the scheduler's thread never runs a receiver."""
        if getattr(_deferred, "skips", None) is not None:
            yield  # the outer block sends them
            return
        skips: list[_Skip] = []
        _deferred.skips = skips
        try:
            yield
        finally:
            _deferred.skips = None
            if skips:
                self._post(skips)

    def _post(self, skips: list[_Skip]) -> None:
        """Send ``skips`` on the signal lane: one sender at a time takes every skip
        waiting, so a slow receiver makes a backlog of skips (at most
        ``_MAX_PENDING_SKIPS``, the newer dropped and logged), not of calls."""
        with self._lock:
            room = max(0, _MAX_PENDING_SKIPS - len(self._pending))
            dropped = len(skips) - room
            self._pending.extend(skips[:room])
            start = not self._sending
            self._sending = True
        if dropped > 0:
            logger.warning(
                "term %d: %d fire_skipped signals dropped: a receiver is too slow",
                self.term.number,
                dropped,
            )
        if start and not self.off_thread(self._send_pending):
            with self._lock:
                self._sending = False

    def _send_pending(self) -> None:
        while True:
            with self._lock:
                skips, self._pending = self._pending, []
                if not skips:
                    self._sending = False
                    return
            for spec, at, reason, fire_key in skips:
                self.announce(spec, at, reason, fire_key)

    def skip(
        self,
        spec: TaskSpec,
        at: datetime,
        reason: str,
        *,
        by: str | None = None,
        outcome: str = "skipped",
        fire_key: str | None = None,
    ) -> None:
        """Count the fire of ``spec`` at ``at`` skipped for ``reason``, and report it
        (and record it in the run history, as ``outcome``, done ``by`` whom).

        Args:
            spec: the task.
            at: the fire's instant.
            reason: why it was skipped.
            by: ``"operator"`` when an operator's action made it so.
            outcome: ``"skipped"``, or ``"missed"`` (no node led at its instant).
            fire_key: the fire's key when not that of the instant (a triggered fire).
        """
        with self._lock:
            spec.stats.skipped += 1
        self._report(spec, at, reason, by, outcome, fire_key)

    def skipped(self, fires: list[tuple[TaskSpec, datetime]], reason: str) -> None:
        """Report ``fires`` skipped for ``reason``, already counted."""
        for spec, at in fires:
            self._report(spec, at, reason, None, "skipped", None)

    def _report(
        self,
        spec: TaskSpec,
        at: datetime,
        reason: str,
        by: str | None,
        outcome: str,
        fire_key: str | None,
    ) -> None:
        """Record the fire of ``spec`` at ``at``, skipped for ``reason``, in the run
        history (when the leader keeps one); then log and send its skip."""
        board = self.board
        if board is not None:
            term = self.term
            board.note((spec, board.name, at, None, None, outcome, reason, term.node_id,
                        term.number, None, by))  # fmt: skip
        self.announce(spec, at, reason, fire_key)

    def announce(
        self, spec: TaskSpec, at: datetime, reason: str, fire_key: str | None = None
    ) -> None:
        """Log and send the skip of the fire at ``at`` (counted already)."""
        skips = getattr(_deferred, "skips", None)
        if skips is not None:  # on the scheduler's thread: sent elsewhere, afterwards
            if signals.fire_skipped.receivers or logger.isEnabledFor(logging.DEBUG):
                skips.append((spec, at, reason, fire_key))
            return
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("fire of %r at %s skipped: %s", spec.name, at.isoformat(), reason)
        if signals.fire_skipped.receivers:  # no payload to build for no one
            signals.emit(
                signals.fire_skipped,
                self.sender,
                task=spec.name,
                scheduled_at=at,
                reason=reason,
                fire_key=fire_key if fire_key is not None else format_fire_key(spec.name, at),
            )

    def stuck(self, stuck: list[str], grace: float, on_stuck: StuckPolicy) -> None:
        """Report the tasks ``stuck`` after ``grace`` seconds; exit with on_stuck="exit"."""
        if on_stuck == "exit":
            # Self-fencing must happen inside the bound: no logging (a handler may block
            # on a full disk or a dead socket), no receivers, just a line on stderr.
            names = ", ".join(repr(name) for name in stuck)
            line = (
                f"rselection: task {names} of term {self.term.number} is still running "
                f"{grace:g}s after cancellation; exiting (code {STUCK_EXIT_CODE})\n"
            )
            with contextlib.suppress(OSError):
                os.write(2, line.encode(errors="replace"))
            os._exit(STUCK_EXIT_CODE)
        for name in stuck:
            logger.warning(
                "task %r of term %d is still running %.1fs after cancellation; "
                "it must check ctx.cancelled (or await) to stop",
                name,
                self.term.number,
                grace,
            )
        # Receivers run on a thread of their own: the caller is the leader's keeper or
        # watchdog, which a slow receiver must never hold up.
        self.off_thread(self._send_stuck, stuck, grace)

    def _send_stuck(self, stuck: list[str], grace: float) -> None:
        for name in stuck:
            signals.emit(
                signals.task_stuck, self.sender, task=name, term=self.term.number, waited=grace
            )
