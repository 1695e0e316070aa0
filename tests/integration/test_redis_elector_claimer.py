"""RedisElector and RedisClaimer against a real Redis.

The cases of the Go package's tests (acquire, renew, follow, fail over after the ttl,
resign, empty names, tiny ttls, one winner per claim), and stricter ones: terms,
concurrency, server time, fail-closed errors, bad input before any I/O, names used
verbatim, and a starting leader's missed fires claimed in one round trip with the
Postgres claimer's semantics.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
import redis

from rselection.claiming import MissedFireClaimer
from rselection.errors import BackendUnavailable, ConfigError
from rselection.postgres import PostgresClaimer, migrate
from rselection.redis import RedisClaimer, RedisElector
from rselection.validation import MAX_NAME
from tests.support.pg import PrivateRedis
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
    a = make_elector(node_id="node-a", ttl=5)
    b = make_elector(node_id="node-b", ttl=5)
    assert a.term is None
    assert a.is_leader() is True and a.term == 1
    assert client.get(key) == b"node-a"
    client.pexpire(key, 1000)
    assert a.is_leader() is True and a.term == 1  # renewed: the full ttl again
    assert client.pttl(key) > 4000
    assert b.is_leader() is False and b.term is None
    assert client.get(key) == b"node-a"


def test_failover_after_ttl_increments_the_term(make_elector: Callable[..., RedisElector]) -> None:
    a = make_elector(node_id="a", ttl=0.3)
    b = make_elector(node_id="b", ttl=0.3)
    assert a.is_leader() and a.term == 1
    waited = until_true(b.is_leader, 3, "b to take over")
    assert waited >= 0.2 and b.term == 2
    assert a.is_leader() is False


def test_a_holder_renewing_after_its_own_expiry_keeps_its_term(
    make_elector: Callable[..., RedisElector],
) -> None:
    a = make_elector(node_id="a", ttl=0.05)
    assert a.is_leader() and a.term == 1
    time.sleep(0.1)
    assert a.is_leader() and a.term == 1


def test_resign_hands_over_at_once_and_the_next_holder_gets_a_new_term(
    make_elector: Callable[..., RedisElector], client: redis.Redis, key: str
) -> None:
    a = make_elector(node_id="a", ttl=30)
    b = make_elector(node_id="b", ttl=30)
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
    assert len({e.node_id for e in electors}) == 16  # unique per instance


def test_with_block_resigns(make_elector: Callable[..., RedisElector], client: redis.Redis) -> None:
    with make_elector() as elector:
        assert elector.is_leader()
    assert client.get(elector.key) is None


def test_names_are_used_verbatim_and_the_keys_share_the_hash_slot(
    client: redis.Redis, name: str
) -> None:
    spaced = RedisElector(client, name=f"  {name}\n", node_id=" a ")
    plain = RedisElector(client, name=name, node_id="a")
    assert spaced.name == f"  {name}\n" and spaced.node_id == " a "  # never trimmed
    assert spaced.key == "rselection:{  " + name + "\n}:elector"
    assert spaced.term_key == spaced.key + ":term"
    assert spaced.is_leader() and plain.is_leader()  # two elections, two holders
    assert client.get(spaced.key) == b" a " and client.get(plain.key) == b"a"
    tagged = RedisElector(client, name=name, key_prefix="{app}:")
    assert tagged.key == "{app}:{" + name + "}:elector"
    assert tagged.term_key == tagged.key + ":term"
    assert spaced.resign() and plain.resign()


@pytest.mark.parametrize("bad", ["", "   ", "\t\n", None, 5, "a\x00b", "x" * (MAX_NAME + 1)])
def test_blank_or_bad_names_and_node_ids_are_refused(client: redis.Redis, bad: Any) -> None:
    with pytest.raises(ConfigError, match="name"):
        RedisElector(client, name=bad)
    if bad is not None:  # None: a new node id
        with pytest.raises(ConfigError, match="node_id"):
            RedisElector(client, node_id=bad)


def test_a_name_of_the_longest_length_is_accepted(client: redis.Redis) -> None:
    elector = RedisElector(client, name="n" * MAX_NAME, ttl=5)
    assert elector.is_leader() and elector.resign()


@pytest.mark.parametrize("ttl", [0, 0.0009, -1, float("nan"), float("inf"), True, "30"])
def test_ttl_below_a_millisecond_or_not_a_number_is_refused(client: redis.Redis, ttl: Any) -> None:
    with pytest.raises(ConfigError, match="ttl"):
        RedisElector(client, ttl=ttl)


def test_a_one_millisecond_ttl_works(make_elector: Callable[..., RedisElector]) -> None:
    assert make_elector(ttl=0.001).is_leader()


def test_an_unreachable_server_raises_and_never_says_leader() -> None:
    elector = RedisElector(
        redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1), name="x"
    )
    with pytest.raises(BackendUnavailable, match=r"127\.0\.0\.1:1"):
        elector.is_leader()
    assert elector.term is None


def test_bad_clients_are_refused() -> None:
    for source in (None, 42, object(), ""):
        with pytest.raises(ConfigError):
            RedisElector(source)


def test_a_restarted_server_keeps_the_term(private_redis: PrivateRedis) -> None:
    client = redis.Redis.from_url(private_redis.url)
    a = RedisElector(client, name="k", node_id="a", ttl=30)
    assert a.is_leader() and a.term == 1
    private_redis.restart()
    assert a.is_leader() and a.term == 1  # persisted (appendonly): still a's
    assert a.resign()
    b = RedisElector(client, name="k", node_id="b", ttl=30)
    assert b.is_leader() and b.term == 2
    client.close()


# -- claimer --------------------------------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"t-claim:{uuid.uuid4().hex[:8]}:"


def test_a_claim_is_won_once_and_kept_until_its_ttl_then_replaced(
    client: redis.Redis, prefix: str
) -> None:
    a = RedisClaimer(client, key_prefix=prefix, ttl=0.3, node_id="a")
    b = RedisClaimer(client, key_prefix=prefix, ttl=0.3, node_id="b")
    assert a.claim("purge@1") is True
    assert a.claim("purge@1") is False  # also not twice by its own holder
    assert b.claim("purge@1") is False
    until_true(lambda: b.claim("purge@1"), 3, "the claim to expire")
    assert b.holder_of("purge@1")["node_id"] == "b"  # type: ignore[index]


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


def test_default_node_id_is_unique_and_keys_are_independent(
    client: redis.Redis, prefix: str
) -> None:
    a, b = RedisClaimer(client, key_prefix=prefix), RedisClaimer(client, key_prefix=prefix)
    assert a.node_id != b.node_id and a.ttl == 600
    assert all(a.claim(f"k{i}") for i in range(20))
    assert not any(b.claim(f"k{i}") for i in range(20))


def test_concurrent_claimers_win_each_key_exactly_once(client: redis.Redis, prefix: str) -> None:
    claimers = [RedisClaimer(client, key_prefix=prefix, ttl=60) for _ in range(8)]
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


@pytest.mark.parametrize("node_id", ["", "  ", 3, "x" * (MAX_NAME + 1)])
def test_bad_node_id_or_key_prefix_is_refused(client: redis.Redis, node_id: Any) -> None:
    with pytest.raises(ConfigError, match="node_id"):
        RedisClaimer(client, node_id=node_id)
    with pytest.raises(ConfigError, match="key_prefix"):
        RedisClaimer(client, key_prefix=None)  # type: ignore[arg-type]


def test_fire_keys_and_node_ids_are_used_verbatim(client: redis.Redis, prefix: str) -> None:
    claimer = RedisClaimer(client, key_prefix=prefix, node_id=" n1 ")
    assert claimer.claim(" purge@1 ") and claimer.claim("purge@1")  # two fires
    assert client.exists(prefix + " purge@1 ") and client.exists(prefix + "purge@1")
    assert claimer.holder_of(" purge@1 ")["node_id"] == " n1 "  # type: ignore[index]


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


def test_claim_missed_takes_the_keys_after_the_newest_held(
    client: redis.Redis, prefix: str
) -> None:
    old = RedisClaimer(client, key_prefix=prefix, node_id="old-leader")
    new = RedisClaimer(client, key_prefix=prefix, node_id="new-leader")
    keys = [f"tick@{i:02d}" for i in range(10)]
    assert old.claim(keys[3]) and old.claim(keys[6])  # the old leader got as far as 6
    assert new.claim_missed(keys, term=7) == keys[7:]
    # Those now bind: a second look back finds nothing, the old leader cannot take them.
    assert new.claim_missed(keys, term=8) == []
    assert not old.claim(keys[8])
    assert new.holder_of(keys[8]) == {
        "node_id": "new-leader",
        "term": 7,
        "format": "1",
        "at": new.holder_of(keys[8])["at"],  # type: ignore[index]
    }
    assert 599_000 < client.pttl(prefix + keys[9]) <= 600_000
    # Keys before the newest held one stay unclaimed (not missed: before the handover).
    assert old.claim(keys[5])
    assert new.claim_missed([], term=1) == []


def test_claim_missed_with_nothing_held_takes_everything(client: redis.Redis, prefix: str) -> None:
    claimer = RedisClaimer(client, key_prefix=prefix, node_id="first")
    keys = [f"first@{i:02d}" for i in range(5)]
    assert claimer.claim_missed(keys, term=1) == keys
    docs = [json.loads(client.get(prefix + k) or b"{}") for k in keys]
    assert {(d["node_id"], d["term"]) for d in docs} == {("first", "1")}


def test_claim_missed_retakes_expired_claims(client: redis.Redis, prefix: str) -> None:
    short = RedisClaimer(client, key_prefix=prefix, ttl=0.05, node_id="short")
    keys = ["exp@1", "exp@2", "exp@3"]
    assert short.claim("exp@3")
    wait_until(lambda: not client.exists(prefix + "exp@3"), 5.0, "the claim to expire")
    later = RedisClaimer(client, key_prefix=prefix, node_id="later")
    assert later.claim_missed(keys) == keys


def test_claim_missed_is_atomic_between_two_starting_leaders(
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


@pytest.mark.parametrize(
    ("fire_keys", "term", "match"),
    [
        (["ok", ""], None, "fire_key"),
        (["ok", None], None, "fire_key"),
        (["ok", "x" * (MAX_NAME + 1)], None, "fire_key"),
        (["ok"], -1, "term"),
        (["ok"], True, "term"),
        ("ok", None, "list"),
    ],
)
def test_claim_missed_refuses_bad_input_before_any_io(
    fire_keys: Any, term: Any, match: str
) -> None:
    claimer = RedisClaimer(redis.Redis(host="127.0.0.1", port=1))  # never reached
    with pytest.raises(ConfigError, match=match):
        claimer.claim_missed(fire_keys, term=term)


def test_claim_missed_fails_closed() -> None:
    claimer = RedisClaimer(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1))
    with pytest.raises(BackendUnavailable, match="missed fires"):
        claimer.claim_missed(["a@1", "a@2"])


# -- the same look back on Redis and Postgres --------------------------------------------


@pytest.fixture(params=["redis", "postgres"])
def make_claimer(
    request: pytest.FixtureRequest, redis_url: str, prefix: str
) -> Iterator[Callable[..., MissedFireClaimer]]:
    """Claimers of one backend sharing one namespace (a key prefix, or a schema)."""
    made: list[Any] = []
    if request.param == "postgres":
        dsn = request.getfixturevalue("pg_dsn")
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)

    def make(ttl: float = 600.0) -> MissedFireClaimer:
        claimer: Any
        if request.param == "postgres":
            claimer = PostgresClaimer(dsn, ttl=ttl)
        else:
            claimer = RedisClaimer(redis_url, key_prefix=prefix, ttl=ttl)
        made.append(claimer)
        return claimer  # type: ignore[no-any-return]

    yield make
    for claimer in made:
        claimer.close()


def test_claim_missed_means_the_same_on_redis_and_postgres(
    make_claimer: Callable[..., MissedFireClaimer],
) -> None:
    old, new = make_claimer(), make_claimer()
    assert isinstance(old, MissedFireClaimer)
    keys = [f"tick@{i:02d}" for i in range(10)]
    assert new.claim_missed(keys[:2], term=1) == keys[:2]  # nothing held: all
    assert old.claim(keys[3]) and old.claim(keys[6])
    assert new.claim_missed(keys, term=2) == keys[7:]  # after the newest held only
    assert new.claim_missed(keys, term=3) == []  # all held now
    assert not old.claim(keys[9])
    assert old.claim(keys[5])  # before the newest held: left alone
    assert new.claim_missed([], term=4) == []
    # An expired claim counts as none: the look back takes it again.
    short, later = make_claimer(ttl=0.05), make_claimer()
    exp = ["exp@1", "exp@2", "exp@3"]
    assert short.claim(exp[2])
    assert later.claim_missed(exp) == []  # exp@3 held, the others before it
    wait_until(lambda: later.claim_missed(exp) == exp, 5.0, "the expired claim to be retaken")
