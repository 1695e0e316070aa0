"""The coordinator's rounds without a server: who counts, who may receive, what moves.

A stand-in sharded leader serves scripted reads (``state()``) and records the handovers
the rebalancer asks for instead of sending them; the clock is the reads' server time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from rselection import sharded
from rselection.lease import LeaderInfo
from rselection.sharded import Rebalancer, ShardState
from rselection.sharding import Move

T0 = datetime(2026, 12, 1, tzinfo=UTC)


class Fleet:
    """What the rebalancer reads: shard holders and heartbeats, on a scripted clock."""

    def __init__(self, shards: int) -> None:
        self.name = "pollers"
        self.shards = shards
        self.settle = 1.0
        self.heartbeat_interval = 1.0
        self.max_moves = 32
        self.handover_valid_for = 3.0
        self.now = T0
        self.holders: dict[int, str] = {}
        self.acquired: dict[int, datetime] = {}
        self.beats: dict[str, tuple[datetime, datetime]] = {}  # node: (started, last seen)
        self.drained: set[str] = set()  # heartbeating as ineligible
        self.asked: list[Move] = []

    def join(self, node: str) -> None:
        self.beats[node] = (self.now, self.now)

    def beat(self, *nodes: str) -> None:
        for node in nodes:
            self.beats[node] = (self.beats[node][0], self.now)

    def take(self, node: str, *shards: int) -> None:
        for shard in shards:
            self.holders[shard] = node
            self.acquired[shard] = self.now

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def state(self) -> ShardState:
        timeout = timedelta(seconds=3 * self.heartbeat_interval)
        return ShardState(
            holders={
                shard: LeaderInfo(node, 1, self.acquired[shard], self.now + timedelta(seconds=15))
                for shard, node in self.holders.items()
            },
            nodes={
                node: (started, seen, self.now - seen <= timeout)
                for node, (started, seen) in self.beats.items()
                if node not in self.drained
            },
            now=self.now,
            ineligible=frozenset(
                node
                for node, (_, seen) in self.beats.items()
                if node in self.drained and self.now - seen <= timeout
            ),
        )

    def _request_handovers(
        self, targets: dict[str, str], *, fence: tuple[str, int] | None = None
    ) -> dict[str, LeaderInfo]:
        """What the backend's handover requests answer: the holder asked of each shard
        held by another node than its target."""
        answers = {}
        for name, target in targets.items():
            shard = int(name.rsplit("/", 1)[1])
            holder = self.holders.get(shard)
            if holder is None or holder == target:
                continue
            self.asked.append(Move(shard, holder, target))
            answers[name] = LeaderInfo(holder, 1, self.acquired[shard], self.now)
        return answers


@pytest.fixture
def fleet() -> Fleet:
    return Fleet(12)


def run(fleet: Fleet, rebalancer: Rebalancer, *beating: str) -> list[Move]:
    """One heartbeat interval: the nodes named heartbeat, then one round."""
    fleet.tick(1.0)
    fleet.beat(*beating)
    fleet.asked.clear()
    rebalancer.step()
    return list(fleet.asked)


def apply(fleet: Fleet, moves: list[Move]) -> None:
    for move in moves:
        fleet.take(move.target, move.shard)


def three_nodes_with_four_shards_each(fleet: Fleet) -> None:
    for node in ("a", "b", "c"):
        fleet.join(node)
    fleet.take("a", 0, 1, 2, 3)
    fleet.take("b", 4, 5, 6, 7)
    fleet.take("c", 8, 9, 10, 11)


def test_a_new_node_gets_shards_only_once_it_heartbeats_and_settles(fleet: Fleet) -> None:
    rebalancer = Rebalancer(fleet)  # type: ignore[arg-type]
    for node in ("a", "b"):
        fleet.join(node)
    fleet.take("a", *range(6))
    fleet.take("b", *range(6, 12))
    assert run(fleet, rebalancer, "a", "b") == []
    fleet.join("c")
    # First seen: not yet proven to run now (its heartbeat has not advanced).
    assert run(fleet, rebalancer, "a", "b") == []
    moves = run(fleet, rebalancer, "a", "b", "c")
    assert len(moves) == 4 and {m.target for m in moves} == {"c"}
    assert {m.source for m in moves} == {"a", "b"}


def test_a_node_that_lost_shards_without_a_handover_stops_counting_at_once(
    fleet: Fleet,
) -> None:
    rebalancer = Rebalancer(fleet)  # type: ignore[arg-type]
    three_nodes_with_four_shards_each(fleet)
    for _ in range(3):
        assert run(fleet, rebalancer, "a", "b", "c") == []
    # c is killed: a takes all its shards over at once; c's heartbeat row still looks
    # alive for a while, but c lost shards that no handover explains.
    fleet.take("a", 8, 9, 10, 11)
    moves = run(fleet, rebalancer, "a", "b")
    assert moves and all(m.source == "a" and m.target == "b" for m in moves)
    assert {m.shard for m in moves} <= {8, 9, 10, 11}  # a's own shards stay with it
    assert len(moves) == 2  # 6 and 6 over a and b: c is not counted
    apply(fleet, moves)
    assert run(fleet, rebalancer, "a", "b") == []


def test_a_target_that_does_not_take_its_shard_gets_no_more(fleet: Fleet) -> None:
    rebalancer = Rebalancer(fleet)  # type: ignore[arg-type]
    for node in ("a", "b"):
        fleet.join(node)
    fleet.take("a", *range(12))
    for _ in range(2):
        moves = run(fleet, rebalancer, "a", "b")
    assert len(moves) == 6 and {m.target for m in moves} == {"b"}
    # b never takes them (it died just after its last heartbeat): a released them, and
    # they stay free until their reservations for b lapse.
    for move in moves:
        del fleet.holders[move.shard]
    for _ in range(5):
        assert run(fleet, rebalancer, "a") == []
    assert rebalancer.suspects() == {"b"}
    fleet.take("a", *(move.shard for move in moves))  # after the lapse, a takes them back
    assert run(fleet, rebalancer, "a") == []


def test_a_paused_node_gets_a_share_again_once_it_heartbeats_and_settles(
    fleet: Fleet,
) -> None:
    rebalancer = Rebalancer(fleet)  # type: ignore[arg-type]
    for node in ("a", "b"):
        fleet.join(node)
    fleet.take("a", *range(6))
    fleet.take("b", *range(6, 12))
    assert run(fleet, rebalancer, "a", "b") == []
    # b pauses beyond the ttl: its leases expire and a takes them; b's heartbeats stop.
    fleet.take("a", *range(6, 12))
    for _ in range(4):
        assert run(fleet, rebalancer, "a") == []
    # b resumes: its first heartbeat clears it, then it settles for one interval.
    assert run(fleet, rebalancer, "a", "b") == []
    moves = run(fleet, rebalancer, "a", "b")
    assert len(moves) == 6 and {m.target for m in moves} == {"b"}


def test_moves_in_flight_are_bounded_per_target_as_well_as_per_source(fleet: Fleet) -> None:
    # Before, only each old owner was bounded: three owners gave a joining node 3 x
    # max_moves shards at once, and its attempts and beginnings queued (handovers of
    # 1,024 shards took up to 200 ms each instead of about 50).
    fleet.max_moves = 2
    rebalancer = Rebalancer(fleet)  # type: ignore[arg-type]
    three_nodes_with_four_shards_each(fleet)
    assert run(fleet, rebalancer, "a", "b", "c") == []
    fleet.join("d")
    assert run(fleet, rebalancer, "a", "b", "c") == []  # not proven yet
    first = run(fleet, rebalancer, "a", "b", "c", "d")
    assert len(first) == 2 and {m.target for m in first} == {"d"}
    assert run(fleet, rebalancer, "a", "b", "c", "d") == []  # both still in flight
    apply(fleet, first)
    second = run(fleet, rebalancer, "a", "b", "c", "d")
    assert len(second) == 1 and second[0].target == "d"  # 3 each: one more to go


class Ctx:
    """The coordinator's task context: live for ``rounds`` sleeps, which it records;
    each sleep is a heartbeat interval of the fleet (``between()``)."""

    def __init__(self, rounds: int, between: Callable[[], None]) -> None:
        self.term = 1
        self.cancelled = threading.Event()
        self.rounds = rounds
        self.between = between
        self.sleeps: list[float] = []

    def is_live(self) -> bool:
        return len(self.sleeps) < self.rounds

    def sleep(self, seconds: float) -> bool:
        self.sleeps.append(seconds)
        self.between()
        return self.is_live()


def test_the_coordinator_looks_again_soon_while_moves_are_under_way(fleet: Fleet) -> None:
    # Before, it waited rebalance_interval between rounds whatever was in flight: each
    # node's next moves waited up to half a second after its earlier ones completed.
    fleet.rebalance_interval = 0.5
    fleet._record_shards = lambda term: None  # type: ignore[attr-defined]
    for node in ("a", "b"):
        fleet.join(node)
    fleet.take("a", *range(12))

    def beat() -> None:
        fleet.tick(1.0)
        fleet.beat("a", "b")

    ctx = Ctx(rounds=4, between=beat)
    Rebalancer(fleet)(ctx)  # type: ignore[arg-type]
    # Round 1: b not proven yet, nothing asked; round 2: 6 moves asked; rounds 3 and 4:
    # still in flight (b never takes them here).
    assert len(fleet.asked) == 6
    assert ctx.sleeps == [0.5, sharded.PENDING_POLL, sharded.PENDING_POLL, sharded.PENDING_POLL]


def test_a_drained_node_s_shards_all_go_to_the_others_and_it_gets_none(fleet: Fleet) -> None:
    three_nodes_with_four_shards_each(fleet)
    rebalancer = Rebalancer(fleet)  # type: ignore[arg-type]
    assert run(fleet, rebalancer, "a", "b", "c") == []
    fleet.drained.add("c")  # it heartbeats as ineligible from now on
    moves = run(fleet, rebalancer, "a", "b", "c")
    assert sorted(m.shard for m in moves) == [8, 9, 10, 11]
    assert {m.source for m in moves} == {"c"} and {m.target for m in moves} == {"a", "b"}
    assert sum(m.target == "a" for m in moves) == 2
    apply(fleet, moves)
    assert run(fleet, rebalancer, "a", "b", "c") == []  # balanced over a and b: 6 and 6
    fleet.drained.discard("c")  # undrained: it settles again, then gets its share
    for _ in range(3):
        apply(fleet, run(fleet, rebalancer, "a", "b", "c"))
    assert sorted(list(fleet.holders.values()).count(n) for n in "abc") == [4, 4, 4]
