"""A term's lifecycle: start its tasks, cancel them at its end, join them.

Persistent tasks start with the term; scheduled ones fire from its timetable
(:mod:`rselection.runtime.timetable`), claimed first when the term has a claimer
(:mod:`rselection.runtime.claims`). Plain ``def`` runs each take a thread (scheduled
fires reuse theirs between instants); ``async def`` ones run on the term's event loop,
all fires due at one instant handed to it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any

from ..context import TaskContext, Term, running_term
from ..event_loops import LoopGuard, SharedLoops
from ..scheduler import SCHEDULER
from ..schedules import format_fire_key
from ..specs import StuckPolicy, TaskSpec, TaskType
from ..task_threads import TaskThreads
from .catch_up import CatchUp
from .claims import Ready, TermClaims
from .pools import SHARED_POOLS
from .reports import TermReports
from .runs import TaskRuns
from .timetable import TermTimetable
from .units import TermUnits

__all__ = ["TermRunner"]

logger = logging.getLogger(__name__)

_JOIN_SHARED = 0.1  # seconds at least that stop() waits for idle shared threads to end

# An async unit handed to the event loop: unit id, task name, coroutine, and the task
# whose running slot the coroutine releases (None: it takes and releases its own).
_Coro = tuple[int, str, Coroutine[Any, Any, None], TaskSpec | None]


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
        self.on_stuck = on_stuck
        self.specs = specs
        self.term = term
        self._loop = loop
        self._guard: LoopGuard | None = None  # the term's place on the shared loop
        self._table: TermTimetable | None = None
        self._scheduler: threading.Thread | None = None  # the shared one, when it ends
        # Held while fires are started from elsewhere than a unit (the scheduler, the
        # look-back): stop() takes it once the term ended, so that every unit that will
        # ever be entered is entered before it waits for them.
        self._dispatch = threading.Lock()
        self._units = TermUnits()
        self._reports = TermReports(sender, term, self._units.cond)
        self._runs = TaskRuns(sender, term, self._units, self._reports)
        self._claims = TermClaims(term, self._units, self._reports, self._launch)
        self._async_tasks: set[asyncio.Task[Any]] = set()
        # Scheduled fires of plain def tasks: a thread each, reused between instants.
        self._threads = TaskThreads(f"rselection-task-term-{term.number}")

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start persistent tasks and the scheduler."""
        if any(spec.is_async for spec in self.specs) and self._loop is None:
            self._guard = SharedLoops.shared().enter()
            self._loop = self._guard.loop
        for spec in self.specs:
            if spec.type is TaskType.PERSISTENT:
                if spec.is_async:
                    self._submit_async(spec.name, self._runs.supervise_async(spec))
                else:
                    self._spawn(spec.name, self._runs.supervise_sync, spec)
        scheduled = [spec for spec in self.specs if spec.type is TaskType.SCHEDULED]
        if scheduled:
            catch_up = None
            if self.term.claimer is not None:
                catch_up = CatchUp(
                    self.term, self._claims, self._reports, self._dispatch, self._fire
                )
            self._table = TermTimetable(
                self.term,
                scheduled,
                reports=self._reports,
                claims=self._claims,
                dispatch=self._dispatch,
                start=self._start,
                catch_up=catch_up,
            )
            self._table.begin()

    def cancel(self) -> None:
        """Signal every task to stop: set ``cancelled`` and cancel async tasks."""
        self.term.cancel()
        if self._table is not None:
            thread = SCHEDULER.remove(self._table)  # nothing of the term fires any more
            if thread is not None:
                self._scheduler = thread
        # Claims in flight: their fires will not run now.
        skipped = self._claims.cancel()
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the caller's loop may be closed
                self._loop.call_soon_threadsafe(self._cancel_async_tasks)
        if skipped:
            # The caller is the leader's keeper or watchdog, or stop(): a receiver of
            # fire_skipped must never hold up the term's end, so it runs elsewhere.
            self._reports.off_thread(self._reports.skipped, skipped, "not-leader")

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
            self._units.wait(deadline, self._guard)
            stuck = self._units.running()
            self._claims.close()
            if self._table is not None:
                self._table.close()
            self._threads.close(max(0.0, deadline - time.monotonic()))
        finally:
            # Whatever went wrong above, the loop stops and what still runs is reported.
            if stuck is None:
                stuck = self._units.running()
            try:
                if self._guard is not None:
                    stuck = self._leave_the_loop(deadline, stuck)
            finally:
                if stuck:
                    self._reports.stuck(stuck, grace, self.on_stuck)
                self._reports.close()  # what was sent off is still sent
                self._end_shared(deadline)
        return stuck

    def _end_shared(self, deadline: float) -> None:
        """When this was the last term: wait briefly for the shared threads that have
        nothing left to do to end (a call still running ends after it)."""
        timeout = max(_JOIN_SHARED, deadline - time.monotonic())
        thread, self._scheduler = self._scheduler, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        for pool in SHARED_POOLS:
            pool.quiesce(max(_JOIN_SHARED, deadline - time.monotonic()))

    # -- event loop -----------------------------------------------------------------

    def _leave_the_loop(self, deadline: float, stuck: list[str]) -> list[str]:
        """Close the term's guard on the shared loop (nothing of the term runs there
        again); return ``stuck`` without the async tasks that were stopped that way."""
        guard = self._guard
        assert guard is not None
        if guard.close(deadline):
            stopped, _ = self._units.only_on_loop()
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

    def _spawn(self, name: str, target: Callable[..., object], *args: Any) -> None:
        unit = self._units.enter(name)

        def run() -> None:
            running_term.set(self.term)
            try:
                target(*args)
            finally:
                self._units.leave(unit)

        thread = threading.Thread(target=run, name=f"rselection-task-{name}", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            self._units.leave(unit)
            logger.error("task %r not started: no thread could be started for it: %s", name, exc)

    def _submit_async(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        unit = self._units.enter(name)
        self._submit_many([(unit, name, self._tracked(unit, coro), None)])

    def _submit_many(self, coros: list[_Coro]) -> None:
        """Start the coroutines on the term's loop, in order, with one hand-over to it
        (a thousand fires due at one instant wake the loop once, not a thousand times)."""
        loop = self._loop
        assert loop is not None
        self._units.on_loop(unit for unit, _, _, _ in coros)
        try:
            loop.call_soon_threadsafe(self._create_tasks, coros)
        except RuntimeError:
            for unit, name, coro, reserved in coros:
                coro.close()
                if reserved is not None:
                    self._units.release(reserved)
                self._units.leave(unit)
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
                self._units.name_of(unit),
                self.term.number,
                type(exc).__name__,
            )
        finally:
            self._async_tasks.discard(task)
            self._units.leave(unit)

    # -- scheduled fires --------------------------------------------------------------

    def _start(self, ready: list[tuple[TaskSpec, list[datetime]]]) -> None:
        """Start the fires of ``ready`` (with overlap="skip", not those of a task whose
        previous fire still runs): at once without a claimer, else once claimed (all in
        one call, see :meth:`TermClaims.claim`)."""
        reserved = []
        for spec, fires in ready:
            if self._units.reserve(spec):
                reserved.append((spec, fires))
            else:
                for at in fires:
                    self._reports.skip(spec, at, "overlap")
        if not reserved:
            return
        with self._units.cond:
            units = [(self._units.enter(spec.name), spec, fires) for spec, fires in reserved]
        if self.term.claimer is None:
            self._launch(units)
        else:
            self._claims.claim(self.term.claimer, units)

    def _fire(self, spec: TaskSpec, fires: list[datetime]) -> None:
        """Run ``fires`` (already claimed, if the term claims) one after another in one
        unit; with overlap="skip" all are skipped while a run is going."""
        if not self._units.reserve(spec):
            for at in fires:
                self._reports.skip(spec, at, "overlap")
            return
        self._launch([(self._units.enter(spec.name), spec, fires)])

    def _launch(self, units: list[Ready]) -> None:
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
                    self._reports.skip(spec, at, reason)
                self._units.release(spec, unit)
        if coros:
            self._submit_many(coros)

    def _run_unit(self, unit: int, spec: TaskSpec, fires: list[datetime]) -> None:
        threading.current_thread().name = f"rselection-task-{spec.name}"
        running_term.set(self.term)
        try:
            for at in fires:
                if not self._stale(spec, at):
                    self._runs.run_sync(spec, self._context(spec, at))
        finally:
            self._units.release(spec, unit)

    def _context(self, spec: TaskSpec, at: datetime) -> TaskContext:
        return TaskContext(
            spec.name, self.term, scheduled_at=at, fire_key=format_fire_key(spec.name, at)
        )

    def _stale(self, spec: TaskSpec, at: datetime) -> bool:
        """Whether the fire at ``at`` is past its grace now, when it is about to start
        (reported as a misfire): a catch-up's later fires age while the earlier run."""
        if time.time() - at.timestamp() <= spec.misfire_grace:  # too_old(), cheaper
            return False
        self._reports.skip(spec, at, "misfire")
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
                    await self._runs.run_async(spec, self._context(spec, at))
        except asyncio.CancelledError:
            pass
        finally:
            self._async_tasks.discard(task)
            self._units.release(spec, unit)
