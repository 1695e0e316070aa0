"""Handover on request with a Redis lease: ``rselection resign --redis-url``,
``rselection.redis.request_handover`` / ``cancel_handover``, and the lease's rules.

Fleet tests run real node processes (``python -m rselection.commands.demo_fleet --backend redis``)
that append fenced entries to a Redis list; each ends by checking that no entry of an
older term landed after one of a newer term.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import rselection as rs
from rselection.commands.demo_fleet import Fleet, redis_ledger_key
from rselection.redis import (
    RedisLeader,
    RedisLease,
    cancel_handover,
    current_holder,
    live_nodes,
    request_handover,
)
from rselection.redis.lease import handover_key, lease_keys
from tests.support.backends import LEDGER, Backend
from tests.support.resign_cli import cli, elected, seen_or_wait, took_ms
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


def forget(url: str, name: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.delete(*lease_keys(name)[:2], handover_key(name), redis_ledger_key(LEDGER, name))
    finally:
        client.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def fleet3(redis_url: str) -> Iterator[tuple[Fleet, dict[str, Any]]]:
    """Three node processes at the default timings (renewals every 2 s): a fast
    handover can only come from the published request, not from a renewal falling due."""
    fleet = Fleet(redis_url, f"rr-{uuid.uuid4().hex[:6]}", ["--backend", "redis", "--ttl", "15"])
    backend = Backend("redis", redis_url)
    with fleet:
        first = fleet.start(3)
        wait_until(lambda: len(live_nodes(redis_url, fleet.name) or []) == 3, 15, "three keepers")
        yield fleet, first
    assert backend.overlaps(fleet.name) == 0
    terms = backend.terms(fleet.name)
    assert terms and all(len(nodes) == 1 for nodes in terms.values())
    forget(redis_url, fleet.name)


# --------------------------------------------------------------------- resign, fleet


def test_resign_hands_over_to_another_node_well_under_a_second(
    redis_url: str, fleet3: tuple[Fleet, dict[str, Any]]
) -> None:
    fleet, current = fleet3
    figures = []
    for _ in range(5):
        out = cli("resign", fleet.name, "--redis-url", redis_url)
        assert out.returncode == 0, out.stdout + out.stderr
        figures.append(took_ms(out.stdout))
        heir = elected(fleet, 10, exclude=current["node"])
        assert heir["term"] == current["term"] + 1
        assert f"{heir['node']} leads {fleet.name!r} now with term {heir['term']}" in out.stdout
        demoted = seen_or_wait(fleet, 10, ev="demoted", node=current["node"], term=current["term"])
        assert demoted is not None and demoted["reason"] == "handover"
        current = heir
    print(
        f"redis resign handover: median {statistics.median(figures):.0f} ms, "
        f"max {max(figures):.0f} ms over {len(figures)} rounds (renew_interval 2 s)"
    )
    assert max(figures) < 1000


def test_resign_to_picks_the_named_node(
    redis_url: str, client: redis.Redis, fleet3: tuple[Fleet, dict[str, Any]]
) -> None:
    fleet, current = fleet3
    # Three rounds, each to a follower picked in turn: luck would pass all three only
    # one time in eight.
    for _ in range(3):
        target = sorted(set(fleet.procs) - {current["node"]})[0]
        out = cli("resign", fleet.name, "--redis-url", redis_url, "--to", target)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"{target} leads {fleet.name!r} now" in out.stdout
        heir = elected(fleet, 10, exclude=current["node"])
        assert heir["node"] == target and heir["term"] == current["term"] + 1
        print(f"redis resign --to {target}: {took_ms(out.stdout):.0f} ms")
        current = heir
    assert client.get(handover_key(fleet.name)) is None  # the acquisition cleared it


def test_resign_to_a_node_that_is_not_live_fails_clearly(
    redis_url: str, client: redis.Redis, fleet3: tuple[Fleet, dict[str, Any]]
) -> None:
    fleet, current = fleet3
    assert live_nodes(redis_url, fleet.name) == ["n0", "n1", "n2"]
    out = cli("resign", fleet.name, "--redis-url", redis_url, "--to", "no-such-node")
    assert out.returncode == 1
    assert "no-such-node is not a live node" in out.stderr
    followers = ", ".join(sorted({"n0", "n1", "n2"} - {current["node"]}))
    assert f"live followers: {followers}" in out.stderr
    same = cli("resign", fleet.name, "--redis-url", redis_url, "--to", current["node"])
    assert same.returncode == 0 and "already leads" in same.stdout
    assert client.get(handover_key(fleet.name)) is None  # nothing was requested
    both = cli("resign", fleet.name, "--redis-url", redis_url, "--dsn", "postgresql://x@h/db")
    assert both.returncode != 0 and "not both" in both.stderr


# --------------------------------------------------------------------- resign, edges


def fake_holder(client: redis.Redis, name: str, node: str, term: int, ttl_ms: int) -> None:
    """A lease key that says ``node`` holds ``term``, with no process behind it."""
    key, term_key, _ = lease_keys(name)
    value = {"token": "0" * 32, "node": node, "term": str(term), "client": "", "run": ""}
    value.update(fast="0", at=str(int(time.time() * 1000)))
    client.set(term_key, term)
    client.set(key, json.dumps(value), px=ttl_ms)


def test_resign_times_out_when_no_leader_process_exists(
    redis_url: str, client: redis.Redis
) -> None:
    name = f"ghost-{uuid.uuid4().hex[:6]}"
    fake_holder(client, name, "ghost-node", 4, 60_000)
    try:
        began = time.monotonic()
        out = cli("resign", name, "--redis-url", redis_url, "--timeout", "1")
        waited = time.monotonic() - began
        assert out.returncode == 1, out.stdout + out.stderr
        assert "asked ghost-node to hand" in out.stdout
        assert "no new term within 1s" in out.stderr
        assert f"ghost-node did not hand {name!r} over" in out.stderr
        assert waited < 15  # 1 s plus interpreter start-up, with a wide margin
        assert client.get(handover_key(name)) is None  # withdrawn
        holder = json.loads(client.get(lease_keys(name)[0]) or b"{}")
        assert (holder["node"], holder["term"]) == ("ghost-node", "4")
    finally:
        forget(redis_url, name)


def test_resign_without_a_holder_or_server_fails_at_once(redis_url: str) -> None:
    name = f"idle-{uuid.uuid4().hex[:6]}"
    out = cli("resign", name, "--redis-url", redis_url, "--timeout", "30")
    assert out.returncode == 1 and "has no leader" in out.stderr
    closed = cli("resign", name, "--redis-url", "redis://u:hunter2@127.0.0.1:1/0")
    assert closed.returncode == 2, closed.stdout + closed.stderr
    assert "127.0.0.1:1" in closed.stderr
    assert "hunter2" not in closed.stdout + closed.stderr
    bad = cli("resign", name, "--redis-url", "http://127.0.0.1:6379/")
    assert bad.returncode != 0 and "redis://" in bad.stderr


def test_resign_of_a_lone_leader_is_refused(redis_url: str) -> None:
    name = f"lone-{uuid.uuid4().hex[:6]}"
    leader = RedisLeader(redis_url, rs.TaskHandler(), name=name, node_id="lone", **FAST)
    leader.start()
    try:
        assert leader.wait_until_leader(10)
        wait_until(lambda: live_nodes(redis_url, name) == ["lone"], 10, "the keeper's channel")
        out = cli("resign", name, "--redis-url", redis_url)
        assert out.returncode == 1
        assert "no other live node" in out.stderr
        assert leader.is_leader
    finally:
        leader.stop(timeout=10)
        forget(redis_url, name)
    assert live_nodes(redis_url, name) == []


def test_an_in_process_leader_hands_over_on_request_and_stays_out(redis_url: str) -> None:
    name = f"inproc-{uuid.uuid4().hex[:6]}"
    slow = {**FAST, "ttl": 15.0, "renew_interval": 2.0, "renew_deadline": 10.0}
    leaders = [
        RedisLeader(redis_url, rs.TaskHandler(), name=name, node_id=f"p{i}", **slow)
        for i in range(2)
    ]
    try:
        leaders[0].start()
        assert leaders[0].wait_until_leader(10)
        leaders[1].start()
        term = leaders[0].term
        assert term is not None
        wait_until(lambda: live_nodes(redis_url, name) == ["p0", "p1"], 10, "both keepers")
        began = time.monotonic()
        asked = request_handover(redis_url, name, timeout=10)
        assert asked is not None and (asked.node_id, asked.term) == ("p0", term)
        assert leaders[1].wait_until_leader(5)
        took = time.monotonic() - began
        assert leaders[1].term == term + 1 and not leaders[0].is_leader
        print(f"in-process redis handover on request: {took * 1000:.0f} ms")
        assert took < 1.5  # the renewal is due only every 2 s: the message woke it
        time.sleep(0.5)
        assert not leaders[0].is_leader
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
        forget(redis_url, name)


# --------------------------------------------------------------- the lease, directly


@pytest.fixture
def name() -> str:
    return f"direct-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def make_lease(redis_url: str, name: str) -> Iterator[Callable[..., RedisLease]]:
    made: list[RedisLease] = []

    def make(**kw: Any) -> RedisLease:
        lease = RedisLease(redis_url, **{"name": name, "ttl": 3.0, "renew_deadline": 2.0, **kw})
        made.append(lease)
        return lease

    yield make
    for lease in made:
        lease.close()
    forget(redis_url, name)


def test_a_request_reserves_the_lease_for_the_named_node_until_its_window_ends(
    redis_url: str, client: redis.Redis, name: str, make_lease: Callable[..., RedisLease]
) -> None:
    a, b, c = make_lease(), make_lease(), make_lease()
    first = a.try_acquire("A")
    assert first.acquired and first.holder is not None
    term = first.holder.term
    asked = request_handover(client, name, to="C", timeout=1.0)
    assert asked is not None and (asked.node_id, asked.term) == ("A", term)
    assert a.renew("A", term)
    request = a.handover_requested()
    assert request is not None and request.term == term and request.to == "C"
    assert 0 < request.timeout <= 1.0
    assert a.handover_requested() is None  # reported once
    a.release("A", term)

    held_back = b.try_acquire("B")
    assert not held_back.acquired and held_back.holder is None
    assert 0 < held_back.expires_in <= 1.0  # how long the reservation lasts
    assert not a.try_acquire("A").acquired
    taken = c.try_acquire("C")
    assert taken.acquired and taken.holder is not None and taken.holder.term == term + 1
    assert client.get(handover_key(name)) is None  # the acquisition cleared the request

    # A reservation nobody uses ends with its window.
    c.release("C", term + 1)
    request_handover(client, name, to="C", timeout=0.5)  # nobody holds it: no request
    assert client.get(handover_key(name)) is None
    client.set(
        handover_key(name), json.dumps({"term": str(term + 1), "from": "C", "to": "C"}), px=500
    )
    assert not b.try_acquire("B").acquired
    time.sleep(0.6)
    assert b.try_acquire("B").acquired


def test_without_a_named_node_only_the_old_holder_is_kept_out(
    client: redis.Redis, name: str, make_lease: Callable[..., RedisLease]
) -> None:
    a, b = make_lease(), make_lease()
    first = a.try_acquire("A")
    assert first.holder is not None
    term = first.holder.term
    assert request_handover(client, name, timeout=5.0) is not None
    assert a.renew("A", term)
    request = a.handover_requested()
    assert request is not None and request.to is None
    a.release("A", term)
    again = a.try_acquire("A")
    assert not again.acquired and again.holder is None and again.expires_in > 0
    taken = b.try_acquire("B")
    assert taken.acquired and taken.holder is not None and taken.holder.term == term + 1
    assert client.get(handover_key(name)) is None


def test_stale_requests_are_ignored(
    redis_url: str, client: redis.Redis, name: str, make_lease: Callable[..., RedisLease]
) -> None:
    a, b = make_lease(), make_lease()
    got = a.try_acquire("A")
    assert got.holder is not None
    term = got.holder.term
    # A request left from an older term: the renewal ignores it ...
    stale = {"term": str(term - 1), "from": "A", "to": "B"}
    client.set(handover_key(name), json.dumps(stale), px=10_000)
    assert a.renew("A", term) and a.handover_requested() is None
    # ... and so does the acquire script, once the lease is free.
    a.release("A", term)
    again = a.try_acquire("A")
    assert again.acquired and again.holder is not None and again.holder.term == term + 1
    term += 1
    # A request withdrawn before the leader renewed is not reported.
    asked = request_handover(redis_url, name, timeout=10)
    assert asked is not None and asked.term == term
    assert not cancel_handover(redis_url, name, term - 1)  # not this term's
    assert cancel_handover(redis_url, name, term)
    assert not cancel_handover(redis_url, name, term)
    assert a.renew("A", term) and a.handover_requested() is None
    # A request whose window passed is gone (Redis expired it).
    request_handover(client, name, timeout=0.2)
    time.sleep(0.35)
    assert a.renew("A", term) and a.handover_requested() is None
    # Until the next acquisition a request binds, also after its term expired: as in
    # Postgres, only the named node may take the lease while the window lasts.
    request_handover(client, name, to="A", timeout=10)
    client.delete(lease_keys(name)[0])  # as if it had expired
    assert not b.try_acquire("B").acquired
    took = a.try_acquire("A")
    assert took.acquired and took.holder is not None and took.holder.term == term + 1
    assert client.get(handover_key(name)) is None


def test_bad_arguments_are_refused(client: redis.Redis, name: str) -> None:
    for timeout in (0, -1, 0.0009, float("nan"), True):
        with pytest.raises(rs.ConfigError, match="timeout"):
            request_handover(client, name, timeout=timeout)
    for to in ("", "  ", "x" * 1001):
        with pytest.raises(rs.ConfigError, match="node_id"):
            request_handover(client, name, to=to)
    for call in (
        lambda bad: request_handover(client, bad),
        lambda bad: cancel_handover(client, bad, 1),
        lambda bad: current_holder(client, bad),
        lambda bad: live_nodes(client, bad),
    ):
        for bad in ("", "   ", None, "x" * 1001):
            with pytest.raises(rs.ConfigError, match="lease name"):
                call(bad)
    with pytest.raises(rs.ConfigError, match="key_prefix"):
        current_holder(client, name, key_prefix=None)  # type: ignore[arg-type]
    with pytest.raises(rs.ConfigError, match="term"):
        cancel_handover(client, name, 0)
    client.set(lease_keys(name)[0], "not json", px=5000)
    try:
        with pytest.raises(rs.ConfigError, match="not an rselection lease"):
            request_handover(client, name)
    finally:
        client.delete(lease_keys(name)[0])
