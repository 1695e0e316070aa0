"""The process's one thread for task stores: run history written in batches, and the
other round trips of task controls (reads, task lists, dropped triggers).

A run that starts, ends or is skipped never waits for a store, nor for a lock: its
record goes into its leader's queue (:class:`RunQueue`) as a plain tuple, and this
thread turns the records into :class:`~rselection.task_runs.RunRecord` rows and writes
each queue in batches, one round trip each
(:meth:`~rselection.abc.TaskStore.write_runs`): :data:`FLUSH_DELAY` seconds after the
first record waited, at most :data:`BATCH` records each, one batch after another.
A store that fails loses that batch (logged once until it works again, and
counted): tasks run on, history is best effort. A queue holding :data:`MAX_PENDING`
records drops its oldest (counted). The other jobs (a task controls read, a task list
to publish, triggers to drop) run in order, each when due. Nothing here is on a
lease's renewal path. The thread ends once idle: at once when no leader uses the desk
any more (:meth:`TaskDesk.use`, :meth:`TaskDesk.drain`), else after :data:`IDLE`
seconds; it starts again with the next record or job.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from .process_thread import ProcessThread
from .task_runs import RunRecord

if TYPE_CHECKING:
    from .abc import TaskStore


class _Stats(Protocol):
    @property
    def next_fire(self) -> datetime | None: ...


class RunTask(Protocol):
    """What the desk reads of a registered task (a :class:`~rselection.specs.TaskSpec`)
    when it writes its runs: its name, and its next fire if it is scheduled."""

    @property
    def name(self) -> str: ...

    @property
    def schedule(self) -> object | None: ...

    @property
    def stats(self) -> _Stats: ...


__all__ = [
    "BATCH",
    "ControlsDesk",
    "FLUSH_DELAY",
    "IDLE",
    "MAX_PENDING",
    "DeskCounts",
    "RunQueue",
    "TaskDesk",
    "Noted",
]

logger = logging.getLogger(__name__)

FLUSH_DELAY = 0.25
"""Seconds a run record waits at most for its batch (when no batch fills first): how
soon a run shows in its task's history, plus one round trip."""

BATCH = 500
"""Most run records one write carries."""

MAX_PENDING = 10_000
"""Most run records waiting per leader; a newer one drops the oldest (counted)."""

IDLE = 5.0
"""Seconds the thread waits with nothing to do before it ends (while a leader uses it)."""

_REPORT_EVERY = 60.0  # seconds between two warnings of the same trouble

Noted = tuple[
    RunTask,  # the task (its next fire is read when the batch is written)
    str,  # the lease
    "datetime | None",  # scheduled_at
    "float | None",  # started (time.time())
    "float | None",  # ended (time.time())
    str,  # outcome
    "str | None",  # reason
    str,  # node_id
    int,  # term
    "str | None",  # error
    "str | None",  # by
]
"""A run as noted on the hot path: a plain tuple, made a record on the desk's thread."""


def _at(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _record(noted: Noted) -> RunRecord:
    spec, lease, scheduled, started, ended, outcome, reason, node, term, error, by = noted
    return RunRecord(
        lease, spec.name, scheduled, _at(started), _at(ended), outcome, reason, node, term,
        error, by,
    )  # fmt: skip


class DeskCounts:
    """What the desk did since the process started (read by tests and benchmarks).

    Attributes:
        written: run records written.
        batches: writes of run records (round trips).
        dropped: run records dropped because their queue was full.
        lost: run records lost with a write that failed.
    """

    def __init__(self) -> None:
        self.written = 0
        self.batches = 0
        self.dropped = 0
        self.lost = 0


class RunQueue:
    """The runs of one leader waiting for the desk (see :meth:`TaskDesk.queue`).

    :meth:`add` takes no lock: the desk is told only when the queue goes from empty to
    waiting. It writes them :data:`FLUSH_DELAY` later, a full batch not sooner: the
    fires due at one instant start first (the desk's work would contend with theirs),
    then their runs are written in batches, one after another.
    """

    def __init__(self, desk: TaskDesk, store: TaskStore, limit: int) -> None:
        self.desk = desk
        self.store = store
        self.limit = limit
        self.runs: deque[Noted] = deque()
        self.armed = False  # the desk knows runs wait (or is writing them)
        self.due = 0.0  # when to write what waits (monotonic)
        self.writing = False
        self.failing = False  # the last write failed (said once)

    def add(self, noted: Noted) -> None:
        """Queue a run (from any thread; never blocks)."""
        runs = self.runs
        if len(runs) >= MAX_PENDING:
            try:
                runs.popleft()
            except IndexError:  # the desk took them meanwhile
                pass
            else:
                self.desk.dropped_one()
        runs.append(noted)
        # Appended before looking, as the desk clears the flag before it looks at the
        # queue: one of the two always sees the other's doing.
        if not self.armed:
            self.armed = True
            self.desk.kick(self, FLUSH_DELAY)


class TaskDesk(ProcessThread):
    """The process's thread for task stores (see the module docstring). Get it with
    :meth:`shared`."""

    THREAD_NAME = "rselection-tasks"

    def __init__(self) -> None:
        super().__init__()
        self._queues: dict[int, RunQueue] = {}  # by id() of the store
        self._jobs: list[tuple[float, int, Callable[[], None]]] = []  # a heap by due time
        self._order = itertools.count()
        self._running_job = False
        self._job_last = False  # the last work taken was a job (see _next)
        self._users: set[int] = set()  # id() of the stores of leaders that run
        self._dropped_said = -_REPORT_EVERY
        self.counts = DeskCounts()
        """What the desk did (see :class:`DeskCounts`)."""

    # -- what callers hand over ----------------------------------------------------------

    def queue(self, store: TaskStore, limit: int) -> RunQueue:
        """The queue of the runs for ``store``, kept to ``limit`` per task."""
        with self._cond:
            found = self._queues.get(id(store))
            if found is None:
                found = self._queues[id(store)] = RunQueue(self, store, limit)
            found.limit = limit
            return found

    def kick(self, queue: RunQueue, delay: float) -> None:
        """Write ``queue`` within ``delay`` seconds (or sooner, if due sooner)."""
        with self._cond:
            due = time.monotonic() + delay
            if not queue.writing and (queue.due <= 0 or due < queue.due):
                queue.due = due
            self._wake()

    def dropped_one(self) -> None:
        """A run was dropped from a full queue: count it (said at most once a minute)."""
        with self._cond:
            self.counts.dropped += 1
            now = time.monotonic()
            if now - self._dropped_said < _REPORT_EVERY:
                return
            self._dropped_said = now
        logger.warning(
            "run history: %d run records dropped so far: the task store does not keep up "
            "(at most %d wait per leader; the oldest go first)",
            self.counts.dropped,
            MAX_PENDING,
        )

    def submit(self, job: Callable[[], None], *, delay: float = 0.0) -> None:
        """Run ``job()`` on the desk's thread, ``delay`` seconds from now at the earliest,
        after the jobs due before it (it must catch its own exceptions: one that escapes
        is logged)."""
        with self._cond:
            heapq.heappush(self._jobs, (time.monotonic() + delay, next(self._order), job))
            self._wake()

    def use(self, store: TaskStore) -> None:
        """A term runs with ``store``: the thread waits :data:`IDLE` seconds for more
        work before it ends (until :meth:`release` or :meth:`drain`)."""
        with self._cond:
            self._users.add(id(store))

    def release(self, store: TaskStore) -> None:
        """The leader of ``store`` leads no term now: once idle, the thread may end."""
        with self._cond:
            self._users.discard(id(store))
            self._cond.notify_all()

    def drain(self, store: TaskStore, timeout: float) -> bool:
        """Write what waits for ``store`` now and wait up to ``timeout`` seconds for it to
        be written (or lost); whether it was. Then forget the store (its leader
        stopped)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._users.discard(id(store))
            self._cond.notify_all()  # an idle thread may end now
            queue = self._queues.get(id(store))
            if queue is None:
                return True
            queue.due = time.monotonic()
            self._wake()
            while queue.runs or queue.writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            if self._queues.get(id(store)) is queue:
                del self._queues[id(store)]
            return True

    def flush(self, timeout: float) -> bool:
        """Write every record waiting and run every job due now; wait up to ``timeout``
        seconds for them (tests and benchmarks); whether all were done."""
        deadline = time.monotonic() + timeout
        with self._cond:
            for queue in self._queues.values():
                if queue.runs:
                    queue.due = time.monotonic()
            self._wake()
            while self._busy(time.monotonic()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    def pending(self) -> int:
        """Run records waiting to be written, of every leader."""
        with self._cond:
            return sum(len(queue.runs) for queue in self._queues.values())

    # -- the thread -----------------------------------------------------------------------

    def _busy(self, now: float) -> bool:
        """Under the lock: records wait, or are being written, or a job due is left."""
        if self._running_job or (self._jobs and self._jobs[0][0] <= now):
            return True
        return any(queue.runs or queue.writing for queue in self._queues.values())

    def _wake(self) -> None:
        """Under the lock: wake the thread, or start it."""
        self._cond.notify_all()
        self._start_thread()

    def _next(self) -> Callable[[], None] | RunQueue | None:
        """Under the lock: the next job or queue to write, waiting for one; ``None`` when
        idle (the thread then ends)."""
        idle_since = time.monotonic()
        while True:
            now = time.monotonic()
            job_due = bool(self._jobs) and self._jobs[0][0] <= now
            # Jobs and batches take turns when both are due: a stream of jobs (reads a
            # flood of notifications asks for) never starves the run history's writes.
            if job_due and not self._job_last:
                return self._pop_job()
            wake_at = self._jobs[0][0] if self._jobs else None
            for queue in self._queues.values():
                if queue.writing or not queue.armed:
                    continue
                if queue.due <= now:
                    queue.writing = True
                    self._job_last = False
                    return queue
                wake_at = queue.due if wake_at is None else min(wake_at, queue.due)
            if job_due:
                return self._pop_job()
            if wake_at is None:
                if not self._users or now - idle_since >= IDLE:
                    self._thread = None
                    return None
                self._cond.wait(IDLE - (now - idle_since))
            else:
                self._cond.wait(max(0.0, wake_at - now))

    def _pop_job(self) -> Callable[[], None]:
        """Under the lock: the job due first, marked running."""
        self._running_job = self._job_last = True
        return heapq.heappop(self._jobs)[2]

    def _run(self) -> None:
        while True:
            with self._cond:
                work = self._next()
            if work is None:
                return
            if isinstance(work, RunQueue):
                self._write(work)
                continue
            try:
                work()
            except Exception:
                logger.exception("task store: a job failed")
            finally:
                with self._cond:
                    self._running_job = False
                    self._cond.notify_all()

    def _take(self, queue: RunQueue) -> list[Noted]:
        """Up to :data:`BATCH` runs of ``queue``, oldest first."""
        taken: list[Noted] = []
        runs = queue.runs
        while len(taken) < BATCH:
            try:
                taken.append(runs.popleft())
            except IndexError:
                break
        return taken

    def _write(self, queue: RunQueue) -> None:
        """Write one batch of ``queue`` (taken and written outside the lock)."""
        noted = self._take(queue)
        ok = False
        try:
            if noted:
                runs = [_record(one) for one in noted]
                next_fires = {
                    (lease, spec.name): spec.stats.next_fire if spec.schedule is not None else None
                    for spec, lease, *_ in noted
                }
                queue.store.write_runs(runs, next_fires=next_fires, limit=queue.limit)
            ok = True
        except Exception as exc:
            if not queue.failing:
                logger.warning(
                    "run history: %d run records not written (%s); tasks run on, and this "
                    "is said again once writes work again and fail anew",
                    len(noted),
                    exc,
                )
            else:
                logger.debug("run history: %d run records not written: %s", len(noted), exc)
        finally:
            with self._cond:
                queue.writing = False
                if ok and noted:
                    if queue.failing:
                        logger.info("run history: writes work again")
                    self.counts.written += len(noted)
                    self.counts.batches += 1
                elif not ok:
                    self.counts.lost += len(noted)
                queue.failing = not ok
                # Cleared before looking at the queue, as a run is appended before its
                # adder looks at the flag (see RunQueue.add).
                queue.armed = False
                if queue.runs:
                    # A full batch waits no more: its runs waited already.
                    queue.armed = True
                    full = len(queue.runs) >= BATCH
                    queue.due = time.monotonic() + (0.0 if full else FLUSH_DELAY)
                else:
                    queue.due = 0.0
                self._cond.notify_all()


class ControlsDesk(TaskDesk):
    """The process's thread for the reads of task controls: a lane of their own, so
    that a pause never waits behind a run history write the store is slow to take (jobs
    only: no run is queued here). Get it with :meth:`shared`."""

    THREAD_NAME = "rselection-task-controls"
