"""The writers of a process take turns on one session: at most one pooled session lent
to broadcast writers at a time, per connection string (or user's pool).

The process's pool holds 2 sessions per connection string, shared with claims,
checkpoints, electors and membership. A writer keeps its lent session for a steady
stream of batches (see :mod:`.writer`), so two streaming broadcasters would hold both
and every claim would wait for one of them to pause. A writer takes the turn of its
pool (:class:`Turn`) before it borrows and gives it back with the session, and gives
both back after its current batch as soon as another writer waits for the turn or any
caller waits for the pool. The turn goes to the writers in the order they asked for it:
a writer that gave it back because another waits asks again behind that one, so a
writer that never runs out of batches cannot keep the others from their turn.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import ClassVar

from ... import forks

__all__ = ["Stopping", "Turn"]


class Stopping(Exception):
    """The writer stopped while it waited for its turn."""


class Turn:
    """The turn of the writers of one pool: one of them at a time borrows from it."""

    _registry: ClassVar[weakref.WeakValueDictionary[Hashable, Turn]] = weakref.WeakValueDictionary()
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        # Writers waiting for the turn, oldest first: only the oldest may take it.
        self._queue: deque[object] = deque()

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child (see :mod:`rselection.forks`): the parent's turns (held, or
        waited for, by its writers) stay the parent's; the child's writers share new
        ones, and the registry's lock is made anew."""
        cls._registry = weakref.WeakValueDictionary()
        cls._registry_lock = threading.Lock()

    @classmethod
    def of(cls, key: Hashable) -> Turn:
        """The turn shared by every writer of the process whose pool is ``key``; kept
        while a writer refers to it."""
        with cls._registry_lock:
            turn = cls._registry.get(key)
            if turn is None:
                turn = cls._registry[key] = Turn()
            return turn

    @property
    def waiting(self) -> int:
        """Writers waiting for the turn."""
        with self._cond:
            return len(self._queue)

    @contextlib.contextmanager
    def held(self, stopping: Callable[[], bool]) -> Iterator[None]:
        """Hold the turn for the ``with`` body, after every writer that asked for it
        before (first in, first served).

        Raises:
            Stopping: ``stopping()`` became true while waiting (see :meth:`wake`).
        """
        me = object()
        with self._cond:
            self._queue.append(me)
            try:
                while (self._held or self._queue[0] is not me) and not stopping():
                    self._cond.wait(1.0)
                taken = not self._held and self._queue[0] is me
                if taken:
                    self._held = True
            finally:
                self._queue.remove(me)
                # The next oldest may take the turn now (or once it is given back).
                self._cond.notify_all()
        if not taken:
            raise Stopping
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def wake(self) -> None:
        """Wake the writers waiting for the turn (one of them is stopping)."""
        with self._cond:
            self._cond.notify_all()


forks.register(Turn)
