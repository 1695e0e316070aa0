"""Redis membership in one process over two servers, one of which hangs.

Server A is a private ``redis-server`` reached through a proxy that goes silent (a
network black hole); server B is healthy. The heartbeats of a node on B must go on as
if A did not exist: before, one thread sent every membership's heartbeats in turn and
waited out A's socket timeout, so the healthy node was reported lost. Stopping the node
on A is bounded and leaves no thread and no error behind.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.slow

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
