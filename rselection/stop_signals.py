"""The stop signals of ``lead()``: SIGTERM and Ctrl-C end a leader gracefully.

Containers, systemd and process managers stop a program with SIGTERM, a terminal with
Ctrl-C (SIGINT). While a leader's ``lead()`` runs in the main thread, either one raises
:class:`KeyboardInterrupt` there, which ``lead()`` turns into a graceful stop (tasks
cancelled and joined, the lease released or the shards handed over) before it returns,
so a program whose last line is ``leader.lead()`` exits 0. ``start()`` and the context
managers install nothing: the application or its framework owns the signals there.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from . import forks

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What ``signal.signal`` returns: a handler to put back."""


class StopSignals:
    """The handler ``lead()`` installs: the first stop signal interrupts the main thread
    (``lead()`` then stops); once the stop has begun, a signal does not interrupt it,
    except a Ctrl-C, which gives up waiting as a terminal user expects.

    Args:
        what: names the leader in the log lines.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.stopping = False
        # The handlers this one replaced, while it is installed.
        self.previous: dict[signal.Signals, _Handler] = {}

    def stop_begins(self) -> None:
        """The stop has begun: a SIGTERM from now on is only logged."""
        self.stopping = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.stopping:
            self.stopping = True
            logger.info("%s received; stopping %s", name, self.what)
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        logger.info("%s received; %s is already stopping", name, self.what)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): no ``lead()`` runs here (a
        worker a task forked): the program's own handlers are put back, so that SIGTERM
        (``multiprocessing``'s ``terminate()``) ends the child as the program says."""
        for sig, old in self.previous.items():
            if signal.getsignal(sig) is self:
                # None: a handler not installed from Python, which cannot be put back.
                signal.signal(sig, signal.SIG_DFL if old is None else old)


@contextlib.contextmanager
def stop_on_signals(what: str) -> Iterator[StopSignals]:
    """While the block runs in the main thread, SIGTERM and SIGINT raise
    :class:`KeyboardInterrupt` in it (see :class:`StopSignals`); the previous handlers
    are put back after, and at once in a process forked meanwhile. A signal the
    program ignores (``SIG_IGN``) stays ignored.

    Elsewhere (another thread, or inside a block of this kind already) no handler is
    installed, and the object yielded only records :meth:`StopSignals.stop_begins`.

    Args:
        what: names the leader in the log lines a signal writes.
    """
    handler = StopSignals(what)
    if threading.current_thread() is not threading.main_thread() or any(
        isinstance(signal.getsignal(sig), StopSignals) for sig in STOP_SIGNALS
    ):
        yield handler
        return
    # A signal the program ignores stays ignored (a shell's background job ignores
    # Ctrl-C): the program chose not to be stopped by it.
    handler.previous = {
        sig: signal.signal(sig, handler)
        for sig in STOP_SIGNALS
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    forks.register(handler)
    try:
        yield handler
    finally:
        for sig, old in handler.previous.items():
            # None: a handler not installed from Python, which cannot be put back.
            signal.signal(sig, signal.SIG_DFL if old is None else old)
