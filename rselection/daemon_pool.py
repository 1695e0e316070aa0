"""An executor whose threads never hold up the interpreter's exit.

The standard :class:`~concurrent.futures.ThreadPoolExecutor` joins its workers when the
interpreter exits. A term's claims run on such a pool so that the term's end never waits
for a claim stuck on a dead connection; but a stuck claim then kept the whole process
from exiting after ``stop()`` had returned (a Redis client without a socket timeout waits
forever). These workers are daemon threads that nothing joins at exit: what a stuck
claim still does is abandoned, as the term that asked for it already was.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["DaemonExecutor"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Item = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonExecutor(Executor):
    """Runs submitted calls on at most ``max_workers`` daemon threads, started on demand.

    Args:
        max_workers: the most threads at once.
        thread_name_prefix: the threads' name prefix.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0
        self._shutdown = False

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        """Run ``fn(*args, **kwargs)`` on a worker; its :class:`Future`."""
        future: Future[_T] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._queue.put((future, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1  # that worker takes this call
                return future
            if self._threads >= self._max_workers:
                return future  # a busy worker takes it when it is done
            self._threads += 1
            index = self._threads
        thread = threading.Thread(
            target=self._work, name=f"{self._prefix}_{index - 1}", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._threads -= 1
            raise
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; with ``cancel_futures`` cancel those not started yet.

        ``wait`` is accepted for the :class:`Executor` interface and ignored: a worker
        stuck in a call is never waited for.
        """
        with self._lock:
            self._shutdown = True
            workers = self._threads
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in range(workers):
            self._queue.put(None)  # one stop mark per worker

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # handed to the caller, as an executor does
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            with self._lock:
                if self._shutdown:
                    continue  # its stop mark is queued
                self._idle += 1
