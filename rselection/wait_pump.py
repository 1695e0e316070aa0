"""One thread that waits for a change in every lease of the process that can be waited on
in steps (a Redis lease), instead of one waiting thread per lease.

A lease offers such waits with ``watch_for_change()``, which returns a :class:`Watch`:
the sockets to watch, when it is next due (a liveness beat to send, a holder's
connection to check), and a step that reads what came and says whether the wait ended.
:class:`WaitPump` runs the steps of every watch in one selector. The lease's owner
(:class:`~rselection.blocking_lease.BlockingLease`) takes a watch out with
:meth:`WaitPump.remove` before each of its calls, which returns once the pump no longer
steps it, so the lease still sees one caller at a time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from . import forks
from .wakeup import Wakeup

__all__ = ["Watch", "Watchable", "WaitPump"]

logger = logging.getLogger("rselection.leader")

_MAX_WAIT = 1.0  # seconds; a timed wait does not count time suspended: look again


class Watch(Protocol):
    """One wait for a change, in steps (see the module docstring)."""

    sockets: tuple[Any, ...]
    """The sockets to watch for reading (fixed for the watch's life)."""

    def due(self) -> float:
        """The monotonic time at which :meth:`step` is due even with nothing to read."""

    def step(self, readable: set[Any]) -> bool:
        """Read the ``readable`` sockets, do what is due; ``True`` when the wait ended
        (the lease may have changed). Raises what the lease's wait would raise."""


@runtime_checkable
class Watchable(Protocol):
    """A lease whose wait for a change can be stepped by :class:`WaitPump`."""

    def watch_for_change(self) -> Watch:
        """Begin a wait (may raise what the lease's wait would raise)."""


Ended = Callable[[BaseException | None], None]
"""Called on the pump's thread when a watch ended: ``None`` early (a change), or with
what its step raised. The watch is out of the pump by then."""


@dataclass
class _Entry:
    watch: Watch
    ended: Ended


class WaitPump:
    """The process's waiting thread for watchable leases; get it with :meth:`shared`.

    Every method is safe from any thread.
    """

    _shared: ClassVar[WaitPump | None] = None
    _shared_pid = 0
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._entries: dict[object, _Entry] = {}  # what the pump's thread steps
        self._adds: dict[object, _Entry] = {}  # to register on the pump's thread
        self._removes: set[object] = set()  # to drop on the pump's thread
        self._stepping: object | None = None  # the key whose step runs now
        self._thread: threading.Thread | None = None
        self._wakeup = Wakeup()

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child: the lock is made anew; :meth:`shared` makes a new pump."""
        cls._shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> WaitPump:
        """This process's pump (a new one after ``fork()``)."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared_pid != os.getpid():
                cls._shared = WaitPump()
                cls._shared_pid = os.getpid()
            return cls._shared

    def add(self, key: object, watch: Watch, ended: Ended) -> None:
        """Step ``watch`` until it ends (then ``ended`` is called) or :meth:`remove`."""
        with self._cond:
            self._removes.discard(key)
            self._adds[key] = _Entry(watch, ended)
            if self._thread is None or not self._thread.is_alive():
                self._wakeup.open()
                self._thread = threading.Thread(
                    target=self._run, name="rselection-wait-pump", daemon=True
                )
                self._thread.start()
        self._wakeup.wake()

    def remove(self, key: object) -> None:
        """Stop stepping ``key``'s watch; returns once no step of it runs (at once on the
        pump's own thread, where no other step runs)."""
        with self._cond:
            self._adds.pop(key, None)
            if key not in self._entries:
                return
            self._removes.add(key)
            if threading.current_thread() is self._thread:
                return  # dropped before the next select; no step of it runs now
        self._wakeup.wake()
        with self._cond:
            self._cond.wait_for(lambda: key not in self._entries and self._stepping is not key)

    def discard(self, key: object) -> None:
        """Stop stepping ``key``'s watch soon; never blocks (a step under way may end)."""
        with self._cond:
            self._adds.pop(key, None)
            if key not in self._entries:
                return
            self._removes.add(key)
        self._wakeup.wake()

    # -- the pump's thread ---------------------------------------------------------------

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            wake = self._wakeup.socket
            assert wake is not None
            sel.register(wake, selectors.EVENT_READ)
            while self._apply(sel):
                ready = sel.select(self._timeout())
                self._wakeup.clear()
                readable: dict[object, set[Any]] = {}
                for selected, _ in ready:
                    if selected.data is not None:
                        readable.setdefault(selected.data, set()).add(selected.fileobj)
                self._step_all(sel, readable)

    def _apply(self, sel: selectors.BaseSelector) -> bool:
        """Register what was added, drop what was removed; ``False`` (and the thread
        ends) once nothing is left to watch."""
        with self._cond:
            for key in self._removes:
                entry = self._entries.pop(key, None)
                if entry is not None:
                    _unregister(sel, entry.watch)
            self._removes.clear()
            failed: list[tuple[_Entry, BaseException]] = []
            for key, entry in self._adds.items():
                old = self._entries.pop(key, None)
                if old is not None:
                    _unregister(sel, old.watch)
                try:
                    for sock in entry.watch.sockets:
                        sel.register(sock, selectors.EVENT_READ, key)
                except (OSError, ValueError, KeyError) as refused:  # a socket closed meanwhile
                    _unregister(sel, entry.watch)
                    failed.append((entry, refused))
                    continue
                self._entries[key] = entry
            self._adds.clear()
            self._cond.notify_all()
            alive = bool(self._entries) or bool(failed)
            if not alive:
                self._thread = None
                self._wakeup.close()
        for entry, exc in failed:
            self._finish(entry, exc)
        return alive

    def _timeout(self) -> float:
        with self._cond:
            entries = list(self._entries.values())
        due = min((entry.watch.due() for entry in entries), default=math.inf)
        return max(0.0, min(_MAX_WAIT, due - time.monotonic()))

    def _step_all(self, sel: selectors.BaseSelector, readable: dict[object, set[Any]]) -> None:
        now = time.monotonic()
        with self._cond:
            entries = list(self._entries.items())
        for key, entry in entries:
            sockets = readable.get(key, set())
            if not sockets and entry.watch.due() > now:
                continue
            with self._cond:
                if key in self._removes or self._entries.get(key) is not entry:
                    continue
                self._stepping = key
            outcome: BaseException | None = None
            try:
                ended = entry.watch.step(sockets)
            except BaseException as exc:  # handed to the lease's owner
                outcome, ended = exc, True
            with self._cond:
                self._stepping = None
                # Removed while it stepped: the remover holds the lease now, and reads it.
                removed = key in self._removes
                if ended or removed:
                    self._entries.pop(key, None)
                    _unregister(sel, entry.watch)
                self._cond.notify_all()
            if ended and not removed:
                self._finish(entry, outcome)

    def _finish(self, entry: _Entry, outcome: BaseException | None) -> None:
        try:
            entry.ended(outcome)
        except Exception:
            logger.exception("wait pump: the end of a wait raised; going on")


def _unregister(sel: selectors.BaseSelector, watch: Watch) -> None:
    for sock in watch.sockets:
        with contextlib.suppress(KeyError, ValueError, OSError):
            sel.unregister(sock)  # unless never registered, or closed meanwhile


forks.register(WaitPump)
