"""The Redis backend on a real Redis Cluster (three masters on loopback, started for this
module): RedisLeader election, graceful and requested handover, fenced writes, the
resign command, and RedisElector / RedisClaimer through ``redis.cluster.RedisCluster``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

import rselection as rs
from rselection.claiming import claim_each
from rselection.redis import (
    RedisClaimer,
    RedisElector,
    RedisFence,
    RedisLeader,
    RedisLease,
    live_nodes,
    request_handover,
)
from rselection.redis.keys import membership_keys
from rselection.redis.lease import handover_key, lease_keys
from tests.support.redis_cluster import PrivateRedisCluster, redis_cluster_fixture
from tests.support.redis_holder import HolderProcess
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}

cluster = pytest.fixture(scope="module")(redis_cluster_fixture)


@pytest.fixture
def make_client(cluster: PrivateRedisCluster) -> Iterator[Callable[[], RedisCluster]]:
    made: list[RedisCluster] = []

    def make() -> RedisCluster:
        client = RedisCluster.from_url(cluster.url, socket_timeout=5)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def slot_master_port(client: RedisCluster, key: str) -> int:
    node: Any = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
    return int(node.port)


class Ledger:
    """Fenced ``RPUSH`` writes of every leader to one list in the lease's slot."""

    def __init__(self, name: str) -> None:
        self.key = f"ledger:{{{name}}}"
        self.stale = 0
        self.lock = threading.Lock()

    def handler(self) -> rs.TaskHandler:
        tasks = rs.TaskHandler()
        ledger = self

        @tasks.persistent("ledger")
        def write(ctx: rs.TaskContext) -> None:
            leader = ctx_leaders[ctx.node_id]
            while ctx.sleep(0.02):
                entry = json.dumps({"term": ctx.term, "node": ctx.node_id})
                try:
                    leader.fence.call(ctx.term, "RPUSH", ledger.key, entry)
                except rs.StaleLeaderError:
                    with ledger.lock:
                        ledger.stale += 1
                    return
                except rs.BackendUnavailable:
                    continue

        return tasks

    def entries(self, client: RedisCluster) -> list[tuple[int, str]]:
        raw = client.lrange(self.key, 0, -1)
        return [(int(e["term"]), str(e["node"])) for e in map(json.loads, raw)]

    def check(self, client: RedisCluster) -> dict[int, set[str]]:
        """No entry of an older term after a newer one; one node per term."""
        newest, late = 0, 0
        terms: dict[int, set[str]] = {}
        for term, node in self.entries(client):
            late += term < newest
            newest = max(newest, term)
            terms.setdefault(term, set()).add(node)
        assert late == 0
        assert all(len(nodes) == 1 for nodes in terms.values()), terms
        return terms


ctx_leaders: dict[str, RedisLeader] = {}


@pytest.fixture
def fleet(
    make_client: Callable[[], RedisCluster],
) -> Iterator[tuple[str, Ledger, list[RedisLeader]]]:
    """Three in-process leaders of one lease, each with a RedisCluster client of its own."""
    name = f"c-{uuid.uuid4().hex[:6]}"
    ledger = Ledger(name)
    leaders = [
        RedisLeader(make_client(), ledger.handler(), name=name, node_id=f"{name}-n{i}", **FAST)
        for i in range(3)
    ]
    for leader in leaders:
        ctx_leaders[leader.node_id] = leader
    try:
        for leader in leaders:
            leader.start()
        yield name, ledger, leaders
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
            ctx_leaders.pop(leader.node_id, None)


def the_leader(leaders: list[RedisLeader], timeout: float = 10) -> RedisLeader:
    wait_until(lambda: sum(x.is_leader for x in leaders) == 1, timeout, "one leader")
    return next(x for x in leaders if x.is_leader)


def test_the_cluster_is_three_masters_and_the_lease_keys_share_a_slot(
    cluster: PrivateRedisCluster, make_client: Callable[[], RedisCluster]
) -> None:
    client = make_client()
    assert len(client.get_primaries()) == 3  # type: ignore[no-untyped-call]
    key, term_key, _ = lease_keys("billing")
    slots = {client.keyslot(k) for k in (key, term_key, handover_key("billing"), "x:{billing}")}
    assert len(slots) == 1
    # Lease names land on different masters, so the tests below exercise routing.
    ports = {slot_master_port(client, lease_keys(f"n{i}")[0]) for i in range(30)}
    assert len(ports) == 3


def test_one_leader_on_the_slot_master_handovers_and_fenced_writes(
    make_client: Callable[[], RedisCluster], fleet: tuple[str, Ledger, list[RedisLeader]]
) -> None:
    name, ledger, leaders = fleet
    client = make_client()
    first = the_leader(leaders)
    term = first.term
    assert term is not None
    key = lease_keys(name)[0]
    assert json.loads(client.get(key) or b"{}")["node"] == first.node_id
    master = slot_master_port(client, key)
    assert f":{master} (cluster)" in repr(first.lease)  # the keeper talks to the slot's master
    seen = {(info.node_id, info.term) for x in leaders if (info := x.leader()) is not None}
    assert seen == {(first.node_id, term)}  # every node agrees
    wait_until(lambda: len(ledger.entries(client)) >= 5, 10, "fenced writes")

    # Graceful handover: stop() releases and a follower takes over at once.
    began = time.monotonic()
    first.stop(timeout=10)
    rest = [x for x in leaders if x is not first]
    second = the_leader(rest)
    took = time.monotonic() - began
    assert second.term == term + 1
    print(f"cluster graceful handover: {took * 1000:.0f} ms")
    assert took < 2.0

    # The deposed term's fenced write is refused and writes nothing.
    before = client.llen(ledger.key)
    with pytest.raises(rs.StaleLeaderError):
        RedisFence(client, name=name).call(term, "RPUSH", ledger.key, "stale")
    assert b"stale" not in client.lrange(ledger.key, before - 1, -1)

    # Handover on request: the leader steps down, the other follower takes over.
    wait_until(
        lambda: (term + 1, second.node_id) in ledger.entries(client), 10, "the second term's writes"
    )
    wait_until(lambda: len(live_nodes(client, name) or []) == 2, 10, "two keepers listed")
    began = time.monotonic()
    asked = request_handover(client, name, valid_for=10)
    assert asked is not None and asked.node_id == second.node_id
    third = the_leader([x for x in rest if x is not second])
    took = time.monotonic() - began
    assert third.term == term + 2
    print(f"cluster handover on request: {took * 1000:.0f} ms")
    assert took < 2.0
    time.sleep(0.5)
    assert not second.is_leader  # kept out while the request lasted, then a follower
    wait_until(lambda: len(ledger.entries(client)) > before + 5, 10, "the new term's writes")
    for leader in leaders:
        leader.stop(timeout=10)
    terms = ledger.check(client)
    assert {term, term + 1, term + 2} <= set(terms)


def test_membership_on_a_cluster_lists_every_node_from_any_node(
    make_client: Callable[[], RedisCluster], fleet: tuple[str, Ledger, list[RedisLeader]]
) -> None:
    name, _, leaders = fleet
    client = make_client()
    nodes_key, info_key = membership_keys(name)
    # The membership keys share the lease's slot: one script reads them and the holder.
    assert len({client.keyslot(k) for k in (lease_keys(name)[0], nodes_key, info_key)}) == 1
    first = the_leader(leaders)
    ids = {x.node_id for x in leaders}
    wait_until(
        lambda: all({n.node_id for n in x.nodes() if n.alive} == ids for x in leaders),
        30,
        "every node listing all three",
    )
    for leader in leaders:
        assert [n.node_id for n in leader.nodes() if n.is_leader] == [first.node_id]
    leaving = next(x for x in leaders if x is not first)
    leaving.stop(timeout=10)
    assert {n.node_id for n in first.nodes()} == ids - {leaving.node_id}


def test_resign_command_on_a_cluster(
    cluster: PrivateRedisCluster,
    make_client: Callable[[], RedisCluster],
    fleet: tuple[str, Ledger, list[RedisLeader]],
) -> None:
    name, ledger, leaders = fleet
    client = make_client()
    first = the_leader(leaders)
    term = first.term
    assert term is not None
    wait_until(lambda: len(live_nodes(client, name) or []) == 3, 10, "three keepers listed")
    # Point the command at a node that does not own the lease's slot.
    master = slot_master_port(client, lease_keys(name)[0])
    url = next(u for u in cluster.urls() if not u.endswith(f":{master}/0"))
    target = next(x for x in leaders if x is not first).node_id
    out = subprocess.run(
        [sys.executable, "-m", "rselection", "resign", name, "--redis-url", url, "--to", target],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{target} leads {name!r} now" in out.stdout
    print(out.stdout.strip().splitlines()[-1])
    heir = next(x for x in leaders if x.node_id == target)
    assert heir.wait_until_leader(5)
    assert heir.term == term + 1
    for leader in leaders:
        leader.stop(timeout=10)
    ledger.check(client)


# -- RedisElector and RedisClaimer --------------------------------------------------


def test_elector_on_a_cluster(make_client: Callable[[], RedisCluster]) -> None:
    client = make_client()
    name = f"c-elect:{uuid.uuid4().hex[:8]}"
    a = RedisElector(client, name=name, ttl=5, node_id="a")
    b = RedisElector(make_client(), name=name, ttl=5, node_id="b")
    assert a.is_leader() and a.term is not None
    first = a.term
    assert not b.is_leader()
    assert client.keyslot(a.key) == client.keyslot(a.term_key)
    assert a.is_leader() and a.term == first  # renewing keeps the term
    assert a.resign()
    assert b.is_leader() and b.term == first + 1
    assert not a.is_leader()
    with b:
        pass  # the block resigns
    assert a.is_leader() and a.term == first + 2
    a.resign()


def test_claimer_on_a_cluster_wins_each_key_once_across_masters(
    make_client: Callable[[], RedisCluster],
) -> None:
    client = make_client()
    prefix = f"c-claim:{uuid.uuid4().hex[:8]}:"
    claimers = [RedisClaimer(make_client(), key_prefix=prefix, ttl=60) for _ in range(4)]
    keys = [f"fire@{i}" for i in range(40)]
    wins: list[list[str]] = [[] for _ in claimers]

    def run(i: int) -> None:
        wins[i] = [k for k in keys if claimers[i].claim(k, term=i + 1)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(claimers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    flat = sorted(k for won in wins for k in won)
    assert flat == sorted(keys)
    # The claims are spread over the masters (each claim is one key).
    assert len({slot_master_port(client, prefix + k) for k in keys}) == 3
    holder = claimers[0].holder_of(keys[0])
    assert holder is not None and holder["node_id"] in {c.node_id for c in claimers}


def test_claim_missed_on_a_cluster_across_slots_and_in_one_slot(
    make_client: Callable[[], RedisCluster],
) -> None:
    client = make_client()
    run = uuid.uuid4().hex[:8]
    spread = RedisClaimer(make_client(), key_prefix=f"c-missed:{run}:", node_id="new")
    old = RedisClaimer(make_client(), key_prefix=f"c-missed:{run}:", node_id="old")
    keys = [f"tick@{i:02d}" for i in range(12)]
    assert len({client.keyslot(spread.key(k)) for k in keys}) > 1
    assert old.claim(keys[2]) and old.claim(keys[5])
    assert spread.claim_missed(keys, term=4) == keys[6:]
    assert spread.claim_missed(keys, term=5) == []
    assert old.claim(keys[4])  # before the newest held: left alone
    doc = spread.holder_of(keys[11])
    assert doc is not None and (doc["node_id"], doc["term"], doc["format"]) == ("new", 4, "1")
    assert int(doc["at"]) > 0
    # A key prefix with a hash tag keeps every claim in one slot: one script.
    tagged = RedisClaimer(make_client(), key_prefix=f"c-missed:{{{run}}}:", node_id="t")
    assert len({client.keyslot(tagged.key(k)) for k in keys}) == 1
    assert tagged.claim(keys[7])
    assert tagged.claim_missed(keys, term=6) == keys[8:]
    assert tagged.claim_missed(keys, term=7) == []
    # Two starting leaders across slots never win one key twice.
    race = [f"race@{i:03d}" for i in range(100)]
    a = RedisClaimer(make_client(), key_prefix=f"c-race:{run}:")
    b = RedisClaimer(make_client(), key_prefix=f"c-race:{run}:")
    results: dict[str, list[str]] = {}
    barrier = threading.Barrier(2)

    def go(label: str, claimer: RedisClaimer) -> None:
        barrier.wait(10)
        results[label] = claimer.claim_missed(race, term=1)

    threads = [threading.Thread(target=go, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not set(results["a"]) & set(results["b"])
    assert set(results["a"]) | set(results["b"]) <= set(race)


def test_claim_many_on_a_cluster_across_slots_and_in_one_slot(
    make_client: Callable[[], RedisCluster],
) -> None:
    """The fires due at one instant, of many tasks (keys in many slots): each won by one
    claimer only, in one call each; with a hash-tagged prefix (one slot), one script."""
    client = make_client()
    run = uuid.uuid4().hex[:8]
    keys = [f"lease/task-{i}@2026-12-01T00:00:00.000000000Z" for i in range(60)]
    for prefix in (f"c-many:{run}:", f"c-many:{{{run}}}:"):
        a = RedisClaimer(make_client(), key_prefix=prefix, node_id="a")
        b = RedisClaimer(make_client(), key_prefix=prefix, node_id="b")
        slots = {client.keyslot(a.key(k)) for k in keys}
        assert (len(slots) > 1) == ("{" not in prefix)
        assert b.claim(keys[3])
        results: dict[str, set[str]] = {}
        barrier = threading.Barrier(2)

        def go(
            label: str,
            claimer: RedisClaimer,
            barrier: threading.Barrier = barrier,
            results: dict[str, set[str]] = results,
        ) -> None:
            barrier.wait(10)
            results[label] = claimer.claim_many(keys, term=2)

        threads = [threading.Thread(target=go, args=(n, c)) for n, c in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not results["a"] & results["b"]
        assert results["a"] | results["b"] == set(keys) - {keys[3]}
        won = next(iter(results["a"] or results["b"]))
        doc = a.holder_of(won)
        assert doc is not None and doc["term"] == 2 and doc["format"] == "1"
        assert a.claim_many(keys) == set()


def test_a_starting_leaders_look_back_on_a_cluster(
    make_client: Callable[[], RedisCluster],
) -> None:
    """ran_before_many and claim_missed_many with tasks in many slots."""
    client = make_client()
    run = uuid.uuid4().hex[:8]
    claimer = RedisClaimer(make_client(), key_prefix=f"c-back:{run}:", node_id="b")
    series = [f"lease/task-{i}@" for i in range(20)]
    assert len({client.keyslot(claimer.key(one)) for one in series}) > 1
    assert claimer.ran_before_many(series) == set()  # first asked: recorded now
    assert claimer.ran_before_many(series) == set(series)
    tasks = [[f"{one}{n:02d}" for n in range(4)] for one in series]
    assert claimer.claim(tasks[0][1])
    won = claimer.claim_missed_many(tasks, term=3)
    assert won[0] == tasks[0][2:] and won[1:] == tasks[1:]
    assert claimer.claim_missed_many(tasks, term=4) == [[] for _ in tasks]


own_cluster = pytest.fixture(redis_cluster_fixture)  # this test's own: it stops a master


def test_claim_many_across_masters_with_one_master_hung_fails_only_that_masters_fires(
    own_cluster: PrivateRedisCluster,
) -> None:
    """A master that hangs (SIGSTOP) fails the claims of its keys only: the fires
    claimed on the masters that answered are won (they may run) and the caller is told
    which failed (they are skipped: claims fail closed)."""
    # Short timeouts and no retries: the call must end before the other masters mark
    # the hung one failed (cluster-node-timeout) and refuse every command.
    client = RedisCluster.from_url(
        own_cluster.url,
        socket_timeout=0.25,
        socket_connect_timeout=0.25,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        claimer = RedisClaimer(client, key_prefix="c-hung:", node_id="a")
        keys = [f"lease/task-{i}@2026-12-01T00:00:00.000000000Z" for i in range(30)]
        claimer.claim_many([f"lease/warm-{i}@x" for i in range(30)])  # a connection to each
        # Not the client's default node: the server time of the claims is read there.
        default: Any = client.get_default_node()  # type: ignore[no-untyped-call]
        victim = next(i for i, port in enumerate(own_cluster.ports) if port != default.port)
        port = own_cluster.ports[victim]
        on_victim = {k for k in keys if slot_master_port(client, claimer.key(k)) == port}
        assert on_victim and on_victim != set(keys)
        held = next(k for k in keys if k not in on_victim)
        assert claimer.claim(held)  # held before: neither won nor failed
        os.kill(own_cluster.procs[victim].pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            won, failed = claim_each(claimer, keys, term=2)
            took = time.monotonic() - began
        finally:
            os.kill(own_cluster.procs[victim].pid, signal.SIGCONT)
        assert won == set(keys) - on_victim - {held}
        assert set(failed) == on_victim
        assert all(isinstance(e, rs.BackendUnavailable) for e in failed.values())
        assert took < 4.5, f"the claims took {took:.2f}s"
        for key in won:
            doc = claimer.holder_of(key)
            assert doc is not None and doc["term"] == 2
    finally:
        client.close()


def test_a_moved_slot_never_makes_a_paused_holder_look_gone() -> None:
    """A process's liveness hub for a cluster node was routed by the key of the lease
    that made it. Once that lease's slot moved to another node, the hub asked that node
    about the holders of the first node's leases, found none, and a follower took over
    from a paused holder whose keeper connection was alive: two leaders after 0.5 s."""
    with PrivateRedisCluster() as fresh:  # its slots are moved: not the module's cluster
        admin = RedisCluster.from_url(fresh.url)
        home: Any = admin.get_node_from_key("{x}")  # type: ignore[no-untyped-call]
        names = (f"moved-{uuid.uuid4().hex[:6]}-{i}" for i in itertools.count())
        same = (n for n in names if slot_master_port(admin, f"{{{n}}}") == home.port)
        first, second = next(same), next(same)  # two leases of one node
        made_hub = RedisLease(RedisCluster.from_url(fresh.url), name=first)
        made_hub.connect()
        # first's (empty) slot moves to another master, as resharding does.
        slot = admin.keyslot(lease_keys(first)[0])
        other = next(p for p in fresh.ports if p != home.port)
        target = redis.Redis(port=other).execute_command("CLUSTER", "MYID")
        for port in fresh.ports:
            redis.Redis(port=port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target)
        moved = lease_keys(first)[0]
        # A command on the slot (answered MOVED by its old node) refreshes the slot map.
        wait_until(
            lambda: admin.exists(moved) == 0 and slot_master_port(admin, moved) == other,
            10,
            "the slot to move",
        )
        holder = HolderProcess(
            fresh.url, second, ttl=15.0, renew_deadline=10.0, liveness_interval=0.5, cluster=True
        )
        follower = RedisLease(RedisCluster.from_url(fresh.url), name=second)
        try:
            assert not follower.try_acquire("f").acquired
            follower.wait_for_change(1.0)
            holder.pause()  # its keeper connection stays open on its node
            until = time.monotonic() + 4.0  # the takeover came after 0.5 s
            while (left := until - time.monotonic()) > 0:
                follower.wait_for_change(left)
                assert not follower.try_acquire("f").acquired, "took over a live holder"
        finally:
            holder.close()
            follower.close()
            made_hub.close()
            admin.close()
