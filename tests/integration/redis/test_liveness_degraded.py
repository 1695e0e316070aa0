"""Crash failover when the holder's liveness beats are missing, on a private Redis.

Beats may be missing because an ACL refuses their channel (to the holder's PUBLISH or
the follower's SUBSCRIBE), or because the holder's process is paused. None of these may
end a term, and a follower must still notice a crashed holder within about a second: a
holder process never heard to beat is checked every ``liveness_interval``; one that
beat and went silent is checked with waits growing to at most a second. The holder runs
in a process of its own (:mod:`tests.support.redis_holder`), so that a pause or a kill
stops its beats and its connections together, as in production.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from rselection.redis import RedisLease
from rselection.redis.keys import liveness_channel
from tests.support.node_process import count
from tests.support.pg import PrivateRedis
from tests.support.redis_holder import HolderProcess
from tests.support.waiting import wait_until

SLOW = {"ttl": 30.0, "renew_deadline": 20.0}


@pytest.fixture
def admin(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    yield client
    client.close()


def _checks(admin: redis.Redis) -> int:
    stats = admin.info("commandstats")
    return int(stats.get("cmdstat_client|list", {}).get("calls", 0))


def _wait(lease: RedisLease, seconds: float) -> None:
    """Wait as a keeper does, for ``seconds`` (a wait may return early on a change)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        lease.wait_for_change(left)


def _noticed_after_kill(holder: HolderProcess, follower: RedisLease) -> float:
    """Kill the holder's process and return how long the follower's wait took to
    notice; it then takes the lease over with the next term."""
    began = time.monotonic()  # the follower's hub may notice before the kill returns
    holder.kill()
    follower.wait_for_change(10.0)
    noticed = time.monotonic() - began
    taken = follower.try_acquire("b")
    assert taken.acquired and taken.holder is not None
    assert taken.holder.term == holder.term + 1
    return noticed


def _acl_without_beats(admin: redis.Redis, user: str, name: str, port: int) -> str:
    """A user granted the lease's own channels one by one, not the liveness channel."""
    admin.execute_command(
        "ACL",
        "SETUSER",
        user,
        "on",
        ">pw",
        "~rselection:*",
        f"&rselection:{{{name}*}}:events",  # and the holder's companion lease's
        f"&rselection:{{{name}*}}:node:*",
        "+@all",
    )
    return f"redis://{user}:pw@127.0.0.1:{port}/0"


def test_an_acl_refusing_the_beats_channel_ends_no_term_and_a_crash_is_noticed(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    name = f"acl-{uuid.uuid4().hex[:6]}"
    url = _acl_without_beats(admin, "app", name, private_redis.port)
    # The holder's PUBLISH of beats is refused, and so is the follower's SUBSCRIBE.
    holder = HolderProcess(url, name, **SLOW, liveness_interval=0.5)
    b = RedisLease(url, name=name, **SLOW, liveness_interval=0.2)
    try:
        assert holder.fast
        assert not b.try_acquire("b").acquired
        _wait(b, 2.0)  # the holder beat (refused) and renewed meanwhile
        seen = b.current()
        assert seen is not None and (seen.node_id, seen.term) == ("holder", holder.term)
        noticed = _noticed_after_kill(holder, b)
        print(f"\ncrash noticed without beats after {noticed:.2f} s")
        assert noticed < 1.5  # checks every 0.2 s; expiry would take 30 s
    finally:
        holder.close()
        b.close()


def test_a_holder_never_heard_to_beat_is_checked_every_liveness_interval(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    name = f"mute-{uuid.uuid4().hex[:6]}"
    # The holder may not publish on the beats channel; the follower hears the channel,
    # and nothing of that holder on it.
    holder = HolderProcess(
        _acl_without_beats(admin, "mute", name, private_redis.port),
        name,
        **SLOW,
        liveness_interval=0.5,
    )
    b = RedisLease(private_redis.url, name=name, **SLOW, liveness_interval=0.2)
    try:
        assert not b.try_acquire("b").acquired
        before = _checks(admin)
        _wait(b, 6.5)  # returns at its timeout: the holder's connection lives
        checks = _checks(admin) - before
        # A check every 0.2 s: the polling cost, in this degraded case only.
        assert checks >= 15, checks
        noticed = _noticed_after_kill(holder, b)
        print(f"\n{checks} checks in 6.5 s; crash noticed after {noticed:.2f} s")
        # Within a check or two; waits growing to 4 s had made it more than 3 s.
        assert noticed < 1.5
    finally:
        holder.close()
        b.close()


def test_a_paused_holder_costs_a_few_checks_and_its_kill_is_noticed_within_a_second(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    name = f"pause-{uuid.uuid4().hex[:6]}"
    holder = HolderProcess(private_redis.url, name, **SLOW, liveness_interval=0.2)
    b = RedisLease(private_redis.url, name=name, **SLOW, liveness_interval=0.2)
    try:
        assert not b.try_acquire("b").acquired
        _wait(b, 0.5)  # hears the holder's beats (every 0.1 s)
        before = _checks(admin)
        _wait(b, 1.0)
        assert _checks(admin) == before  # beats heard: no check
        holder.pause()
        before = _checks(admin)
        _wait(b, 6.5)  # times the silence
        checks = _checks(admin) - before
        # Waits 0.2, 0.4, 0.8, then 1 s: about eight checks, never one per 0.2 s (32).
        assert 3 <= checks <= 15, checks
        noticed = _noticed_after_kill(holder, b)
        print(f"\n{checks} checks of a paused holder in 6.5 s; kill noticed after {noticed:.2f} s")
        # Within the longest wait (1 s) and a margin; waits growing to 4 s had made it
        # more than 3 s.
        assert noticed < 2.0
    finally:
        holder.close()
        b.close()


def test_a_holder_that_lost_its_connection_is_checked_at_once_while_its_process_beats(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    """The holder's process lives and beats on, but the server closed the lease's keeper
    connection: the holder says so in its next beat (a new epoch), and the follower
    checks at once instead of waiting for the lease to expire."""
    name = f"cut-{uuid.uuid4().hex[:6]}"
    holder = HolderProcess(private_redis.url, name, **SLOW, liveness_interval=0.2)
    b = RedisLease(private_redis.url, name=name, **SLOW, liveness_interval=0.2)
    try:
        assert not b.try_acquire("b").acquired
        _wait(b, 0.5)  # hears the holder's beats
        began = time.monotonic()
        admin.client_kill_filter(_id=holder.client)  # its waiting keeper notices
        b.wait_for_change(10.0)
        noticed = time.monotonic() - began
        holder.node.wait_for("the holder to see it", count("lost", 1), 10)
        assert holder.node.proc.poll() is None  # alive, and beating
        taken = b.try_acquire("b")
        assert taken.acquired, taken
        print(f"\na lost keeper connection noticed after {noticed:.2f} s")
        assert noticed < 2.0  # expiry would take 30 s
    finally:
        holder.close()
        b.close()


def _beats_in(url: str, seconds: float) -> int:
    """Beats published on the liveness channel during the next ``seconds`` (a window)."""
    client = redis.Redis.from_url(url)
    listener = client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(liveness_channel())
    heard, until = 0, time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        heard += listener.get_message(timeout=min(left, 0.1)) is not None
    listener.close()
    client.close()
    return heard


def test_a_busy_server_does_not_stop_the_beats_for_good(
    private_redis: PrivateRedis, admin: redis.Redis
) -> None:
    """A ``BUSY`` reply to a beat's PUBLISH (a long script ran) was taken for an ACL's
    refusal: the process never beat again, and its followers polled its connections."""
    lease = RedisLease(private_redis.url, name=f"busy-{uuid.uuid4().hex[:6]}", **SLOW)
    admin.config_set("busy-reply-threshold", 100)
    try:
        held = lease.try_acquire("a").holder
        assert held is not None and lease.fast_failover
        assert _beats_in(private_redis.url, 1.0) >= 2  # every 0.25 s
        with contextlib.suppress(redis.ResponseError):
            admin.eval(
                "local t = tonumber(redis.call('TIME')[1]) + 2 "
                "while tonumber(redis.call('TIME')[1]) < t do end",
                0,
            )
        wait_until(lambda: _beats_in(private_redis.url, 1.0) >= 2, 10, "the beats to resume")
        assert lease.renew("a", held.term)
    finally:
        lease.close()


def test_a_term_closed_unreleased_is_taken_over_at_once_while_its_process_beats(
    private_redis: PrivateRedis,
) -> None:
    """The holder's process closed one lease's connection without releasing it (a
    release that failed, a term that ended with its connection) and beats on for its
    other leases: its next beat carries a new epoch, so the follower checks at once.
    Before, the beats put the check off and the takeover waited for expiry."""
    name = f"drop-{uuid.uuid4().hex[:6]}"
    holder = HolderProcess(private_redis.url, name, **SLOW, liveness_interval=0.2)
    b = RedisLease(private_redis.url, name=name, **SLOW, liveness_interval=0.2)
    try:
        assert not b.try_acquire("b").acquired
        _wait(b, 0.5)  # hears the holder's beats
        began = time.monotonic()
        holder.abandon()
        while not b.try_acquire("b").acquired:
            assert time.monotonic() - began < 40, "never taken over"
            b.wait_for_change(1.0)
        took = time.monotonic() - began
        assert holder.node.proc.poll() is None  # alive, and beating for its companion
        print(f"\nan unreleased term taken over after {took:.2f} s")
        assert took < 2.0  # expiry would take 30 s
    finally:
        holder.close()
        b.close()
