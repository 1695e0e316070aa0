"""``ShardedLeader``: a fixed set of shards across a fleet, whatever the backend.

Each shard ``k`` of a sharded name is an ordinary lease, ``"<name>/<k>"``, with a
:class:`ShardLeader` of its own on every node; the holder of the coordinator lease
``"<name>"`` runs the :class:`~.rebalancer.Rebalancer`. :class:`ShardedLeader` builds
and runs them, takes a dead node's shards over in a planned order, and hands this
node's shards to the others when it stops; a backend's sharded leader supplies the
methods marked *backend* below. See ``docs/explanation/sharding.md``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .. import forks
from ..closeable import Service
from ..errors import BackendUnavailable, ConfigError, RSelectionError, StaleLeaderError
from ..history import HISTORY_LIMIT, check_history_limit
from ..leader import LeaseLeader
from ..lease import LeaderInfo
from ..member_leader import DefaultClaimer, MemberLeader, OwnClaimer
from ..sharding import (
    check_shard_name,
    check_shards,
    quotas,
    shard_lease_name,
    takeover_plan,
)
from ..stop_signals import StopSignals, stop_on_signals
from ..tasks import TaskHandler
from ..timing import Timings
from ..validation import check_node_id, check_optional_seconds, check_seconds, new_node_id
from ..versions import check_eligible, check_version
from .rebalancer import Rebalancer, ShardState

if TYPE_CHECKING:
    from ..members import NodeInfo

__all__ = [
    "HAND_OFF_WAIT",
    "SHARDS_RECORD",
    "TAKEOVER_WAIT",
    "ShardLeader",
    "ShardedLeader",
]

logger = logging.getLogger("rselection.postgres.sharded")

SHARDS_RECORD = "rselection-shards"
"""The checkpoint key (``(SHARDS_RECORD, name)``) under which the coordinator records
the number of shards of a sharded name, fenced by its term: a node built with another
number refuses to start while that coordinator leads."""


TAKEOVER_WAIT = 0.2
"""Seconds a node waits, when a keeper session died, before it competes for a shard
another node is planned to take over (the planned node then takes it first)."""

_PLAN_TTL = 0.2  # seconds a takeover plan is reused (the shards of one death ask at once)


_POLL = 0.05  # seconds between looks of the bounded waits on this node's own state

HAND_OFF_WAIT = 1.0
"""Seconds :meth:`ShardedLeader.stop` waits at most for its hand-off (leaving
the membership, then asking for a handover of each shard it leads; a few round trips).
A server that does not answer by then does not hold the stop up: the shards are
released, or expire, all the same."""


class ShardLeader(LeaseLeader):
    """The leader of one shard: a backend's leader whose terms know their shard.

    A backend's sharded leader builds one per shard from a class that derives from this
    one and from the backend's leader (``class _ShardLeader(ShardLeader, PostgresLeader)``),
    then calls :meth:`place`. Its ``ctx.nodes()`` lists the sharded leader's nodes, and a
    follower woken by another node's acquisition follows the announced holder.
    """

    _owner: ShardedLeader
    _follows_announcements = True

    def __init__(
        self, owner: ShardedLeader, shard: int, target: Any, handler: TaskHandler, **options: Any
    ) -> None:
        """The leader of ``shard`` of ``owner``: the backend's leader built on ``target``
        (its connection string or client) with ``options``, placed."""
        super().__init__(target, handler, **options)  # the backend's leader's
        self.place(owner, shard, owner.shards)
        # A node is drained under the sharded name, through its coordinator's lease:
        # no read of a drain per shard.
        self._state.check_drained = None
        # Task controls and run history are per lease, and a shard's lease is the
        # sharded leader's business: its terms keep none.
        self._state.tasks = None

    def place(self, owner: ShardedLeader, shard: int, shards: int) -> None:
        """Make this the leader of ``shard`` (of ``shards``) of ``owner``."""
        self._owner = owner
        self._state.shard = shard
        self._state.shards = shards
        # Its handovers are the rebalancer's moves (an operator's `resign` of a shard's
        # lease is recorded as one too).
        self._state.handovers_by_operator = False

    def start(self) -> None:
        """Compete for the shard's lease (no heartbeats: the node has them once, as a
        member of the coordinator's lease)."""
        LeaseLeader.start(self)

    def set_eligible(self, eligible: bool) -> None:
        """Whether this node may take the shard now (not while it is drained). A holder
        that may not keeps the shard until the rebalancer hands it on; its term then
        ends as drained."""
        self._state.eligible = eligible
        if eligible:
            self._driven.poke()  # compete again at once

    def nodes(self) -> list[NodeInfo]:
        """The sharded leader's nodes (see :meth:`ShardedLeader.nodes`)."""
        return self._owner.nodes()

    def holder_died(self) -> bool:
        """*Backend*: whether the lease server told that the holder's session died (then
        the shard goes first to the node planned to take it over). Default: never told."""
        return False

    def _takeover_delay(self) -> float:
        """When the holder died, wait :data:`TAKEOVER_WAIT` unless this node is planned
        to take the shard over (see :func:`~rselection.sharding.takeover_plan`): a dead
        node's shards are spread over the others at once, not all taken by the fastest
        and moved again."""
        shard = self._state.shard
        if shard is None or not self.holder_died():
            return 0.0
        taker = self._owner._takeover_plan().get(shard, self.node_id)
        return 0.0 if taker == self.node_id else TAKEOVER_WAIT

    def seen_holder(self) -> str | None:
        """The node that holds this shard, as this node last saw it."""
        if self.is_leader:
            return self.node_id
        seen = self._state.last_seen
        return seen[0] if seen is not None else None


class ShardedLeader(Service, ABC):
    """Leads a fixed set of shards across a fleet, whatever the backend (see the module
    docstring); each shard run by one live node.

    The handler's tasks run once per shard this node owns, with ``ctx.shard`` and
    ``ctx.shards`` set. Each shard is a lease of its own (``"<name>/<shard>"``) with its
    own term, fencing, claims and checkpoints, and losing a shard cancels and joins only
    that shard's tasks. A backend's sharded leader derives from this class: it validates
    and builds what is its own (the connection, the store, the claimer, the coordinator's
    leader), then implements the methods marked *backend*.

    Args:
        handler: the tasks to run for each owned shard (copied per shard at
            :meth:`start`: register every task before).
        name: the sharded name (no ``/``).
        shards: the number of shards (1 to 4,096); every node must use the same.
        node_id: this node's id (default: host, pid and a random suffix).
        timings: every shard's and the coordinator's lease timings.
        heartbeat_interval: seconds between this node's heartbeats.
        node_timeout: a node not seen for this long is lost (default three heartbeats).
        rebalance_interval: seconds between the coordinator's rounds.
        settle: seconds a node must have been heartbeating before it is given shards
            (default: ``heartbeat_interval``).
        max_moves: most handovers in flight at once from any one node.
        handover_valid_for: seconds a moved shard stays reserved for its target (default:
            ``stop_grace + 1``).
        eligible: ``False``: a member that never leads a shard (nor the coordinator's
            lease); the coordinator counts it out of the balance.
        version: this node's release, recorded with its heartbeats and each term it
            takes; shards never move for versions (the coordinator's lease does, as a
            leader's).
        history_limit: terms kept in the history of each shard's lease.

    Raises:
        ConfigError: bad arguments or inconsistent timings (the message shows the math).
    """

    _coordinator: MemberLeader
    """The leader of the coordinator's lease ``"<name>"`` (see :meth:`_build_coordinator`),
    whose membership is this sharded leader's: every node heartbeats as one of its nodes."""

    def __init__(
        self,
        handler: TaskHandler,
        *,
        name: str,
        shards: int,
        node_id: str | None,
        timings: Timings,
        heartbeat_interval: float,
        node_timeout: float | None,
        rebalance_interval: float,
        settle: float | None,
        max_moves: int,
        handover_valid_for: float | None,
        eligible: bool = True,
        version: str | None = None,
        history_limit: int = HISTORY_LIMIT,
    ) -> None:
        if not isinstance(handler, TaskHandler):
            raise ConfigError(f"handler must be a TaskHandler, got {type(handler).__name__}")
        self._shards = check_shards(shards)
        self._name = check_shard_name(name, self._shards)
        self._node_id = check_node_id(node_id) if node_id is not None else new_node_id()
        stop_grace = timings.stop_grace(handler.stop_grace)  # refuses one that does not fit
        self.heartbeat_interval = check_seconds(heartbeat_interval, "heartbeat_interval")
        self.rebalance_interval = check_seconds(rebalance_interval, "rebalance_interval")
        given_settle = check_optional_seconds(settle, "settle", allow_zero=True)
        self.settle = self.heartbeat_interval if given_settle is None else given_settle
        if isinstance(max_moves, bool) or not isinstance(max_moves, int) or max_moves < 1:
            raise ConfigError(f"max_moves must be a positive int, got {max_moves!r:.40}")
        self.max_moves = max_moves
        given_valid_for = check_optional_seconds(handover_valid_for, "handover_valid_for")
        self.handover_valid_for = stop_grace + 1.0 if given_valid_for is None else given_valid_for
        given_node_timeout = check_optional_seconds(node_timeout, "node_timeout")
        self._node_timeout = (
            3 * self.heartbeat_interval if given_node_timeout is None else given_node_timeout
        )
        self.eligible = check_eligible(eligible)
        """Whether this node may lead shards (``eligible=`` as given)."""
        self.version = check_version(version)
        """This node's release (``version=`` as given)."""
        self._history_limit = check_history_limit(history_limit)
        self._handler = handler
        self._timings = timings
        self._cleanup: list[Callable[[], object]] = []
        self._leaders: list[ShardLeader] = []
        self._drained = False  # this node, as its coordinator last read it
        self._lock = threading.Lock()
        self._plan_lock = threading.Lock()
        self._plan: tuple[float, dict[int, str]] | None = None  # (when, takeover plan)
        self._started = False
        self._stop_asked = False
        self._stopped = threading.Event()
        self._stopper: threading.Thread | None = None  # a stop asked from inside runs here
        self._forked = False  # started in a parent process: unusable in this one
        forks.register(self)

    def _build_coordinator(
        self,
        leader: Callable[..., MemberLeader],
        target: Any,
        *,
        node_id: str | None,
        claimer: object,
        make_claimer: Callable[[], OwnClaimer],
        **options: Any,
    ) -> None:
        """Set what every shard's leader is built with, then build the coordinator's.

        Each is a ``leader`` on ``target`` (a connection string, a client) with this
        node's id, the timings, ``claimer`` (for :data:`DEFAULT_CLAIMER` one claimer of
        the backend's own for every shard, made by ``make_claimer`` and closed with this
        leader) and the backend's ``options``. The coordinator's leader claims nothing
        and keeps the ``node_id`` given: a default one is taken anew in a forked child
        (see :meth:`reset_after_fork`), and this node's id follows it.
        """
        self._target = target
        if isinstance(claimer, DefaultClaimer):
            claimer = self._owned_claimer = make_claimer()
            self._cleanup.append(claimer.close)
        timings = self._timings
        self._options = {
            "node_id": self._node_id,
            "ttl": timings.ttl,
            "renew_interval": timings.renew_interval,
            "renew_deadline": timings.renew_deadline,
            "retry_interval": timings.retry_interval,
            "claimer": claimer,
            "eligible": self.eligible,
            "version": self.version,
            "history_limit": self._history_limit,
            **options,
        }
        self._coordinator = leader(
            target,
            self._rebalancing(),
            name=self._name,
            heartbeat_interval=self.heartbeat_interval,
            node_timeout=self._node_timeout,
            **{**self._options, "claimer": None, "node_id": node_id},
        )
        self._coordinator.on_drain_change(self._drain_changed)
        self._adopt_node_id()

    def _rebalancing(self) -> TaskHandler:
        """The coordinator's tasks: its :class:`Rebalancer`."""
        tasks = TaskHandler()
        tasks.persistent("rebalance", restart="always")(Rebalancer(self))
        return tasks

    # -- backend -------------------------------------------------------------------------

    @abstractmethod
    def state(self) -> ShardState:
        """*Backend*: the shards' holders and the nodes' heartbeats, read in one go
        (server time).

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """

    _shard_leader: type[ShardLeader]
    """*Backend*: the class of a shard's leader (see :class:`ShardLeader`)."""
    _target: Any
    """What its leaders are built on (a connection string, a client)."""
    _options: dict[str, Any]
    """The keyword arguments of its shards' leaders (``node_id`` among them)."""

    def _new_shard_leader(self, shard: int, handler: TaskHandler) -> ShardLeader:
        """The leader of ``shard`` on this node, running ``handler``."""
        name = shard_lease_name(self._name, shard)
        options = {**self._options, "eligible": self.eligible and not self._drained}
        return self._shard_leader(self, shard, self._target, handler, name=name, **options)

    def _drain_changed(self, drained: bool) -> None:
        """This node was drained (or undrained): its shards' leaders take no shard while
        it is; the coordinator moves the shards they hold to the other nodes."""
        self._drained = drained
        with self._lock:
            leaders = list(self._leaders)
        for leader in leaders:
            leader.set_eligible(self.eligible and not drained)

    @abstractmethod
    def _request_handovers(
        self, targets: dict[str, str], *, fence: tuple[str, int] | None = None
    ) -> dict[str, LeaderInfo]:
        """*Backend*: ask for a handover of each shard's lease (name -> target node), to
        nodes that are still members of ``"<name>"`` only, and (with ``fence``, the
        coordinator's lease name and term) only while that term holds; the holder asked
        of each lease a request was recorded for.

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """

    @abstractmethod
    def _reopen_handovers(self, names: list[str]) -> list[str]:
        """*Backend*: open to every node the handovers of ``names`` reserved for this
        node; the names opened.

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """

    @abstractmethod
    def _current_holder(self, name: str) -> LeaderInfo | None:
        """*Backend*: the holder of lease ``name`` now, if any.

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """

    @abstractmethod
    def _load_shards_record(self) -> object:
        """*Backend*: what the coordinator of this name recorded (see
        :meth:`_save_shards_record`), or ``None``.

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """

    @abstractmethod
    def _save_shards_record(self, record: dict[str, Any], term: int) -> None:
        """*Backend*: record ``record`` for this name, only while ``term`` holds the
        coordinator's lease ``"<name>"``.

        Raises:
            StaleLeaderError: ``term`` no longer holds it; nothing was written.
            BackendUnavailable: the lease server could not be reached.
        """

    def _leave_membership(self) -> None:
        """Stop heartbeating and delete this node's entry now (best effort)."""
        self._coordinator._leave_membership()

    def _before_shards_start(self) -> None:
        """*Backend*: called once every shard's leader is built, before any starts."""

    def _after_stop(self) -> None:
        """*Backend*: called at the end of :meth:`stop` (close what reads the state)."""

    _owned_claimer: OwnClaimer | None = None
    """The claimer it built for its shards (its node id follows this node's)."""

    def _adopted_node_id(self, node_id: str) -> None:
        """This node's id became ``node_id`` (a default one is per process): pass it on
        to what was built with the old one (the shards' options, the owned claimer)."""
        self._options["node_id"] = node_id
        if self._owned_claimer is not None:
            self._owned_claimer.node_id = node_id

    # -- public ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The sharded name (the shards' leases are ``"<name>/<shard>"``)."""
        return self._name

    @property
    def shards(self) -> int:
        """The number of shards."""
        return self._shards

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._node_id

    @property
    def timings(self) -> Timings:
        """The validated timings of every shard's lease."""
        return self._timings

    @property
    def is_leader(self) -> bool:
        """True while this node leads at least one shard."""
        return any(leader.is_leader for leader in self._leaders)

    @property
    def term(self) -> int | None:
        """Always ``None``: each shard has a term of its own (see :meth:`terms`)."""
        return None

    def terms(self) -> dict[int, int]:
        """The term of each shard this node leads now."""
        out: dict[int, int] = {}
        for shard, leader in enumerate(self._leaders):
            term = leader.term
            if term is not None:
                out[shard] = term
        return out

    def health(self) -> dict[int, dict[str, dict[str, Any]]]:
        """Per shard this node leads now, its tasks' health (see
        :meth:`~rselection.TaskHandler.health`: state, runs, failures, last error...)."""
        return {
            shard: leader.handler.health()
            for shard, leader in enumerate(self._leaders)
            if leader.is_leader
        }

    def owned(self) -> frozenset[int]:
        """The shards this node leads now."""
        return frozenset(shard for shard, leader in enumerate(self._leaders) if leader.is_leader)

    def leader(self) -> LeaderInfo | None:
        """The coordinator (the holder of the lease ``"<name>"``), from any node."""
        return self._coordinator.leader()

    def nodes(self) -> list[NodeInfo]:
        """Every node of this sharded name from its heartbeats, oldest first
        (``is_leader`` flags the coordinator).

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """
        return self._coordinator.nodes()

    def assignment(self) -> dict[int, LeaderInfo]:
        """Who leads each shard now, from the lease server (works on any node).

        Shards nobody holds are missing.

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """
        return self.state().holders

    def balanced(self) -> bool:
        """True when every shard is led by a live node and every live node leads
        ``floor(S/N)`` or ``ceil(S/N)`` shards (N: nodes alive by their heartbeats, this
        one included while it runs).

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """
        state = self.state()
        alive = {node for node, (_, _, up) in state.nodes.items() if up}
        if not alive or len(state.holders) < self._shards:
            return False
        running = self._started and not self._stopped.is_set()
        if running and self.eligible and self._node_id not in alive:
            return False  # this node counts too, from its first heartbeat on
        counts = dict.fromkeys(alive, 0)
        for info in state.holders.values():
            if info.node_id not in counts:
                return False
            counts[info.node_id] += 1
        # Every shard held and no two nodes more than one apart: floor(S/N) or ceil(S/N).
        return max(counts.values()) - min(counts.values()) <= 1

    def wait_until_balanced(self, timeout: float | None = None) -> bool:
        """Block until :meth:`balanced`; return ``False`` after ``timeout`` seconds.

        A lease server that cannot be reached counts as not balanced (the wait goes on).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.balanced():
                    return True
            except BackendUnavailable as exc:
                logger.debug("shards of %r: cannot check the balance (%s)", self._name, exc)
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def wait_until_leader(self, timeout: float | None = None) -> bool:
        """Block until this node leads at least one shard; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_leader:
            if self._stopped.is_set():
                return False
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_POLL)
        return True

    def start(self) -> None:
        """Heartbeat and compete for every shard and the coordinator's lease, in the
        background; return at once.

        Raises:
            RuntimeError: this leader was started before, or the handler runs under
                another leader.
        """
        self._start(coordinator=True)

    def _check_shards(self) -> None:
        """Refuse to start while a coordinator of this name leads with another number of
        shards: its plan would hand this node shards it never competes for, and they
        would bounce between it and the others for ever."""
        try:
            state = self._load_shards_record()
            recorded = state.get("shards") if isinstance(state, dict) else None
            if recorded is None or recorded == self._shards:
                return
            holder = self._current_holder(self._name)
        except (BackendUnavailable, ConfigError):
            return  # nothing readable recorded yet: the coordinator records it when it can
        if holder is not None and holder.node_id != self._node_id:
            raise ConfigError(
                f"the sharded leader {self._name!r} runs with shards={recorded} (its "
                f"coordinator is node {holder.node_id!r}), but this node was built with "
                f"shards={self._shards}: every node must use the same number; to change it, "
                "stop every node, then start them with the new number"
            )

    def _record_shards(self, term: int) -> None:
        """The coordinator's record of the number of shards (fenced by its ``term``)."""
        try:
            self._save_shards_record({"shards": self._shards, "node_id": self._node_id}, term)
        except (BackendUnavailable, StaleLeaderError) as exc:
            logger.warning(
                "shards of %r: could not record the number of shards (%s)", self._name, exc
            )

    def _takeover_plan(self) -> dict[int, str]:
        """Who takes each shard over first if its holder dies, from this node's view of
        the holders (computed at most every ``_PLAN_TTL``: every shard of a dead node
        asks at the same moment)."""
        now = time.monotonic()
        with self._plan_lock:
            if self._plan is not None and now - self._plan[0] < _PLAN_TTL:
                return self._plan[1]
            held: dict[str, list[int]] = {self._node_id: []}
            for shard, leader in enumerate(self._leaders):
                holder = leader.seen_holder()
                if holder is not None:
                    held.setdefault(holder, []).append(shard)
            plan = takeover_plan(held)
            self._plan = (now, plan)
            return plan

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): not yet started, it takes
        the node id its coordinator's leader takes here; started, it is the parent's
        and refuses to run here (its shards' leaders do the same)."""
        if not hasattr(self, "_coordinator"):
            return  # its construction failed before the backend built it: nothing runs
        # A parent's thread may have held it at the fork (start() holds it across the
        # read of the recorded number of shards): here nothing would let go of it.
        self._lock = threading.Lock()
        if self._started:
            self._forked = True
            self._stopped = threading.Event()
            self._stopped.set()
        else:
            self._coordinator.reset_after_fork()
            self._adopt_node_id()

    def _adopt_node_id(self) -> None:
        """This node's id is its coordinator's leader's (a default one is per process)."""
        self._node_id = self._coordinator.node_id
        self._adopted_node_id(self._node_id)

    def _refuse_if_forked(self) -> None:
        if self._forked:
            raise RSelectionError(
                f"sharded leader {self._name!r} was started in the process this one "
                f"({os.getpid()}) was forked from: it cannot go on in a forked child; "
                f"{forks.FORK_ADVICE}"
            )

    def _start(self, *, coordinator: bool, signalled: StopSignals | None = None) -> None:
        """Build and start every shard's leader (and the coordinator's, if asked);
        under ``lead()``, a stop signal interrupts the read of the recorded number of
        shards (``signalled``: its handler), which may take the server's whole timeout."""
        self._refuse_if_forked()
        with self._lock:
            if self._started:
                raise RuntimeError("this leader was already started; create a new one")
            if self._stop_asked:
                # A stop() before start() is final, as for any leader: nothing starts
                # (lead() then returns at once: the coordinator was stopped too).
                self._started = True
                logger.info("sharded leader %r was stopped before it started", self._name)
                return
            if signalled is None:
                self._check_shards()
            else:
                signalled.call(self._check_shards, f"rselection-shards-check-{self._name}")
            self._handler.attach()  # registration is closed from now on
            self._started = True
            try:
                self._leaders = [
                    self._new_shard_leader(shard, self._handler.copy())
                    for shard in range(self._shards)
                ]
            except BaseException:
                self._handler.detach()
                raise
        self._before_shards_start()
        if coordinator:
            self._coordinator.start()
        for leader in self._leaders:
            leader.start()
        logger.info("node %s competes for %d shards of %r", self._node_id, self._shards, self._name)

    def lead(self) -> None:
        """Compete and lead in this thread until :meth:`stop`, SIGTERM or Ctrl-C, then
        hand this node's shards over, clean up and return.

        In the main thread, SIGTERM and SIGINT (Ctrl-C) are a graceful stop, as for
        :meth:`rselection.LeaseLeader.lead`; the program's own handlers are put back on
        return. :meth:`start` and the context managers install no handler.

        Raises:
            ConfigError: the lease server cannot be used safely as configured (a
                connection pooler that is not in session mode, for one); every shard
                was stopped first.
        """
        self._refuse_if_forked()
        with stop_on_signals(f"sharded leader {self._name!r}") as signalled:
            try:
                self._start(coordinator=False, signalled=signalled)
                # The coordinator's leader runs in this thread: it returns once stopped
                # (by stop() or a signal) and raises what made leading unsafe, which
                # holds for every shard too (they share its keeper session).
                self._coordinator.lead()
            except KeyboardInterrupt:
                if signalled.gave_up:  # a second Ctrl-C: no hand-off (see StopSignals)
                    raise
            finally:
                if not signalled.gave_up:
                    signalled.stop_begins()
                    self.stop()  # waits for a stop() called elsewhere rather than repeat it

    def step_down(self, *, hold: float = 0.0, wait: bool = True) -> None:
        """Give up every shard this node leads (each cancelled, joined and released).

        Args:
            hold: seconds each shard's leader stays a follower before competing again.
            wait: block until every shard's term has ended.
        """
        leading = [leader for leader in self._leaders if leader.is_leader]
        for leader in leading:
            leader.step_down(hold=hold, wait=False)
        if wait:
            for leader in leading:
                leader.step_down(hold=hold, wait=True)

    def stop(self, timeout: float | None = None) -> None:
        """Leave the membership, hand this node's shards to the nodes that stay, then
        stop every shard and the coordinator.

        The node first deletes its heartbeat row, so that no other node hands it shards
        any more (and a shard handed to it meanwhile is opened to every node); then each
        shard it leads is handed over to a live node below its share (the plan without
        this node), so that only this node's shards move, once each; the shards' tasks
        are cancelled and joined, and the leases released. Several nodes that stop at
        once hand shards only to the nodes that stay.

        Works from any thread. Called from inside the sharded leader (one of its tasks,
        a signal receiver running on the machinery of one of its shards or of its
        coordinator, the event loop of its async tasks), it only asks for the stop,
        which runs on a thread of its own, and returns at once (waiting there would wait
        for itself); :meth:`lead` returns once that stop is done. A stop before
        :meth:`start` is final: nothing starts afterwards.

        Args:
            timeout: seconds this call may take in all (default: until stopped).
        """
        if self._forked:  # the parent's threads are not in this process: nothing runs
            return
        inside = self._called_from_inside()
        with self._lock:
            asked, self._stop_asked = self._stop_asked, True
            if inside and not asked:
                self._stopper = threading.Thread(
                    target=self._stop, name=f"rselection-shards-stop-{self._name}", daemon=True
                )
        if inside:
            if self._stopper is not None and not asked:
                self._stopper.start()
            return
        if asked:  # another call does the work: wait for it
            self._stopped.wait(timeout)
            return
        self._stop(timeout)

    def _called_from_inside(self) -> bool:
        """True on a thread or loop whose work this leader's stop would wait for: one of
        its shards' or its coordinator's (their tasks, receivers and event loops), or the
        thread that runs a stop asked from there."""
        if self._stopper is not None and threading.current_thread() is self._stopper:
            return True
        return any(leader._called_from_inside() for leader in (self._coordinator, *self._leaders))

    def _stop(self, timeout: float | None = None) -> None:
        """The work of :meth:`stop` (once)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if self._started:
            wait = left()
            self._hand_off_within(HAND_OFF_WAIT if wait is None else min(wait, HAND_OFF_WAIT))
        everyone: list[LeaseLeader] = [self._coordinator, *self._leaders]
        for leader in everyone:
            leader.stop(timeout=0)  # ask them all at once: they wind down together
        for leader in everyone:
            leader.stop(timeout=left())
        for fn in self._cleanup:
            try:
                fn()
            except Exception:  # best effort, as a leader's own clean-up
                logger.exception("shards of %r: error in a clean-up on stop", self._name)
        self._cleanup = []
        self._after_stop()
        if self._started:
            self._handler.detach()
        self._stopped.set()

    def _hand_off_within(self, timeout: float) -> None:
        """:meth:`_leave` then :meth:`_hand_off`, waited for at most ``timeout`` seconds:
        a server that stops answering must not hold the stop up (the hand-off is best
        effort; the shards are released, or expire, all the same)."""

        def hand_off() -> None:
            try:
                self._leave()
                self._hand_off()
            except Exception:  # best effort: the stop goes on
                logger.exception("shards of %r: error while handing the shards over", self._name)

        thread = threading.Thread(
            target=hand_off, name=f"rselection-shards-hand-off-{self._name}", daemon=True
        )
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            logger.info(
                "shards of %r: stopping without waiting for the hand-off (the server did "
                "not answer within %.1f s)",
                self._name,
                timeout,
            )

    def _leave(self) -> None:
        """Leave the membership, then open to every node the handovers reserved for this
        node: from then on no node hands it a shard (:meth:`_request_handovers` skips a
        target without its row, and a request that committed before the row was deleted
        is opened here), so that two nodes stopping at once never reserve shards for
        each other."""
        self._leave_membership()
        names = [shard_lease_name(self._name, shard) for shard in range(self._shards)]
        try:
            reopened = self._reopen_handovers(names)
        except BackendUnavailable as exc:
            logger.info(
                "shards of %r: could not open handovers reserved for %s (%s)",
                self._name,
                self._node_id,
                exc,
            )
            return
        if reopened:
            logger.info(
                "shards of %r: %d shard(s) handed to this stopping node opened to every node",
                self._name,
                len(reopened),
            )

    def _hand_off(self) -> None:
        """Ask for a handover of each shard this node leads, to the live nodes below
        their share without this node, that have not left; best effort (a shard not
        handed over is released by the stop and taken by any node)."""
        mine = sorted(self.owned())
        if not mine:
            return
        try:
            state = self.state()
        except BackendUnavailable as exc:
            logger.info("shards of %r: stopping without handing over (%s)", self._name, exc)
            return
        fresh = timedelta(seconds=2 * self.heartbeat_interval + 0.5)
        others = [
            node
            for node, (_, last_seen, alive) in state.nodes.items()
            if alive and node != self._node_id and state.now - last_seen <= fresh
        ]
        if not others:
            return
        holders = {shard: info.node_id for shard, info in state.holders.items()}
        for shard in mine:
            holders[shard] = self._node_id
        # Plan as though this node were a member that owns nothing more: its shards are
        # the surplus, and the others fill up to their share.
        counts = dict.fromkeys(others, 0)
        for node in holders.values():
            if node in counts:
                counts[node] += 1
        share = quotas(self._shards, counts)
        targets: dict[str, str] = {}
        for shard in mine:
            target = min(others, key=lambda n: (counts[n] - share[n], counts[n], n))
            counts[target] += 1
            targets[shard_lease_name(self._name, shard)] = target
        try:
            self._request_handovers(targets)
        except BackendUnavailable as exc:
            logger.info("shards of %r: stopping without handing over (%s)", self._name, exc)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, shards={self._shards}, "
            f"node_id={self._node_id!r}, owned={len(self.owned())})"
        )
