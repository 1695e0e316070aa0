"""One thread that drives every leader of the process.

A leader has no keeper or watchdog thread of its own. The process's
:class:`LeaseDriver` calls each leader's step when it is due (a renewal, an attempt, a
deadline) or was woken, and a step never blocks: round trips are answered on another
thread (:meth:`LeaseDriver.call`), and whatever may block (connecting, ending a term,
releasing, user receivers) moves to a thread of the driver's pool, one at a time per
leader. The deadline is enforced by the driver's thread itself, which never waits for
I/O or a user's code. See ``docs/explanation/sessions.md`` for the threads it keeps.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Protocol

from . import clock, forks
from .daemon_pool import DaemonExecutor, Lane, SharedPool
from .task_threads import TaskThreads

__all__ = [
    "IDLE_TIMEOUT",
    "MOST_WORKERS",
    "STUCK_AFTER",
    "WAIT_STUCK_AFTER",
    "WAIT_WORKERS",
    "WORKERS",
    "Driven",
    "LeaseDriver",
]

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = 10.0
"""Seconds an idle thread ending a term waits for another before it ends."""

WORKERS = 8
"""The most threads that run leaders' steps that may block (connecting, beginning a
term, releasing, the receivers of ``elected``, ``demoted`` and ``leader_changed``) at
once, not counting stuck ones (see :data:`STUCK_AFTER`). Ends of terms that a deadline
or a stop forced never wait for one: each gets a thread at once."""

STUCK_AFTER = 1.0
"""Seconds after which a running step no longer counts against :data:`WORKERS`."""

MOST_WORKERS = 256
"""The most worker threads, stuck or not (only steps stuck in users' receivers or on a
silent server make more than :data:`WORKERS` run)."""

WAIT_WORKERS = 4
"""The most threads that run the steps of leases' waits (:mod:`rselection.wait_pump`:
reading a lease's messages, reconnecting) at once, not
counting stuck ones (see :data:`WAIT_STUCK_AFTER`)."""

WAIT_STUCK_AFTER = 0.25
"""Seconds after which a running step of a wait no longer counts against
:data:`WAIT_WORKERS`. Such a step takes a round trip on a healthy server; one that
takes longer waits for a server that hangs, and the other leases' steps get another
thread soon (up to :data:`MOST_WORKERS`), so a hung server delays them this long at
most."""

_MAX_WAIT = 1.0  # a timed wait does not count time suspended: look again this often
_RETRY_AFTER_ERROR = 0.1  # seconds before a step that raised is called again


class Driven(Protocol):
    """Something the driver steps: a leader over a non-blocking lease."""

    def drive(self, now: float) -> float | None:
        """One step that never blocks, at :func:`rselection.clock.monotonic` ``now``;
        return when to be called next (sooner on :meth:`LeaseDriver.poke`), or ``None``
        to be forgotten."""


class LeaseDriver(forks.PerProcess):
    """The process's driver of non-blocking leaders; get it with :meth:`shared`.

    Every method is safe from any thread.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[Driven, float] = {}  # each item's next call (the heap may be stale)
        self._heap: list[tuple[float, int, Driven]] = []
        self._order = itertools.count()
        self._poked: dict[Driven, None] = {}  # ordered: first poked, first stepped
        self._calls: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._pools: _Pools | None = None
        # Kept for the process's life: its idle workers end once no lane is open.
        self._work = SharedPool(
            "rselection-driver-work", WORKERS, most=MOST_WORKERS, stuck_after=STUCK_AFTER
        )
        # The wait workers, one pool per server (see wait_lane); kept for the process's
        # life, as their idle workers end.
        self._wait_pools: dict[object, SharedPool] = {}

    def add(self, item: Driven) -> None:
        """Step ``item`` at once, then whenever it asks.

        Raises:
            RuntimeError: the driver's thread cannot start (out of threads or memory).
        """
        self.poke(item)

    def poke(self, item: Driven) -> None:
        """Step ``item`` as soon as possible (it is added if it is not known yet)."""
        with self._cond:
            self._poked[item] = None
            self._start()
            self._cond.notify()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the driver's thread soon (it must not block; one that raises
        is logged)."""
        with self._cond:
            self._calls.append(fn)
            self._start()
            self._cond.notify()

    def lane(self) -> Lane:
        """A leader's own queue of steps that may block: they run in order, one at a time,
        on the driver's workers (at most :data:`WORKERS` that are not stuck; a step
        running for :data:`STUCK_AFTER` seconds, a slow receiver say, no longer counts,
        so one leader's slow step never holds up the others'). Shut it down when done.
        """
        return self._work.lane(1)

    def wait_lane(self, server: object = None) -> Lane:
        """A lease's own queue of the steps of its waits (:mod:`rselection.wait_pump`),
        one at a time, on the driver's wait workers of ``server`` (the lease's server, or
        ``None`` for one pool of the leases that name none). A step stuck on a hung
        server counts as stuck after :data:`WAIT_STUCK_AFTER` (not :data:`STUCK_AFTER`),
        and steps stuck on one server fill that server's pool only: the leases of
        another server never queue behind them. Shut it down when done."""
        with self._cond:
            pool = self._wait_pools.get(server)
            if pool is None:
                pool = self._wait_pools[server] = SharedPool(
                    "rselection-driver-wait",
                    WAIT_WORKERS,
                    most=MOST_WORKERS,
                    stuck_after=WAIT_STUCK_AFTER,
                )
        return pool.lane(1)

    def urgent(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` (the end of a term that must not wait for a worker) on a thread
        of its own, reused when idle; it must catch its own exceptions.

        Raises:
            RuntimeError: no thread could start (``fn`` does not run).
        """
        self._pools_now().urgent.run(fn)

    def notify(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` (signals to users' receivers, which may be slow) on the driver's
        one signal thread, in order; it must catch its own exceptions."""
        self._pools_now().signals.submit(fn)

    def _pools_now(self) -> _Pools:
        with self._cond:
            if self._pools is None:
                self._pools = _Pools()
            return self._pools

    def on_thread(self) -> bool:
        """True on the driver's own thread."""
        return threading.current_thread() is self._thread

    def _start(self) -> None:
        """Under the lock: start the driver's thread unless it runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        thread = threading.Thread(target=self._run, name="rselection-driver", daemon=True)
        thread.start()
        self._thread = thread

    def _run(self) -> None:
        while True:
            with self._cond:
                work = self._wait()
                if work is None:
                    self._thread = None
                    return
            calls, items = work
            for fn in calls:
                try:
                    fn()
                except Exception:  # never let the driver die: it enforces deadlines
                    logger.exception("driver: a hand-over raised; going on")
            now = clock.monotonic()
            for item in items:
                try:
                    after = item.drive(now)
                except Exception:
                    logger.exception("driver: a leader's step raised; it is stepped again soon")
                    after = now + _RETRY_AFTER_ERROR
                with self._cond:
                    if after is None:
                        self._due.pop(item, None)
                        self._poked.pop(item, None)
                    elif item not in self._poked:
                        self._due[item] = after
                        heapq.heappush(self._heap, (after, next(self._order), item))

    def _wait(self) -> tuple[list[Callable[[], None]], list[Driven]] | None:
        """Under the lock: wait for calls, pokes or items due; ``None`` when the thread
        may end (nothing is driven any more: the pool's idle threads end too)."""
        while True:
            now = clock.monotonic()
            self._drop_stale()
            due: list[Driven] = list(self._poked)
            self._poked.clear()
            while self._heap and self._heap[0][0] <= now:
                _, _, item = heapq.heappop(self._heap)
                if item not in due:
                    due.append(item)
                self._due.pop(item, None)
                self._drop_stale()
            if due or self._calls:
                calls, self._calls = self._calls, []
                for item in due:
                    self._due.pop(item, None)
                return calls, due
            if not self._due:
                # Nothing left to drive (every leader stopped): no thread is left behind.
                if self._pools is not None:
                    self._pools.close()
                    self._pools = None
                return None
            self._cond.wait(min(_MAX_WAIT, self._heap[0][0] - now))

    def _drop_stale(self) -> None:
        """Under the lock: pop heap entries that no longer are their item's next call."""
        while self._heap:
            at, _, item = self._heap[0]
            if self._due.get(item) == at:
                return
            heapq.heappop(self._heap)


class _Pools:
    """The driver's threads for what may block (see :class:`LeaseDriver`)."""

    def __init__(self) -> None:
        self.urgent = TaskThreads("rselection-driver-end", idle_timeout=IDLE_TIMEOUT)
        self.signals = DaemonExecutor(1, "rselection-driver-signals")

    def close(self) -> None:
        """End the idle threads; work that still runs finishes on its thread."""
        self.urgent.close(0.0)
        self.signals.shutdown(wait=False)
