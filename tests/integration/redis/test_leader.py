"""RedisLease and RedisLeader against a real Redis: the lease's rules, fast failover and
its limits, bad input, an unreachable server, clean stop, claims and fencing.

The scenarios both backends share are in ``tests/integration/conformance/test_leader.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import rselection as rs
from rselection.errors import BackendUnavailable
from rselection.redis import RedisFence, RedisLeader, RedisLease, fenced_call
from rselection.redis.lease import lease_keys
from tests.support.pg import PrivateRedis
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


@pytest.fixture
def name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def make_lease(redis_url: str, name: str) -> Iterator[Callable[..., RedisLease]]:
    made: list[RedisLease] = []

    def make(**kw: Any) -> RedisLease:
        options: dict[str, Any] = {"name": name, "ttl": 3.0, "renew_deadline": 2.0, **kw}
        lease = RedisLease(kw.pop("url", redis_url), **options)
        made.append(lease)
        return lease

    yield make
    for lease in made:
        lease.close()


@pytest.fixture
def make_leader(redis_url: str, name: str) -> Iterator[Callable[..., RedisLeader]]:
    made: list[RedisLeader] = []

    def make(handler: rs.TaskHandler | None = None, **kw: Any) -> RedisLeader:
        leader = RedisLeader(
            kw.pop("url", redis_url), handler or rs.TaskHandler(), name=name, **{**FAST, **kw}
        )
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


# -- the lease ------------------------------------------------------------------------


def test_acquire_sets_nx_px_with_a_token_and_terms_only_grow(
    make_lease: Callable[..., RedisLease], client: redis.Redis, name: str
) -> None:
    a, b = make_lease(), make_lease()
    got = a.try_acquire("a")
    assert got.acquired and got.holder is not None and got.holder.node_id == "a"
    key, term_key, _ = lease_keys(name)
    value = json.loads(client.get(key) or b"{}")
    assert value["node"] == "a" and value["term"] == str(got.holder.term)
    assert len(value["token"]) == 32 and value["client"] == str(a.client_id)
    assert 0 < client.pttl(key) <= 3000
    assert int(client.get(term_key) or 0) == got.holder.term

    seen = b.try_acquire("b")
    assert not seen.acquired and seen.holder is not None and 0 < seen.expires_in <= 3
    assert (seen.holder.node_id, seen.holder.term, seen.holder.acquired_at) == (
        got.holder.node_id,
        got.holder.term,
        got.holder.acquired_at,
    )
    # expires_at is server TIME + PTTL, each rounded to the millisecond: allow one tick.
    assert abs((seen.holder.expires_at - got.holder.expires_at).total_seconds()) <= 0.005
    assert a.renew("a", got.holder.term)
    a.release("a", got.holder.term)
    assert client.get(key) is None and a.current() is None
    again = b.try_acquire("b")
    assert again.acquired and again.holder is not None
    assert again.holder.term == got.holder.term + 1
    b.release("b", again.holder.term)
    assert a.try_acquire("a").holder.term == got.holder.term + 2  # type: ignore[union-attr]


def test_renew_and_release_never_touch_someone_elses_key(
    make_lease: Callable[..., RedisLease], client: redis.Redis, name: str
) -> None:
    a, b = make_lease(), make_lease(ttl=30.0, renew_deadline=20.0)
    first = a.try_acquire("a").holder
    assert first is not None
    key = lease_keys(name)[0]
    client.delete(key)  # as if it had expired while a was away
    second = b.try_acquire("b").holder
    assert second is not None and second.term == first.term + 1
    client.pexpire(key, 10_000)
    assert a.renew("a", first.term) is False  # RedBeat would have extended b's key here
    assert client.pttl(key) <= 10_000
    a.release("a", first.term)
    holder = a.current()
    assert holder is not None and (holder.node_id, holder.term) == ("b", second.term)


def test_a_crashed_holder_is_replaced_as_soon_as_its_connection_is_gone(
    make_lease: Callable[..., RedisLease], client: redis.Redis
) -> None:
    a, b = make_lease(ttl=30.0, renew_deadline=20.0), make_lease(liveness_interval=0.1)
    held = a.try_acquire("a").holder
    assert held is not None and a.fast_failover
    assert not b.try_acquire("b").acquired
    client.client_kill_filter(_id=a.client_id)  # the kernel closes a killed process's socket
    began = time.monotonic()
    b.wait_for_change(10)
    waited = time.monotonic() - began
    taken = b.try_acquire("b")
    assert taken.acquired and taken.holder is not None and taken.holder.term == held.term + 1
    assert waited < 1.0, f"took {waited:.2f}s to notice the dead connection"


def test_without_liveness_checks_a_crashed_holder_waits_for_expiry(
    make_lease: Callable[..., RedisLease], client: redis.Redis
) -> None:
    a = make_lease(ttl=1.5, renew_deadline=1.0, liveness_interval=None)
    b = make_lease(ttl=1.5, renew_deadline=1.0, liveness_interval=0.05)
    held = a.try_acquire("a").holder
    assert held is not None and not a.fast_failover
    client.client_kill_filter(_id=a.client_id)
    began = time.monotonic()
    while not b.try_acquire("b").acquired:
        b.wait_for_change(0.2)
        assert time.monotonic() - began < 5
    assert time.monotonic() - began > 1.0


def test_a_server_that_forbids_client_and_config_falls_back_to_expiry(
    private_redis: PrivateRedis, name: str
) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-client")
    admin.execute_command("ACL", "SETUSER", "app", "-config")
    url = f"redis://app:pw@127.0.0.1:{private_redis.port}/0"
    a = RedisLease(url, name=name, ttl=1.5, renew_deadline=1.0)
    b = RedisLease(url, name=name, ttl=1.5, renew_deadline=1.0, liveness_interval=0.05)
    try:
        held = a.try_acquire("a").holder
        assert held is not None and not a.fast_failover and a.client_id is None
        assert a.renew("a", held.term)
        a.close()  # a crash: the connection is gone, but nobody may know it
        began = time.monotonic()
        while not b.try_acquire("b").acquired:
            b.wait_for_change(0.2)
            assert time.monotonic() - began < 5
        assert time.monotonic() - began > 1.0  # waited for expiry
    finally:
        b.close()
        admin.close()


def test_a_foreign_value_under_the_lease_key_is_a_clear_error(
    make_lease: Callable[..., RedisLease], client: redis.Redis, name: str
) -> None:
    client.set(lease_keys(name)[0], "not json", px=5000)
    with pytest.raises(rs.BackendUnavailable, match="not an rselection lease"):
        make_lease().try_acquire("a")


def test_a_lease_of_an_earlier_release_with_a_jumped_term_is_a_clear_error(
    make_lease: Callable[..., RedisLease], client: redis.Redis, name: str
) -> None:
    """An earlier release wrote a 16-digit term with Lua's ``tostring``: every node must
    be told to stop the old ones, not take the value for a foreign one and wait."""
    old = {
        "token": "ab" * 16,
        "node": "old-node",
        "term": "1.7961690294577e+15",
        "client": "7",
        "run": "0" * 40,
        "fast": "1",
        "at": str(int(time.time() * 1000)),
    }
    client.set(lease_keys(name)[0], json.dumps(old), px=5000)
    lease = make_lease()
    with pytest.raises(rs.ConfigError, match="earlier rselection release"):
        lease.try_acquire("a")
    with pytest.raises(rs.ConfigError, match="stop every node of the earlier release"):
        lease.current()


# -- the leader -----------------------------------------------------------------------


def test_bad_input_is_refused_at_construction(redis_url: str) -> None:
    h = rs.TaskHandler()
    with pytest.raises(rs.ConfigError, match=r"15 - 14.5 = 0.5"):
        RedisLeader(redis_url, h, ttl=15, renew_deadline=14.5)
    with pytest.raises(rs.ConfigError, match="renew_interval"):
        RedisLeader(redis_url, h, renew_interval=10, renew_deadline=10)
    with pytest.raises(rs.ConfigError, match="ttl"):
        RedisLeader(redis_url, h, ttl=0)
    with pytest.raises(rs.ConfigError, match="lease name"):
        RedisLeader(redis_url, h, name=" ")
    with pytest.raises(rs.ConfigError, match=r"redis\.Redis"):
        RedisLeader(42, h)
    with pytest.raises(rs.ConfigError, match="Redis URL"):
        RedisLeader("", h)
    with pytest.raises(rs.ConfigError, match="URL"):
        RedisLeader("http://example.invalid/", h)
    with pytest.raises(rs.ConfigError, match="liveness_interval"):
        RedisLeader(redis_url, h, liveness_interval=0)
    with pytest.raises(rs.ConfigError, match="key_prefix"):
        RedisLeader(redis_url, h, key_prefix=None)  # type: ignore[arg-type]
    with pytest.raises(rs.ConfigError, match="claimer"):
        RedisLeader(redis_url, h, claimer=object())  # type: ignore[arg-type]
    with pytest.raises(rs.ConfigError, match="node_id"):
        RedisLeader(redis_url, h, node_id="")


def test_a_refusing_server_is_retried_with_backoff_and_no_password_leaks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    leader = RedisLeader("redis://app:s3cret-pw@127.0.0.1:1/0", rs.TaskHandler(), **FAST)
    with caplog.at_level(logging.DEBUG, logger="rselection"):
        leader.start()
        try:
            wait_until(lambda: "backend unavailable" in caplog.text, 10, "the warning")
            time.sleep(3.0)
            assert not leader.is_leader
        finally:
            leader.stop(timeout=10)
    attempts = [r for r in caplog.records if "backend unavailable" in r.getMessage()]
    warnings = [r for r in attempts if r.levelno == logging.WARNING]
    # Backoff 0.1, 0.2, 0.4, 0.8, 1.6 s (jittered down to half): a handful, not a spin.
    assert 2 <= len(attempts) <= 12, len(attempts)
    assert len(warnings) == 1
    assert "127.0.0.1:1" in caplog.text and "s3cret-pw" not in caplog.text


def test_stop_leaves_no_threads_or_connections(
    make_leader: Callable[..., RedisLeader], client: redis.Redis, name: str
) -> None:
    leaders = [make_leader() for _ in range(2)]
    for leader in leaders:
        leader.start()
    wait_until(lambda: sum(x.is_leader for x in leaders) == 1, 10, "one leader")
    assert any(c["name"] == f"rselection:{name}" for c in client.client_list())
    for leader in leaders:
        leader.stop(timeout=10)

    def leftovers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("rselection-")]

    wait_until(lambda: not leftovers(), 5, f"threads to end: {leftovers()}")
    wait_until(
        lambda: not [c for c in client.client_list() if c["name"] == f"rselection:{name}"],
        5,
        "keeper connections to close",
    )
    assert client.get(lease_keys(name)[0]) is None  # released


def test_leader_after_stop_leaves_no_connection_open(
    make_leader: Callable[..., RedisLeader], client: redis.Redis, redis_url: str
) -> None:
    tag = f"leak-{uuid.uuid4().hex[:8]}"  # names the connections of the leader's clients
    url = f"{redis_url}{'&' if '?' in redis_url else '?'}client_name={tag}"

    def connections() -> list[Any]:
        return [c for c in client.client_list() if c["name"] == tag]

    leader = make_leader(url=url)
    leader.start()
    assert leader.wait_until_leader(10)
    assert leader.leader() is not None and connections()
    leader.stop(timeout=10)
    wait_until(lambda: not connections(), 5, "the client's connections to close on stop")
    assert leader.leader() is None  # still answers...
    wait_until(lambda: not connections(), 5, "the connection leader() opened to close")
    assert leader.nodes() == []  # it left the membership; the read closes its connection
    wait_until(lambda: not connections(), 5, "the connection nodes() opened to close")


def test_leader_answers_from_other_threads_while_the_keeper_reconnects(
    make_leader: Callable[..., RedisLeader], client: redis.Redis, redis_url: str
) -> None:
    # From a URL the lease owns the client leader() reads through, and closes it after
    # every outage: a read under way on another thread must not fail with redis-py's
    # internals (a closed socket), only with BackendUnavailable at worst.
    leader = make_leader(url=redis_url)
    leader.start()
    assert leader.wait_until_leader(10)
    errors: list[BaseException] = []
    done = threading.Event()

    def observe() -> None:
        while not done.is_set():
            try:
                leader.leader()
            except BackendUnavailable:
                pass
            except Exception as exc:
                errors.append(exc)

    observers = [threading.Thread(target=observe) for _ in range(3)]
    for thread in observers:
        thread.start()
    try:
        for _ in range(3):
            killed = leader.lease.client_id
            assert killed is not None
            client.client_kill_filter(_id=killed)
            wait_until(
                lambda gone=killed: leader.is_leader and leader.lease.client_id not in (None, gone),
                15,
                "the keeper to reconnect and lead again",
            )
    finally:
        done.set()
        for thread in observers:
            thread.join(10)
    assert not errors, f"leader() raised {sorted({repr(e) for e in errors})[:3]}"


def test_fires_are_claimed_in_redis_under_the_lease_name(
    make_leader: Callable[..., RedisLeader], client: redis.Redis, name: str
) -> None:
    runs: list[int] = []
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.interval(0.2, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        runs.append(ctx.term)

    leader = make_leader(handler, node_id="claimer-node")
    leader.start()
    wait_until(lambda: len(runs) >= 2, 10, "two fires")
    # The fires' claims; not the task's own key (`.../tick@`, the mark that it ran).
    keys = [
        k.decode()
        for k in client.scan_iter(f"rselection:claim:{name}/tick@*")
        if not k.decode().endswith("@")
    ]
    assert keys, "no claims in Redis"
    claim = json.loads(client.get(keys[0]) or b"{}")
    assert claim["node_id"] == "claimer-node" and claim["term"] == str(runs[0])
    assert 0 < client.pttl(keys[0]) <= 600_000


def test_ctx_fence_is_refused_naming_the_fenced_call_and_fence_call_fences(
    make_leader: Callable[..., RedisLeader], client: redis.Redis
) -> None:
    """Redis has no transaction a takeover would wait for: ctx.fence(anything) raises
    a ConfigError that names leader.fence.call, instead of checking the term at one
    moment (which protected no write made after it)."""
    contexts: list[rs.TaskContext] = []
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.persistent("remember")
    def remember(ctx: rs.TaskContext) -> None:
        contexts.append(ctx)
        ctx.cancelled.wait(30)

    leader = make_leader(handler)
    leader.start()
    wait_until(lambda: bool(contexts), 10, "the task")
    ctx = contexts[0]
    for conn in (client, object()):
        with pytest.raises(rs.ConfigError, match=r"leader\.fence\.call\(ctx\.term"):
            ctx.fence(conn)
    key = f"state:{{{leader.name}}}"
    assert leader.fence.call(ctx.term, "SET", key, "v1") == b"OK"
    assert fenced_call(client, leader.name, ctx.term, "GET", key) == b"v1"
    leader.stop()
    with pytest.raises(rs.ConfigError, match="cannot fence a transaction"):
        ctx.fence(client)  # the same answer once the term is over
    with pytest.raises(rs.StaleLeaderError):
        leader.fence.call(ctx.term, "SET", key, "v2")
    with pytest.raises(rs.StaleLeaderError):
        RedisFence(client, name=leader.name).call(ctx.term, "SET", key, "v2")
    assert client.get(key) == b"v1"
    with pytest.raises(rs.ConfigError, match="term"):
        RedisFence(client, name=leader.name).call(0, "GET", key)


def test_the_fence_refusal_names_a_non_default_key_prefix() -> None:
    from rselection.redis.leader import no_transaction_fence

    assert "key_prefix" not in no_transaction_fence("jobs", "rselection:").reason
    assert ", key_prefix='app:'))" in no_transaction_fence("jobs", "app:").reason


def test_a_server_that_may_evict_the_lease_key_is_warned_about_once(
    private_redis: PrivateRedis, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under memory pressure an evicting policy can drop a held lease key: another node
    would acquire while the holder still runs its tasks."""
    with redis.Redis.from_url(private_redis.url) as admin:
        with RedisLease(private_redis.url, name=name, ttl=3.0, renew_deadline=2.0) as safe:
            safe.try_acquire("a")
        evicting = [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        assert evicting == []  # the default: noeviction, no maxmemory
        admin.config_set("maxmemory", 100 * 2**20)
        admin.config_set("maxmemory-policy", "allkeys-lru")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rselection.redis.lease"):
            lease = RedisLease(private_redis.url, name=name, ttl=3.0, renew_deadline=2.0)
            try:
                lease.connect()
                lease.connect()  # a reconnect: no second warning
            finally:
                lease.close()
    warned = [r for r in caplog.records if "maxmemory-policy allkeys-lru" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert warned[0].levelno == logging.WARNING
    assert "noeviction" in warned[0].getMessage() and repr(name) in warned[0].getMessage()


def test_a_server_paused_shorter_than_renew_deadline_costs_no_term(
    private_redis: PrivateRedis, name: str
) -> None:
    # The lease's liveness beat and the renewal share the keeper connection. Before, a
    # renewal that waited more than 2 s for the lease's wait to return (a beat blocked on
    # the paused server) went ahead on the same connection: it read the beat's reply, and
    # the leader lost its term 6.3 s into a 4 s pause (renew_deadline 10 s).
    timings = {"ttl": 15.0, "renew_interval": 2.0, "renew_deadline": 10.0, "retry_interval": 2.0}
    leaders = [
        RedisLeader(private_redis.url, rs.TaskHandler(), name=name, node_id=node, **timings)
        for node in ("l", "f")
    ]
    pid = private_redis.pid
    assert pid is not None
    try:
        leaders[0].start()
        assert leaders[0].wait_until_leader(10)
        term = leaders[0].term
        leaders[1].start()
        wait_until(lambda: leaders[1].leader() is not None, 10, "the follower to see the leader")
        time.sleep(2.3)  # a beat and a renewal are due during the pause
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(4.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Through the next renewals after the pause: still the same term, nobody else.
        until = time.monotonic() + 2 * timings["renew_interval"] + 1.0
        while time.monotonic() < until:
            assert leaders[0].term == term, "the leader lost its term to a 4 s pause"
            assert not leaders[1].is_leader
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
        for leader in leaders:
            leader.stop(timeout=15)
