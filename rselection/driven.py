"""The keeper and watchdog of every leader, stepped by the driver.

:class:`DrivenKeeper` is the one leadership state machine of a
:class:`~rselection.leader.LeaseLeader`, whatever its lease (follow, lead, step down,
recover with backoff, stop), made of steps that never block, called by the process's
:class:`~rselection.driver.LeaseDriver`. What it steps is the leader's
:class:`~rselection.leadership.Leadership` (its terms and the work on them), never the
leader itself. It steps a
:class:`~rselection.abc.NonBlockingLease`: Postgres's lease is one, and any other
lease is adapted by :class:`~rselection.blocking_lease.BlockingLease`.

* the deadline is checked at every step, whatever is in flight, and a passed one (or a
  ``stop()``) ends the term at once on a thread of its own;
* renewals and attempts are started with ``renew_soon`` / ``acquire_soon`` (the backend
  sends those of every lease due together), and their answers come back to the driver's
  thread; when the backend cannot start one without blocking (not connected yet), the
  blocking call runs on a pool thread instead;
* everything else that may block, or that runs a user's code (connecting, beginning and
  ending terms, releasing, the signals), runs on a pool thread, one such piece of work at
  a time per leader, in the order a keeper would do it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from . import clock, signals
from .abc import LeaseBackend, NonBlockingLease, lease_ability
from .blocking_lease import ArmedAttempt, BlockingLease
from .context import Term
from .daemon_pool import Lane
from .driver import LeaseDriver
from .errors import BackendUnavailable, ConfigError
from .leadership import Leadership, StepDown
from .lease import Acquisition, LeaderInfo, ReleaseOutcome, RenewOutcome

__all__ = ["DrivenKeeper", "SKIPPED_RETRY"]

logger = logging.getLogger("rselection.leader")

SKIPPED_RETRY = 0.1
"""Seconds before a renewal the backend skipped (its row locked by another transaction)
is sent again."""

_IN_FLIGHT_CHECK = 1.0  # seconds between deadline checks while work is in flight


class _Begun:
    """What a blocking attempt answers when it won and began the term on its worker."""


class DrivenKeeper:
    """The driven keeper of one leader (see the module docstring).

    Its state is read and written on the driver's thread only, but for the pool work,
    which runs one piece at a time and only while the driver starts nothing else for
    this leader.
    """

    def __init__(self, state: Leadership, lease: NonBlockingLease, backend: LeaseBackend) -> None:
        self._state = state
        self._lease = lease  # the same object as ``backend``, seen as non-blocking
        self._backend = backend
        self._expiry = lease_ability(lease, "watches_expiry")
        self._driver = LeaseDriver.shared()
        self.done = threading.Event()
        """Set once the leader has shut down (released, closed, cleaned up)."""
        self.latch = threading.Lock()
        """Held until :attr:`done` is set, then released: what ``lead()`` waits on in
        the main thread, where a stop signal interrupts its wait (see
        :meth:`rselection.stop_signals.StopSignals.wait`)."""
        self.latch.acquire()
        self._running = False  # added to the driver
        self._busy = False  # pool work of this leader runs (one at a time)
        self._connecting = False  # that work is connecting the lease
        self._in_flight = False  # a renewal or attempt was started, not answered yet
        self._woken = False  # the lease said a wait would have returned early
        self._wake_lock = threading.Lock()
        self._finished = False
        self._failures = 0
        self._follow_at = 0.0  # a follower's next attempt
        self._renew_after = 0.0  # not before this (a skipped renewal)
        self._pause_until = 0.0  # the backoff after a failed step
        self._deferred = False  # a wake's attempt waits for _follow_at (a takeover delay)
        self._ending: Term | None = None  # a term the deadline or a stop ended
        self._threads: set[threading.Thread] = set()  # pool threads working for us
        self._threads_lock = threading.Lock()
        self._lane: Lane | None = None  # this leader's steps on the driver's workers
        # A watched blocking lease runs a follower's next attempt itself when it sees a
        # change (see ArmedAttempt); every step takes it back first.
        self._arms = lease if isinstance(lease, BlockingLease) else None
        self._armed: ArmedAttempt | None = None

    # -- the leader's side -------------------------------------------------------------

    def start(self) -> None:
        """Start being driven (from ``LeaseLeader.start``)."""
        # The starting process's driver: one taken before a fork is the parent's.
        self._driver = LeaseDriver.shared()
        self._lease.on_wake(self._on_wake)
        self._running = True
        self._driver.add(self)

    @property
    def running(self) -> bool:
        """Whether :meth:`start` got as far as the driver."""
        return self._running

    def poke(self) -> None:
        """Step soon (a stop, a step-down)."""
        if not self._running:  # a stop before any start: this process's driver
            self._driver = LeaseDriver.shared()
        self._driver.poke(self)

    def inside(self) -> bool:
        """True on the driver's thread or a pool thread doing this leader's work."""
        if self._driver.on_thread():
            return True
        with self._threads_lock:
            return threading.current_thread() in self._threads

    def _on_wake(self) -> None:
        with self._wake_lock:
            self._woken = True
        self._driver.poke(self)

    def _take_wake(self) -> bool:
        """Whether the lease woke us since the last call (and forget it)."""
        with self._wake_lock:
            woken, self._woken = self._woken, False
        return woken

    # -- steps (the driver's thread) -----------------------------------------------------

    def drive(self, now: float) -> float | None:
        """One step that never blocks; when to step again (``None``: done)."""
        state = self._state
        if self._finished:
            self._lease.on_wake(None)
            if self._lane is not None:
                self._lane.shutdown()
                self._lane = None
            return None
        armed, self._armed = self._armed, None
        if armed is not None and not armed.cancel():
            self._in_flight = True  # a worker runs the attempt: its outcome is on its way
        term = state.term
        watch = self._watch(term, now)
        if self._busy or self._in_flight:
            if self._connecting and state.stopping.is_set():
                # A backend may let a connect give up when interrupted (Postgres's does);
                # again each second, in case the stop came as that connect began.
                state.interrupt_backend()
            return min(watch, now + _IN_FLIGHT_CHECK)
        try:
            return min(watch, self._step(now))
        except BaseException as exc:
            self._failed(exc)
            return watch

    def _watch(self, term: Term | None, now: float) -> float:
        """The watchdog: end a term whose deadline passed, or that a stop ends; return
        when to look again (a follower has nothing to watch: never, unless poked)."""
        if term is None:
            return math.inf
        if term is self._ending or term.cancelled.is_set():
            return now + _IN_FLIGHT_CHECK
        stopping = self._state.stopping.is_set()
        if not stopping and term.live():
            # On the driver's clock, which counts suspended time (the driver looks at it
            # at least every second); a stop() or a notification pokes us sooner.
            return term.deadline
        self._ending = term
        reason = "stopped" if stopping else "deadline"

        def end() -> None:
            self._state.end_term(reason, expected=term, announce=False)
            self._state.interrupt_backend()  # a renewal in flight gives up

        self._pool(end, serial=False)
        return now + _IN_FLIGHT_CHECK

    def _step(self, now: float) -> float:
        state = self._state
        if state.stopping.is_set():
            self._shut_down()
            return now + _IN_FLIGHT_CHECK
        if now < self._pause_until:  # backing off after a failure (a stop cuts it short)
            return self._pause_until
        if state.has_unannounced():
            self._work(state.announce)
            return now + _IN_FLIGHT_CHECK
        if not state.connected:
            self._connecting = True
            self._work(self._connect)
            return now + _IN_FLIGHT_CHECK
        term = state.term
        if term is None:
            return self._follow_step(now)
        if term is self._ending:  # being ended on the pool: then the follower's steps
            return now + _IN_FLIGHT_CHECK
        return self._lead_step(term, now)

    def _follow_step(self, now: float) -> float:
        state = self._state
        if state.held_term is not None:
            self._work(state.release)
            return now + _IN_FLIGHT_CHECK
        if state.hold_until > now:
            return state.hold_until
        woken = self._take_wake()
        if woken:
            self._backend.wait_for_change(0)  # raises when the session broke
            lease = self._lease
            announcer = (
                lease_ability(lease, "announces_holder") if state.follows_announcements else None
            )
            announced = None if announcer is None else announcer.take_announced()
            if announced is not None:
                # Only another node's acquisition woke us: follow it without an attempt
                # (unless an attempt already saw as new a term, or a newer one).
                seen = state.last_seen
                if seen is None or announced.term > seen[1]:
                    self._work(lambda: state.observe(announced))
                return max(now, self._follow_at)
            if not self._deferred:
                delay = state.takeover_delay()
                if delay > 0:  # another node takes it over first, unless it cannot
                    self._deferred = True
                    self._follow_at = now + delay
        if not state.eligible:
            return math.inf  # a member that never leads attempts nothing
        if now < self._follow_at and (not woken or self._deferred):
            if not self._deferred:
                self._arm_attempt()
            return self._follow_at
        self._deferred = False
        sent = clock.monotonic()
        self._round_trip(
            lambda done: self._lease.acquire_soon(state.node_id, done),
            lambda: self._attempt(sent),
            lambda outcome: self._attempted(sent, outcome),
        )
        return now + _IN_FLIGHT_CHECK

    def _attempt(self, sent: float, *, armed: bool = False) -> Acquisition | _Begun:
        """A blocking attempt; one that wins begins the term on the same thread: no hop
        to the driver's thread and back to a worker before the tasks start."""
        state = self._state
        outcome = self._backend.try_acquire(state.node_id)
        holder = outcome.holder
        if not outcome.acquired or holder is None or state.stopping.is_set():
            return outcome
        if armed and self._arms is not None:
            self._arms.step_aside()  # on a wait worker: the receivers may be slow
        self._begin(holder, sent)
        return _Begun()

    def _arm_attempt(self) -> None:
        """A follower that would attempt as soon as woken leaves the attempt with its
        watched lease, which runs it on the worker that sees the change (see
        :class:`~rselection.blocking_lease.ArmedAttempt`)."""
        if self._arms is None:
            return
        armed = ArmedAttempt(lambda: self._run_armed(armed))
        if self._arms.arm_attempt(armed):
            self._armed = armed

    def _run_armed(self, armed: ArmedAttempt) -> bool:
        """A worker of the lease's watch, which took ``armed``: attempt as a woken
        follower's step would (unless a stop, a drain or a takeover delay came
        meanwhile: then only wake the keeper), and hand the outcome to the driver's
        thread."""
        # The keeper learns at once that an attempt is in flight: from then on it steps
        # at least every second, so the deadline of a term begun here is enforced even
        # while this thread runs the elected receivers.
        self._driver.poke(self)
        state = self._state
        current = threading.current_thread()
        with self._threads_lock:
            self._threads.add(current)  # a stop() from a receiver here must not wait
        sent = clock.monotonic()
        outcome: Acquisition | _Begun | BaseException | None = None
        try:
            if state.eligible and not state.stopping.is_set() and state.takeover_delay() <= 0:
                outcome = self._attempt(sent, armed=True)
        except BaseException as exc:  # handed to the driver's thread
            outcome = exc
        finally:
            with self._threads_lock:
                self._threads.discard(current)
        self._driver.call(lambda: self._armed_answered(armed, sent, outcome))
        return outcome is not None

    def _armed_answered(
        self, armed: ArmedAttempt, sent: float, outcome: Acquisition | _Begun | BaseException | None
    ) -> None:
        if self._armed is armed:
            self._armed = None  # answered before any step took it back

        def settle(answer: Acquisition | _Begun | BaseException | None) -> None:
            if answer is None:  # not attempted: what a wake does instead
                with self._wake_lock:
                    self._woken = True
            else:
                self._attempted(sent, answer)

        self._answered(settle, outcome)

    def _lead_step(self, term: Term, now: float) -> float:
        state = self._state
        request = state.take_step_down(term)
        if request is not None:
            self._step_down(request)
            return now + _IN_FLIGHT_CHECK
        if self._take_wake():
            self._backend.wait_for_change(0)  # raises when the session broke
        due = max(state.renewal_due(), self._renew_after)
        handovers = state.handovers
        if due > now and not (handovers is not None and handovers.handover_hinted()):
            return due
        sent = clock.monotonic()
        self._round_trip(
            lambda done: self._lease.renew_soon(state.node_id, term.number, done),
            lambda: self._backend.renew(state.node_id, term.number),
            lambda outcome: self._renewed(term, sent, outcome),
        )
        return now + _IN_FLIGHT_CHECK

    def _round_trip(
        self,
        start: Callable[[Callable[[Any], None]], bool],
        blocking: Callable[[], Any],
        answered: Callable[[Any], None],
    ) -> None:
        """Start a renewal or attempt; ``answered(outcome)`` runs on the driver's thread
        (outcome: what the blocking call returns, or the exception it raises)."""
        self._in_flight = True

        def done(outcome: Any) -> None:
            self._driver.call(lambda: self._answered(answered, outcome))

        try:
            started = start(done)
        except BaseException:
            self._in_flight = False
            raise
        if started:
            return
        self._in_flight = False

        def call() -> Any:
            try:
                return blocking()
            except BaseException as exc:  # handed to the driver's thread
                return exc

        self._work(call, then=answered)

    def _answered(self, answered: Callable[[Any], None], outcome: Any) -> None:
        self._in_flight = False
        answered(outcome)
        self._driver.poke(self)

    def _attempted(self, sent: float, outcome: Acquisition | _Begun | BaseException) -> None:
        if isinstance(outcome, BaseException):
            self._failed(outcome)
            return
        state = self._state
        self._failures = 0
        if isinstance(outcome, _Begun):
            self._follow_at = 0.0  # once the term is over, attempt at once
            return
        holder = outcome.holder
        if outcome.acquired and holder is not None:
            if state.stopping.is_set():
                state.held_term = holder.term  # never begun: the shut-down releases it
                return
            self._follow_at = 0.0
            self._work(lambda: self._begin(holder, sent))
            return
        seen = (holder.node_id, holder.term) if holder is not None else None
        if seen != state.last_seen:
            self._work(lambda: state.observe(holder))
        watched = holder is not None and self._expiry is not None and self._expiry.expiry_watched()
        self._follow_at = clock.monotonic() + state.follow_timeout(outcome, watched=watched)

    def _renewed(self, term: Term, sent: float, outcome: RenewOutcome) -> None:
        if isinstance(outcome, BaseException):
            self._failed(outcome)
            return
        state = self._state
        if outcome is None:  # the row was locked: still ours, not renewed; again soon
            self._renew_after = clock.monotonic() + SKIPPED_RETRY
            return
        self._renew_after = 0.0
        if not outcome:

            def lost() -> None:
                state.end_term("lost")
                state.held_term = None

            self._work(lost)
            return
        self._failures = 0
        extended = state.extend(term, sent)
        if extended is None:
            return  # the watchdog ended the term while the renewal was in flight
        if not extended:
            self._work(lambda: state.end_term("deadline", expected=term))
            return
        if signals.lease_renewed.receivers:
            done = clock.monotonic()
            latency, remaining = done - sent, term.deadline - done
            # On the driver's signal thread: a slow receiver never holds up a renewal.
            self._driver.notify(
                lambda: signals.emit(
                    signals.lease_renewed,
                    state.sender,
                    name=state.name,
                    term=term.number,
                    latency=latency,
                    remaining=remaining,
                )
            )
        handovers = state.handovers
        request = handovers.handover_requested() if handovers is not None else None
        if request is not None:
            state.hand_over(term, request)

    def _failed(self, exc: BaseException) -> None:
        """What the keeper does with an exception of a step: recover, or stop."""
        state = self._state
        if isinstance(exc, BackendUnavailable):
            if state.stopping.is_set() or state.step_down_pending():
                return  # interrupted by stop() or step_down(): the next step does it
            self._failures += 1
            log = logger.warning if self._failures == 1 else logger.debug
            log("lease %r: backend unavailable (%s); retrying with backoff", state.name, exc)
            self._recover("connection")
        elif isinstance(exc, ConfigError):
            state.fatal = exc
            logger.error("lease %r: cannot lead safely, stopping: %s", state.name, exc)

            def fatal() -> None:
                state.end_term("error")
                state.held_term = None  # not through this backend: the lease expires
                try:
                    state.stop_leading()
                finally:
                    self._close()

            self._work(fatal)
        elif isinstance(exc, Exception):
            self._failures += 1
            logger.error(
                "lease %r: unexpected error in the keeper; the term (if any) ends and the "
                "keeper retries",
                state.name,
                exc_info=exc,
            )
            self._recover("error")
        else:  # KeyboardInterrupt, SystemExit: never swallowed, the leader stops
            state.stopping.set()
            self._driver.poke(self)

    def _recover(self, reason: str) -> None:
        failures = self._failures
        state = self._state

        def recover() -> None:
            pause = state.recover_session(reason, failures)
            self._pause_until = clock.monotonic() + pause

        self._work(recover)

    # -- pool work -----------------------------------------------------------------------

    def _begin(self, holder: LeaderInfo, sent: float) -> None:
        self._state.observe(holder)
        self._state.begin_term(holder, sent)

    def _connect(self) -> None:
        if self._state.stopping.is_set():
            return  # the next step shuts down: no connect for it to wait for
        self._backend.connect()
        if self._state.check_drained is not None:
            # Drained while this node was cut off (or stopped): known before any attempt.
            self._state.check_drained()
        self._state.connected = True
        # A new session knows no holder (a lease watching the holder's expiry forgot
        # it): attempt at once rather than when the last session's attempt said.
        self._follow_at = 0.0

    def _step_down(self, request: StepDown) -> None:
        """End the term (a step-down or a handover asked for), release it as a stop does
        (no worker waits for the release: many shards handed over at once are released
        together), then hold off competing for ``request.hold`` seconds; ``request.done``
        is set once released (or once that failed)."""
        state = self._state

        def end() -> int | None:
            try:
                state.end_term(request.reason)
                return state.releasable()
            except BaseException:
                request.finish()
                raise

        def after(held: int | None, outcome: ReleaseOutcome) -> None:
            try:
                if held is not None:
                    self._settle_release(held, outcome)  # an error: the keeper's handling
                state.hold_until = clock.monotonic() + request.hold
                if request.reason == "handover":
                    # Reserved for another node now: an attempt at once would only find
                    # it so. The new holder's acquisition is announced; attempt as a
                    # follower.
                    self._follow_at = clock.monotonic() + state.timings.retry_interval
            finally:
                request.finish()

        self._end_and_release(end, after)

    def _shut_down(self) -> None:
        """End the term, release, then close and clean up (membership, claimer, store),
        each a piece of work of its own, so that when many leaders stop at once every
        release is under way before any leader's clean-ups (see :meth:`_release_soon`)."""

        def after(held: int | None, outcome: ReleaseOutcome) -> None:
            try:
                if held is not None:
                    self._settle_release(held, outcome)
            except Exception as exc:
                self._state.stop_failed(exc)
            finally:
                self._close()

        # No more waits: a wait begun after a call that failed would only reconnect (in
        # an outage, up to the connect timeout) before the release could run.
        self._lease.on_wake(None)
        self._end_and_release(self._state.end_for_release, after)

    def _end_and_release(
        self,
        end: Callable[[], int | None],
        after: Callable[[int | None, ReleaseOutcome], None],
    ) -> None:
        """Run ``end()`` (ending the term: the term to release, if any), start that
        release (see :meth:`_release_soon`), then ``after(held, outcome)``. A lease
        without a non-blocking release ends and releases on one worker, with no hop to
        the driver's thread between."""
        if lease_ability(self._lease, "non_blocking_release") is None:
            self._work(lambda: after(end(), None))
        else:
            self._work(end, then=lambda held: self._release_soon(held, after))

    def _release_soon(
        self, held: int | None, after: Callable[[int | None, ReleaseOutcome], None]
    ) -> None:
        """Driver thread: start the release of ``held`` (if any), then run
        ``after(held, outcome)`` as pool work. A lease that starts a release without
        blocking (:class:`~rselection.abc.NonBlockingRelease`) is released like a
        renewal, with no worker waiting for it (leases released together go in one
        round trip; a locked row holds up nobody); with any other lease, or when the
        round trip could not start, ``outcome`` is ``None``: ``after`` releases."""
        lease = lease_ability(self._lease, "non_blocking_release")
        if held is None or lease is None:
            self._work(lambda: after(held, None))
            return
        node_id = self._state.node_id
        self._round_trip(
            lambda done: lease.release_soon(node_id, held, done),
            lambda: None,  # not started: the blocking release runs on a worker instead
            lambda outcome: self._work(lambda: after(held, outcome)),
        )

    def _settle_release(self, held: int, outcome: ReleaseOutcome) -> None:
        """Pool work: the blocking release if the round trip left it undone (``None``),
        or what the round trip answered (an exception is raised here)."""
        if outcome is None:
            self._state.give_back(held)
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            self._state.observe(None)

    def _close(self) -> None:
        try:
            self._state.close()
        finally:
            try:
                self._lease.on_wake(None)  # no more waits: a waiting thread, if any, ends
            finally:
                first, self._finished = not self._finished, True
                self.done.set()
                if first:  # released once: a waiter may hold it now, passing through
                    self.latch.release()

    def _work(self, fn: Callable[[], Any], *, then: Callable[[Any], None] | None = None) -> None:
        """Run ``fn`` on the driver's workers as this leader's one piece of work; then,
        on the driver's thread, ``then(result)``, or the keeper's handling of the
        exception it raised. Nothing else of this leader starts meanwhile."""
        self._busy = True

        def run() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:  # handed to the driver's thread
                error = exc
            self._driver.call(lambda: self._worked(result, error, then))

        self._pool(run, serial=True)

    def _worked(
        self, result: Any, error: BaseException | None, then: Callable[[Any], None] | None
    ) -> None:
        self._busy = self._connecting = False
        if self._finished:
            if error is not None:
                logger.error("lease %r: error while stopping", self._state.name, exc_info=error)
        elif error is not None:
            self._failed(error)
        elif then is not None:
            then(result)
        self._driver.poke(self)

    def _pool(self, fn: Callable[[], None], *, serial: bool) -> None:
        """Run ``fn`` on the driver's threads, known as this leader's while it runs:
        ``serial`` work on its workers, the rest (ending a term) on a thread at once."""

        def run() -> None:
            current = threading.current_thread()
            with self._threads_lock:
                self._threads.add(current)
            try:
                fn()
            except BaseException:
                logger.exception("lease %r: error in the leader's work", self._state.name)
            finally:
                with self._threads_lock:
                    self._threads.discard(current)

        try:
            if serial:
                if self._lane is None:
                    self._lane = self._driver.lane()
                self._lane.submit(run)
            else:
                self._driver.urgent(run)
        except RuntimeError:
            # No thread could start. Serial work stays queued for a worker; a term's end
            # is tried again on the next step (the deadline is still checked).
            logger.error("lease %r: no thread for the leader's work", self._state.name)
            if not serial:
                self._ending = None
