"""The leadership state machine shared by every backend: follow, lead, step down.

:class:`LeaseLeader` is the leader over any :class:`~rselection.lease.LeaseBackend`;
``PostgresLeader``, ``RedisLeader`` and ``SingleNodeLeader`` build a backend (and its
default claimer, checkpoint store and fence) and hand them to it.

A leader has no keeper or watchdog thread of its own: the process's one driver thread
runs the state machine for every leader (:mod:`rselection.driven`) and checks each
deadline at every step, never waiting for I/O. A lease whose round trips start without
blocking (:class:`~rselection.lease.NonBlockingLease`, Postgres's) is stepped directly;
any other lease (Redis, memory, a user's) through one adapter,
:class:`~rselection.blocking_lease.BlockingLease`, whose calls run on the driver's
workers. The deadline is ``renew_deadline`` after the last successful renewal was
*sent*, measured with :func:`rselection.clock.monotonic` (a clock that keeps counting
through suspend); because ``renew_deadline + stop_grace + 0.5 s <= ttl``, the leader has
cancelled and joined its tasks before the server lets the lease expire, and
no two nodes' wall clocks are ever compared.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

from . import clock, forks, signals
from .abc import lease_ability, store_ability
from .backoff import backoff
from .blocking_lease import BlockingLease
from .checkpoints import CheckpointStore
from .claiming import FireClaimer, LeaseClaims
from .closeable import Service
from .context import Term, TransactionFence, running_term
from .driven import DrivenKeeper
from .errors import BackendUnavailable, ConfigError, RSelectionError
from .lease import (
    Acquisition,
    HandoverRequest,
    LeaderInfo,
    LeaseBackend,
    NonBlockingLease,
)
from .members import NodeInfo
from .stop_signals import stop_on_signals
from .timing import Timings
from .validation import check_name, check_node_id, check_seconds, new_node_id

if TYPE_CHECKING:
    from .broadcast import Broadcaster
    from .tasks import TaskHandler

__all__ = ["CLEANUP_TIMEOUT", "Leader", "LeaseLeader"]

logger = logging.getLogger(__name__)

CLEANUP_TIMEOUT = 5.0
"""Seconds a stopping leader waits for each of its ``cleanup`` callables (then logs a
warning and goes on, leaving it to finish in a daemon thread)."""

_LEASE_MEMBERS = (
    "name",
    "ttl",
    "connect",
    "try_acquire",
    "renew",
    "release",
    "current",
    "wait_for_change",
    "interrupt",
    "term_ended",
    "close",
)


@runtime_checkable
class Leader(Protocol):
    """What every leader offers, whatever its backend."""

    def lead(self) -> None:
        """Run until :meth:`stop` (or Ctrl-C) in the calling thread."""

    def start(self) -> None:
        """Run in background threads; return at once."""

    def stop(self, timeout: float | None = None) -> None:
        """Cancel and join tasks, release the lease, stop every thread."""

    @property
    def is_leader(self) -> bool:
        """True while this node leads and its deadline has not passed."""

    @property
    def term(self) -> int | None:
        """The fencing term while leading, else ``None``."""

    @property
    def node_id(self) -> str:
        """This node's id."""

    def leader(self) -> LeaderInfo | None:
        """The current holder as the lease server sees it, from any node."""

    def nodes(self) -> list[NodeInfo]:
        """The nodes competing for the lease, alive or lost, with the leader flagged."""

    def wait_until_leader(self, timeout: float | None = None) -> bool:
        """Block until this node leads; ``False`` on timeout."""


class LeaseLeader(Service):
    """Leadership over any :class:`~rselection.LeaseBackend`: the one state machine.

    Competes for ``lease`` and, while it holds it, runs ``handler``'s tasks; every task
    is cancelled and joined the moment leadership is lost or in doubt, and the lease is
    released only after that. ``PostgresLeader``, ``RedisLeader`` and
    ``SingleNodeLeader`` are this class over their own lease; build one directly to lead
    over a backend of your own (an etcd lease, say) and check it with
    :class:`rselection.testing.LeaderConformance`.

    Example::

        leader = rs.LeaseLeader(MyLease("billing", ttl=15), tasks)
        leader.lead()

    Args:
        lease: the lease to compete for; the leader's name is ``lease.name``, and its
            ``ttl`` (seconds, or a :class:`~datetime.timedelta`) is how long the lease
            lasts on the server after a renewal.
        handler: the tasks to run while leading.
        node_id: this node's id (default: host, pid and a random suffix).
        ttl: the ttl the leader's deadline and ``stop_grace`` are reckoned on, seconds
            (default: the lease's ``ttl``). A lease whose ``ttl`` is shorter is
            refused: the leader must stop before its lease can pass on.
        renew_interval: seconds between renewals (default 2).
        renew_deadline: step down when no renewal succeeded for this long (default 10).
        retry_interval: a follower's polling period, jittered (default 2).
        timings: the four timings above as one :class:`~rselection.timing.Timings`
            (instead of them).
        claimer: claims each scheduled fire before it runs, so a fire runs once across
            the fleet and a new leader finds the fires missed while none led (any
            :class:`~rselection.FireClaimer`; ``None`` runs every fire unclaimed). Claim
            keys are ``"<lease name>/<fire key>"``, with ``%`` and ``/`` in the lease
            name written ``%25`` and ``%2F``; missed fires are claimed in one call when
            the claimer has ``claim_missed``, else fire by fire.
        checkpoint_store: keeps ``ctx.checkpoint`` (a
            :class:`~rselection.checkpoints.CheckpointStore`; ``None``: tasks have no
            checkpoint). A store that fences against lease objects (a
            :class:`~rselection.MemoryCheckpointStore`) is given this lease.
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        fence: fences a task's transaction to its term for ``ctx.fence`` /
            ``ctx.afence`` (a :class:`~rselection.context.TransactionFence`); ``None``
            when the lease cannot, and then ``ctx.fence`` raises ``ConfigError``.
        cleanup: called once each, in order, when the leader has stopped and released
            its lease (how a factory closes the claimer, store or client it built for
            the leader). Each runs in a thread of its own and is waited for at most
            :data:`CLEANUP_TIMEOUT` seconds; one that raises (anything, ``SystemExit``
            too) is logged, one still running then is logged and left running, and the
            rest run either way.

    Raises:
        ConfigError: bad arguments or inconsistent timings (the message shows the math).
    """

    def __init__(
        self,
        lease: LeaseBackend,
        handler: TaskHandler,
        *,
        node_id: str | None = None,
        ttl: float | None = None,
        renew_interval: float | None = None,
        renew_deadline: float | None = None,
        retry_interval: float | None = None,
        timings: Timings | None = None,
        claimer: FireClaimer | None = None,
        checkpoint_store: CheckpointStore | None = None,
        broadcaster: Broadcaster | None = None,
        fence: TransactionFence | None = None,
        cleanup: Iterable[Callable[[], object]] = (),
    ) -> None:
        if not isinstance(lease, LeaseBackend):
            missing = [m for m in _LEASE_MEMBERS if not hasattr(lease, m)]
            raise ConfigError(
                f"lease must be a LeaseBackend ({', '.join(_LEASE_MEMBERS)}), got "
                f"{type(lease).__name__}, which has no {', '.join(missing) or 'such members'}"
                " (a lease's ttl is the seconds it lasts on the server after a renewal)"
            )
        self._name = check_name(lease.name, "lease name")
        self._timings = _leader_timings(
            lease, timings, ttl, renew_interval, renew_deadline, retry_interval
        )
        self._stop_grace = self._timings.stop_grace(handler.stop_grace)
        if claimer is not None and not isinstance(claimer, FireClaimer):
            raise ConfigError(
                "claimer must have claim(fire_key, *, term) and ttl (a PostgresClaimer, "
                f"RedisClaimer or MemoryClaimer), or be None, got {type(claimer).__name__}"
            )
        if checkpoint_store is not None and not isinstance(checkpoint_store, CheckpointStore):
            raise ConfigError(
                "checkpoint_store must have load(key), save(key, state, *, term, name) and "
                "delete(key, *, term, name) (a PostgresCheckpointStore or "
                f"MemoryCheckpointStore), or be None, got {type(checkpoint_store).__name__}"
            )
        if fence is not None and not isinstance(fence, TransactionFence):
            raise ConfigError(
                "fence must have fence(conn, term) and afence(conn, term), or be None, got "
                f"{type(fence).__name__}"
            )
        self._node_id = check_node_id(node_id) if node_id is not None else new_node_id()
        # A default id names the process that starts (host, pid): a leader built before a
        # fork (gunicorn --preload) takes a new one in each child (see _fix_node_id).
        self._default_node_id = node_id is None
        self._node_id_pid = os.getpid()
        if claimer is not None:
            handler.check_claims(claimer.ttl)
        fenced_store = store_ability(checkpoint_store, "add_lease")
        if fenced_store is not None:
            fenced_store.add_lease(lease)
        self._lease = lease
        # What the driven keeper steps: the lease itself when its round trips start
        # without blocking, else the one adapter of blocking leases.
        backend: LeaseBackend
        driven: NonBlockingLease
        non_blocking = lease_ability(lease, "non_blocking")
        if non_blocking is not None:
            backend, driven = lease, non_blocking
        else:
            adapter = BlockingLease(lease)
            backend, driven = adapter, adapter
        self._backend = backend
        self._handovers = lease_ability(lease, "handover")
        self._schedule = lease_ability(lease, "shared_schedule")
        self._handler = handler
        self._broadcaster = broadcaster
        self._fence = fence
        self._claimer = claimer
        self._claims = None if claimer is None else LeaseClaims(claimer, self._name)
        self._checkpoint_store = checkpoint_store
        self._cleanup = list(cleanup)
        self._created_at = datetime.now(UTC)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set by a sharded leader on each shard's leader: its terms' ctx.shard/ctx.shards.
        self._shard: int | None = None
        self._shards: int | None = None

        self._cond = threading.Condition()  # guards the fields below and wakes waiters
        self._term: Term | None = None
        self._last_term: Term | None = None  # the latest term begun (maybe still ending)
        self._closed = False
        self._transition = threading.RLock()  # one term change at a time
        self._stopping = threading.Event()
        self._step_down: _StepDown | None = None  # asked for one term, acted on by the keeper
        self._held_term: int | None = None  # a term we hold on the server, not yet released
        self._hold_until = 0.0
        self._last_sent = 0.0
        self._connected = False
        self._last_seen: tuple[str, int] | None = None
        self._fatal: ConfigError | None = None
        # Demotions a deadline or a stop forced, announced by the keeper's next step:
        # user receivers never hold up the driver, which enforces every deadline.
        self._unannounced: list[tuple[int, str]] = []
        self._driven = DrivenKeeper(self, driven, self._backend)
        self._started = False
        self._cleaning: threading.Thread | None = None  # the clean-up running on stop
        self._observer_lock = threading.Lock()
        self._forked = False  # started in a parent process: unusable in this one
        forks.register(self)

    # -- public ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The lease name."""
        return self._name

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._node_id

    @property
    def lease(self) -> LeaseBackend:
        """The lease backend this leader competes for."""
        return self._lease

    @property
    def claimer(self) -> FireClaimer | None:
        """The claimer given to the leader (claims go through it under the lease name)."""
        return self._claimer

    @property
    def checkpoint_store(self) -> CheckpointStore | None:
        """The store behind ``ctx.checkpoint`` (to inspect or seed task state), if any."""
        return self._checkpoint_store

    @property
    def handler(self) -> TaskHandler:
        """The task handler this leader runs."""
        return self._handler

    @property
    def broadcaster(self) -> Broadcaster | None:
        """The broadcaster handed to tasks, if any."""
        return self._broadcaster

    @property
    def timings(self) -> Timings:
        """The validated timings."""
        return self._timings

    @property
    def stop_grace(self) -> float:
        """Seconds this leader waits for cancelled tasks (the handler's, or what the
        timings allow)."""
        return self._stop_grace

    @property
    def is_leader(self) -> bool:
        """True while this node leads and its local deadline has not passed."""
        term = self._term
        return term is not None and term.live()

    @property
    def term(self) -> int | None:
        """The fencing term while leading, else ``None``."""
        term = self._term
        return term.number if term is not None and term.live() else None

    def leader(self) -> LeaderInfo | None:
        """The current holder as the lease server sees it (works on every node).

        After :meth:`stop` this still answers, but leaves no connection or thread open.
        """
        self._refuse_if_forked()
        with self._observer_lock:
            try:
                return self._backend.current()
            finally:
                if self._closed:
                    self._close_backend()

    def nodes(self) -> list[NodeInfo]:
        """The nodes competing for this lease. Here only this one; leaders with
        membership (Postgres) list every node from its heartbeats."""
        now = datetime.now(UTC)
        return [
            NodeInfo(
                node_id=self._node_id,
                name=self._name,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                client_addr=None,
                started_at=self._created_at,
                last_seen=now,
                alive=True,
                is_leader=self.is_leader,
            )
        ]

    def wait_until_leader(self, timeout: float | None = None) -> bool:
        """Block until this node leads; return ``False`` after ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._term is not None or self._closed or self._stopping.is_set(),
                timeout,
            )
            return self._term is not None

    def start(self) -> None:
        """Start competing for the lease in background threads; return at once.

        Raises:
            RSelectionError: the leader was started in the process this one was forked
                from (build or start it in each worker instead).
        """
        self._refuse_if_forked()
        with self._cond:
            if self._started:
                raise RuntimeError("this leader was already started; create a new one")
            self._fix_node_id()
            if self._claims is not None:  # tasks may have been registered since __init__
                self._handler.check_claims(self._claims.ttl)
            self._handler.attach()
            self._started = True
        try:
            # Before any election: a receiver (the metrics' is_leader gauge) sees every
            # node, followers included, from its start.
            signals.emit(signals.started, self, node_id=self._node_id, name=self._name)
            self._driven.start()
        except BaseException:  # Ctrl-C included: the keeper, if it started, winds down
            self._stopping.set()
            if not self._driven.running:
                self._handler.detach()
            else:
                self._driven.poke()
            raise

    def lead(self) -> None:
        """Compete and lead in this thread until :meth:`stop`, SIGTERM or Ctrl-C, then
        clean up and return.

        In the main thread, SIGTERM and SIGINT (Ctrl-C) stop the leader gracefully
        (tasks cancelled and joined, the lease released so a follower takes over at once)
        and ``lead()`` returns: a program whose last line is ``leader.lead()`` exits 0.
        The program's own handlers of both signals are put back on return.
        :meth:`start` and the context managers install no handler.

        Raises:
            ConfigError: the lease server cannot be used safely as configured (for
                example a connection pooler that is not in session mode); no task ran
                after the problem was found.
        """
        self._refuse_if_forked()
        with stop_on_signals(f"leader {self._name!r}") as signalled:
            try:
                # A signal may come while starting, when the first term may already run.
                self.start()
                while not self._wait_stopped(0.5):
                    pass
            except KeyboardInterrupt:
                signalled.stop_begins()
                self.stop()
        if self._fatal is not None:
            raise self._fatal

    def stop(self, timeout: float | None = None) -> None:
        """Cancel and join tasks, release the lease so a follower takes over at once.

        Works from any thread. Called from one of this leader's own tasks, from a signal
        receiver running on its keeper or watchdog, or from the event loop its async tasks
        run on, it only asks the leader to stop and returns at once (waiting there would
        wait for itself).

        When ``timeout`` runs out first, the term may already be over (tasks cancelled and
        joined, ``is_leader`` false) while ``demoted`` is still to come: the keeper sends
        it once its round trip in flight ends.

        Args:
            timeout: seconds this call may take in all (default: until stopped, which is
                bounded by ``stop_grace`` plus one release, plus at most
                :data:`CLEANUP_TIMEOUT` per ``cleanup`` callable; on a follower whose
                backend fails to :meth:`~rselection.LeaseBackend.interrupt` its wait,
                also the rest of that wait, at most the lease's ``ttl``).
        """
        if self._forked:  # the parent's threads are not in this process: nothing runs
            return
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        self._interrupt_backend()
        self._driven.poke()
        if self._called_from_inside():
            return
        if self._driven.running:
            self._driven.done.wait(timeout)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): a leader not yet started
        takes a node id of this process if its id was the default; a started one is
        the parent's and refuses to run here (``is_leader`` False, :meth:`start` and
        :meth:`lead` raise, :meth:`stop` returns at once), and its terms are over here
        (the contexts of its tasks in a process a task forked see them ended)."""
        # A parent's thread may have held these at the fork (leader() holds its lock
        # across a round trip): in this process nothing would ever let go of them.
        self._cond = threading.Condition()
        self._observer_lock = threading.Lock()
        if self._started:
            self._forked = True
            for term in (self._term, self._last_term):
                if term is not None:  # seen over by the tasks' contexts in this process
                    term.reset_after_fork()
            self._term = None
            self._closed = True
        else:
            self._fix_node_id()

    def _refuse_if_forked(self) -> None:
        if self._forked:
            raise RSelectionError(
                f"leader {self._name!r} was started in process {self._node_id_pid}, and "
                f"this process ({os.getpid()}) is a fork of it: a leader cannot go on "
                f"in a forked child; {forks.FORK_ADVICE}"
            )

    def _fix_node_id(self) -> None:
        """A default node id is this process's: taken anew in a forked child."""
        if self._default_node_id and self._node_id_pid != os.getpid():
            self._node_id_pid = os.getpid()
            self._node_id = new_node_id()
            self._adopt_node_id(self._node_id)

    def _adopt_node_id(self, node_id: str) -> None:
        """Pass a new default ``node_id`` on to what was built with the old one (the
        factories' membership and claimer)."""

    def _wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the keeper to end; ``True`` once it has."""
        return self._driven.done.wait(timeout)

    def step_down(self, *, hold: float = 0.0, wait: bool = True) -> None:
        """Give leadership up now: cancel and join tasks, release, then compete again.

        Args:
            hold: seconds to stay a follower before competing again (lets another node
                take over).
            wait: block until the term has ended (never from this leader's own tasks,
                receivers or event loop, where it returns at once).
        """
        with self._cond:
            term = self._term
            if term is None:
                return
            earlier = self._step_down
            request = self._step_down = _StepDown(term.number, hold, "step_down")
            if earlier is not None and earlier.term == term.number:
                # One step-down answers both callers (the latest hold counts).
                request.superseded.append(earlier)
        self._interrupt_backend()
        self._driven.poke()
        if wait and not self._called_from_inside():
            term.ended.wait()
            # The release follows the tasks' end: once it is done another node may lead
            # (bounded: a lease that cannot be released passes on when it expires).
            request.done.wait(self._timings.ttl)

    def _called_from_inside(self) -> bool:
        """True on a thread or loop whose work this leader's stop would wait for."""
        if threading.current_thread() is self._cleaning or self._driven.inside():
            return True
        running = running_term.get()
        if running is not None and running in (self._term, self._last_term):
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        return loop is self._loop

    async def __aenter__(self) -> Self:
        """Start, and run async tasks on the loop that entered the block."""
        self._loop = asyncio.get_running_loop()
        self.start()
        return self

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, node_id={self._node_id!r}, "
            f"term={self.term})"
        )

    # -- the keeper's state, stepped by the driven keeper --------------------------------

    def _step_down_pending(self) -> bool:
        """A step-down is asked of the term still led (its interrupt ended a round trip)."""
        with self._cond:
            term, request = self._term, self._step_down
        return term is not None and request is not None and request.term == term.number

    def _recover_session(self, reason: str, failures: int) -> float:
        """End the term (tasks joined), only then drop the session; the seconds to back
        off before the next attempt."""
        self._connected = False
        self._end_term(reason)
        self._announce()
        self._held_term = None  # the server ends a dead session's lease
        self._close_backend()
        return backoff(failures)

    def _follow_timeout(self, attempt: Acquisition) -> float:
        """How long a follower may wait before trying again.

        Until the holder's lease expires nothing can change but a release or the holder's
        session ending, and the backend wakes us for both; so wait until expiry (server
        measured), at least ``retry_interval``, plus jitter so followers do not stampede.
        A free lease with ``expires_in > 0`` is reserved for another node that long.
        """
        t = self._timings
        schedule = self._schedule
        jitter = 0.0 if schedule is not None else random.uniform(0.0, 0.1 * t.retry_interval)
        if attempt.holder is None:
            if attempt.expires_in > 0:
                # Free but reserved for another node (a requested handover) this long;
                # its acquisition notifies us sooner.
                wait = min(attempt.expires_in, t.ttl) + jitter
            else:
                return min(t.retry_interval, 0.05) + jitter  # lost a race: look again soon
        else:
            wait = max(t.retry_interval, min(attempt.expires_in, t.ttl)) + jitter
        if schedule is not None:
            # Attempt with the backend's other leases (its grid's phase differs from
            # other processes', which spreads the fleet as jitter would).
            now = clock.monotonic()
            wait = schedule.attempt_slot(now + wait, t.retry_interval / 2) - now
        return wait

    #: Whether a follower woken only by another node's acquisition follows the holder
    #: its notification announces instead of attempting (see
    #: :class:`~rselection.lease.AnnouncesHolder`). On for a sharded leader's shards,
    #: whose moves would otherwise cost every node an attempt each; off elsewhere: with a
    #: thousand leases per process it left the followers' attempts out of step with the
    #: keeper's attempt slots (measured: 18 statements per second per idle follower
    #: against 7, and a graceful handover of 1,000 leases 40 % slower).
    _follows_announcements = False

    def _takeover_delay(self) -> float:
        """Seconds a follower woken by a possible change waits before it attempts (the
        driven keeper asks once per wake); 0: at once. A sharded leader's shard waits
        when another node is planned to take it over."""
        return 0.0

    def _renewal_due(self) -> float:
        """When the term's next renewal is due (:func:`rselection.clock.monotonic`)."""
        due = self._last_sent + self._timings.renew_interval
        if self._schedule is not None:
            # Earlier, never later: renew with the backend's other leases.
            due = self._schedule.renewal_slot(due, self._timings.renew_interval, self._last_sent)
        return due

    def _extend(self, term: Term, sent: float) -> bool | None:
        """Move ``term``'s deadline after a renewal sent at ``sent``; ``None`` when the
        term is no longer the current one, ``False`` when its deadline had passed."""
        with self._cond:
            if self._term is not term:
                return None
            # A passed deadline is final: tasks may already have seen the term as over.
            extended = term.extend(sent + self._timings.renew_deadline)
            if extended:
                self._last_sent = sent
        return extended

    def _hand_over(self, term: Term, request: HandoverRequest) -> None:
        """Step down because an operator asked (the next keeper step does it).

        No local hold: the lease server keeps this node (and, with ``request.to``, every
        node but that one) from taking the lease until another node took it or the
        request lapsed, so this node follows the new leader as soon as there is one.
        """
        if request.term != term.number or request.to == self._node_id:
            return
        logger.info(
            "node %s hands %r over on request (term %d, to %s)",
            self._node_id,
            self._name,
            term.number,
            request.to or "any other node",
        )
        with self._cond:
            if self._step_down is None:
                self._step_down = _StepDown(term.number, 0.0, "handover")

    def _release(self) -> None:
        """Give the held term back, never before that term's tasks are joined."""
        held = self._releasable()
        if held is not None:
            self._give_back(held)

    def _give_back(self, held: int) -> None:
        """Release ``held`` (its tasks joined, its end announced) through the backend."""
        self._backend.release(self._node_id, held)
        self._observe(None)

    def _releasable(self) -> int | None:
        """Take the held term to give back, once its tasks are joined and its end
        announced; ``None`` when there is none, or it must not be given back."""
        held, self._held_term = self._held_term, None
        if held is None or not self._connected:
            return None
        last = self._last_term
        if last is not None and last.number == held and not last.ended.wait(self._join_bound()):
            # Its tasks are neither joined nor reported stuck: keep the lease until it
            # expires rather than hand it on while they may run.
            logger.error(
                "lease %r: term %d did not finish ending; not releasing it", self._name, held
            )
            return None
        self._announce()  # the demotion, before anyone else can lead
        return held

    def _join_bound(self) -> float:
        """Longest an ending term can take: ``stop_grace`` plus time to unwind."""
        return self._stop_grace + 5.0

    def _shutdown(self) -> None:
        try:
            self._stop_leading()
        finally:
            self._close()

    def _stop_leading(self) -> None:
        """The first half of a shut-down: end the term, announce it, release the lease
        (errors logged: the lease then passes on when it expires)."""
        held = self._end_for_release()
        if held is None:
            return
        try:
            self._give_back(held)
        except Exception as exc:
            self._stop_failed(exc)

    def _end_for_release(self) -> int | None:
        """End the term on stop and announce it; the term to give back, if any (errors
        logged)."""
        try:
            self._end_term("stopped")
            self._announce()
            return self._releasable()
        except Exception as exc:
            self._stop_failed(exc)
            return None

    def _stop_failed(self, exc: Exception) -> None:
        """Log what kept a shut-down from releasing (the lease then passes on by itself)."""
        if isinstance(exc, BackendUnavailable):
            logger.warning("lease %r: could not release on stop (%s)", self._name, exc)
        else:
            logger.error("lease %r: error while stopping", self._name, exc_info=exc)

    def _close(self) -> None:
        """The second half of a shut-down, whatever the first did: close the backend,
        free the handler, run the clean-ups, and let ``stop()`` return."""
        # Whatever a clean-up does, the handler is free again and the threads end.
        try:
            self._close_backend()
            self._handler.detach()
        finally:
            try:
                self._run_cleanup()
            finally:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()

    def _close_backend(self) -> None:
        try:
            self._backend.close()
        except Exception:  # closing is best effort; the server drops dead sessions
            logger.debug("lease %r: error while closing the backend", self._name, exc_info=True)

    def _interrupt_backend(self) -> None:
        """Wake the keeper from the backend's wait; a failure is the backend being
        unavailable: logged, and the keeper wakes at its wait's timeout instead."""
        try:
            self._backend.interrupt()
        except Exception:
            logger.warning(
                "lease %r: the backend's interrupt() failed; the keeper wakes at its next "
                "timeout instead",
                self._name,
                exc_info=True,
            )

    def _tell_term_ended(self, number: int) -> None:
        """Tell the backend a term ended; a failure is the backend being unavailable:
        logged, and the leader goes on (demotion, release, or the lease expires)."""
        try:
            self._backend.term_ended(number)
        except Exception:
            logger.warning(
                "lease %r: the backend's term_ended(%d) failed; going on with the stop or "
                "step-down",
                self._name,
                number,
                exc_info=True,
            )

    def _run_cleanup(self) -> None:
        """Run each clean-up in order, each in a daemon thread waited for at most
        :data:`CLEANUP_TIMEOUT`; whatever one does (raise, exit, hang), the rest run."""
        cleanup, self._cleanup = self._cleanup, []
        for fn in cleanup:
            thread = threading.Thread(
                target=self._clean_up, args=(fn,), name=f"rselection-cleanup-{self._name}"
            )
            thread.daemon = True
            self._cleaning = thread  # a clean-up that calls stop() must not wait for itself
            thread.start()
            thread.join(CLEANUP_TIMEOUT)
            if thread.is_alive():
                logger.warning(
                    "lease %r: a clean-up on stop (%r) still runs after %g s; going on "
                    "without waiting for it",
                    self._name,
                    fn,
                    CLEANUP_TIMEOUT,
                )

    def _clean_up(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException:  # best effort, SystemExit included: the rest still run
            logger.exception("lease %r: error in a clean-up on stop (%r)", self._name, fn)

    def _observe(self, holder: LeaderInfo | None) -> None:
        seen = (holder.node_id, holder.term) if holder is not None else None
        if seen != self._last_seen:
            self._last_seen = seen
            signals.emit(
                signals.leader_changed,
                self,
                name=self._name,
                leader=holder,
                **self._shard_signal(),
            )

    # -- terms ------------------------------------------------------------------------

    def _begin_term(self, holder: LeaderInfo, sent: float) -> None:
        term = Term(
            holder.term,
            self._node_id,
            self._name,
            deadline=sent + self._timings.renew_deadline,
            broadcaster=self._broadcaster,
            fence=self._fence,
            claimer=self._claims,
            checkpoint_store=self._checkpoint_store,
            nodes=self.nodes,
            shard=self._shard,
            shards=self._shards,
        )
        with self._transition:
            # Whatever the watchdog ended meanwhile is announced before this term.
            self._announce()
            if not term.live():
                # Acquired, but its local deadline passed already (the keeper waited
                # here behind a term that took long to end): never start it; the next
                # step releases it.
                logger.warning(
                    "lease %r: term %d came too late to be led; releasing it",
                    self._name,
                    term.number,
                )
                self._held_term = holder.term
                return
            with self._cond:
                self._term = term
                self._last_term = term
                self._held_term = holder.term
                self._last_sent = sent
                self._cond.notify_all()
            self._handler.start_term(term, self._loop)
        logger.info("node %s leads %r with term %d", self._node_id, self._name, term.number)
        signals.emit(
            signals.elected,
            self,
            node_id=self._node_id,
            term=term.number,
            name=self._name,
            **self._shard_signal(),
        )

    def _end_term(
        self, reason: str, expected: Term | None = None, *, announce: bool = True
    ) -> None:
        """Cancel the current term and join its tasks (up to ``stop_grace``); then let
        the backend end the session that held it, and announce the demotion (or, with
        ``announce=False``, leave that to the keeper's next step)."""
        with self._transition:
            term = self._term
            if term is None or (expected is not None and term is not expected):
                return
            try:
                term.cancel()
                with self._cond:
                    self._term = None
                    if self._step_down is not None and self._step_down.term == term.number:
                        self._step_down.finish()
                        self._step_down = None  # asked of this term only
                    self._cond.notify_all()
                log = (
                    logger.info
                    if reason in ("stopped", "step_down", "handover")
                    else logger.warning
                )
                log(
                    "node %s stops leading %r (term %d): %s",
                    self._node_id,
                    self._name,
                    term.number,
                    reason,
                )
                self._handler.end_term(self._stop_grace)
            finally:
                if not announce:  # queued before `ended`: a release announces it first
                    with self._cond:
                        self._unannounced.append((term.number, reason))
                term.ended.set()
                self._tell_term_ended(term.number)
        if announce:
            self._send_demoted(term.number, reason)

    def _announce(self) -> None:
        """Send the demotions a deadline or a stop forced (on the keeper's lane, in order)."""
        with self._cond:
            pending, self._unannounced = self._unannounced, []
        for number, reason in pending:
            self._send_demoted(number, reason)

    def _send_demoted(self, term: int, reason: str) -> None:
        signals.emit(
            signals.demoted,
            self,
            node_id=self._node_id,
            term=term,
            name=self._name,
            reason=reason,
            **self._shard_signal(),
        )

    def _shard_signal(self) -> dict[str, int]:
        """``shard=`` for the signals of a shard's leader; nothing for any other leader
        (receivers written before sharding keep their signatures)."""
        return {} if self._shard is None else {"shard": self._shard}


@dataclass(frozen=True)
class _StepDown:
    """A step-down asked of one term: it lapses when that term ends another way."""

    term: int
    hold: float
    reason: str  # "step_down", or "handover" when an operator asked
    done: threading.Event = field(default_factory=threading.Event, compare=False)
    """Set once the term is released (or the request lapsed, or failed)."""
    superseded: list[_StepDown] = field(default_factory=list, compare=False)
    """Earlier requests of the same term this one replaced: done when this one is."""

    def finish(self) -> None:
        """Set :attr:`done`, and that of every request this one replaced."""
        self.done.set()
        for earlier in self.superseded:
            earlier.finish()


def _leader_timings(
    lease: LeaseBackend,
    timings: Timings | None,
    ttl: float | None,
    renew_interval: float | None,
    renew_deadline: float | None,
    retry_interval: float | None,
) -> Timings:
    """The leader's timings from ``timings`` or the four values, checked against the
    lease's own ttl."""
    given = (ttl, renew_interval, renew_deadline, retry_interval)
    lease_ttl = check_seconds(lease.ttl, f"the ttl of lease {lease.name!r}")
    if timings is not None:
        if any(value is not None for value in given):
            raise ConfigError(
                "pass timings= or ttl/renew_interval/renew_deadline/retry_interval, not both"
            )
        if not isinstance(timings, Timings):
            raise ConfigError(f"timings must be a Timings, got {type(timings).__name__}")
    else:
        default = Timings()
        timings = Timings(
            ttl if ttl is not None else lease_ttl,
            renew_interval if renew_interval is not None else default.renew_interval,
            renew_deadline if renew_deadline is not None else default.renew_deadline,
            retry_interval if retry_interval is not None else default.retry_interval,
        )
    if lease_ttl < timings.ttl - 1e-9:
        raise ConfigError(
            f"lease {lease.name!r} expires {lease_ttl:g}s after a renewal, sooner than the "
            f"leader's ttl of {timings.ttl:g}s on which its deadline and stop_grace are "
            f"reckoned, so another node could lead while this one still does: pass "
            f"ttl={lease_ttl:g} (or less) to the leader, or give the lease a longer ttl"
        )
    return timings
