"""The stop signals of ``lead()``: SIGTERM and Ctrl-C end a leader gracefully.

Containers, systemd and process managers stop a program with SIGTERM, a terminal with
Ctrl-C (SIGINT). While a leader's ``lead()`` runs in the main thread, either one raises
:class:`KeyboardInterrupt` there, which ``lead()`` turns into a graceful stop (tasks
cancelled and joined, the lease released or the shards handed over) before it returns,
so a program whose last line is ``leader.lead()`` exits 0. ``start()`` and the context
managers install nothing: the application or its framework owns the signals there.

The exception is raised only where ``lead()`` waits (:meth:`StopSignals.wait`), never
wherever the main thread happens to be: Python runs a signal's handler between two
bytecodes, and one that raises right after the main thread took a lock in Python code
(``threading.Condition.__enter__``, ``Event.wait``) leaves that lock taken for good,
so that the stop waits forever for a thread that waits for the lock. A signal that
comes while ``lead()`` starts is acted on once it waits.

A Ctrl-C after a stop signal (acted on or not yet) gives up: it raises wherever the main
thread is, and ``lead()`` lets it through without a graceful stop, which could wait for
a lock that the interruption left taken.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from _thread import LockType
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn, TypeVar

from . import forks

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_T = TypeVar("_T")

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What ``signal.signal`` returns: a handler to put back."""


WAIT_SLICE = 0.5
"""Seconds between two looks at whether the leader stopped, while :meth:`StopSignals.wait`
waits (its latch wakes it at once; this only bounds a wake-up gone missing)."""


class StopSignals:
    """The handler ``lead()`` installs: the first stop signal interrupts the main thread
    where ``lead()`` waits (:meth:`wait`; ``lead()`` then stops); after it, a SIGTERM
    is only logged, and a Ctrl-C gives up as a terminal user expects (:attr:`gave_up`),
    be the first one acted on yet or not.

    Args:
        what: names the leader in the log lines.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.stopping = False
        # The stop signal received and not acted on yet: wait() raises for it.
        self.received: signal.Signals | None = None
        # A Ctrl-C came after a stop signal: it raised where the main thread was, and
        # lead() lets it through rather than stop gracefully (see __call__).
        self.gave_up = False
        # The handlers this one replaced, while it is installed.
        self.previous: dict[signal.Signals, _Handler] = {}

    def stop_begins(self) -> None:
        """The stop has begun: a SIGTERM from now on is only logged."""
        self.stopping = True
        self.received = None

    def wait(self, done: threading.Event, latch: LockType) -> None:
        """Wait until ``done`` is set; ``latch``, a plain lock held until then and
        released after it is set, wakes the wait. A stop signal raises
        :class:`KeyboardInterrupt` here: one that comes during the wait, and one that
        came before, while the main thread was elsewhere.

        Nothing here takes a lock in Python code: a signal's handler raises only in
        this frame (see :meth:`__call__`), where an interruption leaves nothing half
        done (the latch taken at most, after ``done`` was set)."""
        while not done.is_set():
            if self.received is not None:
                self._interrupt()
            if latch.acquire(timeout=WAIT_SLICE):
                latch.release()

    def call(self, fn: Callable[[], _T], name: str) -> _T:
        """``fn()``, run on a thread of its own (named ``name``) while this one waits
        for it as in :meth:`wait`: a blocking call that ``lead()`` makes before it
        waits (a read on a server that may take its whole timeout to answer), which a
        stop signal then interrupts at once rather than once the call returns. ``fn``
        so interrupted ends on its own, its outcome unused.

        Raises:
            KeyboardInterrupt: a stop signal came (before or during the call).
            BaseException: what ``fn`` raised.
        """
        if self.received is not None:  # no call once a stop is asked
            self._interrupt()
        done = threading.Event()
        latch = threading.Lock()
        latch.acquire()
        outcome: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                outcome.append((True, fn()))
            except BaseException as exc:  # raised in the waiting thread
                outcome.append((False, exc))
            finally:
                done.set()
                latch.release()

        threading.Thread(target=run, name=name, daemon=True).start()
        self.wait(done, latch)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def _interrupt(self) -> NoReturn:
        received, self.received = self.received, None
        name = received.name if received is not None else "a stop signal"
        logger.info("%s received; stopping %s", name, self.what)
        raise KeyboardInterrupt

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if not self.stopping:
            self.stopping = True
            self.received = sig
            if frame is not None and frame.f_code is _WAIT_CODE:
                self._interrupt()
            # Anywhere else the main thread may have just taken a lock that an exception
            # would leave taken: wait() raises once the main thread gets there.
            return
        if signum == signal.SIGINT:
            # Also while the first one waits to be acted on (lead() still starting):
            # this one raises where the main thread is, maybe right after it took a
            # lock, so lead() must not wait for a graceful stop that may need it.
            self.gave_up = True
            raise KeyboardInterrupt
        logger.info("%s received; %s is already stopping", sig.name, self.what)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): no ``lead()`` runs here (a
        worker a task forked): the program's own handlers are put back, so that SIGTERM
        (``multiprocessing``'s ``terminate()``) ends the child as the program says."""
        for sig in self.previous:
            _put_back(self, sig)


_WAIT_CODE = StopSignals.wait.__code__
"""The frame of :meth:`StopSignals.wait`: the only one a stop signal interrupts."""


@contextlib.contextmanager
def stop_on_signals(what: str) -> Iterator[StopSignals]:
    """While the block runs in the main thread, SIGTERM and SIGINT raise
    :class:`KeyboardInterrupt` where it waits (:meth:`StopSignals.wait`, see
    :class:`StopSignals`); the previous handlers
    are put back after, and at once in a process forked meanwhile. A signal the
    program ignores (``SIG_IGN``) stays ignored.

    Inside a block of this kind already, the handler of the outer block is yielded
    (its signals are acted on where the inner block waits); in another thread no
    handler is installed, and the object yielded only records
    :meth:`StopSignals.stop_begins` and waits.

    Args:
        what: names the leader in the log lines a signal writes.
    """
    handler = StopSignals(what)
    if threading.current_thread() is not threading.main_thread():
        yield handler
        return
    for sig in STOP_SIGNALS:
        installed = signal.getsignal(sig)
        if isinstance(installed, StopSignals):
            yield installed
            return
    # A signal the program ignores stays ignored (a shell's background job ignores
    # Ctrl-C): the program chose not to be stopped by it. The previous handlers are
    # known before any is replaced: a Ctrl-C that the program's handler raises between
    # the two (or while they are put back) leaves none of this block's behind, which
    # would swallow every SIGTERM from then on.
    handler.previous = {
        sig: signal.getsignal(sig)
        for sig in STOP_SIGNALS
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        forks.register(handler)
        for sig in handler.previous:
            signal.signal(sig, handler)
        yield handler
    finally:
        try:
            _put_back(handler, signal.SIGTERM)
        finally:
            _put_back(handler, signal.SIGINT)


def _put_back(handler: StopSignals, sig: signal.Signals) -> None:
    """Put the program's handler of ``sig`` back, if ``handler`` replaced it."""
    old = handler.previous.get(sig, signal.SIG_IGN)  # SIG_IGN: not replaced
    if old is not signal.SIG_IGN and signal.getsignal(sig) is handler:
        # None: a handler not installed from Python, which cannot be put back.
        signal.signal(sig, signal.SIG_DFL if old is None else old)
