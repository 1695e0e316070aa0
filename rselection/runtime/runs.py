"""One run of a task, counted and announced; a persistent task's restarts."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any

from .. import signals
from ..backoff import backoff
from ..context import TaskContext, TaskTerm, Term
from ..errors import LeadershipLost
from ..history import OPERATOR
from ..specs import TaskSpec
from ..task_runs import PAUSED, error_line
from .reports import TermReports
from .units import TermUnits

__all__ = ["TaskRuns", "restart_delay"]

logger = logging.getLogger(__name__)

_RESTART_BASE = 0.1
_RESTART_CAP = 30.0


def restart_delay(attempt: int) -> float:
    """Backoff before restart number ``attempt`` (0-based): capped exponential, jittered."""
    return backoff(attempt + 1, first=_RESTART_BASE, cap=_RESTART_CAP)


class TaskRuns:
    """Runs the tasks of one term: each run counted in its task's statistics, announced
    by signals, its failure logged.

    Args:
        sender: the sender of the task signals (the owning
            :class:`~rselection.TaskHandler`).
        term: the term.
        units: the term's units (their lock guards the statistics).
        reports: where a fire that can no longer start is reported.
    """

    def __init__(self, sender: object, term: Term, units: TermUnits, reports: TermReports) -> None:
        self.sender = sender
        self.term = term
        self.units = units
        self.reports = reports

    def _may_start(self, spec: TaskSpec, ctx: TaskContext) -> bool:
        if self.term.live():
            return True
        if ctx.scheduled_at is not None:  # the term ended between dispatch and start
            self.reports.skip(spec, ctx.scheduled_at, "not-leader")
        return False

    def _failure(self, exc: Exception, term: Term | None) -> Exception | None:
        """What a run that raised ``exc`` failed with: nothing when it only saw its term
        end (:class:`LeadershipLost` once the run's own term is over, ``term``, default
        the leader's: it was told to stop, its task paused or its leadership lost)."""
        if isinstance(exc, LeadershipLost) and not (term or self.term).live():
            return None
        return exc

    def _started(self, spec: TaskSpec, ctx: TaskContext) -> tuple[float, float]:
        """Count the run and announce it; return its start (monotonic, and the time)."""
        started_at = time.time()
        with self.units.cond:
            spec.stats.runs += 1
            if ctx.scheduled_at is not None:
                spec.stats.last_fire = ctx.scheduled_at
        if signals.task_started.receivers:
            signals.emit(
                signals.task_started,
                self.sender,
                task=ctx.name,
                term=ctx.term,
                scheduled_at=ctx.scheduled_at,
            )
        return time.monotonic(), started_at

    def _history(
        self,
        spec: TaskSpec,
        ctx: TaskContext,
        started_at: float,
        error: BaseException | None,
        term: Term,
        by: str | None,
        cancelled: bool,
    ) -> None:
        """Record the run in the run history (when the leader keeps one): ``ok``,
        ``failed``, or ``cancelled`` when its term ended (or an operator paused it)."""
        board = self.term.tasks
        if board is None:
            return
        reason = None
        if error is not None:
            outcome = "failed"
        elif cancelled or not term.live():
            outcome = "cancelled"
            if isinstance(term, TaskTerm) and term.paused:
                reason, by = PAUSED, OPERATOR
            else:
                reason = "not-leader" if not self.term.live() else None
        else:
            outcome = "ok"
        # A plain tuple: the record is made on the task desk's thread, not here.
        board.note((spec, board.name, ctx.scheduled_at, started_at, time.time(), outcome,
                    reason, self.term.node_id, self.term.number,
                    None if error is None else error_line(error), by))  # fmt: skip

    def _record(
        self,
        spec: TaskSpec,
        ctx: TaskContext,
        began: tuple[float, float],
        error: BaseException | None,
        *,
        term: Term | None = None,
        by: str | None = None,
        cancelled: bool = False,
    ) -> None:
        """Count the run's outcome and announce its end (and its failure, if it failed);
        record it in the run history."""
        duration = time.monotonic() - began[0]
        self._history(spec, ctx, began[1], error, term or self.term, by, cancelled)
        with self.units.cond:
            stats = spec.stats
            stats.last_failed = error is not None
            if error is not None:
                stats.failures += 1
                stats.last_error = f"{type(error).__name__}: {error}"
        if error is not None:
            logger.error(
                "task %r failed in term %d",
                spec.name,
                self.term.number,
                exc_info=(type(error), error, error.__traceback__),
            )
            signals.emit(
                signals.task_failed,
                self.sender,
                task=spec.name,
                term=self.term.number,
                error=error,
            )
        if signals.task_finished.receivers:
            signals.emit(
                signals.task_finished,
                self.sender,
                task=spec.name,
                term=self.term.number,
                scheduled_at=ctx.scheduled_at,
                duration=duration,
                error=error,
            )

    def run_sync(
        self,
        spec: TaskSpec,
        ctx: TaskContext,
        *,
        term: Term | None = None,
        by: str | None = None,
    ) -> BaseException | None:
        """Run the plain ``def`` task ``spec`` once; return what it failed with.

        Args:
            spec: the task.
            ctx: the run's context.
            term: the term the run sees (a persistent task's own), default the term's.
            by: ``"operator"`` for a fire an operator triggered.
        """
        if not self._may_start(spec, ctx):
            return None
        began = self._started(spec, ctx)
        error: BaseException | None = None
        try:
            result = spec.task.run(ctx)
            if inspect.isawaitable(result):
                _close_awaitable(result)
                raise TypeError(
                    f"task {spec.name!r} returned an awaitable from a plain function; "
                    "declare it 'async def' so it runs on the event loop"
                )
        except Exception as exc:
            error = self._failure(exc, term)
        self._record(spec, ctx, began, error, term=term, by=by)
        return error

    async def run_async(
        self,
        spec: TaskSpec,
        ctx: TaskContext,
        *,
        term: Term | None = None,
        by: str | None = None,
    ) -> BaseException | None:
        """Run the ``async def`` task ``spec`` once; return what it failed with (as
        :meth:`run_sync`)."""
        if not self._may_start(spec, ctx):
            return None
        began = self._started(spec, ctx)
        error: BaseException | None = None
        try:
            await spec.task.run(ctx)
        except asyncio.CancelledError:
            self._record(spec, ctx, began, None, term=term, by=by, cancelled=True)
            raise
        except Exception as exc:
            error = self._failure(exc, term)
        self._record(spec, ctx, began, error, term=term, by=by)
        return error

    # -- persistent tasks -------------------------------------------------------------

    def _should_restart(self, spec: TaskSpec, error: BaseException | None, term: Term) -> bool:
        if not term.live():
            return False
        if spec.restart == "always":
            return True
        return spec.restart == "on-failure" and error is not None

    def supervise_sync(self, spec: TaskSpec, term: Term | None = None) -> None:
        """Run the persistent plain ``def`` task ``spec``, restarted as its policy says,
        while ``term`` (the task's own, default the term) is live."""
        term = term or self.term
        attempt = 0
        while term.live() and self.units.reserve(spec):
            began = time.monotonic()
            try:
                error = self.run_sync(spec, TaskContext(spec.name, term), term=term)
            finally:
                self.units.release(spec)
            if not self._should_restart(spec, error, term):
                return
            attempt = 0 if time.monotonic() - began > _RESTART_CAP else attempt + 1
            if term.cancelled.wait(restart_delay(attempt - 1 if attempt else 0)):
                return

    async def supervise_async(self, spec: TaskSpec, term: Term | None = None) -> None:
        """Run the persistent ``async def`` task ``spec``, restarted as its policy says,
        while ``term`` (the task's own, default the term) is live."""
        term = term or self.term
        attempt = 0
        while term.live() and self.units.reserve(spec):
            began = time.monotonic()
            try:
                error = await self.run_async(spec, TaskContext(spec.name, term), term=term)
            finally:
                self.units.release(spec)
            if not self._should_restart(spec, error, term):
                return
            attempt = 0 if time.monotonic() - began > _RESTART_CAP else attempt + 1
            await asyncio.sleep(restart_delay(attempt - 1 if attempt else 0))


def _close_awaitable(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()
