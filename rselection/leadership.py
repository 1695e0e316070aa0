"""One leader's terms: the state its engine steps, and the work on it.

:class:`Leadership` is what the leadership state machine reads and changes for one
:class:`~rselection.leader.LeaseLeader`: the current term and the one still to give back,
the holder last seen, a step-down asked for, the demotions still to announce; and the
pieces of work the engine (:class:`~rselection.driven.DrivenKeeper`) runs on its workers:
begin a term, end it (tasks cancelled and joined), release, recover a lost session,
close. The leader is the public face over it (start, stop, step down, the properties);
the engine drives it. Neither reaches into the other: both hold a ``Leadership``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from . import clock, signals
from .abc import CheckpointStore, LeaseBackend, lease_ability
from .backoff import backoff
from .claiming import LeaseClaims
from .clean_ups import run_clean_ups
from .context import Term, TransactionFence
from .errors import BackendUnavailable, ConfigError
from .history import OPERATOR, end_reason_of
from .lease import Acquisition, HandoverRequest, LeaderInfo
from .members import NodeInfo
from .timing import Timings

if TYPE_CHECKING:
    from blinker import NamedSignal

    from .broadcast import Broadcaster
    from .task_board import TaskBoard
    from .tasks import TaskHandler

__all__ = ["CLEANUP_TIMEOUT", "EXPIRY_BACKSTOP", "Leadership", "StepDown"]

# The leader's logger: what a term's beginning and end log is the leader's.
logger = logging.getLogger("rselection.leader")

CLEANUP_TIMEOUT = 5.0
"""Seconds a stopping leader waits for each of its ``cleanup`` callables (then logs a
warning and goes on, leaving it to finish in a daemon thread)."""

EXPIRY_BACKSTOP = 10
"""Lease periods between a follower's own attempts while its lease watches the holder's
expiry (ability ``"watches_expiry"``): the lease wakes it when the holder's lease may be
taken; these attempts only make up for a wake-up that went missing (at 1,000 leases, an
attempt per lease period was 67 round trips a second)."""


@dataclass(frozen=True)
class StepDown:
    """A step-down asked of one term: it lapses when that term ends another way."""

    term: int
    hold: float
    reason: str  # "step_down"; "handover" when an operator asked; "drained"
    done: threading.Event = field(default_factory=threading.Event, compare=False)
    """Set once the term is released (or the request lapsed, or failed)."""
    superseded: list[StepDown] = field(default_factory=list, compare=False)
    """Earlier requests of the same term this one replaced: done when this one is."""

    def finish(self) -> None:
        """Set :attr:`done`, and that of every request this one replaced."""
        self.done.set()
        for earlier in self.superseded:
            earlier.finish()


@dataclass(eq=False, repr=False, kw_only=True)
class Leadership:
    """One leader's terms and the work on them (see the module docstring).

    The fields under :attr:`cond` are read by any thread and changed under it; the
    rest are the engine's, changed by one piece of its work at a time.

    Args:
        sender: the leader, sender of the signals (``elected``, ``demoted``,
            ``leader_changed``).
        backend: the lease as the engine calls it (the user's lease, or the adapter of
            a blocking one).
        lease: the user's lease, asked for its optional abilities (handovers, a shared
            schedule).
        nodes: what a term's ``ctx.nodes()`` calls.
        takeover_delay: seconds a follower woken by a possible change waits before it
            attempts (asked once per wake; 0: at once).
        follows_announcements: whether a follower woken only by another node's
            acquisition follows the holder its notification announces instead of
            attempting (see :class:`~rselection.abc.AnnouncesHolder`).
    """

    sender: object
    name: str
    node_id: str
    timings: Timings
    stop_grace: float
    handler: TaskHandler
    backend: LeaseBackend
    lease: InitVar[LeaseBackend]
    broadcaster: Broadcaster | None
    fence: TransactionFence | None
    claims: LeaseClaims | None
    checkpoint_store: CheckpointStore | None
    cleanup: list[Callable[[], object]]
    nodes: Callable[[], list[NodeInfo]]
    takeover_delay: Callable[[], float]
    follows_announcements: bool
    version: str | None = None  # the release this node runs (validated)
    eligible: bool = True  # False: a member that never attempts to lead

    def __post_init__(self, lease: LeaseBackend) -> None:
        self.handovers = lease_ability(lease, "handover")
        self.schedule = lease_ability(lease, "shared_schedule")
        self.history = lease_ability(self.backend, "records_history")
        # The term whose handover this node asked for itself (a newer version's node
        # leads): its record's `by` is nobody's; any other handover an operator asked,
        # unless the fleet moves them itself (a shard's, which its rebalancer moves).
        self.own_handover_term: int | None = None
        self.handovers_by_operator = True
        self.given_eligible = self.eligible  # as given: eligible unless drained (see drains)
        # Reads whether this node is drained and acts on it (a leader with membership
        # sets it), and the task controls of a leader that keeps them: run on every
        # (re)connect, before any attempt.
        self.check_drained: Callable[[], None] | None = None
        # The task controls and run history of the leader's terms (a leader with a task
        # store sets it; a shard's leader keeps none).
        self.tasks: TaskBoard | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # async tasks run here
        # A shard's leader's terms know their shard (ctx.shard, ctx.shards).
        self.shard: int | None = None
        self.shards: int | None = None

        self.cond = threading.Condition()  # guards the fields below and wakes waiters
        self.term: Term | None = None
        self.acquired_at: datetime | None = None  # the current term's, server time
        self.last_term: Term | None = None  # the latest term begun (maybe still ending)
        self.closed = False
        self.stopping = threading.Event()
        self.step_down_request: StepDown | None = None  # acted on by the engine
        self.transition = threading.RLock()  # one term change at a time
        self.held_term: int | None = None  # a term held on the server, not yet released
        self.hold_until = 0.0  # a step-down's hold: no attempt before this
        self.last_sent = 0.0  # when the last successful renewal was sent
        self.connected = False
        self.last_seen: tuple[str, int] | None = None  # the holder last seen, its term
        self.fatal: ConfigError | None = None  # what stopped the leader for good
        # Demotions a deadline or a stop forced, announced by the engine's next step:
        # user receivers never hold up the driver, which enforces every deadline.
        self.unannounced: list[tuple[int, str]] = []
        self.cleaning: threading.Thread | None = None  # the clean-up running on stop

    def has_unannounced(self) -> bool:
        """Whether demotions wait to be announced."""
        with self.cond:
            return bool(self.unannounced)

    def take_step_down(self, term: Term) -> StepDown | None:
        """The step-down asked of ``term``, taken to be acted on; ``None``: none."""
        with self.cond:
            request = self.step_down_request
            if request is None or request.term != term.number:
                return None
            self.step_down_request = None
            return request

    def ask_step_down(self, term: Term, reason: str, hold: float = 0.0) -> StepDown | None:
        """Ask ``term`` to step down for ``reason`` (an earlier request of the same term
        is answered with this one); ``None`` when ``term`` is no longer led. The caller
        then wakes the engine (``interrupt_backend`` and a poke)."""
        with self.cond:
            if self.term is not term:
                return None
            earlier = self.step_down_request
            request = self.step_down_request = StepDown(term.number, hold, reason)
            if earlier is not None and earlier.term == term.number:
                request.superseded.append(earlier)
            return request

    def step_down_pending(self) -> bool:
        """A step-down is asked of the term still led (its interrupt ended a round trip)."""
        with self.cond:
            term, request = self.term, self.step_down_request
        return term is not None and request is not None and request.term == term.number

    def recover_session(self, reason: str, failures: int) -> float:
        """End the term (tasks joined), only then drop the session; the seconds to back
        off before the next attempt."""
        self.connected = False
        self.end_term(reason)
        self.announce()
        self.held_term = None  # the server ends a dead session's lease
        self.close_backend()
        return backoff(failures)

    def follow_timeout(self, attempt: Acquisition, *, watched: bool = False) -> float:
        """How long a follower may wait before trying again.

        Until the holder's lease expires nothing can change but a release or the holder's
        session ending, and the backend wakes us for both; so wait until expiry (server
        measured), at least ``retry_interval``, plus jitter so followers do not stampede.
        A free lease with ``expires_in > 0`` is reserved for another node that long.
        When the lease ``watched`` the holder's expiry itself (ability
        ``"watches_expiry"``), it wakes us for that too: attempt only every
        :data:`EXPIRY_BACKSTOP` lease periods, in case a wake went missing.
        """
        t = self.timings
        schedule = self.schedule
        jitter = 0.0 if schedule is not None else random.uniform(0.0, 0.1 * t.retry_interval)
        if attempt.holder is None:
            if attempt.expires_in > 0:
                # Free but reserved for another node (a requested handover) this long;
                # its acquisition notifies us sooner.
                wait = min(attempt.expires_in, t.ttl) + jitter
            else:
                return min(t.retry_interval, 0.05) + jitter  # lost a race: look again soon
        elif watched:
            wait = EXPIRY_BACKSTOP * t.ttl + jitter
        else:
            wait = max(t.retry_interval, min(attempt.expires_in, t.ttl)) + jitter
        if schedule is not None:
            # Attempt with the backend's other leases (its grid's phase differs from
            # other processes', which spreads the fleet as jitter would).
            now = clock.monotonic()
            wait = schedule.attempt_slot(now + wait, t.retry_interval / 2) - now
        return wait

    def renewal_due(self) -> float:
        """When the term's next renewal is due (:func:`rselection.clock.monotonic`)."""
        due = self.last_sent + self.timings.renew_interval
        if self.schedule is not None:
            # Earlier, never later: renew with the backend's other leases.
            due = self.schedule.renewal_slot(due, self.timings.renew_interval, self.last_sent)
        return due

    def extend(self, term: Term, sent: float) -> bool | None:
        """Move ``term``'s deadline after a renewal sent at ``sent``; ``None`` when the
        term is no longer the current one, ``False`` when its deadline had passed."""
        with self.cond:
            if self.term is not term:
                return None
            # A passed deadline is final: tasks may already have seen the term as over.
            extended = term.extend(sent + self.timings.renew_deadline)
            if extended:
                self.last_sent = sent
        return extended

    def hand_over(self, term: Term, request: HandoverRequest) -> None:
        """Step down because an operator asked (the next keeper step does it).

        No local hold: the lease server keeps this node (and, with ``request.to``, every
        node but that one) from taking the lease until another node took it or the
        request lapsed, so this node follows the new leader as soon as there is one.
        """
        if request.term != term.number or request.to == self.node_id:
            return
        logger.info(
            "node %s hands %r over on request (term %d, to %s)",
            self.node_id,
            self.name,
            term.number,
            request.to or "any other node",
        )
        with self.cond:
            if self.step_down_request is None:
                # A holder that is not eligible was drained (a drained holder asks for
                # its own successor): its term ends for that.
                reason = "handover" if self.eligible else "drained"
                self.step_down_request = StepDown(term.number, 0.0, reason)

    def release(self) -> None:
        """Give the held term back, never before that term's tasks are joined."""
        held = self.releasable()
        if held is not None:
            self.give_back(held)

    def give_back(self, held: int) -> None:
        """Release ``held`` (its tasks joined, its end announced) through the backend."""
        self.backend.release(self.node_id, held)
        self.observe(None)

    def releasable(self) -> int | None:
        """Take the held term to give back, once its tasks are joined and its end
        announced; ``None`` when there is none, or it must not be given back."""
        held, self.held_term = self.held_term, None
        if held is None or not self.connected:
            return None
        last = self.last_term
        if last is not None and last.number == held and not last.ended.wait(self.join_bound()):
            # Its tasks are neither joined nor reported stuck: keep the lease until it
            # expires rather than hand it on while they may run.
            logger.error(
                "lease %r: term %d did not finish ending; not releasing it", self.name, held
            )
            return None
        self.announce()  # the demotion, before anyone else can lead
        return held

    def join_bound(self) -> float:
        """Longest an ending term can take: ``stop_grace`` plus time to unwind."""
        return self.stop_grace + 5.0

    def stop_leading(self) -> None:
        """The first half of a shut-down: end the term, announce it, release the lease
        (errors logged: the lease then passes on when it expires)."""
        held = self.end_for_release()
        if held is None:
            return
        try:
            self.give_back(held)
        except Exception as exc:
            self.stop_failed(exc)

    def end_for_release(self) -> int | None:
        """End the term on stop and announce it; the term to give back, if any (errors
        logged)."""
        try:
            self.end_term("stopped")
            self.announce()
            return self.releasable()
        except Exception as exc:
            self.stop_failed(exc)
            return None

    def stop_failed(self, exc: Exception) -> None:
        """Log what kept a shut-down from releasing (the lease then passes on by itself)."""
        if isinstance(exc, BackendUnavailable):
            logger.warning("lease %r: could not release on stop (%s)", self.name, exc)
        else:
            logger.error("lease %r: error while stopping", self.name, exc_info=exc)

    def close(self) -> None:
        """The second half of a shut-down, whatever the first did: close the backend,
        free the handler, run the clean-ups, and let ``stop()`` return."""
        # Whatever a clean-up does, the handler is free again and the threads end.
        try:
            self.close_backend()
            self.handler.detach()
        finally:
            try:
                self.run_cleanup()
            finally:
                with self.cond:
                    self.closed = True
                    self.cond.notify_all()

    def close_backend(self) -> None:
        try:
            self.backend.close()
        except Exception:  # closing is best effort; the server drops dead sessions
            logger.debug("lease %r: error while closing the backend", self.name, exc_info=True)

    def interrupt_backend(self) -> None:
        """Wake the keeper from the backend's wait; a failure is the backend being
        unavailable: logged, and the keeper wakes at its wait's timeout instead."""
        try:
            self.backend.interrupt()
        except Exception:
            logger.warning(
                "lease %r: the backend's interrupt() failed; the keeper wakes at its next "
                "timeout instead",
                self.name,
                exc_info=True,
            )

    def tell_term_ending(self, number: int, reason: str) -> None:
        """Tell a lease that keeps a history why term ``number`` ends (before its
        release): who asked is the operator, unless this node asked for the handover
        itself; a failure is logged (the record then says what the release sees)."""
        if self.history is None:
            return
        asked = reason == "handover" and self.own_handover_term != number
        by = OPERATOR if reason == "drained" or (asked and self.handovers_by_operator) else None
        try:
            self.history.term_ending(number, end_reason_of(reason), by)
        except Exception:
            logger.warning(
                "lease %r: recording why term %d ended failed", self.name, number, exc_info=True
            )

    def tell_term_ended(self, number: int) -> None:
        """Tell the backend a term ended; a failure is the backend being unavailable:
        logged, and the leader goes on (demotion, release, or the lease expires)."""
        try:
            self.backend.term_ended(number)
        except Exception:
            logger.warning(
                "lease %r: the backend's term_ended(%d) failed; going on with the stop or "
                "step-down",
                self.name,
                number,
                exc_info=True,
            )

    def run_cleanup(self) -> None:
        """Run the clean-ups in order, each waited for at most :data:`CLEANUP_TIMEOUT`;
        whatever one does (raise, exit, hang), the rest run (see :mod:`.clean_ups`)."""
        cleanup, self.cleanup = self.cleanup, []
        run_clean_ups(cleanup, lease=self.name, timeout=CLEANUP_TIMEOUT, on_thread=self._cleaning)

    def _cleaning(self, thread: threading.Thread) -> None:
        self.cleaning = thread  # a clean-up that calls stop() must not wait for itself

    def observe(self, holder: LeaderInfo | None) -> None:
        seen = (holder.node_id, holder.term) if holder is not None else None
        if seen != self.last_seen:
            self.last_seen = seen
            self._signal(signals.leader_changed, leader=holder)

    # -- terms ------------------------------------------------------------------------

    def begin_term(self, holder: LeaderInfo, sent: float) -> None:
        term = Term(
            holder.term,
            self.node_id,
            self.name,
            deadline=sent + self.timings.renew_deadline,
            broadcaster=self.broadcaster,
            fence=self.fence,
            claimer=self.claims,
            checkpoint_store=self.checkpoint_store,
            nodes=self.nodes,
            shard=self.shard,
            shards=self.shards,
            tasks=self.tasks,
        )
        with self.transition:
            # Whatever the watchdog ended meanwhile is announced before this term.
            self.announce()
            if not term.live():
                # Acquired, but its local deadline passed already (the keeper waited
                # here behind a term that took long to end): never start it; the next
                # step releases it.
                logger.warning(
                    "lease %r: term %d came too late to be led; releasing it",
                    self.name,
                    term.number,
                )
                self.held_term = holder.term
                return
            with self.cond:
                # Drained while the attempt was out (a drain is read, then the term
                # looked at, under this lock): never lead it; the next step releases it.
                drained = not self.eligible
                if not drained:
                    self.term = term
                    self.acquired_at = holder.acquired_at
                    self.last_term = term
                    self.last_sent = sent
                self.held_term = holder.term
                self.cond.notify_all()
            if drained:
                logger.info(
                    "lease %r: term %d was taken as this node was drained; releasing it",
                    self.name,
                    term.number,
                )
                self.tell_term_ending(term.number, "drained")
                return
            self.handler.start_term(term, self.loop)
        logger.info("node %s leads %r with term %d", self.node_id, self.name, term.number)
        self._signal(signals.elected, node_id=self.node_id, term=term.number)

    def end_term(self, reason: str, expected: Term | None = None, *, announce: bool = True) -> None:
        """Cancel the current term and join its tasks (up to ``stop_grace``); then let
        the backend end the session that held it, and announce the demotion (or, with
        ``announce=False``, leave that to the keeper's next step)."""
        with self.transition:
            term = self.term
            if term is None or (expected is not None and term is not expected):
                return
            try:
                term.cancel()
                with self.cond:
                    self.term = None
                    if (
                        self.step_down_request is not None
                        and self.step_down_request.term == term.number
                    ):
                        self.step_down_request.finish()
                        self.step_down_request = None  # asked of this term only
                    self.cond.notify_all()
                log = (
                    logger.info
                    if reason in ("stopped", "step_down", "handover", "drained")
                    else logger.warning
                )
                log(
                    "node %s stops leading %r (term %d): %s",
                    self.node_id,
                    self.name,
                    term.number,
                    reason,
                )
                self.handler.end_term(self.stop_grace)
            finally:
                if not announce:  # queued before `ended`: a release announces it first
                    with self.cond:
                        self.unannounced.append((term.number, reason))
                self.tell_term_ending(term.number, reason)
                term.ended.set()
                self.tell_term_ended(term.number)
        if announce:
            self._send_demoted(term.number, reason)

    def announce(self) -> None:
        """Send the demotions a deadline or a stop forced (on the keeper's lane, in order)."""
        with self.cond:
            pending, self.unannounced = self.unannounced, []
        for number, reason in pending:
            self._send_demoted(number, reason)

    def _send_demoted(self, term: int, reason: str) -> None:
        self._signal(signals.demoted, node_id=self.node_id, term=term, reason=reason)

    def _signal(self, signal: NamedSignal, **payload: object) -> None:
        """Send ``signal`` from the leader with the lease's name, and ``shard=`` for a
        shard's leader only (receivers written before sharding keep their signatures)."""
        shard = {} if self.shard is None else {"shard": self.shard}
        signals.emit(signal, self.sender, name=self.name, **payload, **shard)
