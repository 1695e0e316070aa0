"""The event loops that the ``async def`` tasks of a process's terms share.

A term whose leader was not given a loop runs its ``async def`` tasks on a loop the
process's terms share. Each term holds a :class:`LoopGuard`: once the term has wound
down, nothing it created runs again; a loop blocked for :data:`UNRESPONSIVE` seconds is
given to no later term, and a term ending on it does not wait for tasks that cannot run;
a task cannot stop the loop or replace its task factory. A loop stops, and is closed,
once no term uses it. See ``docs/explanation/sessions.md``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from . import forks

__all__ = ["TICK", "UNRESPONSIVE", "LoopGuard", "SharedLoops"]

logger = logging.getLogger(__name__)

TICK = 0.25
"""Seconds between two ticks on a shared loop (how its health is seen)."""

UNRESPONSIVE = 1.0
"""Seconds without a tick after which a shared loop counts as blocked: it is given to no
later term, and a term ending on it does not wait for its tasks."""

_DRAIN = 1.0  # seconds a term's tasks left after its own tasks ended get to unwind
_POLL = 0.05  # seconds between two looks at a loop's health while waiting on it

_guard: contextvars.ContextVar[LoopGuard | None] = contextvars.ContextVar(
    "rselection_loop_guard", default=None
)


class LoopGuard:
    """One term's place on a shared loop: what it runs there, and the end of it."""

    def __init__(self, shared: _SharedLoop, owner: SharedLoops) -> None:
        self.loop: asyncio.AbstractEventLoop = shared
        self._shared = shared
        self._owner = owner
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.closed = False
        self._running = 0  # callbacks of the term running now (nested ones count too)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._context = contextvars.copy_context()
        self._context.run(_guard.set, self)

    def answers(self) -> bool:
        """False while the loop is blocked (see :data:`UNRESPONSIVE`)."""
        return self._shared.answers()

    def create_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        """On the loop's thread: start ``coro`` as one of the term's tasks."""
        self._context.run(self._shared.create_task, coro)

    def _adopt(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            closed = self.closed
            if not closed:
                self._tasks.add(task)
        if closed:
            self._shared.abandon([task])  # created by a closed term: it never takes a step
        else:
            task.add_done_callback(self._discard, context=contextvars.Context())

    def _discard(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._tasks.discard(task)
            self._changed.notify_all()

    def _wrap(self, callback: Callable[..., object]) -> Callable[..., object]:
        def guarded(*args: Any) -> object:
            with self._lock:
                if self.closed:
                    return None
                self._running += 1
            try:
                return callback(*args)
            finally:
                with self._lock:
                    self._running -= 1
                    if not self._running:
                        self._changed.notify_all()

        return guarded

    def close(self, deadline: float) -> bool:
        """End the term on the loop: cancel what it still has there, give that until
        ``deadline`` (:func:`time.monotonic`) to unwind, at least 0.1 s and at most
        :data:`_DRAIN`, then let nothing of it run again, and give the loop back.

        Returns ``True`` when nothing of the term was still running on the loop.
        """
        shared = self._shared
        on_loop = shared.on_loop_thread()
        try:
            if on_loop:
                self._cancel_all()  # what it leaves can only run once we return: not at all
            elif shared.answers():
                try:
                    shared.call_soon_threadsafe(self._cancel_all)
                except RuntimeError:  # closed: nothing of the term can run
                    pass
                else:
                    until = min(max(0.1, deadline - time.monotonic()), _DRAIN) + time.monotonic()
                    self._wait(lambda: not self._tasks, until)
            with self._lock:
                self.closed = True
                abandoned = list(self._tasks)
                self._tasks.clear()
            shared.abandon(abandoned)
            if on_loop:
                return self._running <= 1  # the step that called us
            # A step of the term that runs now blocks the loop: it cannot be stopped.
            return self._wait(lambda: not self._running, max(0.1, deadline - time.monotonic()))
        finally:
            self._owner.release(shared, max(0.1, deadline - time.monotonic()))

    def _wait(self, done: Callable[[], bool], until: float) -> bool:
        """Under no lock: wait until ``done()`` (read under the lock) or ``until``, or
        until the loop stops answering (what waits on it cannot run); ``done()``."""
        with self._lock:
            while not done():
                left = until - time.monotonic()
                if left <= 0 or not self._shared.answers():
                    return False
                self._changed.wait(min(left, _POLL))
            return True

    def _cancel_all(self) -> None:
        with self._lock:
            tasks = list(self._tasks)
        for task in tasks:
            task.cancel()


class _SharedLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose callbacks are guarded by the term they belong to."""

    def __init__(self, number: int) -> None:
        super().__init__()
        self.number = number
        self.users = 0
        self.retired = False
        self.last_tick = time.monotonic()
        self._owner_stops = False
        self._thread: threading.Thread | None = None
        # Tasks of closed guards that never finish: not waited for when the loop closes.
        self._abandoned: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        super().set_task_factory(_task_factory)

    # -- guarding ----------------------------------------------------------------------

    def call_soon(  # type: ignore[override]
        self,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        return super().call_soon(_guarded(callback, _guard_of(context)), *args, context=context)

    def call_soon_threadsafe(  # type: ignore[override]
        self,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        guarded = _guarded(callback, _guard_of(context))
        return super().call_soon_threadsafe(guarded, *args, context=context)

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        guarded = _guarded(callback, _guard_of(context))
        return super().call_at(when, guarded, *args, context=context)

    def _add_reader(self, fd: Any, callback: Callable[..., object], *args: Any) -> Any:
        return super()._add_reader(fd, _guarded(callback, _guard.get()), *args)  # type: ignore[misc]

    def _add_writer(self, fd: Any, callback: Callable[..., object], *args: Any) -> Any:
        return super()._add_writer(fd, _guarded(callback, _guard.get()), *args)  # type: ignore[misc]

    # -- what a task must not do to the others ------------------------------------------

    def stop(self) -> None:
        if not self._owner_stops:
            raise RuntimeError(
                "this event loop is shared by the async tasks of every term of the "
                "process: a task must not stop it"
            )
        super().stop()

    def set_task_factory(self, factory: Any) -> None:
        raise RuntimeError(
            "this event loop is shared by the async tasks of every term of the process: "
            "its task factory is rselection's"
        )

    # -- life ------------------------------------------------------------------------------

    def abandon(self, tasks: list[asyncio.Task[Any]]) -> None:
        """``tasks`` of closed terms will never take a step: not waited for when the
        loop closes, and not logged as destroyed while pending."""
        for task in tasks:
            task._log_destroy_pending = False  # type: ignore[attr-defined]
            self._abandoned.add(task)

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"rselection-loop-{self.number}", daemon=True
        )
        self._thread.start()
        ready.wait(5.0)

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def answers(self) -> bool:
        return time.monotonic() - self.last_tick < UNRESPONSIVE

    def shut(self, timeout: float) -> None:
        """Stop the loop (it closes itself); wait up to ``timeout`` for its thread."""
        self._owner_stops = True
        try:
            super().call_soon_threadsafe(super().stop)
        except RuntimeError:
            return  # already closed
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout))

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self)
        super().call_soon(ready.set)
        super().call_soon(self._tick)
        try:
            while not self._owner_stops:
                try:
                    self.run_forever()
                except BaseException as exc:  # SystemExit, KeyboardInterrupt from a task
                    logger.error(
                        "an async task raised %s on the shared event loop; the loop and "
                        "the other tasks go on",
                        type(exc).__name__,
                    )
        finally:
            self._close()

    def _tick(self) -> None:
        self.last_tick = time.monotonic()
        super().call_later(TICK, self._tick)

    def _close(self) -> None:
        """Cancel what is left that may still run, let it unwind briefly, close."""
        try:
            pending = [t for t in asyncio.all_tasks(self) if t not in self._abandoned]
            for task in pending:
                task.cancel()
            if pending:
                self.run_until_complete(asyncio.wait(pending, timeout=_DRAIN))
            self.run_until_complete(self.shutdown_asyncgens())
        except BaseException:
            logger.exception("closing a shared event loop")
        finally:
            self.close()


def _guarded(callback: Callable[..., object], guard: LoopGuard | None) -> Callable[..., object]:
    """``callback``, run under the term of ``guard`` when there is one (see
    :meth:`LoopGuard._wrap`)."""
    return callback if guard is None else guard._wrap(callback)


def _guard_of(context: contextvars.Context | None) -> LoopGuard | None:
    if context is None:
        return _guard.get()
    return context.get(_guard)


def _task_factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
    task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, **kwargs)
    guard = _guard_of(kwargs.get("context"))
    if guard is not None:
        guard._adopt(task)
    return task


class SharedLoops(forks.PerProcess):
    """The process's shared loops; get the instance with :meth:`shared`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: _SharedLoop | None = None
        self._loops: set[_SharedLoop] = set()
        self._numbers = 0

    def enter(self) -> LoopGuard:
        """A place for one more term on a loop that answers; end it with
        :meth:`LoopGuard.close`."""
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
                current = _SharedLoop(self._numbers)
                current.start()
                self._current = current
                self._loops.add(current)
            current.users += 1
            return LoopGuard(current, self)

    def release(self, loop: _SharedLoop, timeout: float) -> None:
        """A term no longer uses ``loop``: the last one stops it (and waits up to
        ``timeout`` seconds for its thread)."""
        with self._lock:
            loop.users -= 1
            if loop.users > 0:
                return
            self._loops.discard(loop)
            if self._current is loop:
                self._current = None
        loop.shut(timeout)

    def threads(self) -> int:
        """Loop threads alive now."""
        with self._lock:
            return sum(1 for loop in self._loops if loop._thread and loop._thread.is_alive())
