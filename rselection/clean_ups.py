"""A stopping leader's clean-ups: run in order on one daemon thread, each waited for in
turn up to a bound.

A thread of their own keeps the stop safe from whatever a clean-up does (raise, exit,
hang). One thread for all of them, not one each: a stop runs them just after its release,
as the next leader begins its term, and on a small machine every thread started then is
time taken from that beginning. After a clean-up that outlasts its bound, the rest run on
a new thread; the one left behind ends once its clean-up returns. Each runs in a fresh
:class:`contextvars.Context`; a ``threading.local`` value one sets is seen by the next.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["run_clean_ups"]

logger = logging.getLogger("rselection.leader")

CleanUp = Callable[[], object]


class _Runner:
    """One thread's run of the clean-ups left in ``pending`` (shared with the next)."""

    def __init__(self, pending: collections.deque[CleanUp], lease: str) -> None:
        self.pending = pending
        self.lease = lease
        self.cond = threading.Condition()
        self.current: CleanUp | None = None
        self.ran = 0
        self.finished = False
        self.abandoned = False  # set by the caller: take no more clean-ups

    def serve(self) -> None:
        while True:
            with self.cond:
                if self.abandoned or not self.pending:
                    self.finished = True
                    self.cond.notify_all()
                    return
                fn = self.current = self.pending.popleft()
            try:
                # A context of its own, as on a thread of its own: what one clean-up
                # sets there (a context variable, the decimal context) stays with it.
                contextvars.Context().run(fn)
            except BaseException:  # best effort, SystemExit included: the rest still run
                logger.exception("lease %r: error in a clean-up on stop (%r)", self.lease, fn)
            with self.cond:
                self.current = None
                self.ran += 1
                self.cond.notify_all()

    def wait(self, timeout: float) -> CleanUp | None:
        """Wait until every clean-up ran, each at most ``timeout`` seconds; return the one
        that outlasted it (this runner then takes no more), else ``None``."""
        with self.cond:
            ran, deadline = self.ran, time.monotonic() + timeout
            while not self.finished:
                if self.ran != ran:  # the next one began: its own bound
                    ran, deadline = self.ran, time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    self.abandoned = True
                    return self.current
                self.cond.wait(left)
            return None


def run_clean_ups(
    fns: Iterable[CleanUp],
    *,
    lease: str,
    timeout: float,
    on_thread: Callable[[threading.Thread], None],
) -> None:
    """Run ``fns`` in order on a daemon thread, waiting up to ``timeout`` seconds for each;
    one that raises is logged, one that outlasts ``timeout`` is left to finish while the
    rest go on on a new thread. ``on_thread`` is told of each thread before it starts (a
    clean-up that stops its own leader must not wait for itself)."""
    pending = collections.deque(fns)
    while pending:
        runner = _Runner(pending, lease)
        thread = threading.Thread(
            target=runner.serve, name=f"rselection-cleanup-{lease}", daemon=True
        )
        on_thread(thread)
        thread.start()
        late = runner.wait(timeout)
        if late is not None:
            logger.warning(
                "lease %r: a clean-up on stop (%r) still runs after %g s; going on "
                "without waiting for it",
                lease,
                late,
                timeout,
            )
