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
from rselection.redis import RedisElector, RedisFence, RedisLeader
from rselection.redis.elector import elector_keys
from rselection.redis.lease import RedisLease, lease_keys, term_origin_key
from tests.support.pg import PrivateRedis
from tests.support.redis_replica import RedisReplicaSet
from tests.support.waiting import wait_until

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
        with RedisFence(pair.url(0), name=name) as fence:
            fence.call(lost, "SET", state, "a")  # accepted by the primary, never replicated
        pair.kill(0)
    pair.promote(1)

    with lease_on(pair.url(1), name) as b, RedisFence(pair.url(1), name=name) as fence:
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


def server_micros(url: str) -> int:
    """The server's ``TIME`` in microseconds."""
    with redis.Redis.from_url(url) as client:
        seconds, micros = client.time()
    return seconds * 1_000_000 + micros


def test_a_fresh_lease_starts_at_the_servers_clock(private_redis: PrivateRedis, name: str) -> None:
    """A lease with no counter cannot tell a new lease from one whose counter was lost, so
    its first term is the server's clock in microseconds, then one more per acquisition."""
    with lease_on(private_redis.url, name) as a:
        before = server_micros(private_redis.url)
        first = take(a, "a")
        assert before <= first <= server_micros(private_redis.url)
        a.release("a", first)
        assert take(a, "a") == first + 1


@pytest.mark.parametrize("lost", ["counter", "counter and origin", "flushdb"])
def test_a_term_counter_that_vanished_never_repeats_or_lowers_a_term(
    private_redis: PrivateRedis, name: str, lost: str
) -> None:
    """A counter evicted (``maxmemory``) or deleted, with or without its origin key (a
    ``DEL`` of the lease's keys, ``FLUSHDB``): the next term is still larger."""
    _, term_key, _ = lease_keys(name)
    with lease_on(private_redis.url, name) as a, redis.Redis.from_url(private_redis.url) as client:
        issued = [take(a, "a")]
        a.release("a", issued[-1])
        if lost == "flushdb":
            client.flushdb()
        else:
            client.delete(term_key, *([term_origin_key(name)] if "origin" in lost else []))
        issued.append(take(a, "a"))
        a.release("a", issued[-1])
        issued.append(take(a, "a"))
    assert issued[1] > issued[0], issued
    assert issued[2] == issued[1] + 1


def test_a_lease_evicted_under_memory_pressure_never_repeats_a_term(
    private_redis: PrivateRedis, name: str
) -> None:
    """``maxmemory`` with ``allkeys-lru`` evicts the counter and its origin together."""
    with lease_on(private_redis.url, name) as a, redis.Redis.from_url(private_redis.url) as client:
        issued = [take(a, "a")]
        a.release("a", issued[-1])
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.config_set("maxmemory", 1)  # below any use: every key is evicted
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            client.set("filler", "x")
        assert client.dbsize() == 0 and int(client.info("stats")["evicted_keys"]) >= 2
        client.config_set("maxmemory", 0)
        issued.append(take(a, "a"))
    assert issued[1] > issued[0], issued


def test_a_lease_newer_than_the_last_snapshot_never_repeats_a_term_after_a_crash(
    name: str,
) -> None:
    """Snapshots only (no append-only file): a lease first acquired after the last
    ``SAVE`` is gone, counter and origin, when the server crashes and loads the snapshot."""
    server = PrivateRedis(appendonly=False).start()
    try:
        with redis.Redis.from_url(server.url) as client:
            client.set("other", "kept")
            client.save()
        with lease_on(server.url, name) as a:
            issued = [take(a, "a")]
            a.release("a", issued[-1])
        server.kill()
        server.start()
        with redis.Redis.from_url(server.url) as client:
            assert client.get("other") == b"kept"  # the snapshot was loaded
            assert client.get(lease_keys(name)[1]) is None
        with lease_on(server.url, name) as a:
            assert take(a, "a") > issued[0]
    finally:
        server.close()


def test_a_promoted_server_restarted_before_any_acquisition_never_repeats_a_term(
    pair: RedisReplicaSet, name: str
) -> None:
    """The lease's only acquisitions reached the lost primary; the promoted replica,
    restarted before anyone acquired on it, has neither counter nor origin, and its
    restart forgot that it was promoted."""
    pair.servers[1].appendonly = True
    pair.client(1).config_set("appendonly", "yes")
    wait_until(
        lambda: (
            pair.client(1).info("persistence")["aof_rewrite_in_progress"] == 0
            and pair.client(1).info("persistence")["aof_enabled"] == 1
        ),
        10,
        "the replica's append-only file",
        interval=0.05,
    )
    pair.client(0).set("other", "kept")
    pair.wait_synced()
    pair.stall(1)
    with lease_on(pair.url(0), name) as a:
        lost = [take(a, "a")]
        a.release("a", lost[-1])
        lost.append(take(a, "a"))
    pair.kill(0)
    pair.promote(1)
    pair.servers[1].kill()
    pair.servers[1].start()
    assert pair.client(1).get("other") == b"kept"
    with lease_on(pair.url(1), name) as b:
        assert take(b, "b") > max(lost), lost


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
        before = server_micros(pair.url(0))
        assert take(a, "a") >= before  # the primary starts the lease afresh


def test_a_restarted_server_jumps_the_next_term(private_redis: PrivateRedis, name: str) -> None:
    """A restart gives the server a new replication id: with ``appendfsync everysec`` it
    may have lost the last acquisitions, so the next term jumps as after a promotion."""
    with lease_on(private_redis.url, name) as a:
        a.release("a", before := take(a, "a"))
    private_redis.restart()
    with lease_on(private_redis.url, name) as a:
        after = take(a, "a")
        # It jumped to the clock: a restart takes far longer than a microsecond.
        assert after > before + 1_000, (before, after)
        a.release("a", after)
        assert take(a, "a") == after + 1


def test_terms_stay_exact_beyond_two_to_the_53(private_redis: PrivateRedis, name: str) -> None:
    """Lua numbers are doubles: terms are computed as strings, exact to 2^63 - 1."""
    with lease_on(private_redis.url, name) as a, redis.Redis.from_url(private_redis.url) as client:
        a.release("a", take(a, "a"))  # the origin is this server's: no more jumps
        client.set(lease_keys(name)[1], 2**53 - 2)
        terms = []
        for _ in range(4):
            terms.append(take(a, "a"))
            a.release("a", terms[-1])
    assert terms == [2**53 - 1 + i for i in range(4)], terms


# -- RedisElector keeps a term of its own: the same rule --------------------------------


def test_an_election_whose_term_vanished_never_repeats_a_term(
    private_redis: PrivateRedis, name: str
) -> None:
    with redis.Redis.from_url(private_redis.url) as client:
        a = RedisElector(client, name=name, ttl=30, node_id="a")
        b = RedisElector(client, name=name, ttl=30, node_id="b")
        assert a.is_leader() and a.term is not None
        first = a.term
        assert a.resign()
        client.delete(elector_keys(name)[1])  # evicted, deleted
        assert b.is_leader() and b.term is not None and b.term > first, (first, b.term)
        jumped = b.term
        assert b.resign()
        assert a.is_leader() and a.term == jumped + 1


def test_an_election_on_a_replica_promoted_after_missing_a_change_of_holder_goes_higher(
    pair: RedisReplicaSet, name: str
) -> None:
    a = RedisElector(pair.url(0), name=name, ttl=30, node_id="a")
    b = RedisElector(pair.url(0), name=name, ttl=30, node_id="b")
    try:
        assert a.is_leader() and a.term is not None
        first = a.term
        assert a.resign()
        pair.wait_synced()
        pair.stall(1)
        assert b.is_leader() and b.term == first + 1  # reaches the primary only
        lost = b.term
        pair.kill(0)
    finally:
        a.close()
        b.close()
    pair.promote(1)
    with RedisElector(pair.url(1), name=name, ttl=30, node_id="a") as again:
        # The replica never heard of b's term: a plain HINCRBY would issue it again.
        assert again.is_leader() and again.term is not None and again.term > lost
