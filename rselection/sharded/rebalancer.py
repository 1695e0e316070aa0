"""The coordinator's task of a sharded leader: :class:`Rebalancer`.

The holder of the coordinator lease ``"<name>"`` runs it: every round it reads the
shards' holders and the nodes' heartbeats (a :class:`ShardState`), plans the moves
(:func:`~rselection.sharding.plan_moves`) and asks for them by handovers reserved for
their targets, keeping over its term what it knows of each node (heartbeats seen to
advance, moves under way, shards lost without a handover). See
``docs/explanation/sharding.md``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ..errors import BackendUnavailable
from ..lease import LeaderInfo
from ..sharding import Move, plan_moves, shard_lease_name

if TYPE_CHECKING:
    from ..context import TaskContext

__all__ = ["PENDING_POLL", "Balanced", "Rebalancer", "ShardState"]

logger = logging.getLogger("rselection.postgres.sharded")

PENDING_POLL = 0.1
"""Seconds between the coordinator's rounds while moves it asked for are under way (it
waits ``rebalance_interval`` otherwise)."""

_POLL = 0.05  # seconds between looks at the term while a round's calls are out

_T = TypeVar("_T")


@dataclass(frozen=True)
class ShardState:
    """What the lease server says about a sharded name, read in one go.

    Attributes:
        holders: each held shard's holder (lease rows not expired).
        nodes: each node of the name that may lead (ineligible ones are left out) with
            its first and last heartbeat and whether it is alive (seen within
            ``node_timeout``), server time.
        now: the server's clock when read.
        ineligible: the live nodes that may not lead (drained, or ``eligible=False``):
            the shards they hold are moved to the others.
    """

    holders: dict[int, LeaderInfo]
    nodes: dict[str, tuple[datetime, datetime, bool]]
    now: datetime
    ineligible: frozenset[str] = frozenset()


class Balanced(Protocol):
    """What a :class:`Rebalancer` reads and asks of the sharded leader it balances (a
    :class:`~rselection.sharded.ShardedLeader`): its name and number of shards, the
    seconds a node must heartbeat before it receives shards (``settle``), between its
    heartbeats and between two rounds, the most moves under way from or to one node,
    and how long a moved shard stays reserved for its target."""

    settle: float
    heartbeat_interval: float
    rebalance_interval: float
    max_moves: int
    handover_valid_for: float

    @property
    def name(self) -> str:
        """The sharded name."""

    @property
    def shards(self) -> int:
        """The number of shards."""

    def state(self) -> ShardState:
        """The shards' holders and the nodes' heartbeats, read in one go."""

    def _record_shards(self, term: int) -> None:
        """Record the number of shards, fenced by the coordinator's ``term``."""

    def _request_handovers(
        self, targets: dict[str, str], *, fence: tuple[str, int] | None = None
    ) -> dict[str, LeaderInfo]:
        """Ask for a handover of each lease of ``targets`` to its node."""


class _Abandonable(Generic[_T]):
    """One call of the coordinator's, run on a thread of its own so that the task can
    return as soon as its term is cancelled: a call that waits for a server that does
    not answer is abandoned (it ends by its own timeouts; what it would still write is
    fenced by the term)."""

    def __init__(self, fn: Callable[[], _T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: _T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to the waiting task
            self.error = exc
        finally:
            self.done.set()


class _Rounds:
    """The coordinator's thread for its blocking calls, for one term (see
    :class:`_Abandonable`)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Abandonable[Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._serve, name=f"rselection-rebalance-{name}", daemon=True
        )
        self._thread.start()

    def call(self, ctx: TaskContext, fn: Callable[[], _T]) -> tuple[bool, _T | None]:
        """``(True, fn())`` (its exception raised here), or ``(False, None)`` once the
        term is cancelled first."""
        call = _Abandonable(fn)
        self._calls.put(call)
        while not call.done.wait(_POLL):
            if ctx.cancelled.is_set():
                return False, None
        if call.error is not None:
            raise call.error
        return True, call.value

    def close(self) -> None:
        """End the thread once the call it runs, if any, has ended."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call.run()


@dataclass
class _Track:
    """What the coordinator knows of one node's liveness."""

    last_seen: datetime
    alive_since: datetime | None  # start of its current run of heartbeats (None: lost)
    proven: bool = False  # a heartbeat was seen to advance in this run: it runs now
    suspect_since: datetime | None = None  # lost shards no one moved; cleared by a beat


@dataclass
class _Pending:
    move: Move
    until: datetime  # server time after which the move has failed (its reservation lapsed)


@dataclass
class _Round:
    """The coordinator's memory over one of its terms (a new term starts empty)."""

    tracks: dict[str, _Track] = field(default_factory=dict)
    pending: dict[int, _Pending] = field(default_factory=dict)
    held: dict[str, set[int]] = field(default_factory=dict)
    moved_away: dict[str, set[int]] = field(default_factory=dict)


class Rebalancer:
    """The coordinator's task: moves surplus shards to the nodes below their share.

    Runs on the holder of the lease ``"<name>"`` only. Every ``rebalance_interval`` it
    reads the shards' holders and the nodes' heartbeats
    (:meth:`ShardedLeader.state`), then plans
    (:func:`~rselection.sharding.plan_moves`) and asks for at most ``max_moves``
    handovers at a time from any one node. A node receives shards only once its
    heartbeat was seen to advance, it has been heartbeating for ``settle`` seconds and
    its last heartbeat is fresh; a node that lost shards no handover explains (it died,
    or its session broke) is counted out until its next heartbeat. A move that does not
    complete within ``handover_valid_for`` counts its target out the same way.

    Args:
        leader: the sharded leader it balances.
    """

    def __init__(self, leader: Balanced) -> None:
        self.leader = leader
        self._memory = _Round()

    def __call__(self, ctx: TaskContext) -> None:
        """Rebalance until the coordinator's term ends.

        Each round's reads and requests run on a thread of their own: once the term is
        cancelled the task returns within ``_POLL`` seconds, even while the server does
        not answer (the round is abandoned; its requests are fenced by the term).
        """
        self._memory = _Round()  # a new term starts from the server alone
        leader = self.leader
        rounds = _Rounds(leader.name)
        try:
            done, _ = rounds.call(ctx, lambda: leader._record_shards(ctx.term))
            while done and ctx.is_live():
                try:
                    done, _ = rounds.call(ctx, lambda: self.step(ctx.term))
                except BackendUnavailable as exc:
                    logger.warning("shards of %r: cannot rebalance now (%s)", leader.name, exc)
                # While moves are under way, look again soon: the next moves of a node
                # wait for its earlier ones to complete.
                pause = leader.rebalance_interval
                if self._memory.pending:
                    pause = min(pause, PENDING_POLL)
                if not done or not ctx.sleep(pause):
                    return
        finally:
            rounds.close()

    def suspects(self) -> set[str]:
        """The nodes counted out until their next heartbeat (they lost shards no
        handover explains, or did not take a shard handed to them)."""
        return {n for n, t in self._memory.tracks.items() if t.suspect_since is not None}

    def step(self, term: int | None = None) -> list[Move]:
        """One round: read, plan, ask for the moves; return the moves asked for.

        Args:
            term: the coordinator's term: the moves are recorded only while it still
                holds the lease ``"<name>"`` (checked in the statement that records
                them), so that a deposed coordinator moves nothing. ``None``: not fenced.

        Raises:
            BackendUnavailable: the lease server could not be reached.
        """
        memory = self._memory
        leader = self.leader
        state = leader.state()
        now = state.now
        holders = {shard: info.node_id for shard, info in state.holders.items()}
        self._track(memory, state)
        self._settle_pending(memory, holders, now)
        self._find_losses(memory, holders, now)

        settle = timedelta(seconds=leader.settle)
        fresh = timedelta(seconds=2 * leader.heartbeat_interval + 0.5)
        owning = {node for node in holders.values()}
        members: list[str] = []
        targets: list[str] = []
        for node, (_, last_seen, alive) in state.nodes.items():
            track = memory.tracks[node]
            if not alive or track.suspect_since is not None:
                continue
            if node in owning or track.proven:
                members.append(node)
            if (
                track.proven
                and track.alive_since is not None
                and now - track.alive_since >= settle
                and now - last_seen <= fresh
            ):
                targets.append(node)

        planned = dict(holders)
        for shard, pending in memory.pending.items():
            planned[shard] = pending.move.target
        recent = {shard: info.acquired_at.timestamp() for shard, info in state.holders.items()}
        leaving = state.ineligible & owning  # drained: every shard they hold goes
        moves = plan_moves(
            leader.shards, planned, members, targets=targets, recent=recent, leaving=leaving
        )
        # Each old owner cancels, joins and releases what it gives, and each new owner
        # takes and begins what it gets: bound that work per node, not across the
        # fleet, so that a join is served by every owner at once, each move promptly.
        busy: Counter[str] = Counter()
        for pending in memory.pending.values():
            busy[pending.move.source] += 1
            busy[pending.move.target] += 1
        chosen: dict[int, Move] = {}
        for move in moves:
            if move.shard in memory.pending:
                continue
            if max(busy[move.source], busy[move.target]) >= leader.max_moves:
                continue
            busy[move.source] += 1
            busy[move.target] += 1
            chosen[move.shard] = move
        if not chosen:
            return []
        # Every move of the round in one statement (each old owner is woken at once).
        # Only to nodes that have not left meanwhile, and only while this term holds.
        answers = leader._request_handovers(
            {shard_lease_name(leader.name, k): move.target for k, move in chosen.items()},
            fence=None if term is None else (leader.name, term),
        )
        # The reservation lasts handover_valid_for from the request, by the server's
        # clock; a second more for the target's attempt to land.
        until = now + timedelta(seconds=leader.handover_valid_for + 1.0)
        asked: list[Move] = []
        for shard, move in chosen.items():
            info = answers.get(shard_lease_name(leader.name, shard))
            if info is None:
                continue  # freed, or taken by its target meanwhile: the next round sees it
            # Asked of whoever holds it now (it may have changed since the read).
            move = Move(shard, info.node_id, move.target)
            memory.pending[shard] = _Pending(move, until)
            memory.moved_away.setdefault(move.source, set()).add(shard)
            asked.append(move)
        if asked:
            logger.info(
                "shards of %r: moving %d shard(s): %s",
                leader.name,
                len(asked),
                ", ".join(f"{m.shard} from {m.source} to {m.target}" for m in asked),
            )
        return asked

    def _track(self, memory: _Round, state: ShardState) -> None:
        """Follow each node's heartbeats: a run of them starts when a node is first seen
        alive (from its first heartbeat, for a node the coordinator finds running) or
        heartbeats again after it was lost or suspect; it is proven once a heartbeat is
        seen to advance."""
        now = state.now
        for node, (started_at, last_seen, alive) in state.nodes.items():
            track = memory.tracks.get(node)
            if track is None:
                memory.tracks[node] = _Track(last_seen, started_at if alive else None)
                continue
            if not alive:
                track.alive_since, track.proven = None, False
                continue
            if track.alive_since is None:
                track.alive_since = now
            if last_seen > track.last_seen:
                track.last_seen = last_seen
                if track.suspect_since is not None and last_seen > track.suspect_since:
                    logger.info("shards of %r: node %s heartbeats again", self.leader.name, node)
                    track.suspect_since = None
                    track.alive_since = now  # a new run: it settles again
                track.proven = True
        for node in set(memory.tracks) - set(state.nodes):
            del memory.tracks[node]

    def _settle_pending(self, memory: _Round, holders: dict[int, str], now: datetime) -> None:
        """Forget completed moves; a move that timed out counts its target out."""
        for shard, pending in list(memory.pending.items()):
            move, holder = pending.move, holders.get(shard)
            if holder == move.target:
                del memory.pending[shard]
            elif now > pending.until:
                del memory.pending[shard]
                if holder == move.source:
                    memory.moved_away.get(move.source, set()).discard(shard)
                else:
                    track = memory.tracks.get(move.target)
                    if track is not None:
                        logger.warning(
                            "shards of %r: node %s did not take shard %d in time; no more "
                            "shards go to it until it heartbeats again",
                            self.leader.name,
                            move.target,
                            shard,
                        )
                        track.suspect_since = now

    def _find_losses(self, memory: _Round, holders: dict[int, str], now: datetime) -> None:
        """Count out a node that lost shards no handover explains (until it heartbeats)."""
        held: dict[str, set[int]] = {}
        for shard, node in holders.items():
            held.setdefault(node, set()).add(shard)
        for node, before in memory.held.items():
            gone = before - held.get(node, set())
            moved = memory.moved_away.get(node, set())
            unexplained = gone - moved
            moved -= gone
            track = memory.tracks.get(node)
            if unexplained and track is not None and track.suspect_since is None:
                logger.warning(
                    "shards of %r: node %s lost %d shard(s) without a handover; no shards "
                    "go to it until it heartbeats again",
                    self.leader.name,
                    node,
                    len(unexplained),
                )
                track.suspect_since = now
        memory.held = held
