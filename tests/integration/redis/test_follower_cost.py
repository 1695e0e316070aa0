"""What an idle Redis follower costs the server, and that it still takes over at once.

An idle follower's commands, as Redis counts them (``INFO commandstats``, the calls
inside scripts included), are counted on a private ``redis-server`` with one leader and
one follower at the default timings: at most one per second, membership heartbeats
included, and no polling of the holder's connection (the holder's process beats tell
the follower it is alive). A holder killed with SIGKILL is still replaced within a
second or so: the beats stop, the follower checks the holder's connection once, finds
it gone, and takes over. The holders that stop beating run in processes of their own
(:mod:`tests.support.redis_holder`): a process beats for all the leases it holds.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

import rselection as rs
from rselection.commands.demo_fleet import Fleet
from rselection.redis import RedisLeader, RedisLease
from rselection.redis.keys import liveness_channel, membership_keys
from tests.support.pg import PrivateRedis
from tests.support.redis_holder import HolderProcess
from tests.support.waiting import wait_until

# serial: commands per second and a takeover within a second or so are what it measures.
pytestmark = [pytest.mark.serial]

WINDOW = 20.0  # seconds of the follower's window: more than one lease period (15 s)
ALONE = 10.0  # seconds of the leader-alone window


def commandstats(client: redis.Redis) -> Counter[str]:
    """Calls per command name so far (the reading's own ``INFO`` left out)."""
    stats = client.info("commandstats")
    return Counter(
        {
            k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in stats.items()
            if k != "cmdstat_info"
        }
    )


def counted(client: redis.Redis, seconds: float) -> Counter[str]:
    """Commands per name run by the server during the next ``seconds`` (a measuring
    window: it lasts its length by design)."""
    before = commandstats(client)
    time.sleep(seconds)
    return commandstats(client) - before


@pytest.fixture
def admin(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    yield client
    client.close()


def test_an_idle_follower_sends_at_most_one_command_per_second_and_never_polls(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    name = f"cost-{uuid.uuid4().hex[:6]}"
    # The leader at the default timings, but with its own heartbeats out of the windows
    # (one an hour), so that what it sends is only beats and renewals: PUBLISH, and a
    # fixed set of commands per renewal (measured alone, counted by its PEXPIRE).
    leader = RedisLeader(
        private_redis.url,
        rs.TaskHandler(),
        name=name,
        node_id="leader",
        claimer=None,
        heartbeat_interval=3600,
    )
    follower = RedisLeader(private_redis.url, rs.TaskHandler(), name=name, node_id="follower")
    nodes_key = membership_keys(name)[0]
    try:
        leader.start()
        assert leader.wait_until_leader(10)
        wait_until(lambda: admin.zscore(nodes_key, "leader") is not None, 10, "its heartbeat")
        alone = counted(admin, ALONE)
        assert alone["pexpire"] >= 3, alone  # renewals every 2 s
        per_renewal = (sum(alone.values()) - alone["publish"]) / alone["pexpire"]

        follower.start()
        channel = liveness_channel()
        wait_until(
            lambda: (
                admin.zscore(nodes_key, "follower") is not None
                and dict(admin.pubsub_numsub(channel)).get(channel.encode(), 0) >= 1
            ),
            10,
            "the follower's first heartbeat and its listening to the beats",
        )
        both = counted(admin, WINDOW)
    finally:
        follower.stop(timeout=10)
        leader.stop(timeout=10)
    leader_part = both["publish"] + per_renewal * both["pexpire"]
    rate = (sum(both.values()) - leader_part) / WINDOW
    print(
        f"\nidle follower: {rate:.2f} commands/s over {WINDOW:g} s "
        f"(leader: {per_renewal:g} commands per renewal, beats {both['publish'] / WINDOW:.1f}/s);"
        f" all commands: {dict(both)}"
    )
    assert rate <= 1.0
    assert both["zadd"] >= 1  # its heartbeats were counted
    # Not polled: a check of the holder's connection only when its beats stop (a busy
    # machine may delay one now and then; none in the runs measured), never every
    # liveness_interval (40 in this window before the beats).
    assert both["client|list"] <= 5


def test_a_killed_holder_is_replaced_within_seconds_at_the_default_timings(
    redis_url: str,
) -> None:
    name = f"t-{uuid.uuid4().hex[:6]}"
    fleet = Fleet(redis_url, name, ["--backend", "redis"])  # default timings: ttl 15 s
    failovers = []
    with fleet:
        first = fleet.start(4)
        for _ in range(3):  # three leaders in turn; a follower is left each time
            deadline = time.monotonic() + 0.5  # let the followers hear a few beats
            while (left := deadline - time.monotonic()) > 0:
                fleet.next_event(left)
            killed_at = time.time()
            fleet.kill(first["node"])
            heir = fleet.wait_for(10, ev="elected")
            assert heir is not None, fleet.history[-20:]
            failovers.append(heir["t"] - killed_at)
            assert heir["term"] == first["term"] + 1
            first = heir
    print(f"\nkill -9 failover (ttl 15 s): {[round(f * 1000) for f in failovers]} ms")
    # Measured: 0.3-0.6 s; the bound is several times that for a busy 2-core machine,
    # and far below the 15 s a failover by expiry would take.
    assert max(failovers) < 3.0


def test_a_silent_holder_costs_a_few_checks_never_a_poll(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    name = f"t-{uuid.uuid4().hex[:6]}"
    # A holder that beat and went silent: a paused process. (One never heard to beat is
    # checked every liveness_interval: see test_liveness_degraded.py.)
    timings = {"ttl": 30.0, "renew_deadline": 20.0, "liveness_interval": 0.1}
    a = HolderProcess(private_redis.url, name, **timings)
    b = RedisLease(private_redis.url, name=name, **timings)
    try:
        assert a.fast and not b.try_acquire("b").acquired
        b.wait_for_change(0.3)  # follows the holder; hears its beats
        a.pause()
        before = commandstats(admin)["client|list"]
        b.wait_for_change(3.0)  # returns at its timeout: the holder's connection lives
        checks = commandstats(admin)["client|list"] - before
        # Checks after 0.1, 0.3, 0.7, 1.5 and 2.5 s (each wait twice the last, up to
        # 1 s); a poll every liveness_interval would have made 30.
        print(f"\nchecks of a silent holder in 3 s: {checks}")
        assert 1 <= checks <= 6
        began = time.monotonic()
        a.kill()  # now it is gone for real
        b.wait_for_change(10.0)
        noticed = time.monotonic() - began
        assert b.try_acquire("b").acquired
        # Within the longest wait between checks (1 s), with a margin.
        assert noticed < 2.0, f"took {noticed:.2f}s"
    finally:
        a.close()
        b.close()
