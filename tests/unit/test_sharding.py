"""Shards without a server: the key hash, the balanced sticky plan, and the checks."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

import rselection as rs
from rselection.context import TaskContext, Term
from rselection.errors import ConfigError
from rselection.postgres.sharded import PostgresShardedLeader
from rselection.sharding import (
    MAX_SHARDS,
    Move,
    check_shard_name,
    check_shards,
    plan_moves,
    quotas,
    shard_lease_name,
    takeover_plan,
)

# Computed once (SHA-256, first 8 bytes big-endian, modulo shards) and written here: a
# change of these values would move every user's keys to other shards.
KNOWN = [
    ("tenant-42", 64, 8),
    ("tenant-42", 1024, 200),
    ("tenant-42", 7, 4),
    ("", 64, 20),
    ("é", 1024, 851),
    (b"\x00\xff", 64, 37),
]


@pytest.mark.parametrize(("key", "shards", "expected"), KNOWN)
def test_shard_of_gives_the_documented_values(key: str | bytes, shards: int, expected: int) -> None:
    assert rs.shard_of(key, shards) == expected


def test_shard_of_a_str_is_the_shard_of_its_utf8_bytes() -> None:
    assert rs.shard_of("é-tenant", 97) == rs.shard_of("é-tenant".encode(), 97)


def test_shard_of_spreads_keys_evenly() -> None:
    counts = Counter(rs.shard_of(f"tenant-{i}", 16) for i in range(16_000))
    assert set(counts) == set(range(16))
    assert max(counts.values()) < 1.15 * 1000 and min(counts.values()) > 0.85 * 1000


@pytest.mark.parametrize("bad", [0, -1, MAX_SHARDS + 1, 2.0, "8", True, None])
def test_bad_numbers_of_shards_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="shards must be"):
        check_shards(bad)
    with pytest.raises(ConfigError, match="shards must be"):
        rs.shard_of("k", bad)  # type: ignore[arg-type]


def test_shard_of_refuses_keys_that_are_not_text_or_bytes() -> None:
    with pytest.raises(TypeError, match=r"str\(key\)"):
        rs.shard_of(42, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "  ", "a/b", "x" * 1000, None, 5])
def test_bad_sharded_names_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="name"):
        check_shard_name(bad, 64)


def test_shard_lease_names() -> None:
    assert check_shard_name("pollers", 64) == "pollers"
    assert shard_lease_name("pollers", 17) == "pollers/17"


def test_quotas_are_floor_or_ceil_and_the_larger_ones_go_to_the_fullest_nodes() -> None:
    share = quotas(32, {"a": 12, "b": 11, "c": 9})
    assert share == {"a": 11, "b": 11, "c": 10}
    assert sum(quotas(10, {"a": 0, "b": 0, "c": 0}).values()) == 10


def owners(plan: list[Move], holders: dict[int, str]) -> dict[int, str]:
    after = dict(holders)
    for move in plan:
        assert after[move.shard] == move.source
        after[move.shard] = move.target
    return after


def counts(holders: dict[int, str], nodes: list[str]) -> dict[str, int]:
    tally = Counter(holders.values())
    return {node: tally.get(node, 0) for node in nodes}


def test_one_node_holding_everything_spreads_to_floor_or_ceil() -> None:
    holders = dict.fromkeys(range(32), "a")
    nodes = ["a", "b", "c", "d", "e"]
    plan = plan_moves(32, holders, nodes)
    after = counts(owners(plan, holders), nodes)
    assert sorted(after.values()) == [6, 6, 6, 7, 7]
    assert len(plan) == 32 - 7  # a keeps its share: nothing else moves


def test_a_balanced_fleet_moves_nothing() -> None:
    holders = {shard: "abcd"[shard % 4] for shard in range(30)}
    assert plan_moves(30, holders, list("abcd")) == []


@pytest.mark.parametrize(("shards", "nodes"), [(32, 4), (16, 2), (64, 7), (1024, 8), (5, 4)])
def test_a_joining_node_gets_its_share_with_the_fewest_moves(shards: int, nodes: int) -> None:
    fleet = [f"n{i}" for i in range(nodes)]
    holders = {shard: fleet[shard % nodes] for shard in range(shards)}
    plan = plan_moves(shards, holders, [*fleet, "new"])
    assert all(move.target == "new" for move in plan)
    after = counts(owners(plan, holders), [*fleet, "new"])
    assert max(after.values()) - min(after.values()) <= 1
    assert len(plan) == after["new"] == shards // (nodes + 1) <= math.ceil(shards / (nodes + 1))


def test_after_a_death_only_the_dead_nodes_shards_move() -> None:
    fleet = ["a", "b", "c", "d"]
    before = {shard: fleet[shard % 4] for shard in range(32)}
    # d's shards were taken over by whoever was first (here all by a).
    holders = {shard: ("a" if node == "d" else node) for shard, node in before.items()}
    recent = {shard: (1.0 if before[shard] == "d" else 0.0) for shard in holders}
    plan = plan_moves(32, holders, ["a", "b", "c"], recent=recent)
    assert {move.source for move in plan} == {"a"}
    assert all(before[move.shard] == "d" for move in plan)  # a keeps its own
    after = counts(owners(plan, holders), ["a", "b", "c"])
    assert sorted(after.values()) == [10, 11, 11]


def test_only_targets_receive_and_non_members_keep_their_shards() -> None:
    holders = {**dict.fromkeys(range(8), "a"), **dict.fromkeys(range(8, 12), "gone")}
    plan = plan_moves(12, holders, ["a", "b", "c"], targets=["b"])
    assert {move.target for move in plan} == {"b"}
    assert all(move.source == "a" for move in plan)
    assert len(plan) == 4  # b's quota of 4; c is not yet a target


def test_the_limit_caps_the_moves_of_one_round() -> None:
    holders = dict.fromkeys(range(64), "a")
    assert len(plan_moves(64, holders, ["a", "b"], limit=5)) == 5


def test_random_fleets_end_balanced_in_the_fewest_moves() -> None:
    rng = random.Random(7)
    for _ in range(300):
        shards = rng.randint(1, 200)
        nodes = [f"n{i}" for i in range(rng.randint(1, 9))]
        holders = {s: rng.choice(nodes) for s in range(shards) if rng.random() < 0.95}
        plan = plan_moves(shards, holders, nodes)
        after = counts(owners(plan, holders), nodes)
        share = quotas(shards, counts(holders, nodes))
        # Each move fills one missing shard of a node below its share: none is wasted.
        missing = sum(max(0, share[n] - c) for n, c in counts(holders, nodes).items())
        surplus = sum(max(0, c - share[n]) for n, c in counts(holders, nodes).items())
        assert len(plan) == min(missing, surplus)
        assert len({move.shard for move in plan}) == len(plan)
        if len(holders) == shards:
            assert max(after.values()) - min(after.values()) <= 1


def test_a_task_context_shows_its_shard() -> None:
    plain = TaskContext("t", Term(3, "n"))
    assert plain.shard is None and plain.shards is None
    sharded = TaskContext("t", Term(3, "n", "p/5", shard=5, shards=8))
    assert (sharded.shard, sharded.shards) == (5, 8)


def test_a_handler_copy_has_the_same_tasks_and_counters_of_its_own() -> None:
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work", restart="always")
    def work(ctx: rs.TaskContext) -> None: ...

    @tasks.interval(5, name="tick")
    def tick(ctx: rs.TaskContext) -> None: ...

    copy = tasks.copy()
    assert copy.names == ["work", "tick"] and copy.stop_grace == 1.0
    assert copy.spec("work").restart == "always"
    assert copy.spec("work").stats is not tasks.spec("work").stats
    copy.attach()
    tasks.attach()  # the copy runs apart from the original


def sharded(**options: Any) -> PostgresShardedLeader:
    settings: dict[str, Any] = {"name": "pollers", "shards": 8, **options}
    return PostgresShardedLeader("postgresql://nowhere/db", rs.TaskHandler(), **settings)


def test_a_sharded_leader_is_a_leader_and_connects_to_nothing_until_started() -> None:
    leader = sharded(node_id="n1")
    assert isinstance(leader, rs.Leader)
    assert (leader.node_id, leader.shards, leader.name) == ("n1", 8, "pollers")
    assert leader.owned() == frozenset() and not leader.is_leader and leader.term is None
    leader.stop()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shards": 0}, "shards must be"),
        ({"shards": "8"}, "shards must be"),
        ({"name": "a/b"}, "may not contain '/'"),
        ({"name": " "}, "non-blank"),
        ({"max_moves": 0}, "max_moves"),
        ({"rebalance_interval": 0}, "rebalance_interval"),
        ({"ttl": 5, "renew_deadline": 4.9}, "ttl - renew_deadline"),
        ({"table": "bad name;"}, "table"),
    ],
)
def test_bad_sharded_leader_arguments_are_refused_at_construction(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        sharded(**options)


def test_a_sharded_leader_needs_a_connection_string() -> None:
    with pytest.raises(ConfigError, match="connection string"):
        PostgresShardedLeader(object(), rs.TaskHandler(), name="p", shards=2)  # type: ignore[arg-type]


def test_status_finds_sharded_names_and_the_shards_each_node_leads() -> None:
    from rselection.commands.status import shard_ranges, sharded_names

    assert shard_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert shard_ranges([]) == ""
    rows = [
        # name, holder, term, acquired, expires, expires_in, ...
        ("pollers", "a", 1, None, None, 10.0),
        ("pollers/0", "a", 3, None, None, 10.0),
        ("pollers/1", "b", 2, None, None, 10.0),
        ("pollers/2", "b", 2, None, None, -1.0),  # expired: nobody leads it
        ("scale/0", "a", 1, None, None, 10.0),  # no lease "scale": not a sharded name
        ("pollers/01", "a", 1, None, None, 10.0),  # not a shard's number as written
    ]
    shown = {row[0] for row in rows}
    [found] = sharded_names(rows, shown, lambda name: True)
    assert found == {"name": "pollers", "shards": 3, "unled": [2], "nodes": {"a": [0], "b": [1]}}


# ----------------------------------------------------------------- takeover_plan


def test_takeover_plan_spreads_each_nodes_shards_over_the_others_in_balance() -> None:
    held = {"a": list(range(0, 11)), "b": list(range(11, 22)), "c": list(range(22, 32)), "d": []}
    plan = takeover_plan(held)
    assert set(plan) == set(range(32))
    for dead, theirs in held.items():
        counts = {node: len(shards) for node, shards in held.items() if node != dead}
        for shard in theirs:
            assert plan[shard] != dead
            counts[plan[shard]] += 1
        # After the takeover the survivors are balanced: no second move is needed.
        assert max(counts.values()) - min(counts.values()) <= 1, (dead, counts)


def test_takeover_plan_is_the_same_whatever_the_order_it_is_given_in() -> None:
    held = {f"n{i}": list(range(i * 100, i * 100 + 100)) for i in range(6)}
    reordered = {node: list(reversed(held[node])) for node in reversed(list(held))}
    assert takeover_plan(held) == takeover_plan(reordered)


def test_takeover_plan_has_no_taker_with_one_node() -> None:
    assert takeover_plan({"a": [0, 1, 2]}) == {}
    assert takeover_plan({}) == {}
