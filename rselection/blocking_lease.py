"""How the driven keeper leads over a lease whose calls block: one adapter for all.

:class:`BlockingLease` gives a :class:`~rselection.abc.LeaseBackend` whose calls block
(Redis, memory, a user's own) the :class:`~rselection.abc.NonBlockingLease` face that
the driven keeper (:mod:`rselection.driven`) steps: its calls run on the keeper's lane
of the driver's workers, and something waits in the lease for a change between them.
That is one waiting thread per lease; none for a lease whose wait can be taken in steps
(:class:`~rselection.abc.Watchable`, watched by :mod:`rselection.wait_pump`) or one that
calls back on every change (:class:`~rselection.abc.NotifiesChanges`). A call first
takes the session from the wait, so the lease sees one caller at a time. See
``docs/explanation/sessions.md``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .abc import LeaseBackend, Watch, lease_ability
from .daemon_pool import Lane
from .driver import LeaseDriver
from .lease import Acquisition, LeaderInfo, RenewOutcome
from .wait_pump import WaitPump

__all__ = ["WAIT_SLICE", "WATCH_SLICE", "ArmedAttempt", "BlockingLease"]

logger = logging.getLogger("rselection.leader")

WAIT_SLICE = 5.0
"""Seconds of one wait of the waiting thread. A wait's return wakes the keeper whether a
change or the timeout ended it (a lease cannot tell which, and a change taken for a
timeout would leave a follower asleep until the lease expires), so a follower attempts
at least this often; a lease whose ``interrupt()`` fails holds up a call of the keeper
at most this long."""

WATCH_SLICE = 60.0
"""Seconds of one watch of a watched lease (:mod:`rselection.wait_pump`), after which it
is begun anew (its lease then looks at its connections and its holder again). Its end
wakes nobody: the watch's steps report every change. Each new watch costs a few
system calls, so at 1,000 leases a slice of 5 s took 3 % of a core."""


class ArmedAttempt:
    """An attempt a follower's keeper leaves with its watched lease: the worker whose
    watch sees the lease change runs it at once, rather than waking the keeper to send
    it from another thread (two hand-offs between threads fewer in a handover).

    Exactly one side acts: a worker takes it (:meth:`take`) and runs it, or the keeper
    cancels it first (:meth:`cancel`, as every step of the keeper does) and acts itself.

    Args:
        run: the attempt; it never raises, reports its outcome itself, and returns
            whether it called the lease (``False``: it found it must not attempt).
    """

    def __init__(self, run: Callable[[], bool]) -> None:
        self.run = run
        self._lock = threading.Lock()
        self._state = "armed"

    def take(self) -> bool:
        """The worker's side: whether it may run the attempt (the keeper did not cancel
        it), after which the keeper no longer can."""
        return self._settle("taken")

    def cancel(self) -> bool:
        """The keeper's side: whether the attempt will never run (``False``: a worker
        took it, and its outcome is on its way)."""
        return self._settle("cancelled") or self._state == "cancelled"

    def _settle(self, state: str) -> bool:
        with self._lock:
            if self._state != "armed":
                return False
            self._state = state
            return True


class BlockingLease:
    """A blocking lease as the driven keeper steps it (see the module docstring).

    Args:
        lease: the lease whose calls block.
    """

    def __init__(self, lease: LeaseBackend) -> None:
        self.lease = lease
        self.name = lease.name
        self._cond = threading.Condition()
        self._waker: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self._connected = False  # the session is open: the waiting thread may wait
        self._calls = 0  # calls of the keeper holding the session now
        self._waiting = False  # the waiting thread is inside the lease's wait
        self._taken = 0  # how many times a call took the session from a wait
        self._error: BaseException | None = None  # what a wait raised, for the keeper
        self._broken = False  # a wait raised: no more waits until the next connect()
        # A lease whose calls may run while another thread waits in it (a memory lease)
        # is not interrupted for each call: its other waiters would wake for nothing.
        self._concurrent = bool(getattr(lease, "concurrent_calls", False))
        # A lease whose wait can be taken in steps (a Redis lease) has no waiting thread:
        # the process's WaitPump watches it, its steps on a lane of the driver's wait workers.
        self._watchable = lease_ability(lease, "watchable")
        self._pumped = self._watchable is not None
        self._lane: Lane | None = None  # pumped: the lane of the watch's steps
        self._armed: ArmedAttempt | None = None  # pumped: run when the watch sees a change
        # A lease that calls back on every change (a memory lease) needs no waiting at all:
        # each change wakes the keeper, which attempts when the holder's lease may expire.
        # One that can also be watched is watched (its watch reports every change): one
        # mode, or its calls would watch it while nothing ever stopped the watch.
        self._notifier = None if self._pumped else lease_ability(lease, "notifies_changes")
        self._expiry = lease_ability(lease, "watches_expiry")
        self._unsubscribe: Callable[[], None] | None = None

    # -- LeaseBackend ---------------------------------------------------------------------

    @property
    def ttl(self) -> float:
        """The lease's ttl."""
        return self.lease.ttl

    def connect(self) -> None:
        """Open the lease's session; the waiting thread waits on it from then on."""
        with self._session():
            self.lease.connect()
            with self._cond:
                self._connected, self._broken, self._error = True, False, None
                self._cond.notify_all()

    def try_acquire(self, node_id: str) -> Acquisition:
        """The lease's ``try_acquire``, with the session taken from the waiting thread."""
        with self._session():
            return self.lease.try_acquire(node_id)

    def renew(self, node_id: str, term: int) -> bool:
        """The lease's ``renew``, with the session taken from the waiting thread."""
        with self._session():
            return self.lease.renew(node_id, term)

    def release(self, node_id: str, term: int) -> None:
        """The lease's ``release``, with the session taken from the waiting thread."""
        with self._session():
            self.lease.release(node_id, term)

    def current(self) -> LeaderInfo | None:
        """The lease's ``current`` (safe from any thread by the lease's contract)."""
        return self.lease.current()

    def wait_for_change(self, timeout: float) -> None:
        """Never blocks (the keeper is driven): raise what the waiting thread's last wait
        raised, once; else return."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def interrupt(self) -> None:
        """The lease's ``interrupt``: a wait under way returns (and wakes the keeper)."""
        if self._pumped or self._notifier is not None:
            self._wake()  # what an interrupted wait does; the watch goes on
        else:
            self.lease.interrupt()

    def term_ended(self, term: int) -> None:
        """The lease's ``term_ended`` (safe from any thread by the lease's contract)."""
        self.lease.term_ended(term)

    def term_ending(self, term: int, reason: str, by: str | None) -> None:
        """The lease's ``term_ending``, if it keeps a history (it never blocks)."""
        history = lease_ability(self.lease, "records_history")
        if history is not None:
            history.term_ending(term, reason, by)

    def close(self) -> None:
        """Close the lease's session; the waiting thread waits no more until the next
        :meth:`connect`."""
        with self._session():
            with self._cond:
                self._connected = False
                waiting = self._waiting  # only a lease with concurrent calls still waits
            if waiting:
                self._interrupt_wait()  # the waiting thread leaves the closed lease now
            self.lease.close()

    def expiry_watched(self) -> bool:
        """The lease's ``expiry_watched`` (ability ``"watches_expiry"``), else ``False``."""
        return self._expiry is not None and self._expiry.expiry_watched()

    # -- NonBlockingLease -----------------------------------------------------------------

    def renew_soon(self, node_id: str, term: int, done: Callable[[RenewOutcome], None]) -> bool:
        """Nothing starts without blocking: the keeper calls :meth:`renew` on its lane."""
        return False

    def acquire_soon(
        self, node_id: str, done: Callable[[Acquisition | BaseException], None]
    ) -> bool:
        """Nothing starts without blocking: the keeper calls :meth:`try_acquire`."""
        return False

    def on_wake(self, waker: Callable[[], None] | None) -> None:
        """Wake ``waker`` when a wait ends; ``None``: no more waits (the waiting thread
        ends once its wait under way returns; never blocks, the driver calls it)."""
        if self._notifier is not None:
            with self._cond:
                self._waker = waker
                unsubscribe, self._unsubscribe = self._unsubscribe, None
            if unsubscribe is not None:
                unsubscribe()
            if waker is not None:
                self._unsubscribe = self._notifier.subscribe_changes(self._wake)
            return
        if self._pumped:
            with self._cond:
                self._waker = waker
                if waker is None:
                    self._armed = None
                    WaitPump.shared().discard(self)  # a step under way may end
                    if self._lane is not None:
                        self._lane.shutdown()
                        self._lane = None
                else:
                    self._arm()
            return
        with self._cond:
            self._waker = waker
            self._cond.notify_all()
            if waker is not None and self._thread is None:
                self._thread = threading.Thread(
                    target=self._wait_loop, name=f"rselection-wait-{self.name}", daemon=True
                )
                self._thread.start()

    def arm_attempt(self, attempt: ArmedAttempt) -> bool:
        """Leave ``attempt`` with the lease: the next change its watch sees runs it on
        the watch's worker instead of waking the keeper (a wait that raised, or a slice
        that ran out, does not). ``False`` when the lease is not watched in steps (the
        keeper attempts when woken, as usual). Never blocks; the driver calls it."""
        if not self._pumped:
            return False
        with self._cond:
            self._armed = attempt
        return True

    def step_aside(self) -> None:
        """On the worker running an armed attempt that won, before the term begins (its
        receivers are a user's code): the lease's wait workers no longer count it, so
        the steps of other leases of the server never queue behind those receivers."""
        lane = self._lane
        if lane is not None:
            lane.pool.step_aside()

    # -- the session, shared with the waiting thread --------------------------------------

    @contextmanager
    def _session(self) -> Iterator[None]:
        """Hold the lease's session for one call of the keeper: a wait under way is
        interrupted, and the call runs once the wait has returned."""
        if self._pumped:
            with self._pumped_session():
                yield
            return
        if self._concurrent or self._notifier is not None:
            yield  # nobody waits in the lease: nothing to take the session from
            return
        with self._cond:
            self._calls += 1
            self._taken += 1
            interrupt = self._waiting
        try:
            if interrupt:
                self._interrupt_wait()
            with self._cond:
                # Never two callers at once: a lease whose interrupt() fails is called
                # when its wait returns by itself (the deadline is the driver's meanwhile).
                if not self._cond.wait_for(lambda: not self._waiting, WAIT_SLICE + 1.0):
                    logger.warning(
                        "lease %r: the wait did not end on interrupt(); the call waits for it",
                        self.lease.name,
                    )
                    self._cond.wait_for(lambda: not self._waiting)
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    @contextmanager
    def _pumped_session(self) -> Iterator[None]:
        """The lease out of the pump for one call (a step of it under way ends first;
        no new one starts meanwhile); then watched again."""
        with self._cond:
            self._calls += 1
        try:
            WaitPump.shared().remove(self)
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._arm()

    def _arm(self) -> None:
        """Pumped, under the lock: watch the lease when it is connected and no call uses
        it (the last call arms it when done). The watch begins on the lease's lane. A
        lease not watched again now, and not used by a call, is not coming back soon: the
        pump's thread need not wait for it (see :data:`rselection.wait_pump.LINGER`)."""
        if self._waker is None or not self._may_wait():
            if self._calls == 0:
                WaitPump.shared().discard(self)
            return
        if self._lane is None:
            # Leases of one server share its wait workers: a hung server holds up its own.
            server = getattr(self._watchable, "server", None)
            self._lane = LeaseDriver.shared().wait_lane(server)
        try:
            WaitPump.shared().add(
                self, self._lane, self._start_watch, self._watch_ended, WATCH_SLICE
            )
        except RuntimeError as exc:  # no thread: the keeper's next call tries again
            logger.error("lease %r: cannot watch the lease (%s)", self.name, exc)
            self._error, self._broken = exc, True
            self._waker()  # the keeper's poke never blocks: it raises the error, recovers

    def _start_watch(self) -> Watch:
        assert self._watchable is not None
        return self._watchable.watch_for_change()

    def _watch_ended(self, outcome: BaseException | None, sliced: bool, stepped: bool) -> None:
        """Pumped, on the lease's lane (unless not ``stepped``): a watch ended (a change,
        its slice, or ``outcome`` raised). Watch again unless the lease broke, and wake
        the keeper, unless only the slice ran out: a watch's step reports every change,
        so a slice's end is none (a wake would cost every follower an attempt per slice:
        200 a second at 1,000 leases). An armed attempt runs only on the lane, never on
        the pump's thread."""
        changed = outcome is None and not sliced and stepped
        with self._cond:
            if outcome is not None:
                self._error, self._broken = outcome, True
            waker = self._waker
            armed = self._armed if changed and waker is not None else None
            if armed is not None and armed.take():
                self._armed = None
            else:
                armed = None
                self._arm()
        if armed is not None:
            # Its call takes the session and watches the lease again after it.
            if not armed.run():
                with self._cond:
                    self._arm()
        elif waker is not None and not (sliced and outcome is None):
            waker()

    def _wake(self) -> None:
        with self._cond:
            waker = self._waker
        if waker is not None:
            waker()

    def _interrupt_wait(self) -> None:
        try:
            self.lease.interrupt()
        except Exception:
            logger.warning(
                "lease %r: interrupt() failed; the call waits for the wait's end",
                self.lease.name,
                exc_info=True,
            )

    def _may_wait(self) -> bool:
        return self._connected and self._calls == 0 and not self._broken

    def _wait_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waker is None or self._may_wait())
                if self._waker is None:
                    self._thread = None
                    return
                self._waiting = True
                taken = self._taken
            outcome = self._wait_once()
            with self._cond:
                self._waiting = False
                self._cond.notify_all()
                # A wait a call took over wakes nobody: the call reads the lease itself,
                # after the wait returned.
                woken = self._taken == taken
                if isinstance(outcome, BaseException):
                    self._error, self._broken, woken = outcome, True, True
                waker = self._waker
            if woken and waker is not None:
                waker()

    def _wait_once(self) -> BaseException | None:
        """One wait: the exception it raised, else ``None``."""
        try:
            self.lease.wait_for_change(WAIT_SLICE)
        except BaseException as exc:  # handed to the keeper, which recovers
            return exc
        return None
