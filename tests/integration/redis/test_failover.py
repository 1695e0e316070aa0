"""Terms across a Redis failover: a promoted replica never repeats or lowers a term.

A private primary with replicas, each following through its own proxy. ``stall`` stops
a replica's stream silently, so an acquisition reaches only the primary; then the primary
is killed and the replica promoted with ``REPLICAOF NO ONE``, as Sentinel would. The
promoted replica has never heard of the last term: the acquire script must notice that
its counter was written under another replication id and jump past every term the lost
primary could have issued.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

import rselection as rs
from rselection.errors import StaleLeaderError
from rselection.redis import RedisFence, RedisLeader
from rselection.redis.lease import RedisLease, lease_keys
from tests.support.pg import PrivateRedis
from tests.support.redis_replica import RedisReplicaSet
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TTL = 2.0


@pytest.fixture
def name() -> str:
    return f"failover-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pair() -> Iterator[RedisReplicaSet]:
    with RedisReplicaSet(1) as servers:
        yield servers


def lease_on(url: str, name: str) -> RedisLease:
    return RedisLease(url, name=name, ttl=TTL, renew_deadline=1.0)


def take(lease: RedisLease, node: str) -> int:
    got = lease.try_acquire(node)
    assert got.acquired and got.holder is not None, got
    return got.holder.term


def counter(servers: RedisReplicaSet, i: int, name: str) -> int:
    return int(servers.client(i).get(lease_keys(name)[1]) or 0)


def test_a_replica_promoted_after_missing_an_acquisition_issues_a_larger_term(
    pair: RedisReplicaSet, name: str
) -> None:
    issued: list[int] = []
    with lease_on(pair.url(0), name) as a:
        for _ in range(3):
            issued.append(take(a, "a"))
            a.release("a", issued[-1])
        pair.wait_synced()
        pair.stall(1)
        issued.append(take(a, "a"))  # reaches the primary only
        assert counter(pair, 0, name) == issued[-1]
        assert counter(pair, 1, name) == issued[-2]  # the replica really missed it
        pair.kill(0)
    pair.promote(1)

    with lease_on(pair.url(1), name) as b:
        first = take(b, "b")
        assert first > max(issued), (first, issued)
        b.release("b", first)
        # After the jump, terms count up by one again on the same server.
        assert take(b, "b") == first + 1
    assert issued == sorted(set(issued))


def test_a_fenced_write_of_the_lost_term_is_refused_on_the_promoted_replica(
    pair: RedisReplicaSet, name: str
) -> None:
    state = f"{{{name}}}:state"
    with lease_on(pair.url(0), name) as a:
        a.release("a", take(a, "a"))
        pair.wait_synced()
        pair.stall(1)
        lost = take(a, "a")
        with RedisFence(pair.url(0), name) as fence:
            fence.call(lost, "SET", state, "a")  # accepted by the primary, never replicated
        pair.kill(0)
    pair.promote(1)

    with lease_on(pair.url(1), name) as b, RedisFence(pair.url(1), name) as fence:
        with pytest.raises(StaleLeaderError):
            fence.call(lost, "SET", state, "stale, before anyone leads")
        term = take(b, "b")
        assert term > lost
        with pytest.raises(StaleLeaderError):
            fence.call(lost, "SET", state, "stale")
        fence.call(term, "SET", state, "b")
        assert pair.client(1).get(state) == b"b"


def test_a_replicated_lease_stays_held_across_promotion_until_it_expires(
    pair: RedisReplicaSet, name: str
) -> None:
    with lease_on(pair.url(0), name) as a:
        held = take(a, "a")
        pair.wait_synced()
        pair.kill(0)
    pair.promote(1)

    with lease_on(pair.url(1), name) as b:
        seen = b.try_acquire("b")
        # The key came with the stream: the old holder keeps it until its PX runs out
        # (its keeper's connection died with the primary, so it is stepping down).
        assert not seen.acquired and seen.holder is not None
        assert (seen.holder.node_id, seen.holder.term) == ("a", held)
        took: list[int] = []

        def acquired() -> bool:
            got = b.try_acquire("b")
            if got.acquired and got.holder is not None:
                took.append(got.holder.term)
            return bool(took)

        wait_until(acquired, TTL * 5, "the carried-over lease to expire", interval=0.05)
        assert took[0] > held


def test_a_second_promotion_that_lost_the_first_ones_jump_still_goes_higher(
    name: str,
) -> None:
    with RedisReplicaSet(2) as servers:
        with lease_on(servers.url(0), name) as a:
            a.release("a", take(a, "a"))
            before = take(a, "a")
            a.release("a", before)
            servers.wait_synced()
            servers.kill(0)
        servers.promote(1)
        servers.follow(2, 1)
        servers.wait_synced(primary=1)
        servers.stall(2)
        with lease_on(servers.url(1), name) as b:
            jumped = take(b, "b")  # the first promotion's jump, never replicated
            assert jumped > before
            assert counter(servers, 2, name) == before
            servers.kill(1)
        servers.promote(2)
        with lease_on(servers.url(2), name) as c:
            assert take(c, "c") > jumped


def test_a_follower_on_the_replica_leads_after_promotion_with_a_larger_term(
    pair: RedisReplicaSet, name: str
) -> None:
    """Whole leaders: the leader's lost term is never seen again by any task."""
    terms: dict[str, list[int]] = {"a": [], "b": []}
    lock = threading.Lock()

    def handler(node: str) -> rs.TaskHandler:
        tasks = rs.TaskHandler()

        @tasks.persistent("work")
        def work(ctx: rs.TaskContext) -> None:
            with lock:
                terms[node].append(ctx.term)
            ctx.cancelled.wait()

        return tasks

    timings = {"ttl": TTL, "renew_interval": 0.2, "renew_deadline": 1.0, "retry_interval": 0.1}
    a = RedisLeader(pair.url(0), handler("a"), name=name, node_id="a", claimer=None, **timings)
    b = RedisLeader(pair.url(1), handler("b"), name=name, node_id="b", claimer=None, **timings)
    try:
        a.start()
        assert a.wait_until_leader(10)
        wait_until(lambda: terms["a"], 10, "a's task")
        pair.wait_synced()
        a.step_down()
        wait_until(lambda: len(terms["a"]) >= 2, 10, "a's second term")
        pair.stall(1)  # (a's second term may or may not have reached the replica)
        a.step_down()
        wait_until(lambda: len(terms["a"]) >= 3, 10, "a's term the replica missed")
        b.start()  # its attempts fail (READONLY) until the promotion
        pair.kill(0)
        wait_until(lambda: not a.is_leader, 10, "a to step down")
        promoted = time.monotonic()
        pair.promote(1)
        assert b.wait_until_leader(10)
        print(f"b leads {time.monotonic() - promoted:.3f} s after the promotion")
        wait_until(lambda: terms["b"], 10, "b's task")
    finally:
        b.stop(timeout=10)
        a.stop(timeout=10)
    assert terms["b"][0] > max(terms["a"]), terms
    assert len(set(terms["a"] + terms["b"])) == len(terms["a"]) + len(terms["b"])


def test_a_term_counter_that_vanished_does_not_restart_terms_at_one(
    private_redis: PrivateRedis, name: str
) -> None:
    """A counter evicted (``maxmemory``) or deleted while its origin key stayed."""
    with lease_on(private_redis.url, name) as a:
        first = take(a, "a")
        assert first == 1  # a fresh lease on a server never promoted starts at 1
        a.release("a", first)
        with redis.Redis.from_url(private_redis.url) as client:
            client.delete(lease_keys(name)[1])
        again = take(a, "a")
        assert again > first, again
        a.release("a", again)
        assert take(a, "a") == again + 1


def test_a_writable_replica_refuses_the_lease(pair: RedisReplicaSet, name: str) -> None:
    """With ``replica-read-only no`` a replica accepts writes it never passes on: a term
    counted there would be counted again by its primary."""
    pair.client(1).config_set("replica-read-only", "no")
    with (
        lease_on(pair.url(1), name) as on_replica,
        pytest.raises(rs.BackendUnavailable, match="replica"),
    ):
        on_replica.try_acquire("r")
    assert pair.client(1).get(lease_keys(name)[1]) is None
    with lease_on(pair.url(0), name) as a:
        assert take(a, "a") == 1


def test_a_restarted_server_jumps_the_next_term(private_redis: PrivateRedis, name: str) -> None:
    """A restart gives the server a new replication id: with ``appendfsync everysec`` it
    may have lost the last acquisitions, so the next term jumps as after a promotion."""
    with lease_on(private_redis.url, name) as a:
        a.release("a", before := take(a, "a"))
    private_redis.restart()
    with lease_on(private_redis.url, name) as a:
        after = take(a, "a")
        assert after > 10**15 > before, (before, after)
        a.release("a", after)
        assert take(a, "a") == after + 1
