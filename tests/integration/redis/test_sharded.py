"""``RedisShardedLeader`` in one process: what is Redis's own in the sharded leader.

The fleet scenarios (balance, crash failover, joins, pauses, graceful stops, chaos) run
on both backends in ``tests/integration/conformance/test_sharding.py``. Here: the
handover requests (only to members, never to a holder, fenced by the coordinator's
term), the opening of requests reserved for a node that left, a stop before start, and
the refusal of another number of shards.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import rselection as rs
from rselection.redis import RedisLeader
from rselection.redis import sharded as redis_sharded
from rselection.redis.handover import reopen_handovers, request_handovers
from rselection.redis.lease import handover_key
from rselection.sharded import Rebalancer
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


def idle_tasks() -> rs.TaskHandler:
    tasks = rs.TaskHandler()

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.cancelled.wait()

    return tasks


@pytest.fixture
def name(redis_url: str) -> Iterator[str]:
    """A sharded name of this test's own; its keys are deleted after the test."""
    made = f"rsh-{uuid.uuid4().hex[:8]}"
    yield made
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"rselection:{{{made}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def reservation(redis_url: str, lease: str) -> dict[str, Any] | None:
    """The handover request recorded on ``lease``, if any."""
    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.get(handover_key(lease))
    finally:
        client.close()
    return None if raw is None else dict(json.loads(raw))


def test_requests_skip_a_lease_its_target_holds_and_a_node_that_left_opens_its_own(
    redis_url: str, name: str
) -> None:
    holders = [
        RedisLeader(redis_url, idle_tasks(), name=f"{name}/{k}", node_id="a", **FAST)
        for k in range(2)
    ]
    try:
        for leader in holders:
            leader.start()
        wait_until(lambda: all(h.is_leader for h in holders), 20, "a leads both leases")
        # A lease its target holds is left alone; the other is reserved for its target.
        asked = request_handovers(redis_url, {f"{name}/0": "b", f"{name}/1": "a"}, timeout=30)
        assert set(asked) == {f"{name}/0"} and asked[f"{name}/0"].node_id == "a"
        assert reservation(redis_url, f"{name}/1") is None
        reserved = reservation(redis_url, f"{name}/0")
        assert reserved is not None and reserved["to"] == "b" and reserved["from"] == "a"
        # b leaves: what was reserved for it is opened to every node but its old holder.
        names = [f"{name}/0", f"{name}/1"]
        assert reopen_handovers(redis_url, names, "b") == [f"{name}/0"]
        opened = reservation(redis_url, f"{name}/0")
        assert opened is not None and opened["to"] == "" and opened["from"] == "a"
        assert reopen_handovers(redis_url, names, "b") == []
    finally:
        for leader in holders:
            leader.stop(timeout=10)


def test_a_deposed_coordinators_moves_are_not_recorded_nor_those_to_a_node_that_left(
    redis_url: str, name: str
) -> None:
    shards = [
        RedisLeader(redis_url, idle_tasks(), name=f"{name}/{k}", node_id="a", **FAST)
        for k in range(4)
    ]
    coordinators = {
        node: RedisLeader(
            redis_url, rs.TaskHandler(), name=name, node_id=node, heartbeat_interval=0.5, **FAST
        )
        for node in ("a", "b")
    }
    view = rs.RedisShardedLeader(
        redis_url, idle_tasks(), name=name, shards=4, node_id="a", heartbeat_interval=0.5, settle=0
    )
    try:
        for leader in shards:
            leader.start()
        coordinators["a"].start()
        assert coordinators["a"].wait_until_leader(20)
        coordinators["b"].start()
        stale = coordinators["a"].term
        assert stale is not None
        coordinators["a"].step_down(hold=30)  # deposed: b coordinates from now on
        assert coordinators["b"].wait_until_leader(20)
        current = coordinators["b"].term
        assert current is not None and current > stale
        wait_until(lambda: all(leader.is_leader for leader in shards), 20, "a leads every shard")
        wait_until(
            lambda: {n.node_id for n in coordinators["b"].nodes() if n.alive} == {"a", "b"},
            20,
            "both nodes heartbeat",
        )
        names = [f"{name}/{k}" for k in range(4)]
        # A's rebalancer, deposed: it plans moves to b (a holds every shard) but none is
        # recorded, round after round, while b heartbeats and settles.
        rebalancer = Rebalancer(view)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert rebalancer.step(stale) == []
            time.sleep(0.1)
        assert all(reservation(redis_url, lease) is None for lease in names)
        moved = rebalancer.step(current)  # the same round under the live term is recorded
        assert [m.target for m in moved] == ["b", "b"], moved
        assert {(reservation(redis_url, m) or {}).get("to") for m in names} >= {"b"}
        # A node that is not a member of the name is never asked to take a shard.
        left = next(f"{name}/{k}" for k in range(4) if k not in {m.shard for m in moved})
        assert view._request_handovers({left: "ghost"}, fence=(name, current)) == {}
        assert reservation(redis_url, left) is None
    finally:
        for leader in [*shards, *coordinators.values()]:
            leader.stop(timeout=10)
        view.stop(timeout=10)


def test_a_stop_before_start_is_final(redis_url: str, name: str) -> None:
    stopped = rs.RedisShardedLeader(
        redis_url, idle_tasks(), name=name, shards=3, node_id="stopped", **FAST
    )
    other = rs.RedisShardedLeader(
        redis_url, idle_tasks(), name=name, shards=3, node_id="other", **FAST
    )
    try:
        stopped.stop()
        stopped.start()  # as LeaseLeader: no error, and nothing starts
        with pytest.raises(RuntimeError, match="already started"):
            stopped.start()
        other.start()
        wait_until(lambda: other.owned() == {0, 1, 2}, 20, "the other node to lead all", 0.05)
        assert stopped.owned() == frozenset()
        assert {info.node_id for info in other.assignment().values()} == {"other"}
    finally:
        stopped.stop(timeout=10)
        other.stop(timeout=10)
    again = rs.RedisShardedLeader(redis_url, idle_tasks(), name=name, shards=3, **FAST)
    again.stop()
    thread = threading.Thread(target=again.lead, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "lead() after stop() did not return"
    assert again.owned() == frozenset()


def test_a_node_built_with_another_number_of_shards_is_refused_while_the_fleet_runs(
    redis_url: str, name: str
) -> None:
    running = rs.RedisShardedLeader(
        redis_url, idle_tasks(), name=name, shards=4, node_id="first", **FAST
    )
    odd = rs.RedisShardedLeader(redis_url, idle_tasks(), name=name, shards=5, node_id="odd")
    try:
        running.start()
        assert running.wait_until_balanced(20)
        # The coordinator records its number of shards, fenced by its term.
        client = redis.Redis.from_url(redis_url)
        try:
            wait_until(
                lambda: client.get(f"rselection:{{{name}}}:rselection-shards") is not None,
                10,
                "the coordinator's record of the number of shards",
            )
        finally:
            client.close()
        with pytest.raises(rs.ConfigError, match="shards=4"):
            odd.start()
    finally:
        running.stop(timeout=10)
        odd.stop(timeout=10)


def test_bad_arguments_are_refused_with_a_clear_message(redis_url: str) -> None:
    with pytest.raises(rs.ConfigError, match="claimer"):
        rs.RedisShardedLeader(redis_url, idle_tasks(), name="bad", shards=2, claimer=object())
    with pytest.raises(rs.ConfigError, match="shards"):
        rs.RedisShardedLeader(redis_url, idle_tasks(), name="bad", shards=0)
    with pytest.raises(rs.ConfigError, match="Redis URL"):
        rs.RedisShardedLeader("", idle_tasks(), name="bad", shards=2)


def test_a_move_to_a_node_that_left_before_the_request_landed_is_opened_at_once(
    redis_url: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a target that left between the coordinator's read of the members and its
    # requests had opened nothing (nothing was reserved for it yet), and the requests
    # that then landed kept its shards unled until they lapsed (1.5 s with these
    # timings, 5.5 s with the defaults).
    quick = {**FAST, "heartbeat_interval": 0.5, "rebalance_interval": 0.25}
    first = rs.RedisShardedLeader(
        redis_url, idle_tasks(), name=name, shards=4, node_id="A", **quick
    )
    joiner = rs.RedisShardedLeader(
        redis_url, idle_tasks(), name=name, shards=4, node_id="J", **quick
    )
    real = redis_sharded.request_handovers
    left = threading.Event()

    def leave_first(client: Any, targets: dict[str, str], **kw: Any) -> Any:
        if not left.is_set() and "J" in targets.values():
            joiner.stop(timeout=15)  # J leaves after the read, before the requests land
            left.set()
        return real(client, targets, **kw)

    monkeypatch.setattr(redis_sharded, "request_handovers", leave_first)
    try:
        first.start()
        wait_until(lambda: first.owned() == {0, 1, 2, 3}, 20, "A leads every shard", 0.05)
        joiner.start()
        wait_until(left.is_set, 30, "a move planned to J", 0.05)
        began = time.monotonic()
        wait_until(lambda: first.owned() == {0, 1, 2, 3}, 10, "A to lead every shard again", 0.02)
        took = time.monotonic() - began
        assert took < 1.0, f"shards moved to a node that had left were unled for {took:.2f} s"
    finally:
        joiner.stop(timeout=10)
        first.stop(timeout=10)
