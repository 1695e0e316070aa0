"""Runs one term's tasks: supervision, schedules, cancellation and join.

Plain ``def`` tasks run in their own threads, so a CPU-bound task or an ``async def``
task that blocks the event loop never holds up the others. ``async def`` tasks run on
one event loop: the caller's under ``async with leader``, else the loop that the
process's terms share (:mod:`rselection.event_loops`), on which nothing of a term runs
once it has ended.

The machinery's threads are shared by every term of the process, so that they do not
grow with the number of leases: one scheduler thread fires every term's scheduled tasks
(:mod:`rselection.scheduler`; each term keeps its own timetable), one pool of daemon
workers runs every term's claims (and the look-back for missed fires, and the
preparation of fires of schedules that are not the library's own), one more the
clean-ups of expired claims, and one more the signals sent off the caller's thread.
Each term has a lane of its own in each pool (see
:class:`~rselection.daemon_pool.SharedPool`): at most two of its claims run at once and
the lanes are served in turn, so a term whose claims hang on a dead connection holds
two workers, and the pool starts more (up to a bound) once those count as stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import inspect
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from . import signals
from .abc import claimer_ability
from .backoff import backoff
from .claiming import (
    CLEANUP_BATCH,
    CleanupClaimer,
    FireClaimer,
    LeaseClaims,
    check_fire_key,
    claim_each,
    claim_missed_each,
    ran_before_each,
)
from .context import TaskContext, Term, running_term
from .daemon_pool import SharedPool
from .errors import ConfigError, LeadershipLost
from .event_loops import LoopGuard, SharedLoops
from .misfire import scan_due, split_behind, split_by_policy, too_old, window
from .scheduler import MAX_LEAD, SCHEDULER, Prepared
from .schedules import CronSchedule, IntervalSchedule, fire_series, format_fire_key
from .specs import StuckPolicy, TaskSpec, TaskType
from .task_threads import TaskThreads

if TYPE_CHECKING:
    from .schedules import Schedule

__all__ = ["TermRunner", "cleanup_period", "restart_delay"]

logger = logging.getLogger(__name__)

STUCK_EXIT_CODE = 70
"""Process exit code when a task is stuck and the handler was built with on_stuck="exit"."""

_RESTART_BASE = 0.1
_RESTART_CAP = 30.0
_T = TypeVar("_T")
_CLAIMS_PER_TERM = 2  # a term's claims running at once, at most
_MAX_PENDING_SKIPS = 10_000  # skips waiting for a slow fire_skipped receiver, at most
_JOIN_SHARED = 0.1  # seconds at least that stop() waits for idle shared threads to end
_LOOP_HEALTH_POLL = 0.05  # seconds between looks at the shared loop while waiting on it

# The process's pools, shared by every term (each term has lanes of its own): claims,
# the look-back for missed fires and off-thread preparations; clean-ups of expired
# claims (so that one never holds up a claim); signals sent off the caller's thread.
# Workers start on demand; a call running for a second counts as stuck and lets the
# pool start one more, up to ``most``.
_CLAIM_POOL = SharedPool("rselection-claims", 4, most=32)
_CLEANUP_POOL = SharedPool("rselection-cleanup", 1, most=4)
_SIGNAL_POOL = SharedPool("rselection-signals", 2, most=8)
_SHARED_POOLS = (_CLAIM_POOL, _CLEANUP_POOL, _SIGNAL_POOL)  # reset in a forked child

# Schedules whose next_fire is the library's own (fast, never blocks): their fires are
# prepared on the scheduler's thread; any other schedule's on its term's lane.
_OWN_SCHEDULES = (IntervalSchedule, CronSchedule)

# Skips announced on the scheduler's thread, by the term it works for: their signals
# are sent on the term's signal lane instead (see TermRunner._deferring).
_deferred = threading.local()

# A unit of fires ready to start: its unit id, its task, its fires (oldest first).
_Ready = tuple[int, TaskSpec, list[datetime]]
# An async unit handed to the event loop: unit id, task name, coroutine, and the task
# whose running slot the coroutine releases (None: it takes and releases its own).
_Coro = tuple[int, str, Coroutine[Any, Any, None], TaskSpec | None]


def cleanup_period(ttl: float) -> float:
    """Seconds between a leader's clean-ups of expired claims: half the claim ttl, at
    least a second unless the ttl is shorter (so at least once per ttl)."""
    return min(ttl, max(ttl / 2, 1.0))


def restart_delay(attempt: int) -> float:
    """Backoff before restart number ``attempt`` (0-based): capped exponential, jittered."""
    return backoff(attempt + 1, first=_RESTART_BASE, cap=_RESTART_CAP)


class TermRunner:
    """Runs every registered task for one :class:`~rselection.context.Term`.

    Args:
        sender: the sender of the task signals (the owning
            :class:`~rselection.TaskHandler`).
        on_stuck: ``"exit"`` ends the process when a task outlives the grace.
        specs: the registered tasks.
        term: the term to run.
        loop: event loop for ``async def`` tasks; ``None``: the process's shared one.
    """

    def __init__(
        self,
        sender: object,
        on_stuck: StuckPolicy,
        specs: list[TaskSpec],
        term: Term,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.sender = sender
        self.on_stuck = on_stuck
        self.specs = specs
        self.term = term
        self._loop = loop
        self._guard: LoopGuard | None = None  # the term's place on the shared loop
        self._table: _Timetable | None = None
        self._scheduler: threading.Thread | None = None  # the shared one, when it ends
        # Held while fires are started from elsewhere than a unit (the scheduler, the
        # look-back): stop() takes it once the term ended, so that every unit that will
        # ever be entered is entered before it waits for them.
        self._dispatch = threading.Lock()
        self._cond = threading.Condition()
        self._units: dict[int, str] = {}
        self._async_units: set[int] = set()  # those of _units that run on the loop
        self._unit_ids = itertools.count()
        self._async_tasks: set[asyncio.Task[Any]] = set()
        # Claims run on the shared claim pool, so that one stuck on a dead connection
        # never holds the term's end (nothing waits for it), nor another term's claims.
        # Daemon threads: a stuck claim never keeps the process from exiting after stop().
        self._claims = _CLAIM_POOL.lane(_CLAIMS_PER_TERM)
        # Preparations of fires whose schedule is not the library's own, in order.
        self._preps = _CLAIM_POOL.lane(1)
        # The clean-up of expired claims (one at a time), never in a claim's way.
        self._cleanups = _CLEANUP_POOL.lane(1)
        self._cleanup: Future[None] | None = None
        # Signal receivers that must not run on the caller's thread, in order.
        self._signals = _SIGNAL_POOL.lane(1)
        self._pending_skips: list[tuple[TaskSpec, datetime, str]] = []  # to send there
        self._sending_skips = False
        # Scheduled fires of plain def tasks: a thread each, reused between instants.
        self._threads = TaskThreads(f"rselection-task-term-{term.number}")
        # Claims of the fires due at one instant, in flight (see _claim_batch).
        self._batches: set[_ClaimBatch] = set()

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start persistent tasks and the scheduler."""
        if any(spec.is_async for spec in self.specs) and self._loop is None:
            self._guard = SharedLoops.shared().enter()
            self._loop = self._guard.loop
        for spec in self.specs:
            if spec.type is TaskType.PERSISTENT:
                if spec.is_async:
                    self._submit_async(spec.name, self._supervise_async(spec))
                else:
                    self._spawn(spec.name, self._supervise_sync, spec)
        scheduled = [spec for spec in self.specs if spec.type is TaskType.SCHEDULED]
        if scheduled:
            table = self._table = _Timetable(self, scheduled)
            if self.term.claimer is not None:
                # Fires that came due while no node led, found through the claims (round
                # trips: on the claim pool), before any newer fire, so they run in order.
                self._claims.submit(table.recover)
            elif table.inline:
                SCHEDULER.add(table, setup=True)
            else:
                self._preps.submit(table.set_up_elsewhere)

    def cancel(self) -> None:
        """Signal every task to stop: set ``cancelled`` and cancel async tasks."""
        self.term.cancel()
        if self._table is not None:
            thread = SCHEDULER.remove(self._table)  # nothing of the term fires any more
            if thread is not None:
                self._scheduler = thread
        with self._cond:
            # Claims in flight: their fires will not run now. Settled here, under the
            # lock, so that their units no longer hold up the join.
            batches = list(self._batches)
            self._batches.clear()
            skipped = [self._free(batch) for batch in batches]
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the caller's loop may be closed
                self._loop.call_soon_threadsafe(self._cancel_async_tasks)
        if any(skipped):
            # The caller is the leader's keeper or watchdog, or stop(): a receiver of
            # fire_skipped must never hold up the term's end, so it runs elsewhere.
            self._off_thread(
                self._send_skipped, [fire for fires in skipped for fire in fires], "not-leader"
            )

    def stop(self, grace: float) -> list[str]:
        """Cancel, wait up to ``grace`` seconds for every task, report the stuck ones."""
        deadline = time.monotonic() + grace
        stuck: list[str] | None = None
        try:
            self.cancel()
            # Fires being started first (by the scheduler, or a look-back's catch-up): they
            # add units to join. They see the term over once this lock is free.
            if self._dispatch.acquire(timeout=max(0.0, deadline - time.monotonic())):
                self._dispatch.release()
            self._wait_for_units(deadline)
            with self._cond:
                stuck = sorted(set(self._units.values()))
            for lane in (self._claims, self._preps, self._cleanups):
                lane.shutdown(wait=False, cancel_futures=True)
            self._threads.close(max(0.0, deadline - time.monotonic()))
        finally:
            # Whatever went wrong above, the loop stops and what still runs is reported.
            if stuck is None:
                with self._cond:
                    stuck = sorted(set(self._units.values()))
            try:
                if self._guard is not None:
                    stuck = self._leave_the_loop(deadline, stuck)
            finally:
                if stuck:
                    self._report_stuck(stuck, grace)
                self._signals.shutdown(wait=False)  # what was sent off is still sent
                self._end_shared(deadline)
        return stuck

    def _end_shared(self, deadline: float) -> None:
        """When this was the last term: wait briefly for the shared threads that have
        nothing left to do to end (a call still running ends after it)."""
        timeout = max(_JOIN_SHARED, deadline - time.monotonic())
        thread, self._scheduler = self._scheduler, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        for pool in _SHARED_POOLS:
            pool.quiesce(max(_JOIN_SHARED, deadline - time.monotonic()))

    def _report_stuck(self, stuck: list[str], grace: float) -> None:
        if self.on_stuck == "exit":
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
        self._off_thread(self._send_stuck, stuck, grace)

    def _off_thread(self, target: Callable[..., None], *args: Any) -> bool:
        """Run ``target(*args)`` (signal receivers) on the term's signal lane, after the
        signals sent there before; when that cannot be, log it and drop them (return
        false): the caller must go on."""
        try:
            self._signals.submit(target, *args)
        except RuntimeError as exc:
            logger.error("signals of term %d not sent: %s", self.term.number, exc)
            return False
        return True

    @contextlib.contextmanager
    def _deferring(self) -> Iterator[None]:
        """Skips announced in this block on this thread are sent on the term's signal
        lane afterwards: the scheduler's thread never runs a receiver (a slow one would
        hold up every term's fires)."""
        if getattr(_deferred, "skips", None) is not None:
            yield  # the outer block sends them
            return
        skips: list[tuple[TaskSpec, datetime, str]] = []
        _deferred.skips = skips
        try:
            yield
        finally:
            _deferred.skips = None
            if skips:
                self._post_skips(skips)

    def _post_skips(self, skips: list[tuple[TaskSpec, datetime, str]]) -> None:
        """Send ``skips`` on the signal lane: one sender at a time takes every skip
        waiting, so a slow receiver makes a backlog of skips (at most
        ``_MAX_PENDING_SKIPS``, the newer dropped and logged), not of calls."""
        with self._cond:
            room = max(0, _MAX_PENDING_SKIPS - len(self._pending_skips))
            dropped = len(skips) - room
            self._pending_skips.extend(skips[:room])
            start = not self._sending_skips
            self._sending_skips = True
        if dropped > 0:
            logger.warning(
                "term %d: %d fire_skipped signals dropped: a receiver is too slow",
                self.term.number,
                dropped,
            )
        if start and not self._off_thread(self._send_pending_skips):
            with self._cond:
                self._sending_skips = False

    def _send_pending_skips(self) -> None:
        while True:
            with self._cond:
                skips, self._pending_skips = self._pending_skips, []
                if not skips:
                    self._sending_skips = False
                    return
            for spec, at, reason in skips:
                self._announce_skip(spec, at, reason)

    def _send_stuck(self, stuck: list[str], grace: float) -> None:
        for name in stuck:
            signals.emit(
                signals.task_stuck, self.sender, task=name, term=self.term.number, waited=grace
            )

    # -- event loop -----------------------------------------------------------------

    def _wait_for_units(self, deadline: float) -> None:
        """Wait until every unit has left, or ``deadline``; on a shared loop that does not
        answer (a task blocks it), not for the term's async tasks: they cannot run."""
        guard = self._guard

        def done() -> bool:
            if not self._units:
                return True
            return (
                guard is not None
                and not guard.answers()
                and self._async_units.issuperset(self._units)
            )

        with self._cond:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(min(left, _LOOP_HEALTH_POLL) if guard is not None else left)

    def _leave_the_loop(self, deadline: float, stuck: list[str]) -> list[str]:
        """Close the term's guard on the shared loop (nothing of the term runs there
        again); return ``stuck`` without the async tasks that were stopped that way."""
        guard = self._guard
        assert guard is not None
        if guard.close(deadline):
            with self._cond:
                stopped = {self._units[u] for u in self._async_units if u in self._units}
                running = {n for u, n in self._units.items() if u not in self._async_units}
            stopped -= running
            if stopped:
                logger.warning(
                    "async task %s of term %d did not unwind within its grace (it ignored "
                    "cancellation, or the shared event loop was blocked): stopped without "
                    "running to its end",
                    ", ".join(repr(name) for name in sorted(stopped)),
                    self.term.number,
                )
                return [name for name in stuck if name not in stopped]
        # A step of the term still runs (one of its async tasks blocks the loop): every
        # async task left counts as stuck.
        return stuck

    def _cancel_async_tasks(self) -> None:
        for task in list(self._async_tasks):
            task.cancel()

    # -- units: everything that must be joined --------------------------------------

    def _enter(self, name: str) -> int:
        with self._cond:
            unit = next(self._unit_ids)
            self._units[unit] = name
            return unit

    def _leave(self, unit: int) -> None:
        with self._cond:
            self._units.pop(unit, None)
            self._async_units.discard(unit)
            self._cond.notify_all()

    def _spawn(self, name: str, target: Callable[..., object], *args: Any) -> None:
        unit = self._enter(name)

        def run() -> None:
            running_term.set(self.term)
            try:
                target(*args)
            finally:
                self._leave(unit)

        thread = threading.Thread(target=run, name=f"rselection-task-{name}", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            self._leave(unit)
            logger.error("task %r not started: no thread could be started for it: %s", name, exc)

    def _submit_async(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        unit = self._enter(name)
        self._submit_many([(unit, name, self._tracked(unit, coro), None)])

    def _submit_many(self, coros: list[_Coro]) -> None:
        """Start the coroutines on the term's loop, in order, with one hand-over to it
        (a thousand fires due at one instant wake the loop once, not a thousand times)."""
        loop = self._loop
        assert loop is not None
        with self._cond:
            self._async_units.update(unit for unit, _, _, _ in coros)
        try:
            loop.call_soon_threadsafe(self._create_tasks, coros)
        except RuntimeError:
            for unit, name, coro, reserved in coros:
                coro.close()
                if reserved is not None:
                    self._release(reserved)
                self._leave(unit)
                logger.error("task %r not started: its event loop is closed", name)

    def _create_tasks(self, coros: list[_Coro]) -> None:
        guard = self._guard
        create = guard.create_task if guard is not None else self._loop.create_task  # type: ignore[union-attr]
        for _, _, coro, _ in coros:
            create(coro)

    async def _tracked(self, unit: int, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.current_task()
        assert task is not None
        running_term.set(self.term)  # in this task's own context only
        self._async_tasks.add(task)
        try:
            await coro
        except asyncio.CancelledError:
            pass
        except (SystemExit, KeyboardInterrupt) as exc:
            # Raised on, it would leave the loop's run_forever under the other tasks.
            logger.error(
                "task %r of term %d raised %s: it ends; the other tasks go on",
                self._units.get(unit),
                self.term.number,
                type(exc).__name__,
            )
        finally:
            self._async_tasks.discard(task)
            self._leave(unit)

    # -- one run ----------------------------------------------------------------------

    def _reserve(self, spec: TaskSpec) -> bool:
        """Take a running slot; with overlap="skip" refuse while a fire of it is running."""
        with self._cond:
            stats = spec.stats
            if spec.overlap == "skip" and spec.type is TaskType.SCHEDULED and stats.running:
                return False
            stats.running += 1
            stats.state = "running"
            return True

    def _release(self, spec: TaskSpec, unit: int | None = None) -> None:
        """Give the running slot back (and leave ``unit``, if given: one lock for both)."""
        with self._cond:
            stats = spec.stats
            stats.running -= 1
            if not stats.running:
                stats.state = "failed" if stats.last_failed else "idle"
            if unit is not None:
                self._units.pop(unit, None)
                self._async_units.discard(unit)
                self._cond.notify_all()

    def _started(self, spec: TaskSpec, ctx: TaskContext) -> float:
        """Count the run and announce it; return its start (monotonic)."""
        with self._cond:
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
        return time.monotonic()

    def _record(
        self, spec: TaskSpec, ctx: TaskContext, began: float, error: BaseException | None
    ) -> None:
        """Count the run's outcome and announce its end (and its failure, if it failed)."""
        duration = time.monotonic() - began
        with self._cond:
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

    def _may_start(self, spec: TaskSpec, ctx: TaskContext) -> bool:
        if self.term.live():
            return True
        if ctx.scheduled_at is not None:  # the term ended between dispatch and start
            self._skip(spec, ctx.scheduled_at, "not-leader")
        return False

    def _failure(self, exc: Exception) -> Exception | None:
        """What a run that raised ``exc`` failed with: nothing when it only saw its term
        end (:class:`LeadershipLost` once the term is over: it was told to stop)."""
        if isinstance(exc, LeadershipLost) and not self.term.live():
            return None
        return exc

    def _run_sync(self, spec: TaskSpec, ctx: TaskContext) -> BaseException | None:
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
            error = self._failure(exc)
        self._record(spec, ctx, began, error)
        return error

    async def _run_async(self, spec: TaskSpec, ctx: TaskContext) -> BaseException | None:
        if not self._may_start(spec, ctx):
            return None
        began = self._started(spec, ctx)
        error: BaseException | None = None
        try:
            await spec.task.run(ctx)
        except asyncio.CancelledError:
            self._record(spec, ctx, began, None)
            raise
        except Exception as exc:
            error = self._failure(exc)
        self._record(spec, ctx, began, error)
        return error

    # -- persistent tasks -------------------------------------------------------------

    def _should_restart(self, spec: TaskSpec, error: BaseException | None) -> bool:
        if not self.term.live():
            return False
        if spec.restart == "always":
            return True
        return spec.restart == "on-failure" and error is not None

    def _supervise_sync(self, spec: TaskSpec) -> None:
        attempt = 0
        while self.term.live() and self._reserve(spec):
            began = time.monotonic()
            try:
                error = self._run_sync(spec, TaskContext(spec.name, self.term))
            finally:
                self._release(spec)
            if not self._should_restart(spec, error):
                return
            attempt = 0 if time.monotonic() - began > _RESTART_CAP else attempt + 1
            if self.term.cancelled.wait(restart_delay(attempt - 1 if attempt else 0)):
                return

    async def _supervise_async(self, spec: TaskSpec) -> None:
        attempt = 0
        while self.term.live() and self._reserve(spec):
            began = time.monotonic()
            try:
                error = await self._run_async(spec, TaskContext(spec.name, self.term))
            finally:
                self._release(spec)
            if not self._should_restart(spec, error):
                return
            attempt = 0 if time.monotonic() - began > _RESTART_CAP else attempt + 1
            await asyncio.sleep(restart_delay(attempt - 1 if attempt else 0))

    # -- scheduled tasks ----------------------------------------------------------------

    @contextlib.contextmanager
    def _survive(self, spec: TaskSpec) -> Iterator[None]:
        """Keep the scheduler going when one task's schedule or claimer raises: that task
        fires no more this term (logged), the others go on."""
        try:
            yield
        except Exception:
            logger.exception(
                "task %r: scheduling it failed in term %d; it fires no more this term",
                spec.name,
                self.term.number,
            )

    def _push(
        self,
        heap: list[tuple[datetime, int, TaskSpec]],
        spec: TaskSpec,
        at: datetime | None,
        order: itertools.count[int],
    ) -> None:
        spec.stats.next_fire = at
        if at is not None:
            heapq.heappush(heap, (at, next(order), spec))

    def _prepare(
        self,
        due: list[tuple[datetime, int, TaskSpec]],
        now: datetime,
        heap: list[tuple[datetime, int, TaskSpec]],
        order: itertools.count[int],
    ) -> list[tuple[TaskSpec, list[datetime]]]:
        """The fires to start at ``now`` (each task's first one given), by task; put each
        task's next fire on the heap.

        Of each task, the newest fire due is on time (its successor is not due yet) and
        runs whatever the policy; the older ones mean this node fell behind by whole
        periods: they are missed, and the policy decides (see
        :func:`~rselection.misfire.split_behind`). Fires older than the grace are skipped.
        """
        ready: list[tuple[TaskSpec, list[datetime]]] = []
        for first, _, spec in due:
            try:
                fires, dropped, following = scan_due(_schedule(spec), first, now)
                if following is not None and following.timestamp() <= time.time():
                    # The scan itself took a period or more (a slow schedule): the fires
                    # that came due meanwhile belong to this unit, in order.
                    fires, dropped, following = scan_due(_schedule(spec), first, datetime.now(UTC))
                if len(fires) == 1 and not dropped:  # on time: no policy to apply
                    run, skipped = fires, dropped
                else:
                    run, skipped = split_behind(spec.misfire, fires)
                    skipped = dropped + skipped
                stale = [at for at in run if too_old(at, now, spec.misfire_grace)]
                for at in sorted(skipped + stale):
                    self._skip(spec, at, "misfire")
                fresh = [at for at in run if at not in stale] if stale else run
                if fresh:
                    ready.append((spec, fresh))
                self._push(heap, spec, following, order)
            except Exception:
                # That task fires no more this term; the others go on.
                logger.exception(
                    "task %r: scheduling it failed in term %d; it fires no more this term",
                    spec.name,
                    self.term.number,
                )
        return ready

    def _start(self, ready: list[tuple[TaskSpec, list[datetime]]]) -> None:
        """Start the fires of ``ready`` (with overlap="skip", not those of a task whose
        previous fire still runs): at once without a claimer, else once claimed (all in
        one call, see :meth:`_claim_batch`)."""
        reserved = []
        for spec, fires in ready:
            if self._reserve(spec):
                reserved.append((spec, fires))
            else:
                for at in fires:
                    self._skip(spec, at, "overlap")
        if not reserved:
            return
        with self._cond:
            units = [(self._enter(spec.name), spec, fires) for spec, fires in reserved]
        if self.term.claimer is None:
            self._launch(units)
        else:
            self._claim_batch(self.term.claimer, units)

    def _select(self, spec: TaskSpec, missed: list[datetime]) -> list[datetime]:
        """Of missed fires (oldest first), the ones ``spec.misfire`` runs; skip the rest."""
        run, skipped = split_by_policy(spec.misfire, missed)
        for at in skipped:
            self._skip(spec, at, "misfire")
        return run

    def _recover(self, specs: list[TaskSpec], started: datetime) -> None:
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
            with self._survive(spec):
                candidates = window(_schedule(spec), started, spec.misfire_grace)
                if candidates and self._claimable(claimer, spec, candidates[-1]):
                    found.append((spec, candidates))
        if not found:
            return
        # A task that never ran anywhere has missed nothing: its first term starts at
        # its next instant, as on a leader without claims, and reports nothing.
        series = {fire_series(spec.name): spec for spec, _ in found}
        failed = "their claims could not be read"
        ran = self._recovery_call(found, failed, ran_before_each, claimer, list(series))
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
        won = self._recovery_call(found, failed, claim_missed_each, claimer, keys_of, term=term)
        if won is None:
            return
        for (spec, _), keys, won_keys in zip(found, groups, won, strict=True):
            with self._survive(spec):
                self._catch_up(spec, [keys[key] for key in won_keys])

    def _recovery_call(
        self,
        found: list[tuple[TaskSpec, list[datetime]]],
        failed: str,
        fn: Callable[..., _T],
        *args: Any,
        **kwargs: Any,
    ) -> _T | None:
        """A call of :meth:`_recover` (see :meth:`_claim_call`); ``None`` when the term
        ended meanwhile, or when it failed: then the missed fires of the tasks ``found``
        are not recovered, and a warning says why (``failed``)."""
        try:
            return self._claim_call(fn, *args, **kwargs)
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
        """Run the missed fires ``won`` (claimed, oldest first) as the policy says."""
        run = self._select(spec, won)
        if run and spec.misfire == "latest":
            following = _schedule(spec).next_fire(run[-1])
            if following is not None and following <= datetime.now(UTC):
                # A newer fire is already due and the scheduler runs it next: the
                # catch-up would only hold it up (or get it skipped as an overlap).
                self._skip(spec, run.pop(), "misfire")
        with self._dispatch:  # stop() waits for the units entered here
            if run and self.term.live():
                self._fire(spec, run)
                return
        for at in run:
            self._skip(spec, at, "not-leader")

    def _start_cleanup(self, claimer: CleanupClaimer) -> None:
        """Delete expired claims on the claim pool, batch by batch while the term lasts;
        the scheduler does not wait for it, and one clean-up runs at a time."""
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

    def _claim_call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | None:
        """``fn(*args, **kwargs)``, on the claim pool already; ``None`` if the term ended
        before it answered (nothing waits for it: the end of a term is seen at once).

        A claim answered too late this way may still have landed: its fire then stays
        claimed but unrun, as for a node that stopped leading.
        """
        if not self.term.live():
            return None
        result = fn(*args, **kwargs)
        return result if self.term.live() else None

    def _claim_batch(self, claimer: FireClaimer, units: list[_Ready]) -> None:
        """Claim every fire of ``units`` in one call on the claim pool; start the units
        with the fires won once it answers (see :meth:`_claimed`).

        The scheduler never waits for the claim: it goes on to the next instant. The
        units are joined like running ones meanwhile, and the end of the term settles
        them at once (:meth:`cancel`): nothing of theirs runs then.
        """
        batch = _ClaimBatch(units)
        with self._cond:
            self._batches.add(batch)
        if not self.term.live():  # never claim a fire this node can no longer run
            self._settle(batch)
            return
        try:
            future = self._claims.submit(self._claim_keys, claimer, list(batch.keys))
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

    def _take(self, batch: _ClaimBatch) -> bool:
        """Whether this caller settles ``batch`` (the claim's answer or the term's end,
        whichever comes first)."""
        with self._cond:
            if batch not in self._batches:
                return False
            self._batches.discard(batch)
            return True

    def _settle(self, batch: _ClaimBatch) -> None:
        """The term ended before ``batch`` was claimed: report its fires, free its units."""
        with self._cond:
            if batch not in self._batches:
                return
            self._batches.discard(batch)
            skipped = self._free(batch)
        self._send_skipped(skipped, "not-leader")

    def _free(self, batch: _ClaimBatch) -> list[tuple[TaskSpec, datetime]]:
        """Under the lock: give back the running slots of ``batch``'s units, leave them,
        and count their fires skipped; return the fires, to report (outside the lock)."""
        skipped: list[tuple[TaskSpec, datetime]] = []
        for unit, spec, fires in batch.units:
            spec.stats.skipped += len(fires)
            skipped.extend((spec, at) for at in fires)
            self._release(spec, unit)  # the lock is reentrant
        return skipped

    def _send_skipped(self, fires: list[tuple[TaskSpec, datetime]], reason: str) -> None:
        """Report ``fires`` skipped for ``reason``, already counted (see :meth:`_skip`)."""
        for spec, at in fires:
            self._announce_skip(spec, at, reason)

    def _claimed(
        self,
        batch: _ClaimBatch,
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
        start: list[_Ready] = []
        for unit, spec, fires in batch.units:
            keep: list[datetime] = []
            for at in fires:
                key = batch.key_of[spec.name, at]
                if key in won:
                    keep.append(at)
                else:
                    self._skip(spec, at, "claim-error" if key in failed else "already-claimed")
            if keep:
                start.append((unit, spec, keep))
            else:
                self._release(spec)
                self._leave(unit)
        self._launch(start)

    def _skip(self, spec: TaskSpec, at: datetime, reason: str) -> None:
        with self._cond:
            spec.stats.skipped += 1
        self._announce_skip(spec, at, reason)

    def _announce_skip(self, spec: TaskSpec, at: datetime, reason: str) -> None:
        """Log and send the skip of the fire at ``at`` (counted already)."""
        skips = getattr(_deferred, "skips", None)
        if skips is not None:  # on the scheduler's thread: sent elsewhere, afterwards
            if signals.fire_skipped.receivers or logger.isEnabledFor(logging.DEBUG):
                skips.append((spec, at, reason))
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
                fire_key=format_fire_key(spec.name, at),
            )

    def _fire(self, spec: TaskSpec, fires: list[datetime]) -> None:
        """Run ``fires`` (already claimed, if the term claims) one after another in one
        unit; with overlap="skip" all are skipped while a run is going."""
        if not self._reserve(spec):
            for at in fires:
                self._skip(spec, at, "overlap")
            return
        self._launch([(self._enter(spec.name), spec, fires)])

    def _launch(self, units: list[_Ready]) -> None:
        """Start reserved units: plain ``def`` ones each on a thread, ``async def`` ones
        on the loop, all of them in one hand-over to it."""
        coros: list[_Coro] = []
        for unit, spec, fires in units:
            if spec.is_async:
                coros.append((unit, spec.name, self._fire_async(unit, spec, fires), spec))
                continue
            try:
                self._threads.run(functools.partial(self._run_unit, unit, spec, fires))
            except RuntimeError as exc:
                if self._threads.closed:  # the term is over
                    reason = "not-leader"
                else:
                    reason = "no-thread"
                    logger.error(
                        "%d fires of %r skipped: no thread could be started for them: %s",
                        len(fires),
                        spec.name,
                        exc,
                    )
                for at in fires:
                    self._skip(spec, at, reason)
                self._release(spec, unit)
        if coros:
            self._submit_many(coros)

    def _run_unit(self, unit: int, spec: TaskSpec, fires: list[datetime]) -> None:
        threading.current_thread().name = f"rselection-task-{spec.name}"
        running_term.set(self.term)
        try:
            for at in fires:
                if not self._stale(spec, at):
                    self._run_sync(spec, self._context(spec, at))
        finally:
            self._release(spec, unit)

    def _context(self, spec: TaskSpec, at: datetime) -> TaskContext:
        return TaskContext(
            spec.name, self.term, scheduled_at=at, fire_key=format_fire_key(spec.name, at)
        )

    def _stale(self, spec: TaskSpec, at: datetime) -> bool:
        """Whether the fire at ``at`` is past its grace now, when it is about to start
        (reported as a misfire): a catch-up's later fires age while the earlier run."""
        if time.time() - at.timestamp() <= spec.misfire_grace:  # too_old(), cheaper
            return False
        self._skip(spec, at, "misfire")
        return True

    async def _fire_async(self, unit: int, spec: TaskSpec, fires: list[datetime]) -> None:
        """One unit of ``async def`` fires, as its own asyncio task (tracked, so that the
        end of the term cancels it)."""
        task = asyncio.current_task()
        assert task is not None
        running_term.set(self.term)  # in this task's own context only
        self._async_tasks.add(task)
        try:
            for at in fires:
                if not self._stale(spec, at):
                    await self._run_async(spec, self._context(spec, at))
        except asyncio.CancelledError:
            pass
        finally:
            self._async_tasks.discard(task)
            self._release(spec, unit)


class _Timetable:
    """One term's scheduled tasks, as the process's scheduler fires them (see
    :class:`~rselection.scheduler.Timetable`): their next fires, by instant.

    Args:
        runner: the term's runner.
        specs: its scheduled tasks.
    """

    def __init__(self, runner: TermRunner, specs: list[TaskSpec]) -> None:
        self.runner = runner
        self.specs = specs
        self.heap: list[tuple[datetime, int, TaskSpec]] = []
        self.order = itertools.count()
        self.inline = all(type(spec.schedule) in _OWN_SCHEDULES for spec in specs)
        self.lead = 0.0
        claimer = runner.term.claimer
        self.cleaning = claimer_ability(claimer, "cleanup")
        self._next_cleanup = time.monotonic()  # at the start of the term, then every period
        self.started = datetime.now(UTC)

    def live(self) -> bool:
        return self.runner.term.live()

    def recover(self) -> None:
        """On the claim pool, at the start of a term with claims: run the fires missed
        while no node led (see :meth:`TermRunner._recover`); then fire the rest."""
        runner = self.runner
        try:
            runner._recover(self.specs, self.started)
        except Exception:  # the newer fires still run
            logger.exception("term %d: looking for missed fires failed", runner.term.number)
        if not runner.term.live():
            return
        if self.inline:
            SCHEDULER.add(self, setup=True)
        else:
            self.set_up_elsewhere()

    def set_up_elsewhere(self) -> None:
        """Off the scheduler's thread: :meth:`setup`, then fire."""
        self.setup()
        if self.runner.term.live():
            SCHEDULER.add(self)

    def setup(self) -> None:
        runner = self.runner
        with runner._deferring():
            for spec in self.specs:
                with runner._survive(spec):
                    first = _schedule(spec).next_fire(self.started)
                    runner._push(self.heap, spec, first, self.order)

    def head(self) -> float | None:
        return self.heap[0][0].timestamp() if self.heap else None

    def prepare(self, lead: float) -> Prepared | None:
        """The fires due at the next instant, if it is at most ``lead`` seconds away."""
        runner, heap = self.runner, self.heap
        if not heap or not runner.term.live():
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
        with runner._deferring():
            ready = runner._prepare(due, now, heap, self.order)
        return (at.timestamp(), ready) if ready else None

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
                    self.runner.term.number,
                )
                SCHEDULER.remove(self)
                return
            self.lead = min(MAX_LEAD, 2 * (time.perf_counter() - began))
            done(prepared)

        try:
            self.runner._preps.submit(prepare)
        except RuntimeError:  # the term is over
            done(None)

    def launch(self, prepared: Prepared) -> None:
        runner = self.runner
        with runner._dispatch:  # stop() waits for the units entered here
            if runner.term.live():
                with runner._deferring():
                    runner._start(prepared[1])

    def next_cleanup(self) -> float | None:
        return None if self.cleaning is None else self._next_cleanup

    def clean_up(self) -> None:
        if self.cleaning is not None:
            self.runner._start_cleanup(self.cleaning)
            self._next_cleanup = time.monotonic() + cleanup_period(self.cleaning.ttl)


class _ClaimBatch:
    """The units of fires due at one instant, while their claim is in flight.

    Args:
        units: the units, each reserved and entered.
    """

    def __init__(self, units: list[_Ready]) -> None:
        self.units = units
        self.key_of = {
            (spec.name, at): format_fire_key(spec.name, at)
            for _, spec, fires in units
            for at in fires
        }
        """The fire key of each fire, by task name and instant."""
        self.keys = list(self.key_of.values())
        """The fire keys to claim."""


def _schedule(spec: TaskSpec) -> Schedule:
    schedule = spec.schedule
    assert schedule is not None
    return schedule


def _close_awaitable(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()
