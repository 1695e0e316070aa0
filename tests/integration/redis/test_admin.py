"""``RedisAdmin``: the command line's reads and operations, for programs, on a real Redis
(the command line itself: test_status.py and test_resign.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

import rselection as rs
from rselection.admin import LeaseStatus, Refused, StatusSnapshot
from rselection.redis import DEFAULT_KEY_PREFIX, RedisAdmin, RedisLeader
from rselection.redis.keys import lease_keys, retired_key
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


@pytest.fixture
def admin(redis_url: str, redis_prefix: str) -> Iterator[RedisAdmin]:
    with RedisAdmin(redis_url, key_prefix=redis_prefix) as made:
        yield made


def leader(redis_url: str, redis_prefix: str, node_id: str, name: str = "billing") -> RedisLeader:
    made = RedisLeader(
        redis_url,
        rs.TaskHandler(),
        name=name,
        node_id=node_id,
        key_prefix=redis_prefix,
        heartbeat_interval=0.2,
        **FAST,
    )
    made.start()
    return made


def lease(snapshot: StatusSnapshot, name: str) -> LeaseStatus:
    (found,) = [lease for lease in snapshot.leases if lease.name == name]
    return found


def test_the_default_prefix_is_the_leaders(redis_url: str) -> None:
    with RedisAdmin(redis_url) as admin:
        assert admin.key_prefix == DEFAULT_KEY_PREFIX == "rselection:"
        assert "6379" in admin.where


def test_status_shows_the_holder_and_every_node(
    admin: RedisAdmin, redis_url: str, redis_prefix: str
) -> None:
    assert admin.leases() == [] and admin.status().leases == ()
    fleet = [leader(redis_url, redis_prefix, "a")]
    try:
        assert fleet[0].wait_until_leader(10)
        fleet.append(leader(redis_url, redis_prefix, "b"))
        wait_until(lambda: len(admin.nodes("billing")) == 2, 10, "both heartbeats")
        snapshot = admin.status()
        # A keeper subscribes to its node channel apart from its heartbeats.
        wait_until(lambda: admin.live_nodes("billing") == ["a", "b"], 10, "both keepers")
    finally:
        for each in fleet:
            each.stop(timeout=10)
    found = lease(snapshot, "billing")
    assert (found.holder, found.live, found.retired) == ("a", True, False)
    assert found.term is not None and found.term >= 1
    assert found.expires_in is not None and 0 < found.expires_in <= FAST["ttl"]
    assert snapshot.handovers == () and snapshot.fires is None
    assert snapshot.nodes is not None
    assert {(n.node_id, n.name, n.is_leader, n.alive) for n in snapshot.nodes} == {
        ("a", "billing", True, True),
        ("b", "billing", False, True),
    }
    assert admin.leases() == ["billing"] and admin.exists("billing")
    assert not admin.exists("nope") and admin.status(["nope"]).leases == ()
    after = lease(admin.status(["billing"]), "billing")
    # b may have led between a's stop and its own: the term is at least the one seen.
    assert not after.live and after.term is not None and after.term >= found.term


def test_named_status_keeps_the_shards_of_each_name(
    admin: RedisAdmin, redis_url: str, redis_prefix: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        for name in ("p/0", "p/1", "pq", "q"):
            client.set(lease_keys(name, redis_prefix)[1], 1)  # a term: a lease that once led
    finally:
        client.close()
    assert [x.name for x in admin.status(["p"]).leases] == ["p/0", "p/1"]
    assert [x.name for x in admin.status().leases] == ["p/0", "p/1", "pq", "q"]


def test_a_handover_request_shows_in_status_until_withdrawn(
    admin: RedisAdmin, redis_url: str, redis_prefix: str
) -> None:
    first = leader(redis_url, redis_prefix, "a")
    try:
        assert first.wait_until_leader(10)
        asked = admin.request_handover("billing", to="elsewhere", valid_for=30)
        assert asked is not None and asked.node_id == "a"
        pending = admin.status().handovers
        assert pending is not None
        (request,) = pending
        assert (request.lease, request.term, request.node_id, request.to) == (
            "billing",
            asked.term,
            "a",
            "elsewhere",
        )
        assert 0 < request.expires_in <= 30
        assert admin.cancel_handover("billing", asked.term)
        assert admin.status().handovers == ()
    finally:
        first.stop(timeout=10)


def test_watch_terms_sees_the_takeover_a_request_asked_for(
    admin: RedisAdmin, redis_url: str, redis_prefix: str
) -> None:
    fleet = [leader(redis_url, redis_prefix, "a")]
    try:
        assert fleet[0].wait_until_leader(10)
        fleet.append(leader(redis_url, redis_prefix, "b"))
        wait_until(lambda: admin.live_nodes("billing") == ["a", "b"], 10, "both keepers")
        with admin.watch_terms("billing") as watch:
            asked = admin.request_handover("billing", to="b")
            assert asked is not None and asked.node_id == "a"
            new = watch.wait(asked.term, 15)
        assert new is not None and (new.node_id, new.term > asked.term) == ("b", True)
        with admin.watch_terms("billing") as watch:
            assert watch.wait(new.term, 0.3) is None  # nobody asked: the term stays
    finally:
        for each in fleet:
            each.stop(timeout=10)


def test_retire_refuses_a_live_lease_then_marks_it_and_a_new_term_revives_it(
    admin: RedisAdmin, redis_url: str, redis_prefix: str
) -> None:
    with pytest.raises(Refused, match="no lease 'billing'"):
        admin.retire("billing")
    first = leader(redis_url, redis_prefix, "a")
    try:
        assert first.wait_until_leader(10)
        with pytest.raises(Refused, match="has a live holder: a leads term"):
            admin.retire("billing")
    finally:
        first.stop(timeout=10)
    done = admin.retire("billing")
    assert (done.name, done.already, done.marker) == (
        "billing",
        False,
        retired_key("billing", redis_prefix),
    )
    assert admin.retire("billing").already
    assert lease(admin.status(), "billing").retired
    second = leader(redis_url, redis_prefix, "b")
    try:
        assert second.wait_until_leader(10)
        revived = lease(admin.status(), "billing")
        assert not revived.retired and revived.term is not None and revived.term > done.term
    finally:
        second.stop(timeout=10)


def test_a_client_passed_in_stays_open(redis_url: str, redis_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        with RedisAdmin(client, key_prefix=redis_prefix) as admin:
            assert admin.leases() == []
        assert client.ping()
    finally:
        client.close()
