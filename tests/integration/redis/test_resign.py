"""Handover on request with a Redis lease, what only Redis has: request keys of an older
term, ``live_nodes``, the lease key holding something else, the URL the command takes.
What handover on request promises on every backend runs in
``tests/integration/conformance/test_resign.py``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import rselection as rs
from rselection.commands.demo_fleet import redis_ledger_key
from rselection.redis import RedisLease, current_holder, live_nodes, request_handover
from rselection.redis.lease import handover_key, lease_keys
from tests.support.backends import LEDGER
from tests.support.resign_cli import cli


def forget(url: str, name: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.delete(*lease_keys(name)[:2], handover_key(name), redis_ledger_key(LEDGER, name))
    finally:
        client.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


# ---------------------------------------------------------------------------- resign


def test_resign_refuses_a_url_that_is_not_redis_and_both_servers(redis_url: str) -> None:
    bad = cli("resign", "any", "--redis-url", "http://127.0.0.1:6379/")
    assert bad.returncode != 0 and "redis://" in bad.stderr
    both = cli("resign", "any", "--redis-url", redis_url, "--dsn", "postgresql://x@h/db")
    assert both.returncode != 0 and "not both" in both.stderr


# --------------------------------------------------------------- the lease, directly


@pytest.fixture
def name() -> str:
    return f"direct-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def make_lease(redis_url: str, name: str) -> Iterator[Callable[..., RedisLease]]:
    made: list[RedisLease] = []

    def make(**kw: Any) -> RedisLease:
        lease = RedisLease(redis_url, **{"name": name, "ttl": 3.0, "renew_deadline": 2.0, **kw})
        made.append(lease)
        return lease

    yield make
    for lease in made:
        lease.close()
    forget(redis_url, name)


def test_a_request_key_of_an_older_term_is_ignored(
    client: redis.Redis, name: str, make_lease: Callable[..., RedisLease]
) -> None:
    a = make_lease()
    got = a.try_acquire("A")
    assert got.holder is not None
    term = got.holder.term
    # A request left from an older term: the renewal ignores it ...
    stale = {"term": str(term - 1), "from": "A", "to": "B"}
    client.set(handover_key(name), json.dumps(stale), px=10_000)
    assert a.renew("A", term) and a.handover_requested() is None
    # ... and so does the acquire script, once the lease is free.
    a.release("A", term)
    again = a.try_acquire("A")
    assert again.acquired and again.holder is not None and again.holder.term == term + 1


def test_a_request_of_another_term_asks_nothing(
    client: redis.Redis, name: str, make_lease: Callable[..., RedisLease]
) -> None:
    # Before, a holder whose term had ended (its succession look in flight) could ask the
    # next holder's term to hand over: the request named no term.
    lease = make_lease()
    got = lease.try_acquire("A")
    assert got.holder is not None
    term = got.holder.term
    assert request_handover(client, name, to="N", term=term - 1) is None
    assert not client.exists(handover_key(name))
    asked = request_handover(client, name, to="N", term=term)
    assert asked is not None and (asked.node_id, asked.term) == ("A", term)
    assert client.exists(handover_key(name))


def test_bad_arguments_are_refused(client: redis.Redis, name: str) -> None:
    for bad in ("", "   ", None, "x" * 1001):
        with pytest.raises(rs.ConfigError, match="lease name"):
            live_nodes(client, bad)
    with pytest.raises(rs.ConfigError, match="key_prefix"):
        current_holder(client, name, key_prefix=None)  # type: ignore[arg-type]
    client.set(lease_keys(name)[0], "not json", px=5000)
    try:
        with pytest.raises(rs.ConfigError, match="not an rselection lease"):
            request_handover(client, name)
    finally:
        client.delete(lease_keys(name)[0])
