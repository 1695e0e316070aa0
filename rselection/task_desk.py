"""The process's one thread for task stores: run history written in batches, and the
other round trips of task controls (reads, task lists, dropped triggers).

A run that starts, ends or is skipped never waits for a store: its record goes into a
bounded queue per store (:meth:`TaskDesk.record`), and this thread writes each queue
in batches, one round trip each (:meth:`~rselection.abc.TaskStore.write_runs`): at
most :data:`BATCH` records, :data:`FLUSH_DELAY` seconds after the oldest one waited, at
once when a batch is full. A store that fails loses that batch (logged once until it
works again, and counted): tasks run on, history is best effort. A queue holding
:data:`MAX_PENDING` records drops its oldest (counted). The other jobs (a task
controls read, a task list to publish, triggers to drop) run in order, each when due.
Nothing here is on a lease's renewal path. The thread ends once idle, at once when no
leader uses the desk any more (:meth:`TaskDesk.use`, :meth:`TaskDesk.drain`), else
after :data:`IDLE` seconds; it starts again with the next record or job.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from . import forks

if TYPE_CHECKING:
    from .abc import TaskStore
    from .task_runs import RunRecord

__all__ = ["BATCH", "FLUSH_DELAY", "IDLE", "MAX_PENDING", "DeskCounts", "TaskDesk"]

logger = logging.getLogger(__name__)

FLUSH_DELAY = 0.25
"""Seconds a run record waits at most for its batch (when no batch fills first): how
soon a run shows in its task's history, plus one round trip."""

BATCH = 500
"""Most run records one write carries."""

MAX_PENDING = 10_000
"""Most run records waiting per store; a newer one drops the oldest (counted)."""

IDLE = 5.0
"""Seconds the thread waits with nothing to do before it ends."""

_REPORT_EVERY = 60.0  # seconds between two warnings of the same trouble


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


class _Queue:
    """The run records waiting for one store."""

    def __init__(self, store: TaskStore) -> None:
        self.store = store
        self.runs: deque[RunRecord] = deque()
        self.next_fires: dict[tuple[str, str], datetime | None] = {}
        self.limit = 1
        self.since = 0.0  # when the oldest waiting record came (monotonic)
        self.urgent = False  # written at once (a leader stops)
        self.writing = False
        self.failing = False  # the last write failed (said once)


class TaskDesk(forks.PerProcess):
    """The process's thread for task stores (see the module docstring). Get it with
    :meth:`shared`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[int, _Queue] = {}  # by id() of the store
        self._jobs: list[tuple[float, int, Callable[[], None]]] = []  # a heap by due time
        self._order = itertools.count()
        self._running_job = False
        self._users: set[int] = set()  # id() of the stores of leaders that run
        self._thread: threading.Thread | None = None
        self._dropped_said = -_REPORT_EVERY
        self.counts = DeskCounts()
        """What the desk did (see :class:`DeskCounts`)."""

    # -- what callers hand over ----------------------------------------------------------

    def record(
        self, store: TaskStore, run: RunRecord, *, next_fire: datetime | None, limit: int
    ) -> None:
        """Queue ``run`` for ``store`` (the task's next fire with it), kept to ``limit``
        per task; never blocks on the store."""
        with self._cond:
            queue = self._queues.get(id(store))
            if queue is None:
                queue = self._queues[id(store)] = _Queue(store)
            if not queue.runs:
                queue.since = time.monotonic()
            elif len(queue.runs) >= MAX_PENDING:
                queue.runs.popleft()
                self.counts.dropped += 1
                self._say_dropped()
            queue.runs.append(run)
            queue.next_fires[run.lease, run.task] = next_fire
            queue.limit = limit
            if len(queue.runs) == 1 or len(queue.runs) >= BATCH:
                self._wake()

    def submit(self, job: Callable[[], None], *, delay: float = 0.0) -> None:
        """Run ``job()`` on the desk's thread, ``delay`` seconds from now at the earliest,
        after the jobs due before it (it must catch its own exceptions: one that escapes
        is logged)."""
        with self._cond:
            heapq.heappush(self._jobs, (time.monotonic() + delay, next(self._order), job))
            self._wake()

    def use(self, store: TaskStore) -> None:
        """A leader runs with ``store``: the thread waits :data:`IDLE` seconds for more
        work before it ends (until :meth:`drain`)."""
        with self._cond:
            self._users.add(id(store))

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
            queue.urgent = True
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
                queue.urgent = bool(queue.runs)
            self._wake()
            while self._busy(time.monotonic()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    def pending(self) -> int:
        """Run records waiting to be written, of every store."""
        with self._cond:
            return sum(len(queue.runs) for queue in self._queues.values())

    # -- the thread -----------------------------------------------------------------------

    def _busy(self, now: float) -> bool:
        """Under the lock: records wait, or are being written, or a job due is left."""
        if self._running_job or (self._jobs and self._jobs[0][0] <= now):
            return True
        return any(queue.runs or queue.writing for queue in self._queues.values())

    def _say_dropped(self) -> None:
        now = time.monotonic()
        if now - self._dropped_said >= _REPORT_EVERY:
            self._dropped_said = now
            logger.warning(
                "run history: %d run records dropped so far: the task store does not keep "
                "up (at most %d wait per store; the oldest go first)",
                self.counts.dropped,
                MAX_PENDING,
            )

    def _wake(self) -> None:
        """Under the lock: wake the thread, or start it."""
        self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rselection-tasks", daemon=True)
            self._thread.start()

    def _next(self) -> Callable[[], None] | _Queue | None:
        """Under the lock: the next job or queue to write, waiting for one; ``None`` when
        idle for :data:`IDLE` seconds (the thread then ends)."""
        idle_since = time.monotonic()
        while True:
            now = time.monotonic()
            if self._jobs and self._jobs[0][0] <= now:
                self._running_job = True
                return heapq.heappop(self._jobs)[2]
            wake_at = self._jobs[0][0] if self._jobs else None
            for queue in self._queues.values():
                if not queue.runs or queue.writing:
                    continue
                due = queue.since + FLUSH_DELAY
                if queue.urgent or len(queue.runs) >= BATCH or due <= now:
                    queue.writing = True
                    return queue
                wake_at = due if wake_at is None else min(wake_at, due)
            if wake_at is None:
                if not self._users or now - idle_since >= IDLE:
                    self._thread = None
                    return None
                self._cond.wait(IDLE - (now - idle_since))
            else:
                self._cond.wait(max(0.0, wake_at - now))

    def _run(self) -> None:
        while True:
            with self._cond:
                work = self._next()
            if work is None:
                return
            if isinstance(work, _Queue):
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

    def _write(self, queue: _Queue) -> None:
        """Write one batch of ``queue`` (taken under the lock, written outside it)."""
        with self._cond:
            count = min(BATCH, len(queue.runs))
            runs = [queue.runs.popleft() for _ in range(count)]
            keys = {(run.lease, run.task) for run in runs}
            next_fires = {key: queue.next_fires.pop(key) for key in keys if key in queue.next_fires}
            if queue.runs:
                queue.since = time.monotonic() - FLUSH_DELAY  # the rest is due at once
            else:
                queue.urgent = False
            limit = queue.limit
        ok = False
        try:
            queue.store.write_runs(runs, next_fires=next_fires, limit=limit)
            ok = True
        except Exception as exc:
            if not queue.failing:
                logger.warning(
                    "run history: %d run records not written (%s); tasks run on, and this "
                    "is said again once writes work again and fail anew",
                    len(runs),
                    exc,
                )
            else:
                logger.debug("run history: %d run records not written: %s", len(runs), exc)
        finally:
            with self._cond:
                queue.writing = False
                if ok:
                    if queue.failing:
                        logger.info("run history: writes work again")
                    self.counts.written += len(runs)
                    self.counts.batches += 1
                else:
                    self.counts.lost += len(runs)
                queue.failing = not ok
                self._cond.notify_all()
