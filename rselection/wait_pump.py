"""One thread that watches every lease of the process whose wait for a change can be
taken in steps (a Redis lease), instead of one waiting thread per lease.

:class:`WaitPump`'s thread only selects on the sockets of the watches (:class:`Watch`)
and pops due timers; every step that may block runs on the lease's own lane of the
driver's wait workers, one at a time per lease, and reads a bounded number of messages,
so one slow or flooded lease holds up no other. :meth:`WaitPump.remove` takes a lease's
watch out before each of its calls. See ``docs/explanation/sessions.md``.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import selectors
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from . import forks
from .abc import Watch, Watchable
from .wakeup import Wakeup

__all__ = ["SLACK", "Watch", "Watchable", "WaitPump"]

logger = logging.getLogger("rselection.leader")

SLACK = 0.02
"""Seconds a due step may be late, so that one wake-up of the pump's thread serves the
steps that fall due close together (beats of many leaders) rather than one each."""

_MAX_WAIT = 1.0  # seconds; a timed wait does not count time suspended: look again

LINGER = 10.0
"""Seconds the pump's thread stays, watching no lease, while a lease it watched is out
for a call of its keeper (:meth:`WaitPump.remove`: a renewal, an attempt) or its watch
ended (a change), and may come back. Before, the thread of a process with one lease
ended at every such call and started again right after it, its socket pair and selector
made anew, on the path from a release to the next holder's first task. Once no lease is
out either (each left with :meth:`WaitPump.discard`), the thread ends at once."""


Ended = Callable[[BaseException | None, bool, bool], None]
"""Called when a watch ended: with what its start or step raised, or ``None``; whether
only its slice ran out (no change was seen); and whether a step on the lease's lane
ended it (``False``: the pump could not hand a step to a worker, and calls this from its
own thread, which must not wait for a server or a user's code). The watch is out of the
pump by then."""


@dataclass(slots=True, eq=False)
class _Entry:
    """One lease's watch in the pump. ``removed``, ``running``, ``stepping``,
    ``registered`` and ``version`` are the pump's (under its lock); ``watch`` is the
    worker's."""

    key: object
    lane: Executor
    start: Callable[[], Watch]
    ended: Ended
    slice_end: float
    watch: Watch | None = None
    removed: bool = False  # out of the pump: no more steps
    running: bool = False  # a step runs on a worker now
    stepping: bool = True  # submitted to the lane, or running: not in the selector
    registered: tuple[Any, ...] = ()  # its sockets in the pump's selector
    version: int = 0  # its timer on the heap is current only with this version


class WaitPump(forks.PerProcess):
    """The process's waiting thread for watchable leases; get it with :meth:`shared`.

    Every method is safe from any thread and never calls back into its caller.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._entries: dict[object, _Entry] = {}
        self._ready: list[tuple[_Entry, float]] = []  # back from a step: (entry, due)
        self._dropped: list[_Entry] = []  # removed while in the selector
        self._out: set[object] = set()  # keys removed for a call, not added back yet
        self._thread: threading.Thread | None = None
        self._wakeup = Wakeup()
        self._woken = False  # a wake-up byte is on its way to the pump's thread
        # Steps handed to a lane and not back yet: the pump's thread looks for those back
        # every SLACK seconds (one wake-up for many, not one per step).
        self._stepping = 0
        self._order = itertools.count()

    def add(
        self,
        key: object,
        lane: Executor,
        start: Callable[[], Watch],
        ended: Ended,
        slice_seconds: float,
    ) -> None:
        """Watch ``key``'s lease: ``start()`` on ``lane`` begins a watch, whose steps then
        run on ``lane`` until it ends (``ended`` is called), ``slice_seconds`` pass (so
        is it, saying so) or :meth:`remove`. Replaces a watch of ``key``.

        Raises:
            RuntimeError: ``lane`` was shut down, or no thread could start.
        """
        entry = _Entry(key, lane, start, ended, time.monotonic() + slice_seconds)
        with self._cond:
            self._forget(self._entries.pop(key, None))
            self._out.discard(key)
            self._entries[key] = entry
            if self._thread is None:
                self._wakeup.open()
                thread = threading.Thread(
                    target=self._run, name="rselection-wait-pump", daemon=True
                )
                try:
                    thread.start()
                except BaseException:
                    self._entries.pop(key, None)
                    raise
                self._thread = thread
            self._stepping += 1
        try:
            lane.submit(self._step, entry, frozenset())
        except BaseException:
            with self._cond:
                self._stepping -= 1
                if self._entries.get(key) is entry:
                    self._forget(self._entries.pop(key))
            raise

    def remove(self, key: object) -> None:
        """Stop watching ``key``'s lease; returns once no step of its watch runs (a step
        of another lease is never waited for). Call it from a thread other than the
        lease's lane (a step runs there)."""
        with self._cond:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            self._out.add(key)  # back after the call, most likely: the thread lingers
            self._forget(entry)
            self._cond.wait_for(lambda: not entry.running)

    def discard(self, key: object) -> None:
        """Stop watching ``key``'s lease soon; never blocks (a step under way may end)."""
        with self._cond:
            if key in self._out:
                self._out.discard(key)
                self._wake()  # maybe the last one: the thread ends
            self._forget(self._entries.pop(key, None))

    def watching(self) -> int:
        """How many leases the pump watches now."""
        with self._cond:
            return len(self._entries)

    def _forget(self, entry: _Entry | None) -> None:
        """Under the lock: ``entry`` is out; its sockets leave the selector soon."""
        if entry is None:
            return
        entry.removed = True
        if not entry.stepping:
            self._dropped.append(entry)
            self._wake()

    def _wake(self) -> None:
        """Under the lock: wake the pump's thread (once until it looks)."""
        if not self._woken:
            self._woken = True
            self._wakeup.wake()

    # -- a worker: one step of one lease --------------------------------------------------

    def _step(self, entry: _Entry, readable: frozenset[Any]) -> None:
        with self._cond:
            if entry.removed:
                self._stepping -= 1
                return
            entry.running = True
        outcome: BaseException | None = None
        ended = sliced = False
        due = math.inf
        watch = entry.watch
        began = watch is None
        try:
            if watch is None:
                watch = entry.watch = entry.start()  # may reconnect: here, never on the pump
            else:
                ended = watch.step(readable)
            if not ended:
                due = watch.due()
        except BaseException as exc:  # handed to the lease's owner
            outcome, ended = exc, True
        if not ended and time.monotonic() >= entry.slice_end:
            ended = sliced = True  # the slice is over, as a lease's wait times out
        with self._cond:
            entry.running = False
            self._stepping -= 1
            self._cond.notify_all()
            if entry.removed:
                return  # the remover holds the lease now, and reads it itself
            if ended:
                entry.removed = True
                if self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]
                    self._out.add(entry.key)  # its owner watches again, most likely
                if not self._entries:
                    self._wake()  # nothing is left: the thread ends (or lingers)
            else:
                self._ready.append((entry, min(due, entry.slice_end)))
                if due == -math.inf or began:
                    # More to read now, or a watch just begun (added while the pump's
                    # thread may sleep for up to _MAX_WAIT, not SLACK: its sockets
                    # would go unwatched that long, and a release unseen); else the
                    # pump, which handed this step out, looks within SLACK.
                    self._wake()
        if ended:
            try:
                entry.ended(outcome, sliced, True)
            except Exception:
                logger.exception("wait pump: the end of a wait raised; going on")

    # -- the pump's thread ----------------------------------------------------------------

    def _run(self) -> None:
        heap: list[tuple[float, int, int, _Entry]] = []
        empty_since: float | None = None  # watching nothing since (monotonic)
        with selectors.DefaultSelector() as sel:
            wake = self._wakeup.socket
            assert wake is not None
            sel.register(wake, selectors.EVENT_READ, None)
            while True:
                with self._cond:
                    self._woken = False
                    self._wakeup.clear()
                    now = time.monotonic()
                    if self._entries or self._ready:
                        empty_since = None
                    else:
                        empty_since = now if empty_since is None else empty_since
                        if not self._out or now - empty_since >= LINGER:
                            self._thread = None
                            self._wakeup.close()
                            return
                    ready, self._ready = self._ready, []
                    dropped, self._dropped = self._dropped, []
                    for entry in dropped:
                        _unregister(sel, entry)
                    for entry, due in ready:
                        if entry.removed:
                            continue
                        entry.stepping = False
                        _register(sel, entry)
                        if due < math.inf:
                            heapq.heappush(heap, (due, next(self._order), entry.version, entry))
                    timeout = SLACK if self._stepping else _MAX_WAIT
                if empty_since is not None:  # lingering: end once LINGER has passed
                    timeout = min(timeout, max(0.0, empty_since + LINGER - time.monotonic()))
                if heap:
                    wait = heap[0][0] - time.monotonic()
                    timeout = 0.0 if wait <= 0 else min(timeout, wait + SLACK)
                events = sel.select(timeout)
                due_now: dict[_Entry, set[Any]] = {}
                for selected, _ in events:
                    if selected.data is not None:
                        due_now.setdefault(selected.data, set()).add(selected.fileobj)
                now = time.monotonic()
                while heap and heap[0][0] <= now:
                    _, _, version, entry = heapq.heappop(heap)
                    if version == entry.version:
                        due_now.setdefault(entry, set())
                self._submit(sel, due_now)

    def _submit(self, sel: selectors.BaseSelector, due_now: dict[_Entry, set[Any]]) -> None:
        """Hand the steps that are due to the leases' lanes; their sockets and timers are
        out until the step is back."""
        with self._cond:
            steps: list[tuple[_Entry, frozenset[Any]]] = []
            for entry, readable in due_now.items():
                if entry.stepping:
                    continue
                _unregister(sel, entry)
                if entry.removed:
                    continue
                entry.stepping = True
                entry.version += 1  # its timer on the heap is stale now
                self._stepping += 1
                steps.append((entry, frozenset(readable)))
        for entry, sockets in steps:
            try:
                entry.lane.submit(self._step, entry, sockets)
            except RuntimeError:
                # The lane was shut down (its lease left) or no worker could start: the
                # watch ends; its owner is told, and watches again when it may.
                logger.warning("wait pump: a step could not be handed to a worker")
                with self._cond:
                    self._stepping -= 1
                    if entry.removed:
                        continue
                    entry.removed = True
                    if self._entries.get(entry.key) is entry:
                        del self._entries[entry.key]
                with contextlib.suppress(Exception):
                    entry.ended(None, False, False)


def _register(sel: selectors.BaseSelector, entry: _Entry) -> None:
    watch = entry.watch
    assert watch is not None
    for sock in watch.sockets:
        try:
            sel.register(sock, selectors.EVENT_READ, entry)
        except KeyError:
            # The same descriptor under a socket closed meanwhile (a lease reconnected):
            # that registration is stale.
            with contextlib.suppress(KeyError, ValueError, OSError):
                sel.unregister(sel.get_map()[sock.fileno()].fileobj)
            with contextlib.suppress(KeyError, ValueError, OSError):
                sel.register(sock, selectors.EVENT_READ, entry)
        except (ValueError, OSError):
            continue  # closed meanwhile: the next step (or call) finds it broken
    entry.registered = watch.sockets


def _unregister(sel: selectors.BaseSelector, entry: _Entry) -> None:
    registered, entry.registered = entry.registered, ()
    for sock in registered:
        with contextlib.suppress(KeyError, ValueError, OSError):
            sel.unregister(sock)  # unless closed meanwhile
