"""RedisElector and RedisClaimer against a real Redis: what only Redis has.

The keys an election and a claim use (layout, hash slots, the prefix, the stored value
and its expiry), ``RedisClaimer.holder_of``, a starting leader's missed fires claimed in
one round trip by one script. What every elector and claimer promises runs on both
backends in ``tests/integration/conformance/test_elector.py`` and ``test_claimer.py``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from rselection.errors import ConfigError
from rselection.redis import RedisClaimer, RedisElector
from rselection.validation import MAX_NAME
from tests.support.waiting import wait_until


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def name() -> str:
    return f"t-elect:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def key(name: str) -> str:
    """The election key of ``name``."""
    return "rselection:{" + name + "}:elector"


@pytest.fixture
def make_elector(client: redis.Redis, name: str) -> Callable[..., RedisElector]:
    def make(**kw: Any) -> RedisElector:
        return RedisElector(kw.pop("source", client), **{"name": name, **kw})

    return make


# -- elector --------------------------------------------------------------------------


def test_a_renewal_resets_the_key_expiry_to_the_full_ttl(
    make_elector: Callable[..., RedisElector], client: redis.Redis, key: str
) -> None:
    a = make_elector(node_id="node-a", ttl=5)
    assert a.is_leader() is True and a.term is not None
    first = a.term
    assert client.get(key) == b"node-a"  # the key holds the node id
    client.pexpire(key, 1000)
    assert a.is_leader() is True and a.term == first
    assert client.pttl(key) > 4000
    assert make_elector(node_id="node-b", ttl=5).is_leader() is False
    assert client.get(key) == b"node-a"


def test_the_keys_take_the_name_verbatim_share_its_hash_slot_and_take_the_prefix(
    client: redis.Redis, name: str
) -> None:
    spaced = RedisElector(client, name=f"  {name}\n", node_id=" a ")
    assert spaced.key == "rselection:{  " + name + "\n}:elector"
    assert spaced.term_key == spaced.key + ":term"
    assert spaced.is_leader()
    assert client.get(spaced.key) == b" a "
    tagged = RedisElector(client, name=name, key_prefix="{app}:")
    assert tagged.key == "{app}:{" + name + "}:elector"
    assert tagged.term_key == tagged.key + ":term"
    assert spaced.resign()


# -- claimer --------------------------------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"t-claim:{uuid.uuid4().hex[:8]}:"


def test_a_claim_records_node_id_term_format_and_server_expiry(
    client: redis.Redis, prefix: str
) -> None:
    claimer = RedisClaimer(client, key_prefix=prefix, ttl=60, node_id="node-1")
    assert claimer.claim("report@2026-01-01T00:00:00.000000000Z", term=7)
    raw = json.loads(client.get(prefix + "report@2026-01-01T00:00:00.000000000Z") or b"{}")
    assert raw["node_id"] == "node-1" and raw["term"] == "7" and raw["format"] == "1"
    assert abs(int(raw["at"]) / 1000 - time.time()) < 5
    assert 59_000 < client.pttl(prefix + "report@2026-01-01T00:00:00.000000000Z") <= 60_000
    assert claimer.holder_of("report@2026-01-01T00:00:00.000000000Z")["term"] == 7  # type: ignore[index]
    assert claimer.claim("other") and claimer.holder_of("other")["term"] is None  # type: ignore[index]
    assert claimer.holder_of("never") is None
    assert claimer.claim(" spaced ") and client.exists(prefix + " spaced ")  # verbatim


@pytest.mark.parametrize("key_prefix", [None, 3, b"p:", "x" * (MAX_NAME + 1)])
def test_a_bad_key_prefix_is_refused(client: redis.Redis, key_prefix: Any) -> None:
    with pytest.raises(ConfigError, match="key_prefix"):
        RedisClaimer(client, key_prefix=key_prefix)
    with pytest.raises(ConfigError, match="key_prefix"):
        RedisElector(client, key_prefix=key_prefix)


# -- claim_missed: a starting leader's look back, in one round trip --------------------


def counting_client(redis_url: str) -> tuple[redis.Redis, list[int]]:
    """A client whose connections count what they send (one send per round trip)."""
    sent = [0]

    class Counting(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            sent[0] += 1
            super().send_packed_command(command, check_health)

    pool = redis.ConnectionPool.from_url(redis_url, connection_class=Counting)
    return redis.Redis(connection_pool=pool), sent


@pytest.mark.parametrize("count", [1, 50, 500])
def test_claim_missed_costs_one_round_trip_whatever_the_number_of_keys(
    redis_url: str, prefix: str, count: int
) -> None:
    client, sent = counting_client(redis_url)
    claimer = RedisClaimer(client, key_prefix=prefix, node_id="n")
    assert claimer.claim_missed(["warm-up"]) == ["warm-up"]  # connects, loads the script
    keys = [f"tick@{i:04d}" for i in range(count)]
    assert claimer.claim(keys[count // 2])
    before = sent[0]
    won = claimer.claim_missed(keys, term=3)
    assert sent[0] - before == 1
    assert won == keys[count // 2 + 1 :]
    client.close()


def test_claim_missed_records_its_claims_as_claim_does(client: redis.Redis, prefix: str) -> None:
    old = RedisClaimer(client, key_prefix=prefix, node_id="old-leader")
    new = RedisClaimer(client, key_prefix=prefix, node_id="new-leader")
    keys = [f"tick@{i:02d}" for i in range(10)]
    assert old.claim(keys[6])
    assert new.claim_missed(keys, term=7) == keys[7:]
    assert new.holder_of(keys[8]) == {
        "node_id": "new-leader",
        "term": 7,
        "format": "1",
        "at": new.holder_of(keys[8])["at"],  # type: ignore[index]
    }
    assert 599_000 < client.pttl(prefix + keys[9]) <= 600_000


def test_claim_missed_is_one_script_so_one_starting_leader_takes_every_key(
    client: redis.Redis, prefix: str
) -> None:
    keys = [f"race@{i:03d}" for i in range(200)]
    a = RedisClaimer(client, key_prefix=prefix, node_id="a")
    b = RedisClaimer(client, key_prefix=prefix, node_id="b")
    results: dict[str, list[str]] = {}
    barrier = threading.Barrier(2)

    def run(name: str, claimer: RedisClaimer) -> None:
        barrier.wait(10)
        results[name] = claimer.claim_missed(keys, term=1)

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # One script runs first and takes every key; the other then finds the newest held.
    assert sorted([results["a"], results["b"]], key=len) == [[], keys]


def test_claims_expire_by_themselves_and_each_task_keeps_one_key(
    client: redis.Redis, prefix: str
) -> None:
    """Nothing to clean up in Redis: every claim expires on its own; the one key a task
    keeps (``ran_before``) has no expiry."""
    claimer = RedisClaimer(client, key_prefix=prefix, ttl=1.0)
    keys = [f"tick@2026-01-01T00:00:{i:02d}.000000000Z" for i in range(50)]
    assert claimer.claim_missed(keys[:40]) == keys[:40]
    assert all(claimer.claim(k) for k in keys[40:])
    assert claimer.ran_before("tick@") is False  # first asked: recorded now
    assert claimer.ran_before("tick@") is True
    assert 1 < len(list(client.scan_iter(match=prefix + "*"))) <= 51

    def left() -> list[bytes]:
        return list(client.scan_iter(match=prefix + "*"))

    wait_until(lambda: len(left()) == 1, 10, "the claims to expire")
    assert left() == [(prefix + "tick@").encode()]
    assert client.pttl(prefix + "tick@") == -1
    assert not hasattr(claimer, "cleanup")
    client.delete(prefix + "tick@")
