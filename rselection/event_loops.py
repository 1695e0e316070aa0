"""The event loop that the ``async def`` tasks of every term of a process share.

A term whose leader was not given a loop (``async with leader`` gives it the caller's)
runs its ``async def`` tasks on the process's shared loop, one thread for every term,
rather than on a loop thread of its own: a process leading a thousand leases runs one
loop thread, not a thousand.

A loop is shared only while it answers. A tick runs on it every :data:`TICK` seconds;
a loop whose last tick is older than :data:`UNRESPONSIVE` (an ``async def`` task that
blocks it: ``time.sleep``, a CPU-bound loop) is retired: terms that start from then on
get a new loop, so one blocking task never keeps the async tasks of later terms from
running. A loop stops, and is closed (what is left on it cancelled, as on a term's own
loop), once no term uses it any more.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import ClassVar

__all__ = ["TICK", "UNRESPONSIVE", "SharedLoops"]

logger = logging.getLogger(__name__)

TICK = 0.25
"""Seconds between two ticks on a shared loop (how its health is seen)."""

UNRESPONSIVE = 1.0
"""Seconds without a tick after which a shared loop is given to no more terms."""

_DRAIN = 1.0  # seconds a stopped loop gets to unwind what was left on it


class _Loop:
    """One shared loop, its thread and the terms that use it."""

    def __init__(self, number: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.users = 0
        self.retired = False
        self.last_tick = time.monotonic()
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(ready,), name=f"rselection-loop-{number}", daemon=True
        )
        self.thread.start()
        ready.wait(5.0)

    def _run(self, ready: threading.Event) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.call_soon(self._tick)
        try:
            loop.run_forever()
        finally:
            _close(loop)

    def _tick(self) -> None:
        self.last_tick = time.monotonic()
        self.loop.call_later(TICK, self._tick)

    def answers(self) -> bool:
        return time.monotonic() - self.last_tick < UNRESPONSIVE


class SharedLoops:
    """The process's shared loops; get the instance with :meth:`shared`."""

    _instance: ClassVar[SharedLoops | None] = None
    _pid = 0
    _class_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: _Loop | None = None
        self._by_loop: dict[asyncio.AbstractEventLoop, _Loop] = {}
        self._numbers = 0

    @classmethod
    def shared(cls) -> SharedLoops:
        """This process's shared loops (new ones after ``fork()``)."""
        with cls._class_lock:
            if cls._instance is None or cls._pid != os.getpid():
                cls._instance = SharedLoops()
                cls._pid = os.getpid()
            return cls._instance

    def acquire(self) -> asyncio.AbstractEventLoop:
        """A running loop for one more term; give it back with :meth:`release`."""
        with self._lock:
            current = self._current
            if current is not None and not current.answers():
                logger.warning(
                    "the shared event loop has not answered for %.1f s (an async task "
                    "blocks it); later terms run their async tasks on a new loop",
                    time.monotonic() - current.last_tick,
                )
                current.retired = True
                self._current = current = None
            if current is None:
                self._numbers += 1
                current = self._current = _Loop(self._numbers)
                self._by_loop[current.loop] = current
            current.users += 1
            return current.loop

    def release(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """A term no longer uses ``loop``: the last term stops and closes it, waiting up
        to ``timeout`` seconds for its thread (a loop that a task blocks closes itself
        once the task lets go)."""
        with self._lock:
            entry = self._by_loop.get(loop)
            if entry is None:
                return
            entry.users -= 1
            if entry.users > 0:
                return
            del self._by_loop[loop]
            if self._current is entry:
                self._current = None
        loop.call_soon_threadsafe(loop.stop)
        if entry.thread is not threading.current_thread():
            entry.thread.join(max(0.1, timeout))

    def threads(self) -> int:
        """Loop threads alive now."""
        with self._lock:
            return sum(1 for entry in self._by_loop.values() if entry.thread.is_alive())


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on a stopped loop, let it unwind briefly, close it."""
    try:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=_DRAIN))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
