"""An in-memory lease that answers renewals and attempts on another thread.

:class:`NonBlockingMemoryLease` is one leader's view of a :class:`WakingMemoryLease`
shared by the competing leaders of a test. It has the
:class:`~rselection.abc.NonBlockingLease` methods, so a ``LeaseLeader`` over it is
driven by the process's driver (as a ``PostgresLeader`` is), without a database: the
leader's own machinery is what is tested here. Its answers come from one
:class:`Answerer` thread, like the shared keeper's batches; a test can hold a view's
answers back (a round trip that hangs) or make its next renewal raise.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from rselection.lease import Acquisition, LeaderInfo, RenewOutcome
from rselection.memory import MemoryLease


class WakingMemoryLease(MemoryLease):
    """A :class:`MemoryLease` that also calls its views' wakers on every change."""

    def __init__(self, name: str = "default", ttl: float = 15.0) -> None:
        super().__init__(name=name, ttl=ttl)
        self.wakers: dict[object, Callable[[], None]] = {}

    def _changed(self) -> None:
        super()._changed()
        for waker in list(self.wakers.values()):
            waker()


class Answerer:
    """One thread that runs the queued round trips in order (started on first use)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="test-answerer", daemon=True)
        self._thread.start()

    def put(self, call: Callable[[], None]) -> None:
        self._queue.put(call)

    def _run(self) -> None:
        while True:
            self._queue.get()()


class NonBlockingMemoryLease:
    """One leader's view of ``shared``, answering through ``answerer``."""

    def __init__(self, shared: WakingMemoryLease, answerer: Answerer) -> None:
        self.shared = shared
        self.name = shared.name
        self.ttl = shared.ttl
        self._answerer = answerer
        self.held = threading.Event()  # set: answers wait until it is cleared
        self._released = threading.Condition()
        self.renew_error: BaseException | None = None  # the next renewal raises this
        self.renewals_started = 0

    # -- blocking methods: the shared lease's -------------------------------------------

    def connect(self) -> None:
        self.shared.connect()

    def try_acquire(self, node_id: str) -> Acquisition:
        return self.shared.try_acquire(node_id)

    def renew(self, node_id: str, term: int) -> bool:
        error, self.renew_error = self.renew_error, None
        if error is not None:
            raise error
        return self.shared.renew(node_id, term)

    def release(self, node_id: str, term: int) -> None:
        self.shared.release(node_id, term)

    def current(self) -> LeaderInfo | None:
        return self.shared.current()

    def wait_for_change(self, timeout: float) -> None:
        self.shared.wait_for_change(timeout)

    def interrupt(self) -> None:
        self.shared.interrupt()

    def term_ended(self, term: int) -> None:
        self.shared.term_ended(term)

    def close(self) -> None:
        self.shared.close()

    # -- non-blocking ----------------------------------------------------------------

    def renew_soon(self, node_id: str, term: int, done: Callable[[RenewOutcome], None]) -> bool:
        self.renewals_started += 1
        self._answer(lambda: self.renew(node_id, term), done)
        return True

    def acquire_soon(
        self, node_id: str, done: Callable[[Acquisition | BaseException], None]
    ) -> bool:
        self._answer(lambda: self.try_acquire(node_id), done)
        return True

    def on_wake(self, waker: Callable[[], None] | None) -> None:
        with self.shared._cond:
            if waker is None:
                self.shared.wakers.pop(self, None)
            else:
                self.shared.wakers[self] = waker

    def release_answers(self) -> None:
        """Let held answers go."""
        with self._released:
            self.held.clear()
            self._released.notify_all()

    def _answer(self, call: Callable[[], Any], done: Callable[[Any], None]) -> None:
        def run() -> None:
            # A held view's answer waits on a thread of its own: the others go on.
            if self.held.is_set():
                threading.Thread(target=later, daemon=True).start()
                return
            answer()

        def later() -> None:
            with self._released:
                self._released.wait_for(lambda: not self.held.is_set())
            answer()

        def answer() -> None:
            try:
                outcome = call()
            except BaseException as exc:
                outcome = exc
            done(outcome)

        self._answerer.put(run)


class AnnouncingMemoryLease(NonBlockingMemoryLease):
    """A view whose test can announce a holder, as a Postgres lease's acquisition
    notification does (:class:`~rselection.abc.AnnouncesHolder`)."""

    def __init__(self, shared: WakingMemoryLease, answerer: Answerer) -> None:
        super().__init__(shared, answerer)
        self._announced: LeaderInfo | None = None

    def announce(self, holder: LeaderInfo) -> None:
        """Announce ``holder`` and wake the leader (nothing else woke it)."""
        self._announced = holder
        with self.shared._cond:
            waker = self.shared.wakers.get(self)
        if waker is not None:
            waker()

    def take_announced(self) -> LeaderInfo | None:
        announced, self._announced = self._announced, None
        return announced
