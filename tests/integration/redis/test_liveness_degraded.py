"""Crash failover when the holder's liveness beats are missing, on a private Redis.

Beats may be missing because the holder runs a release without them (a rolling
upgrade), because an ACL refuses their channel, or because the holder is paused. None
of these may end a term, and a follower must still notice a crashed holder within
about a second: a holder never heard to beat is checked every ``liveness_interval``; one
that beat and went silent is checked with waits growing to at most a second.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from rselection.redis import RedisLease
from tests.support.pg import PrivateRedis

pytestmark = pytest.mark.slow


@pytest.fixture
def admin(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    yield client
    client.close()


def _checks(admin: redis.Redis) -> int:
    stats = admin.info("commandstats")
    return int(stats.get("cmdstat_client|list", {}).get("calls", 0))


def _wait(lease: RedisLease, seconds: float) -> None:
    """Wait as a keeper does, for ``seconds`` (its own acquisition's publish wakes the
    first wait at once)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        lease.wait_for_change(left)


def _noticed_after_kill(admin: redis.Redis, holder: RedisLease, follower: RedisLease) -> float:
    """Kill the holder's connection (as its process's death would) and return how long
    the follower's wait took to notice; it then takes the lease over."""
    admin.client_kill_filter(_id=holder.client_id)
    began = time.monotonic()
    follower.wait_for_change(10.0)
    noticed = time.monotonic() - began
    assert follower.try_acquire("b").acquired
    return noticed


def test_an_acl_granting_only_the_older_channels_ends_no_term_and_a_crash_is_noticed(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    name = f"acl-{uuid.uuid4().hex[:6]}"
    # The channels a lease used before liveness beats, granted one by one.
    admin.execute_command(
        "ACL",
        "SETUSER",
        "app",
        "on",
        ">pw",
        "~rselection:*",
        f"&rselection:{{{name}}}:events",
        f"&rselection:{{{name}}}:node:*",
        "+@all",
    )
    url = f"redis://app:pw@127.0.0.1:{private_redis.port}/0"
    a = RedisLease(url, name=name, ttl=30.0, renew_deadline=20.0)
    b = RedisLease(url, name=name, ttl=30.0, renew_deadline=20.0, liveness_interval=0.2)
    try:
        held = a.try_acquire("a").holder
        assert held is not None and a.fast_failover
        _wait(a, 1.0)  # its beats are refused: the term goes on
        assert a.renew("a", held.term)
        assert not b.try_acquire("b").acquired
        _wait(b, 1.0)  # its SUBSCRIBE to the beats is refused: it goes on
        _wait(a, 0.3)
        assert a.renew("a", held.term)
        noticed = _noticed_after_kill(admin, a, b)
        print(f"\ncrash noticed without beats after {noticed:.2f} s")
        assert noticed < 1.5  # checks every 0.2 s; expiry would take 30 s
    finally:
        a.close()
        b.close()


def test_a_holder_that_never_beat_is_checked_every_liveness_interval(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    name = f"old-{uuid.uuid4().hex[:6]}"
    # A holder that publishes no beats at all (its keeper never waits here), like a
    # release without them.
    a = RedisLease(private_redis.url, name=name, ttl=30.0, renew_deadline=20.0)
    b = RedisLease(
        private_redis.url, name=name, ttl=30.0, renew_deadline=20.0, liveness_interval=0.2
    )
    try:
        assert a.try_acquire("a").acquired and a.fast_failover
        assert not b.try_acquire("b").acquired
        before = _checks(admin)
        _wait(b, 6.5)  # returns at its timeout: the holder's connection lives
        checks = _checks(admin) - before
        # A check every 0.2 s: the polling cost, in this degraded case only.
        assert checks >= 15, checks
        noticed = _noticed_after_kill(admin, a, b)
        print(f"\n{checks} checks in 6.5 s; crash noticed after {noticed:.2f} s")
        # Within a check or two; waits growing to 4 s had made it more than 3 s.
        assert noticed < 1.5
    finally:
        a.close()
        b.close()


def test_a_paused_holder_costs_a_few_checks_and_its_kill_is_noticed_within_a_second(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    name = f"pause-{uuid.uuid4().hex[:6]}"
    a = RedisLease(
        private_redis.url, name=name, ttl=30.0, renew_deadline=20.0, liveness_interval=0.2
    )
    b = RedisLease(
        private_redis.url, name=name, ttl=30.0, renew_deadline=20.0, liveness_interval=0.2
    )
    try:
        assert a.try_acquire("a").acquired and a.fast_failover
        assert not b.try_acquire("b").acquired
        b.wait_for_change(0.05)  # subscribes to the beats
        time.sleep(0.05)  # the SUBSCRIBE is sent; let the server register it
        _wait(a, 0.3)  # beats (three, every 0.1 s), then pauses: no more
        before = _checks(admin)
        b.wait_for_change(6.5)  # hears the beats, then times the silence
        checks = _checks(admin) - before
        # Waits 0.2, 0.4, 0.8, then 1 s: about eight checks, never one per 0.2 s (32).
        assert 3 <= checks <= 15, checks
        noticed = _noticed_after_kill(admin, a, b)
        print(f"\n{checks} checks of a paused holder in 6.5 s; kill noticed after {noticed:.2f} s")
        # Within the longest wait (1 s) and a margin; waits growing to 4 s had made it
        # more than 3 s.
        assert noticed < 2.0
    finally:
        a.close()
        b.close()
