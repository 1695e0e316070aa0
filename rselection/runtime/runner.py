"""A term's lifecycle: start its tasks, cancel them at its end, join them.

Persistent tasks start with the term; scheduled ones fire from its timetable
(:mod:`rselection.runtime.timetable`), claimed first when the term has a claimer
(:mod:`rselection.runtime.claims`). Plain ``def`` runs each take a thread (scheduled
fires reuse theirs between instants); ``async def`` ones run on the term's event loop,
all fires due at one instant handed to it at once.

A leader with task controls (:mod:`rselection.task_board`) reads them before the term's
first task starts: a paused task's fires are skipped (reason ``paused``), a paused
persistent task does not run (and stops when paused later, until resumed), and each
trigger is one more fire of its task, claimed under its own fire key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..claiming import LeaseClaims, claim_each
from ..context import TaskContext, TaskTerm, Term, running_term
from ..event_loops import LoopGuard, SharedLoops
from ..history import OPERATOR
from ..scheduler import SCHEDULER
from ..schedules import format_fire_key
from ..specs import StuckPolicy, TaskSpec, TaskType, entry_of
from ..task_runs import PAUSED, TaskControls, TaskEntry, Trigger
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

# A trigger older than this share of the claim ttl is not run: its claim may have
# expired already, and a node that ran it but could not drop it would not be seen.
_TRIGGER_AGE = 0.9


@dataclass
class _Persistent:
    """A persistent task's runs in one term, as task controls see them."""

    term: TaskTerm | None = None  # the term its runs see while they go on
    stopped: bool = False  # paused: not running until resumed
    resume: bool = False  # resumed while its paused runs still ended: go on after


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
        self._board = term.tasks  # the leader's task controls, if it keeps them
        self._controls = threading.Lock()  # guards the two below
        self._persistent: dict[str, _Persistent] = {}
        self._triggers_seen: set[str] = set()  # taken in this term (or being taken)

    # -- lifecycle ------------------------------------------------------------------

    def _entries(self) -> list[TaskEntry]:
        """The term's tasks as its lease's list of tasks shows them."""
        return [entry_of(spec) for spec in self.specs]

    def start(self) -> None:
        """Start the persistent tasks and the scheduler, as the task controls say.

        A leader with task controls starts its tasks as its controls say. Nothing of
        them runs on the caller's thread (the engine's worker: its renewals and term
        starts never wait for a task store): the controls it holds are used at once when
        they are current (read, and kept so by notifications since it connected) and the
        term has no scheduled task; otherwise the board reads them on the task desk and
        the term begins its tasks once read (see :meth:`TaskBoard.read_for_term`), so
        that no scheduled fire of a term ever runs before its controls were read.
        """
        if any(spec.is_async for spec in self.specs) and self._loop is None:
            self._guard = SharedLoops.shared().enter()
            self._loop = self._guard.loop
        board = self._board
        if board is None:
            self._start_persistents(None)
            self._start_schedule()
            return
        board.attach(self)
        scheduled = any(spec.type is TaskType.SCHEDULED for spec in self.specs)
        persistents = not board.fresh
        if not persistents:  # current: the persistent tasks start now, as they say
            self._start_persistents(board.controls)
            if not scheduled:
                board.publish(self.term.node_id, self.term.number, self._entries())
                return
        board.read_for_term(
            functools.partial(self._begin_with, persistents=persistents), self.term.live
        )

    def _begin_with(self, controls: TaskControls, *, persistents: bool) -> None:
        """On the task desk, the controls read: start the persistent tasks (unless
        started already), act on what changed, then begin the scheduler."""
        board = self._board
        assert board is not None
        with self._dispatch:  # stop() waits for the units entered here
            if not self.term.live():
                return
            if persistents:
                self._start_persistents(controls)
        self.apply_controls(controls)  # a change since, and the triggers
        with self._dispatch:
            if not self.term.live():
                return
            self._start_schedule()
        board.publish(self.term.node_id, self.term.number, self._entries())

    def _start_persistents(self, controls: TaskControls | None) -> None:
        """Start the persistent tasks not paused."""
        with self._controls:
            for spec in self.specs:
                if spec.type is TaskType.PERSISTENT:
                    slot = self._persistent[spec.name] = _Persistent()
                    if controls is not None and spec.name in controls.paused:
                        slot.stopped = True
                    else:
                        self._start_persistent(spec, slot)

    def _start_schedule(self) -> None:
        """Begin the scheduler: the look-back for missed fires, then each instant."""
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
        if self._board is not None:
            self._board.detach(self)
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
            if self._table is not None:  # begun on the claim lane as the term ended
                thread = SCHEDULER.remove(self._table)
                if thread is not None:
                    self._scheduler = thread
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

    # -- task controls ----------------------------------------------------------------

    def _start_persistent(self, spec: TaskSpec, slot: _Persistent) -> None:
        """Start the runs of persistent task ``spec`` under a term of their own."""
        child = slot.term = TaskTerm(self.term)
        if spec.is_async:
            self._submit_async(spec.name, self._supervise_async(spec, child))
        else:
            self._spawn(spec.name, self._supervise_sync, spec, child)

    def _supervise_sync(self, spec: TaskSpec, child: TaskTerm | None) -> None:
        while child is not None:
            try:
                self._runs.supervise_sync(spec, child)
            finally:
                child.release()
            child = self._persistent_ended(spec, child)

    async def _supervise_async(self, spec: TaskSpec, child: TaskTerm | None) -> None:
        task = asyncio.current_task()
        assert task is not None
        while child is not None:
            child.task, child.loop = task, asyncio.get_running_loop()
            try:
                await self._runs.supervise_async(spec, child)
            except asyncio.CancelledError:
                if not child.paused or not self.term.live():
                    raise
                task.uncancel()  # the pause's cancellation, taken: the task may go on
            finally:
                child.release()
            child = self._persistent_ended(spec, child)

    def _persistent_ended(self, spec: TaskSpec, child: TaskTerm) -> TaskTerm | None:
        """The runs of ``spec`` under ``child`` ended: a new term for them when they
        were paused and resumed meanwhile, else ``None`` (they stay stopped while
        paused, and end for good otherwise)."""
        with self._controls:
            slot = self._persistent.get(spec.name)
            if slot is None or slot.term is not child:
                return None
            slot.term = None
            if not child.paused:
                return None
            board = self._board
            if slot.resume and self.term.live() and not (board and board.paused(spec.name)):
                slot.resume = False
                slot.term = TaskTerm(self.term)
                return slot.term
            slot.stopped, slot.resume = True, False
            return None

    def apply_controls(self, controls: TaskControls) -> None:
        """Act on the task controls just read (from the claim lane or the task desk):
        stop the persistent tasks paused, start again those resumed, run the triggers
        not taken yet."""
        triggers: list[Trigger] = []
        with self._dispatch:  # persistent tasks start from here: stop() waits for them
            if not self.term.live():
                return
            with self._controls:
                for spec in self.specs:
                    slot = self._persistent.get(spec.name)
                    if slot is None:
                        continue
                    if spec.name in controls.paused:
                        slot.resume = False
                        if slot.term is not None and not slot.term.paused:
                            logger.info("task %r paused by an operator: its run stops", spec.name)
                            slot.term.pause()
                    elif slot.term is None and slot.stopped:
                        logger.info("task %r resumed by an operator: it starts", spec.name)
                        slot.stopped = False
                        self._start_persistent(spec, slot)
                    elif slot.term is not None and slot.term.paused:
                        slot.resume = True
                for trigger in controls.triggers:
                    if trigger.fire_key not in self._triggers_seen:
                        self._triggers_seen.add(trigger.fire_key)
                        triggers.append(trigger)
        if triggers:
            self._take_triggers(triggers, controls.read_at)

    def _take_triggers(self, triggers: list[Trigger], read_at: datetime | None) -> None:
        """Run each trigger once: claimed first under its own fire key when the term
        claims; dropped from the store once taken (or refused)."""
        board = self._board
        assert board is not None
        specs = {spec.name: spec for spec in self.specs}
        refused: list[str] = []
        for trigger in triggers:
            spec = specs.get(trigger.task)
            if spec is None or spec.type is not TaskType.SCHEDULED:
                logger.warning(
                    "trigger %.120s dropped: %r is not a scheduled task of this leader",
                    trigger.fire_key,
                    trigger.task,
                )
                refused.append(trigger.fire_key)
                continue
            claimer = self.term.claimer
            if claimer is None:
                self._start_trigger(spec, trigger, claimed_at=None)
                continue
            # Judged on the clock that stamped it, the store's (the node's own may be
            # off by any amount), when the store told it.
            now = read_at.timestamp() if read_at is not None else time.time()
            age = now - trigger.requested_at.timestamp()
            if age > _TRIGGER_AGE * claimer.ttl:
                self._reports.skip(
                    spec,
                    trigger.requested_at,
                    "expired",
                    by=OPERATOR,
                    outcome="missed",
                    fire_key=trigger.fire_key,
                )
                refused.append(trigger.fire_key)
                continue
            try:
                self._claims.submit(functools.partial(self._claim_trigger, spec, trigger))
            except RuntimeError:  # the pool is shut down: the term is over
                return
        if refused:
            board.drop_triggers(refused)

    def _claim_trigger(self, spec: TaskSpec, trigger: Trigger) -> None:
        """On the claim lane: claim the trigger's fire; run it if won."""
        board, claimer, key = self._board, self.term.claimer, trigger.fire_key
        assert board is not None and claimer is not None
        if not self.term.live():
            return
        try:
            if isinstance(claimer, LeaseClaims):
                won, failed = claimer.claim_each([key], term=self.term.number)
            else:
                won, failed = claim_each(claimer, [key], term=self.term.number)
        except Exception as exc:
            won, failed = set(), {key: exc}
        if failed:
            logger.warning("trigger %.120s not run yet: its claim failed: %s", key, failed[key])
            with self._controls:
                self._triggers_seen.discard(key)
            board.retry_soon()
            return
        if key in won:
            self._start_trigger(spec, trigger, claimed_at=time.monotonic())
            return
        # Run by another node (a leader before this one) that did not drop it.
        logger.debug("trigger %.120s was claimed before: dropped", key)
        board.drop_triggers([key])

    def _start_trigger(self, spec: TaskSpec, trigger: Trigger, *, claimed_at: float | None) -> None:
        """Start the trigger's fire (claimed at ``claimed_at``, monotonic, when the term
        claims), and drop it from the store once started. While a fire of its task runs
        it waits for it to end (on a thread of its own), never skipped. A term that
        ends first leaves it to the next leader: asked again under a fresh key when
        this term claimed it (the next leader would find its key claimed), unless its
        claim may have expired meanwhile (the next leader may claim and run it)."""
        board = self._board
        assert board is not None
        outcome = self._fire_trigger(spec, trigger)
        if outcome == "busy":
            threading.Thread(
                target=self._trigger_when_free,
                args=(spec, trigger, claimed_at),
                name=f"rselection-trigger-{spec.name}"[:60],
                daemon=True,
            ).start()
            return
        if outcome == "started":
            board.drop_triggers([trigger.fire_key])
            return
        claimer = self.term.claimer
        if claimed_at is None or claimer is None:
            return  # never claimed: the next leader reads and runs it
        if time.monotonic() - claimed_at < _TRIGGER_AGE * claimer.ttl:
            logger.info("trigger %.120s not run: its term ended; asked again", trigger.fire_key)
            board.reissue_trigger(trigger)
        else:
            logger.warning(
                "trigger %.120s not run: its term ended after its claim may have expired",
                trigger.fire_key,
            )

    def _trigger_when_free(
        self, spec: TaskSpec, trigger: Trigger, claimed_at: float | None
    ) -> None:
        """Wait for the fire of ``spec`` that runs to end, then start the trigger's."""
        units = self._units
        with units.cond:
            while self.term.live() and spec.stats.running:
                units.cond.wait(0.1)
        self._start_trigger(spec, trigger, claimed_at=claimed_at)

    def _fire_trigger(self, spec: TaskSpec, trigger: Trigger) -> str:
        """Start the triggered fire (claimed, if the term claims) in a unit of its own:
        ``"started"`` (or on record as not started), ``"busy"`` while a fire of its task
        runs, ``"over"`` when the term is (the trigger is for the next leader)."""
        at, key = trigger.requested_at, trigger.fire_key
        with self._dispatch:  # stop() waits for the units entered here
            if not self.term.live():
                return "over"
            if not self._units.reserve(spec):
                return "busy"
            unit = self._units.enter(spec.name)
            ctx = TaskContext(spec.name, self.term, scheduled_at=at, fire_key=key)
            if spec.is_async:
                self._submit_many([(unit, spec.name, self._trigger_async(unit, spec, ctx), spec)])
                return "started"
            try:
                self._threads.run(functools.partial(self._trigger_sync, unit, spec, ctx))
            except RuntimeError:
                self._units.release(spec, unit)
                if self._threads.closed:
                    return "over"
                self._reports.skip(spec, at, "no-thread", by=OPERATOR, fire_key=key)
            return "started"

    def _trigger_sync(self, unit: int, spec: TaskSpec, ctx: TaskContext) -> None:
        threading.current_thread().name = f"rselection-task-{spec.name}"
        running_term.set(self.term)
        try:
            self._runs.run_sync(spec, ctx, by=OPERATOR)
        finally:
            self._units.release(spec, unit)

    async def _trigger_async(self, unit: int, spec: TaskSpec, ctx: TaskContext) -> None:
        task = asyncio.current_task()
        assert task is not None
        running_term.set(self.term)  # in this task's own context only
        self._async_tasks.add(task)
        try:
            await self._runs.run_async(spec, ctx, by=OPERATOR)
        except asyncio.CancelledError:
            pass
        finally:
            self._async_tasks.discard(task)
            self._units.release(spec, unit)

    def _unpaused(
        self, ready: list[tuple[TaskSpec, list[datetime]]]
    ) -> list[tuple[TaskSpec, list[datetime]]]:
        """``ready`` without the fires of paused tasks, which are skipped (reason
        ``paused``, by the operator)."""
        board = self._board
        if board is None or not board.controls.paused:
            return ready
        kept = []
        for spec, fires in ready:
            if board.paused(spec.name):
                for at in fires:
                    self._reports.skip(spec, at, PAUSED, by=OPERATOR)
            else:
                kept.append((spec, fires))
        return kept

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
        previous fire still runs; nor those of a paused task): at once without a
        claimer, else once claimed (all in one call, see :meth:`TermClaims.claim`)."""
        reserved = []
        for spec, fires in self._unpaused(ready):
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
        unit; with overlap="skip" all are skipped while a run is going (and all while
        the task is paused)."""
        if not self._unpaused([(spec, fires)]):
            return
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
