"""The threads that run one term's plain ``def`` fires: one per running fire, reused.

Starting a thread costs a hand-over between threads (``Thread.start`` waits until the
new thread runs), and a scheduler that starts a thousand fires due at one instant pays
it a thousand times in a row. A thread that finished a fire waits a while for the next
one instead, so that an instant's fires are handed to threads that already run. A fire
never waits for a busy thread: when no thread is idle, a new one starts. So there is
still one thread per running fire, and no more threads than fires ran at once.

Each call runs in a fresh, empty :class:`contextvars.Context`, as on a new thread, so a
fire never sees the context variables (nor the :mod:`decimal` context) that an earlier
fire on the same thread set. ``threading.local`` values do stay with the thread.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["IDLE_TIMEOUT", "TaskThreads"]

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0
"""Seconds an idle thread waits for a fire before it ends."""

_Work = Callable[[], None]


class TaskThreads:
    """Runs each call given to :meth:`run` on a thread of its own, reusing idle ones.

    Args:
        prefix: the threads' name prefix.
        idle_timeout: seconds an idle thread waits for more work before it ends.
    """

    def __init__(self, prefix: str, *, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.prefix = prefix
        self.idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = 0  # threads waiting on the queue that no work was promised to yet
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def run(self, work: _Work) -> None:
        """Run ``work()`` on an idle thread, or on a new one if none is idle, in a fresh
        :class:`contextvars.Context` (empty, as on a new thread).

        ``work`` must catch its own exceptions (one that escapes is logged).

        Raises:
            RuntimeError: after :meth:`close` (then :attr:`closed` is true), or when no
                thread can be started (the process is out of threads or memory).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the task threads are closed")
            if self._idle:
                self._idle -= 1
                self._work.put(work)
                return
            thread = threading.Thread(
                target=self._serve, args=(work,), name=self.prefix, daemon=True
            )
            # Known before it runs, so that its end (which forgets it) comes after.
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._threads.discard(thread)
            raise

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (then :meth:`run` refuses work)."""
        with self._lock:
            return self._closed

    def _serve(self, work: _Work | None) -> None:
        try:
            while work is not None:
                try:
                    # Each call in a context of its own, as a new thread would give it.
                    contextvars.Context().run(work)
                except Exception:
                    logger.exception("a task thread's work raised; ignored")
                work = self._next()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _next(self) -> _Work | None:
        """The next work for this thread, or ``None`` when it is to end."""
        with self._lock:
            if self._closed:
                return None
            self._idle += 1
        try:
            return self._work.get(timeout=self.idle_timeout)
        except queue.Empty:
            pass
        with self._lock:
            # A call may have promised work to an idle thread (this one) just now.
            try:
                return self._work.get_nowait()
            except queue.Empty:
                self._idle -= 1
                return None

    def close(self, timeout: float) -> None:
        """End the idle threads and refuse more work; wait up to ``timeout`` seconds for
        every thread to end (a thread still running work ends after it)."""
        with self._lock:
            self._closed = True
            for _ in range(self._idle):
                self._work.put(None)
            self._idle = 0
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            # Work may close its own pool; a thread that never started has nothing to
            # wait for (and join() would raise).
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def idle(self) -> int:
        """Threads waiting for work now."""
        with self._lock:
            return self._idle

    def count(self) -> int:
        """Threads alive now, idle or running work."""
        with self._lock:
            return len(self._threads)
