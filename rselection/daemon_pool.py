"""An executor whose threads never hold up the interpreter's exit.

The standard :class:`~concurrent.futures.ThreadPoolExecutor` joins its workers when the
interpreter exits. A term's claims run on such a pool so that the term's end never waits
for a claim stuck on a dead connection; but a stuck claim then kept the whole process
from exiting after ``stop()`` had returned (a Redis client without a socket timeout waits
forever). These workers are daemon threads that nothing joins at exit: what a stuck
claim still does is abandoned, as the term that asked for it already was.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from . import forks

__all__ = ["DaemonExecutor", "Lane", "SharedPool"]

_T = TypeVar("_T")
_Item = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class SharedPool:
    """Daemon worker threads shared by many users, each served through a :class:`Lane`.

    Fair: a lane has at most ``limit`` calls running at once (its others wait in its
    own queue, in order), and the workers serve the lanes with runnable calls in turn.
    Bounded: the pool starts workers on demand, up to ``workers`` that are not stuck; a
    worker whose call has run for ``stuck_after`` seconds or more (a dead connection)
    no longer counts against that, so more may start, up to ``most`` threads in all. So
    a lane whose calls hang holds at most ``limit`` workers, and the others' calls go on.
    Idle workers end after ``idle_timeout`` seconds, and at once when no lane is open.

    Args:
        prefix: the threads' name prefix.
        workers: the most workers that are not stuck.
        most: the most workers, stuck or not.
        stuck_after: seconds after which a running call counts as stuck.
        idle_timeout: seconds an idle worker waits for a call before it ends.
    """

    def __init__(
        self,
        prefix: str,
        workers: int,
        *,
        most: int,
        stuck_after: float = 1.0,
        idle_timeout: float = 10.0,
    ) -> None:
        if not 1 <= workers <= most:
            raise ValueError(f"need 1 <= workers <= most, got {workers} and {most}")
        self.prefix = prefix
        self.workers = workers
        self.most = most
        self.stuck_after = stuck_after
        self.idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._ready: collections.deque[Lane] = collections.deque()  # lanes with a runnable call
        self._busy: dict[threading.Thread, float] = {}  # running a call since (monotonic)
        self._idle: list[_Idle] = []  # waiting for a call, the latest last
        self._promised = 0  # workers woken or started for a call, not there yet
        self._promised_new = 0  # of which started, not running yet
        self._standby = False  # a worker waits for busy ones to count as stuck
        self._ending: set[threading.Thread] = set()  # workers told to end, or ending
        self._queued = 0  # calls waiting in the lanes
        self._open = 0  # lanes open
        self._names = itertools.count()
        forks.register(self)

    def lane(self, limit: int) -> Lane:
        """A new lane: an :class:`Executor` whose calls run here, ``limit`` at a time."""
        return Lane(self, limit)

    def threads(self) -> int:
        """Workers alive now."""
        with self._lock:
            return self._alive()

    def step_aside(self) -> None:
        """Called on a worker about to run something that may take long (a user's code):
        from now on it counts as stuck, so a call waiting for a worker gets another at
        once rather than after ``stuck_after``. Does nothing on any other thread."""
        me = threading.current_thread()
        with self._lock:
            since = self._busy.get(me)
            if since is None:
                return
            self._busy[me] = min(since, time.monotonic() - self.stuck_after)
            start = self._ensure()
        self._start(start)

    def _submit(self, lane: Lane, item: _Item) -> None:
        with self._lock:
            if lane._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            lane._items.append(item)
            self._queued += 1
            self._mark_ready(lane)
            start = self._ensure()
        self._start(start)

    def _ensure(self) -> tuple[int, bool]:
        """Under the lock: wake idle workers for the runnable calls; return how many
        workers to start for the rest (counted as alive already), and whether to start
        the standby too."""
        start, standby = 0, False
        while len(self._ready) > self._promised:
            if self._idle:
                idle = self._idle.pop()
                idle.woken = True
                self._busy[idle.thread] = time.monotonic()  # counted until it looks
                idle.event.set()
            elif self._may_grow():
                self._promised_new += 1
                start += 1
            else:
                if not self._standby and self._alive() < self.most:
                    # Busy workers may be stuck: one more waits until they count as such.
                    self._standby = standby = True
                break  # else a busy worker takes it when it is done
            self._promised += 1
        return start, standby

    def _start(self, started: tuple[int, bool]) -> None:
        """Start the workers :meth:`_ensure` counted."""
        count, standby_too = started
        for index in range(count + standby_too):
            standby = index == count
            thread = threading.Thread(
                target=self._stand_by if standby else self._work,
                name=f"{self.prefix}_{next(self._names)}",
                daemon=True,
            )
            try:
                thread.start()
            except BaseException:
                with self._lock:
                    if standby:
                        self._standby = False
                    else:
                        self._promised_new -= 1
                        self._promised -= 1
                raise

    def _alive(self) -> int:
        return len(self._busy) + len(self._idle) + self._promised_new + self._standby

    def _stand_by(self) -> None:
        """The standby worker: wait while calls wait and every busy worker that counts
        is not stuck yet; when one is, become a worker (or end when nothing waits)."""
        while True:
            with self._lock:
                self._standby = False  # not counted while it looks
                if not self._ready:
                    return
                if self._may_grow():
                    self._promised_new += 1
                    self._promised += 1
                    break
                now = time.monotonic()
                young = [since for since in self._busy.values() if now - since < self.stuck_after]
                if not young:
                    return  # the pool is full of stuck workers: nothing more to do
                self._standby = True
                wait = min(young) + self.stuck_after - now
            time.sleep(max(0.001, wait))
        self._work()

    def _may_grow(self) -> bool:
        """Under the lock: whether another worker may start."""
        alive = self._alive()
        if alive >= self.most:
            return False
        if alive < self.workers:
            return True
        now = time.monotonic()
        stuck = sum(1 for since in self._busy.values() if now - since >= self.stuck_after)
        return alive - stuck < self.workers

    def _mark_ready(self, lane: Lane) -> None:
        """Under the lock: queue ``lane`` for the workers if it has a call it may run."""
        if not lane._ready and lane._items and lane._running < lane.limit:
            lane._ready = True
            self._ready.append(lane)

    def _take(self) -> tuple[Lane, _Item] | None:
        """Under the lock: the next call to run, the lanes served in turn."""
        if not self._ready:
            return None
        lane = self._ready.popleft()
        lane._ready = False
        item = lane._items.popleft()
        self._queued -= 1
        lane._running += 1
        self._mark_ready(lane)  # to the back of the line, if it may run another
        return lane, item

    def _close(self, lane: Lane, cancel: bool) -> list[_Item]:
        with self._lock:
            if lane._closed:
                return []
            lane._closed = True
            self._open -= 1
            dropped: list[_Item] = []
            if cancel:
                dropped = list(lane._items)
                lane._items.clear()
                self._queued -= len(dropped)
                if lane._ready:
                    self._ready.remove(lane)
                    lane._ready = False
            retired: list[_Idle] = []
            if not self._open and not self._queued:
                retired, self._idle = self._idle, []
            for idle in retired:
                self._ending.add(idle.thread)
                idle.event.set()  # not woken: it ends
            return dropped

    def quiesce(self, timeout: float) -> None:
        """When no lane is open: wait up to ``timeout`` seconds for the workers that are
        not running a call to end (those running one end after it)."""
        with self._lock:
            if self._open:
                return
            ending = list(self._ending)
        deadline = time.monotonic() + timeout
        for thread in ending:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _work(self) -> None:
        me = threading.current_thread()
        promised = True  # started for a call
        with self._lock:
            self._promised_new -= 1
            self._busy[me] = time.monotonic()
        try:
            while True:
                with self._lock:
                    if promised:
                        self._promised -= 1
                        promised = False
                    taken = self._take()
                    if taken is None:
                        self._busy.pop(me, None)
                        if not self._open and not self._queued:
                            self._ending.add(me)
                            return
                        idle = _Idle(me)
                        self._idle.append(idle)
                    else:
                        self._busy[me] = time.monotonic()
                        start = self._ensure()  # the lane may run another, or others wait
                if taken is None:
                    if not self._wait(idle):
                        return
                    promised = True
                    continue
                self._start(start)
                lane, item = taken
                _run_item(item)
                del item
                with self._lock:
                    lane._running -= 1
                    self._mark_ready(lane)
        finally:
            with self._lock:
                self._busy.pop(me, None)
                self._ending.discard(me)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): none of the parent's workers
        runs there, and the calls its lanes queued are the parent's (a term's claims):
        the child's workers never run them."""
        self._lock = threading.Lock()
        self._ready.clear()
        self._queued = 0
        self._busy.clear()
        self._idle.clear()
        self._ending.clear()
        self._promised = self._promised_new = 0
        self._standby = False

    def _wait(self, idle: _Idle) -> bool:
        """Wait for a call; whether this worker goes on (else it ends)."""
        idle.event.wait(self.idle_timeout)
        with self._lock:
            if idle.woken:
                return True
            if idle in self._idle:  # timed out: nobody promised it a call
                self._idle.remove(idle)
            self._ending.add(idle.thread)
            return False


class _Idle:
    """A worker waiting for a call."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.event = threading.Event()
        self.woken = False  # set (under the pool's lock) when a call is promised to it


class Lane(Executor):
    """One user's share of a :class:`SharedPool`: its calls run in order, at most
    ``limit`` at a time (see :meth:`SharedPool.lane`).

    Args:
        pool: the pool.
        limit: the most calls of this lane running at once.
    """

    def __init__(self, pool: SharedPool, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.pool = pool
        self.limit = limit
        # The fields below belong to the pool, under its lock.
        self._items: collections.deque[_Item] = collections.deque()
        self._running = 0
        self._ready = False  # in the pool's line of lanes with a runnable call
        self._closed = False
        with pool._lock:
            pool._open += 1

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        """Run ``fn(*args, **kwargs)`` on the pool, after this lane's earlier calls got a
        worker; its :class:`Future`.

        Raises:
            RuntimeError: after :meth:`shutdown`, or when no thread can start.
        """
        future: Future[_T] = Future()
        self.pool._submit(self, (future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; with ``cancel_futures`` cancel those not started yet (the
        others still run). ``wait`` is ignored: a call in a worker is never waited for."""
        for future, _, _, _ in self.pool._close(self, cancel_futures):
            future.cancel()


class DaemonExecutor(Lane):
    """Runs submitted calls on at most ``max_workers`` daemon threads, started on demand
    (named ``<thread_name_prefix>_<n>``): the one lane of a :class:`SharedPool` of its own.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(SharedPool(thread_name_prefix, max_workers, most=max_workers), max_workers)


def _run_item(item: _Item) -> None:
    """Run a submitted call and settle its future (unless it was cancelled)."""
    future, fn, args, kwargs = item
    if future.set_running_or_notify_cancel():
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller, as an executor does
            future.set_exception(exc)
        else:
            future.set_result(result)
