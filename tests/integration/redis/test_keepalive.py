"""Which ``tcp-keepalive`` settings of a real Redis let a holder offer fast crash failover.

A follower takes over from a holder whose connection is gone, so the server must not
drop a partitioned holder's connection before that holder has stopped (``ttl`` after its
last renewal at the latest). Redis drops a silent client ``k + 3 * max(1, k // 3)``
seconds after it fell silent (``k`` = ``tcp-keepalive``): a holder offers fast failover
only when that is longer than its ``ttl``. The settings are changed on a private server;
the shared one is only read.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
import redis

from rselection.redis import RedisLease
from tests.support.pg import PrivateRedis


@pytest.fixture
def admin(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    yield client
    client.close()


def offers_fast_failover(url: str, ttl: float) -> bool:
    lease = RedisLease(url, name=f"t-{uuid.uuid4().hex[:8]}", ttl=ttl, renew_deadline=ttl / 2)
    try:
        lease.connect()
        return lease.fast_failover
    finally:
        lease.close()


# ttl 15 s: (tcp-keepalive, seconds a silent client is kept, fast failover offered)
SETTINGS = [(0, None, True), (7, 13, False), (8, 14, False), (9, 18, True), (10, 19, True)]


def test_fast_failover_only_where_the_server_keeps_a_silent_holder_past_the_ttl(
    private_redis: PrivateRedis, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rselection.redis.lease")
    seen = []
    for keepalive, kept, _ in SETTINGS:
        admin.config_set("tcp-keepalive", keepalive)
        seen.append((keepalive, kept, offers_fast_failover(private_redis.url, 15.0)))
    assert seen == SETTINGS
    # The refusal of 8 s shows the math, and what to set instead.
    assert any(
        "8 + 3 * 2 = 14 s" in r.getMessage() and "at least 9" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_the_shared_servers_setting_is_judged_by_the_same_rule(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        keepalive = int(client.config_get("tcp-keepalive")["tcp-keepalive"])
        idle_timeout = int(client.config_get("timeout")["timeout"])
    finally:
        client.close()
    # Redis's probes, as above; no keepalive (0) never drops a client.
    kept = keepalive + 3 * max(1, keepalive // 3) if keepalive else None
    ttls = [15.0] if kept is None else [kept - 0.5, float(kept)]
    for ttl in ttls:
        expected = (kept is None or kept > ttl) and (not idle_timeout or idle_timeout > ttl)
        assert offers_fast_failover(redis_url, ttl) is expected, (keepalive, idle_timeout, ttl)
