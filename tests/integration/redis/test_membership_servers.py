"""Redis membership heartbeats of one process: per server, and in batches.

Over two servers, one of which hangs: server A is a private ``redis-server`` reached
through a proxy that goes silent (a network black hole); server B is healthy. The
heartbeats of a node on B must go on as if A did not exist: before, one thread sent
every membership's heartbeats in turn and waited out A's socket timeout, so the healthy
node was reported lost. Stopping the node on A is bounded and leaves no thread and no
error behind.

On one server, the heartbeats of many leases go in one pipeline on one connection (the
server's ``INFO`` counts its reads and connections); a refused heartbeat fails its
membership alone; lost scripts and a closed connection cost no heartbeat; and a stop
waits for the batch in flight with its node.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import pytest
import redis

import rselection as rs
from rselection.redis import RedisLeader
from rselection.redis.lease import lease_keys
from rselection.redis.membership import RedisMembership
from tests.support.pg import PrivateRedis
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_until

TIMINGS = dict(ttl=3.0, renew_interval=0.5, renew_deadline=2.0, retry_interval=0.5)


def test_a_hung_server_delays_no_heartbeat_of_another_and_its_node_stops_in_bounded_time(
    private_redis: PrivateRedis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="rselection")
    name = f"hung-{uuid.uuid4().hex[:6]}"
    proxy = TcpProxy("127.0.0.1", private_redis.port)
    # node_timeout leaves y five missed heartbeats of room on a busy machine; the
    # heartbeats' socket timeout is then min(0.5, 3.0 / 3) = 0.5 s.
    hb = dict(heartbeat_interval=0.5, node_timeout=3.0)
    # Four nodes on the server that will hang (they share its heartbeat thread), one on
    # the healthy one.
    xs = [
        RedisLeader(
            f"redis://127.0.0.1:{proxy.port}/0",
            rs.TaskHandler(),
            name=f"{name}-x{i}",
            node_id=f"x{i}",
            claimer=None,
            **TIMINGS,
            **hb,
        )
        for i in range(4)
    ]
    y = RedisLeader(
        redis_url, rs.TaskHandler(), name=name, node_id="y", claimer=None, **TIMINGS, **hb
    )
    try:
        for leader in [*xs, y]:
            leader.start()

        def y_alive() -> bool:
            return [(n.node_id, n.alive) for n in y.nodes()] == [("y", True)]

        wait_until(y_alive, 10, "node y's first heartbeat")
        proxy.blackhole()
        began = time.monotonic()
        lost = []
        while time.monotonic() - began < 8.0:  # many of A's socket timeouts
            if not y_alive():
                lost.append(round(time.monotonic() - began, 2))
            time.sleep(0.2)
        assert not lost, f"healthy node y reported lost at {lost} s of the hang"
        heartbeat_threads = [
            t.name
            for t in threading.enumerate()
            if t.name.startswith("rselection-redis-heartbeats")
        ]
        assert len(heartbeat_threads) <= 2  # one per server, not one per lease
        y.stop(timeout=5)
        stopping = time.monotonic()
        for leader in xs:
            leader.stop(timeout=10)
        took = time.monotonic() - stopping
        # Each removal waits for at most a heartbeat's socket timeout (0.5 s) twice.
        assert took < 8.0, f"stopping the nodes on the hung server took {took:.2f} s"
        wait_until(
            lambda: (
                not [
                    t.name
                    for t in threading.enumerate()
                    if t.name.startswith(("rselection-cleanup", "rselection-redis-heartbeats"))
                ]
            ),
            5,
            "the clean-up and heartbeat threads to end",
        )
    finally:
        for leader in [*xs, y]:
            leader.stop(timeout=5)
        proxy.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert redis.Redis.from_url(redis_url).zscore(f"rselection:{{{name}}}:nodes", "y") is None


def test_a_second_stop_of_a_membership_waits_for_no_server(private_redis: PrivateRedis) -> None:
    """A sharded node's membership is stopped twice (at the hand-off, then by the
    coordinator's clean-up): during an outage the second stop waited for the server
    again, half a second more of the node's stop."""
    name = f"twice-{uuid.uuid4().hex[:6]}"
    proxy = TcpProxy("127.0.0.1", private_redis.port)
    client = redis.Redis.from_url(f"redis://127.0.0.1:{proxy.port}/0")
    member = RedisMembership(
        client,
        name=name,
        node_id="x",
        lease_key=lease_keys(name)[0],
        heartbeat_interval=0.5,
        node_timeout=3.0,
    )
    try:
        member.start()
        wait_until(lambda: [n.node_id for n in member.nodes()] == ["x"], 10, "a heartbeat")
        proxy.blackhole()
        member.stop()  # bounded by the heartbeats' socket timeout
        began = time.monotonic()
        member.stop()
        assert time.monotonic() - began < 0.1
    finally:
        proxy.close()
        client.close()


def _memberships(url: str, name: str, count: int, **timings: float) -> list[RedisMembership]:
    """``count`` memberships of leases ``<name>-<i>``, each on a client of its own (as
    leaders built from a URL have)."""
    return [
        RedisMembership(
            redis.Redis.from_url(url),
            name=f"{name}-{i}",
            node_id=f"n{i}",
            lease_key=lease_keys(f"{name}-{i}")[0],
            **timings,
        )
        for i in range(count)
    ]


def _stop(members: list[RedisMembership]) -> None:
    for member in members:
        member.stop()
        member._client.close()


def _scores(admin: redis.Redis, members: list[RedisMembership]) -> list[float | None]:
    """Each membership's last heartbeat (server ms), or None."""
    pipe = admin.pipeline(transaction=False)
    for member in members:
        pipe.zscore(member.keys[0], member.node_id)
    return list(pipe.execute())


def _beaten_since(
    admin: redis.Redis, members: list[RedisMembership], before: list[float | None]
) -> bool:
    """Whether each membership heartbeated since its score was ``before``."""
    now = _scores(admin, members)
    return all(b is not None and a is not None and b > a for a, b in zip(before, now, strict=True))


def _others(admin: redis.Redis) -> list[dict[str, object]]:
    """The server's client connections but ``admin``'s own."""
    me = admin.client_id()
    return [c for c in admin.client_list() if int(c["id"]) != me]


def test_the_heartbeats_of_many_leases_go_in_a_few_round_trips_on_one_connection(
    private_redis: PrivateRedis,
) -> None:
    """200 leases of one process on one server: one connection for all their heartbeats
    (was one per lease), and a few reads by the server per round (was one per heartbeat)."""
    count, window = 200, 3.0
    admin = redis.Redis.from_url(private_redis.url)
    members = _memberships(
        private_redis.url,
        f"many-{uuid.uuid4().hex[:6]}",
        count,
        heartbeat_interval=1.0,
        node_timeout=3.0,
    )
    try:
        for member in members:
            member.start()
        wait_until(lambda: None not in _scores(admin, members), 15, "every membership's heartbeat")
        before = admin.info("stats")
        calls = admin.info("commandstats")["cmdstat_evalsha"]["calls"]
        time.sleep(window)  # a measuring window: it lasts its length by design
        after = admin.info("stats")
        heartbeats = admin.info("commandstats")["cmdstat_evalsha"]["calls"] - calls
        connections = _others(admin)
    finally:
        _stop(members)
        admin.close()
    # admin's own commands in the window: INFO twice and CLIENT ID, CLIENT LIST.
    reads = after["total_reads_processed"] - before["total_reads_processed"] - 4
    print(f"\n{heartbeats} heartbeats in {window:g} s: {reads} reads, {len(connections)} conns")
    assert heartbeats >= 2 * count  # each membership beats about once a second
    # One pipeline of 200 heartbeats (about 60 kB) is read in a few reads.
    assert reads <= heartbeats / 10, f"{reads} reads for {heartbeats} heartbeats"
    assert len(connections) <= 2, f"{len(connections)} connections for {count} leases"
    assert after["total_connections_received"] == before["total_connections_received"]


def test_an_error_of_one_membership_in_a_batch_fails_no_other(
    private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A heartbeat refused (a key of the wrong type) fails its membership alone, which
    goes on retrying and heartbeats once the key is fixed."""
    caplog.set_level(logging.WARNING, logger="rselection")
    admin = redis.Redis.from_url(private_redis.url)
    members = _memberships(
        private_redis.url,
        f"err-{uuid.uuid4().hex[:6]}",
        4,
        heartbeat_interval=0.5,
        node_timeout=3.0,
    )
    bad, good = members[0], members[1:]
    admin.set(bad.keys[0], "not a sorted set")
    try:
        for member in members:
            member.start()
        wait_until(lambda: None not in _scores(admin, good), 10, "the others' heartbeats")
        first = _scores(admin, good)
        wait_until(lambda: _beaten_since(admin, good, first), 10, "the others' next heartbeats")
        refused = [r for r in caplog.records if "WRONGTYPE" in r.getMessage()]
        assert refused and all(bad.node_id in r.getMessage() for r in refused)
        assert len(_others(admin)) <= 2  # still batched
        admin.delete(bad.keys[0])
        wait_until(lambda: _scores(admin, [bad]) != [None], 10, "its heartbeat, fixed")
    finally:
        _stop(members)
        admin.close()
    failed = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert all(bad.node_id in m for m in failed), failed


def test_heartbeats_go_on_after_a_script_flush_and_a_killed_connection(
    private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Scripts the server lost are loaded again, and a connection the server closed is
    opened again, without a heartbeat failing."""
    caplog.set_level(logging.WARNING, logger="rselection")
    admin = redis.Redis.from_url(private_redis.url)
    members = _memberships(
        private_redis.url,
        f"flush-{uuid.uuid4().hex[:6]}",
        3,
        heartbeat_interval=0.5,
        node_timeout=3.0,
    )

    def beat_after(ms: int) -> bool:
        return all(s is not None and s > ms for s in _scores(admin, members))

    def server_ms() -> int:
        sec, usec = admin.time()
        return int(sec * 1000 + usec // 1000)

    try:
        for member in members:
            member.start()
        wait_until(lambda: None not in _scores(admin, members), 10, "the first heartbeats")
        loads = admin.info("commandstats").get("cmdstat_script|load", {}).get("calls", 0)
        admin.script_flush()
        since = server_ms()
        wait_until(lambda: beat_after(since), 10, "heartbeats after SCRIPT FLUSH")
        assert admin.info("commandstats")["cmdstat_script|load"]["calls"] > loads
        (conn,) = _others(admin)
        admin.client_kill_filter(_id=str(conn["id"]))
        since = server_ms()
        wait_until(lambda: beat_after(since), 10, "heartbeats after the kill")
        (again,) = _others(admin)
        assert again["id"] != conn["id"]
        # The node's info names the address of the connection that sends its heartbeats.
        info = admin.hget(members[0].keys[1], members[0].node_id)
        assert info is not None
        assert json.loads(info)["addr"] == str(again["addr"]).rsplit(":", 1)[0]
    finally:
        _stop(members)
        admin.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert not warnings, warnings


def test_a_stop_waits_for_the_batch_in_flight_with_its_node_and_no_heartbeat_lands_after(
    private_redis: PrivateRedis,
) -> None:
    """Replies held back 1.5 s by the network: a membership stopped while a batch with
    its heartbeat is in flight returns only after that batch, then its removal, came
    back (one connection, in order); its node is gone for good, the others go on."""
    delay = 1.5
    proxy = TcpProxy("127.0.0.1", private_redis.port)
    admin = redis.Redis.from_url(private_redis.url)
    # A socket timeout of min(2, 9 / 3) = 2 s: the held replies do not time out.
    members = _memberships(
        f"redis://127.0.0.1:{proxy.port}/0",
        f"inflight-{uuid.uuid4().hex[:6]}",
        3,
        heartbeat_interval=2.0,
        node_timeout=9.0,
    )
    stopped, others = members[0], members[1:]
    try:
        for member in members:
            member.start()
        wait_until(lambda: None not in _scores(admin, members), 10, "the first heartbeats")
        proxy.delay(delay)
        (last,) = _scores(admin, [stopped])
        wait_until(lambda: _scores(admin, [stopped]) != [last], 10, "a batch sent", 0.002)
        landed = time.monotonic()  # its reply comes back 1.5 s later
        stopped.stop()
        took = time.monotonic() - landed
        assert _scores(admin, [stopped]) == [None]
        # The batch's reply, then the removal's, each held 1.5 s.
        assert 2 * delay - 0.5 <= took < 2 * delay + 3.0, f"stop took {took:.2f} s"
        seen = _scores(admin, others)
        wait_until(lambda: _beaten_since(admin, others, seen), 15, "the others' next heartbeats")
        assert _scores(admin, [stopped]) == [None]
    finally:
        proxy.heal()
        _stop(members)
        proxy.close()
        admin.close()
