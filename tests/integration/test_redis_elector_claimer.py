"""RedisElector and RedisClaimer against a real Redis.

The cases of the Go package's tests (acquire, renew, follow, fail over after the ttl,
resign, trimmed and empty keys, tiny ttls, one winner per claim), and stricter ones:
terms, concurrency, server time, fail-closed errors, bad input before any I/O.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from rselection.errors import BackendUnavailable, ConfigError
from rselection.redis import RedisClaimer, RedisElector
from tests.support.pg import PrivateRedis


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def key() -> str:
    return f"t-elect:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_elector(client: redis.Redis, key: str) -> Callable[..., RedisElector]:
    def make(**kw: Any) -> RedisElector:
        return RedisElector(kw.pop("source", client), **{"key": key, **kw})

    return make


def until_true(attempt: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not attempt():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


# -- elector --------------------------------------------------------------------------


def test_acquire_renew_and_follow(
    make_elector: Callable[..., RedisElector], client: redis.Redis, key: str
) -> None:
    a = make_elector(identity="node-a", ttl=5)
    b = make_elector(identity="node-b", ttl=5)
    assert a.term is None
    assert a.is_leader() is True and a.term == 1
    assert client.get(key) == b"node-a"
    client.pexpire(key, 1000)
    assert a.is_leader() is True and a.term == 1  # renewed: the full ttl again
    assert client.pttl(key) > 4000
    assert b.is_leader() is False and b.term is None
    assert client.get(key) == b"node-a"


def test_failover_after_ttl_increments_the_term(make_elector: Callable[..., RedisElector]) -> None:
    a = make_elector(identity="a", ttl=0.3)
    b = make_elector(identity="b", ttl=0.3)
    assert a.is_leader() and a.term == 1
    waited = until_true(b.is_leader, 3, "b to take over")
    assert waited >= 0.2 and b.term == 2
    assert a.is_leader() is False


def test_a_holder_renewing_after_its_own_expiry_keeps_its_term(
    make_elector: Callable[..., RedisElector],
) -> None:
    a = make_elector(identity="a", ttl=0.05)
    assert a.is_leader() and a.term == 1
    time.sleep(0.1)
    assert a.is_leader() and a.term == 1


def test_resign_hands_over_at_once_and_the_next_holder_gets_a_new_term(
    make_elector: Callable[..., RedisElector], client: redis.Redis, key: str
) -> None:
    a = make_elector(identity="a", ttl=30)
    b = make_elector(identity="b", ttl=30)
    assert a.is_leader()
    assert b.resign() is False  # not the holder: nothing deleted
    assert client.get(key) == b"a"
    assert a.resign() is True and a.term is None
    assert b.is_leader() and b.term == 2
    assert b.resign() and a.is_leader() and a.term == 3  # terms never go back


def test_exactly_one_of_many_concurrent_candidates_wins(
    make_elector: Callable[..., RedisElector],
) -> None:
    electors = [make_elector(ttl=30) for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda e: e.is_leader(), electors))
    assert results.count(True) == 1
    assert len({e.identity for e in electors}) == 16  # random per instance


def test_with_block_resigns(make_elector: Callable[..., RedisElector], client: redis.Redis) -> None:
    with make_elector() as elector:
        assert elector.is_leader()
    assert client.get(elector.key) is None


def test_key_is_trimmed_and_its_term_shares_the_hash_slot(client: redis.Redis, key: str) -> None:
    elector = RedisElector(client, key=f"  {key}\n")
    assert elector.key == key and elector.term_key == "{" + key + "}:term"
    tagged = RedisElector(client, key="{app}:leader")
    assert tagged.term_key == "{app}:leader:term"
    assert elector.is_leader() and client.get(key) is not None


@pytest.mark.parametrize("bad", ["", "   ", "\t\n", None, 5])
def test_empty_or_bad_keys_are_refused(client: redis.Redis, bad: Any) -> None:
    with pytest.raises(ConfigError, match="key"):
        RedisElector(client, key=bad)


@pytest.mark.parametrize("ttl", [0, 0.0009, -1, float("nan"), float("inf"), True, "30"])
def test_ttl_below_a_millisecond_or_not_a_number_is_refused(client: redis.Redis, ttl: Any) -> None:
    with pytest.raises(ConfigError, match="ttl"):
        RedisElector(client, ttl=ttl)


def test_a_one_millisecond_ttl_works(make_elector: Callable[..., RedisElector]) -> None:
    assert make_elector(ttl=0.001).is_leader()


def test_an_unreachable_server_raises_and_never_says_leader() -> None:
    elector = RedisElector(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1), key="x")
    with pytest.raises(BackendUnavailable, match=r"127\.0\.0\.1:1"):
        elector.is_leader()
    assert elector.term is None


def test_bad_clients_are_refused() -> None:
    for source in (None, 42, object(), ""):
        with pytest.raises(ConfigError):
            RedisElector(source)


def test_a_restarted_server_keeps_the_term(private_redis: PrivateRedis) -> None:
    client = redis.Redis.from_url(private_redis.url)
    a = RedisElector(client, key="k", identity="a", ttl=30)
    assert a.is_leader() and a.term == 1
    private_redis.restart()
    assert a.is_leader() and a.term == 1  # persisted (appendonly): still a's
    assert a.resign()
    b = RedisElector(client, key="k", identity="b", ttl=30)
    assert b.is_leader() and b.term == 2
    client.close()


# -- claimer --------------------------------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"t-claim:{uuid.uuid4().hex[:8]}:"


def test_a_claim_is_won_once_and_kept_until_its_ttl_then_replaced(
    client: redis.Redis, prefix: str
) -> None:
    a = RedisClaimer(client, prefix=prefix, ttl=0.3, holder="a")
    b = RedisClaimer(client, prefix=prefix, ttl=0.3, holder="b")
    assert a.claim("purge@1") is True
    assert a.claim("purge@1") is False  # also not twice by its own holder
    assert b.claim("purge@1") is False
    until_true(lambda: b.claim("purge@1"), 3, "the claim to expire")
    assert b.holder_of("purge@1")["holder"] == "b"  # type: ignore[index]


def test_a_claim_records_holder_term_format_and_server_expiry(
    client: redis.Redis, prefix: str
) -> None:
    claimer = RedisClaimer(client, prefix=prefix, ttl=60, holder="node-1")
    assert claimer.claim("report@2026-01-01T00:00:00.000000000Z", term=7)
    raw = json.loads(client.get(prefix + "report@2026-01-01T00:00:00.000000000Z") or b"{}")
    assert raw["holder"] == "node-1" and raw["term"] == "7" and raw["format"] == "1"
    assert abs(int(raw["at"]) / 1000 - time.time()) < 5
    assert 59_000 < client.pttl(prefix + "report@2026-01-01T00:00:00.000000000Z") <= 60_000
    assert claimer.holder_of("report@2026-01-01T00:00:00.000000000Z")["term"] == 7  # type: ignore[index]
    assert claimer.claim("other") and claimer.holder_of("other")["term"] is None  # type: ignore[index]


def test_default_holder_is_random_and_keys_are_independent(
    client: redis.Redis, prefix: str
) -> None:
    a, b = RedisClaimer(client, prefix=prefix), RedisClaimer(client, prefix=prefix)
    assert a.holder != b.holder and a.ttl == 600
    assert all(a.claim(f"k{i}") for i in range(20))
    assert not any(b.claim(f"k{i}") for i in range(20))


def test_concurrent_claimers_win_each_key_exactly_once(client: redis.Redis, prefix: str) -> None:
    claimers = [RedisClaimer(client, prefix=prefix, ttl=60) for _ in range(8)]
    keys = [f"fire@{i}" for i in range(50)]
    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda c: [k for k in keys if c.claim(k)], claimers))
    flat = [k for won in wins for k in won]
    assert sorted(flat) == sorted(keys)


def test_an_unreachable_server_raises_and_hides_the_password() -> None:
    claimer = RedisClaimer("redis://app:s3cret-pw@127.0.0.1:1/0")
    with pytest.raises(BackendUnavailable) as err:
        claimer.claim("x")
    assert "127.0.0.1:1" in str(err.value) and "s3cret-pw" not in str(err.value)
    claimer.close()


def test_a_server_down_mid_use_raises_then_recovers(private_redis: PrivateRedis) -> None:
    claimer = RedisClaimer(redis.Redis.from_url(private_redis.url, socket_timeout=2))
    assert claimer.claim("a")
    private_redis.stop(mode="immediate")
    with pytest.raises(BackendUnavailable):
        claimer.claim("b")  # fail closed: never "someone else has it"
    private_redis.start()
    assert claimer.claim("b") and not claimer.claim("a")


@pytest.mark.parametrize("ttl", [0, 0.0009, -5, float("nan"), None, True])
def test_bad_ttl_is_refused(client: redis.Redis, ttl: Any) -> None:
    with pytest.raises(ConfigError, match="ttl"):
        RedisClaimer(client, ttl=ttl)


@pytest.mark.parametrize(
    ("fire_key", "term"),
    [("", None), (None, None), (5, None), ("k", True), ("k", -1), ("k", 2**63), ("k", "3")],
)
def test_bad_claim_arguments_are_refused_before_any_io(fire_key: Any, term: Any) -> None:
    claimer = RedisClaimer(redis.Redis(host="127.0.0.1", port=1))  # never reached
    with pytest.raises(ConfigError):
        claimer.claim(fire_key, term=term)


@pytest.mark.parametrize("holder", ["", "  ", 3])
def test_bad_holder_or_prefix_is_refused(client: redis.Redis, holder: Any) -> None:
    with pytest.raises(ConfigError):
        RedisClaimer(client, holder=holder)
    with pytest.raises(ConfigError, match="prefix"):
        RedisClaimer(client, prefix=None)  # type: ignore[arg-type]
