"""``RedisShardedLeader`` in one process: what is Redis's own in the sharded leader.

The fleet scenarios, the status command, claims, lead() and stop() against a silent
server and the refusal of another number of shards run on both backends in
``tests/integration/conformance/test_sharding.py``; stopping the hard ways and the
coordinator's handover requests (fenced by its term, only to members, opened when their
target leaves) in ``tests/integration/conformance/test_sharding_stop.py``. Here: the
handover requests never go to a lease's holder, a node that left opens what was
reserved for it, arguments are checked, and a move to a node that left before the
request landed leaves no shard unled.
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
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(120)]

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
        asked = request_handovers(redis_url, {f"{name}/0": "b", f"{name}/1": "a"}, valid_for=30)
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
