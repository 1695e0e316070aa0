"""The process's scheduler: one thread fires the scheduled tasks of every running term.

Each term keeps its own timetable (:class:`Timetable`) and registers it here; one
daemon thread waits for the earliest instant over all timetables, prepares the fires
due then (early, by as long as preparing took the last time) and starts them on the
instant. Nothing that can block runs on that thread (see :mod:`rselection.runtime`), so
a slow schedule, claimer or receiver of one term never delays another term's fires. See
``docs/explanation/sessions.md``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from . import forks

__all__ = ["MAX_LEAD", "SCHEDULER", "Prepared", "Scheduler", "Timetable"]

logger = logging.getLogger(__name__)

MAX_LEAD = 0.05
"""Seconds ahead of an instant at most that its fires are prepared."""

Prepared = tuple[float, Any]
"""Fires prepared for one instant: the instant (``time.time()`` seconds), and what the
timetable needs to start them."""


class Timetable(Protocol):
    """One term's scheduled tasks, as the scheduler drives them.

    Every method but :meth:`prepare_elsewhere` runs on the scheduler's thread and must
    not block; none is called again for a timetable before the last call returned.
    """

    inline: bool
    """Whether :meth:`prepare` may run on the scheduler's thread (else
    :meth:`prepare_elsewhere`)."""
    lead: float
    """Seconds :meth:`prepare_elsewhere` takes, to start it that much ahead."""

    def live(self) -> bool:
        """Whether the term may still fire."""
        ...

    def setup(self) -> None:
        """Compute the first fires (called once, before :meth:`head`, when the timetable
        was added with ``setup=True``)."""
        ...

    def head(self) -> float | None:
        """The next instant a fire is due (``time.time()`` seconds); ``None``: none."""
        ...

    def prepare(self, lead: float) -> Prepared | None:
        """Take the fires due at the next instant if it is at most ``lead`` seconds
        away; ``None`` when it is not (the clock stepped) or nothing is to start."""
        ...

    def prepare_elsewhere(self, lead: float, done: Callable[[Prepared | None], None]) -> None:
        """:meth:`prepare` off the scheduler's thread; then ``done(prepared)``."""
        ...

    def launch(self, prepared: Prepared) -> None:
        """Start fires prepared for their instant, which has come."""
        ...

    def next_cleanup(self) -> float | None:
        """When (:func:`time.monotonic`) :meth:`clean_up` is due; ``None``: never."""
        ...

    def clean_up(self) -> None:
        """Start the periodic clean-up (elsewhere: it must not block)."""
        ...


class Scheduler:
    """Fires every registered :class:`Timetable` from one daemon thread.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "rselection-scheduler") -> None:
        self.name = name
        self._cond = threading.Condition(threading.Lock())
        self._terms: set[Timetable] = set()
        self._setups: list[Timetable] = []
        self._heap: list[tuple[float, int, Timetable]] = []  # (when to prepare, wall)
        self._ready: list[tuple[float, int, Timetable, Prepared]] = []  # (instant, wall)
        self._cleanups: list[tuple[float, int, Timetable]] = []  # (when, monotonic)
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._retired: threading.Thread | None = None  # the last thread let go
        # Seconds the last instant's inline preparation took, twice (at most MAX_LEAD):
        # the next instant is prepared that much ahead and its fires start on it.
        self._lead = 0.0

    def add(self, table: Timetable, *, setup: bool = False) -> None:
        """Fire ``table``'s tasks from now on (``setup``: call its :meth:`~Timetable.setup`
        first, on the scheduler's thread)."""
        with self._cond:
            self._terms.add(table)
            if setup:
                self._setups.append(table)
            else:
                self._schedule(table)
            self._plan_cleanup(table)
            if self._thread is None and self._terms:
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread = thread
                thread.start()
            self._cond.notify()

    def remove(self, table: Timetable) -> threading.Thread | None:
        """Fire nothing more of ``table`` (a launch under way still ends). When it was the
        last one, the thread ends: return it, to join."""
        with self._cond:
            self._terms.discard(table)
            thread = self._retire()
            if thread is None and not self._terms:
                thread = self._retired  # let go already, maybe still ending
            return thread if thread is not None and thread.is_alive() else None

    def running(self) -> bool:
        """Whether the scheduler's thread runs (some timetable is registered)."""
        with self._cond:
            return self._thread is not None

    def _retire(self) -> threading.Thread | None:
        """Under the lock: with no timetable left, let the thread go; return it."""
        if self._terms or self._thread is None:
            return None
        thread, self._thread = self._thread, None
        self._retired = thread
        self._cond.notify()
        return thread

    def _schedule(self, table: Timetable) -> None:
        """Under the lock: queue ``table``'s next instant, or let it go."""
        if table not in self._terms:
            return
        head = table.head() if table.live() else None
        if head is None:
            self._terms.discard(table)
            self._retire()
            return
        lead = self._lead if table.inline else max(self._lead, table.lead)
        heapq.heappush(self._heap, (head - lead, next(self._seq), table))

    def _plan_cleanup(self, table: Timetable) -> None:
        when = table.next_cleanup()
        if when is not None:
            heapq.heappush(self._cleanups, (when, next(self._seq), table))

    def _prepared(self, table: Timetable, prepared: Prepared | None) -> None:
        """Fires of ``table`` prepared (or nothing due yet): start them on their instant."""
        with self._cond:
            if table not in self._terms:
                return
            if prepared is None:
                self._schedule(table)
            else:
                heapq.heappush(self._ready, (prepared[0], next(self._seq), table, prepared))
            self._cond.notify()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                if self._thread is not me:
                    return
                setups, self._setups = self._setups, []
                now, mono = time.time(), time.monotonic()
                starts: list[tuple[Timetable, Prepared]] = []
                while self._ready and self._ready[0][0] <= now:
                    _, _, table, prepared = heapq.heappop(self._ready)
                    if table in self._terms:
                        starts.append((table, prepared))
                preps: list[tuple[Timetable, float]] = []
                while self._heap and self._heap[0][0] <= now:
                    when, _, table = heapq.heappop(self._heap)
                    head = table.head()
                    if table in self._terms and head is not None:
                        preps.append((table, head - when))
                cleans: list[Timetable] = []
                while self._cleanups and self._cleanups[0][0] <= mono:
                    _, _, table = heapq.heappop(self._cleanups)
                    if table in self._terms:
                        cleans.append(table)
                if not (setups or starts or preps or cleans):
                    waits = []
                    if self._ready:
                        waits.append(self._ready[0][0] - now)
                    if self._heap:
                        waits.append(self._heap[0][0] - now)
                    if self._cleanups:
                        waits.append(self._cleanups[0][0] - mono)
                    self._cond.wait(max(0.0, min(waits)) if waits else None)
                    continue
            # The instant's starts first: they are due now, the preparations ahead.
            for table, prepared in starts:
                self._call(table, table.launch, prepared)
                with self._cond:
                    self._schedule(table)
            for table in setups:
                self._call(table, table.setup)
                with self._cond:
                    self._schedule(table)
            for table in cleans:
                self._call(table, table.clean_up)
                with self._cond:
                    if table in self._terms:
                        self._plan_cleanup(table)
            began = time.perf_counter()
            inline = False
            for table, lead in preps:
                if table.inline:
                    inline = True
                    prepared = self._call(table, table.prepare, lead)
                    self._prepared(table, prepared)
                else:
                    done = _Done(self, table)
                    self._call(table, table.prepare_elsewhere, lead, done)
            if inline:
                self._lead = min(MAX_LEAD, 2 * (time.perf_counter() - began))

    def _call(self, table: Timetable, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)``; when it raises, the timetable fires no more (logged)."""
        try:
            return method(*args)
        except Exception:
            logger.exception("the scheduler stops firing a term's tasks: it failed")
            with self._cond:
                self._terms.discard(table)
                self._retire()
            return None

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): no thread runs there, and no
        term was ever started there."""
        self._cond = threading.Condition(threading.Lock())
        self._terms.clear()
        self._setups.clear()
        self._heap.clear()
        self._ready.clear()
        self._cleanups.clear()
        self._thread = None
        self._retired = None


class _Done:
    """Hands an off-thread preparation back to the scheduler."""

    def __init__(self, scheduler: Scheduler, table: Timetable) -> None:
        self.scheduler = scheduler
        self.table = table

    def __call__(self, prepared: Prepared | None) -> None:
        self.scheduler._prepared(self.table, prepared)


SCHEDULER = Scheduler()
"""The process's scheduler."""

forks.register(SCHEDULER)
