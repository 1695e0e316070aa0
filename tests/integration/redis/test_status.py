"""``rselection status --redis-url``: the Redis leases, their holders and their nodes."""

from __future__ import annotations

import json

import rselection as rs
from rselection.redis import RedisLeader
from tests.support.resign_cli import cli
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


def status(redis_url: str, redis_prefix: str, *names: str) -> tuple[int, dict[str, object]]:
    out = cli("status", *names, "--redis-url", redis_url, "--key-prefix", redis_prefix, "--json")
    return out.returncode, json.loads(out.stdout)


def test_status_shows_the_redis_leases_and_every_node(redis_url: str, redis_prefix: str) -> None:
    made = [
        RedisLeader(
            redis_url,
            rs.TaskHandler(),
            name="billing",
            node_id=node_id,
            key_prefix=redis_prefix,
            heartbeat_interval=0.2,
            **FAST,
        )
        for node_id in ("a", "b")
    ]
    try:
        made[0].start()
        assert made[0].wait_until_leader(10)
        made[1].start()
        wait_until(lambda: len(made[1].nodes()) == 2, 10, "both heartbeats")
        code, shown = status(redis_url, redis_prefix)
        assert code == 0, shown
        (lease,) = shown["leases"]  # type: ignore[misc]
        assert (lease["name"], lease["holder"], lease["live"]) == ("billing", "a", True)
        nodes = {n["node_id"]: n for n in shown["nodes"]}  # type: ignore[attr-defined]
        assert set(nodes) == {"a", "b"}
        assert nodes["a"]["is_leader"] and not nodes["b"]["is_leader"]
        assert all(n["alive"] and n["lease"] == "billing" for n in nodes.values())
        text = cli("status", "--redis-url", redis_url, "--key-prefix", redis_prefix).stdout
        assert "nodes: 2 alive, 0 lost (alive = seen within 30s)" in text
        made[1].stop(timeout=10)  # a graceful leave is gone from the list at once
        code, shown = status(redis_url, redis_prefix, "billing")
        assert [n["node_id"] for n in shown["nodes"]] == ["a"]  # type: ignore[attr-defined]
    finally:
        for leader in made:
            leader.stop(timeout=10)
    # No leader: exit 1; a lease that never existed is named as such.
    code, shown = status(redis_url, redis_prefix, "billing", "nope")
    assert code == 1 and shown["unknown"] == ["nope"] and shown["headless"] == ["billing", "nope"]


def test_status_refuses_both_servers_and_names_an_unreachable_redis(redis_url: str) -> None:
    both = cli("status", "--redis-url", redis_url, "--dsn", "postgresql://x@h/db")
    assert both.returncode == 2 and "not both" in both.stderr
    gone = cli("status", "--redis-url", "redis://u:hunter2@127.0.0.1:1/0")
    assert gone.returncode == 3 and "hunter2" not in gone.stderr + gone.stdout
