"""Lease names and node ids follow one rule on Postgres and Redis alike.

A name is a non-blank string of at most 1,000 bytes as UTF-8, without NUL, used exactly as
given: nothing is trimmed, so ``" jobs "`` and ``"jobs"`` are two leases on both
backends (Redis used to refuse what Postgres took, and the other way round).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from rselection.abc import LeaseBackend
from rselection.errors import ConfigError
from rselection.postgres import PostgresLease
from rselection.redis import RedisLease
from rselection.validation import MAX_NAME, check_name
from tests.support.backends import Backend
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}

MakeLease = Callable[..., LeaseBackend]

ACCEPTED = [
    "jobs",
    " jobs ",
    "jobs\t",
    "ünïcode/näme",
    "x" * 1000,
]
REFUSED: list[Any] = ["", " ", "\t\n", "x" * 1001, "jo\x00bs", None, 5]


@pytest.fixture(params=["postgres", "redis"])
def make_lease(request: pytest.FixtureRequest) -> Iterator[MakeLease]:
    """Leases of one backend; on Redis under a key prefix of this test's own."""
    made: list[LeaseBackend] = []
    if request.param == "postgres":
        dsn = request.getfixturevalue("pg_dsn")

        def make(name: Any) -> LeaseBackend:
            return PostgresLease(dsn, name=name, ttl=5.0, renew_deadline=3.0)

    else:
        url = request.getfixturevalue("redis_url")
        prefix = f"t-{uuid.uuid4().hex[:8]}:"

        def make(name: Any) -> LeaseBackend:
            return RedisLease(url, name=name, key_prefix=prefix, ttl=5.0, renew_deadline=3.0)

    def tracked(name: Any) -> LeaseBackend:
        lease = make(name)
        made.append(lease)
        return lease

    yield tracked
    for lease in made:
        lease.close()


@pytest.mark.parametrize("name", REFUSED, ids=repr)
def test_a_blank_overlong_or_non_string_name_is_refused_by_every_backend(
    make_lease: MakeLease, name: Any
) -> None:
    with pytest.raises(ConfigError, match="lease name"):
        make_lease(name)


@pytest.mark.parametrize("name", ACCEPTED, ids=lambda n: repr(n)[:20])
def test_every_backend_takes_a_name_as_given(make_lease: MakeLease, name: str) -> None:
    lease = make_lease(name)
    assert lease.name == name
    attempt = lease.try_acquire("node-a")
    assert attempt.acquired
    holder = lease.current()
    assert holder is not None and holder.node_id == "node-a"


def test_names_that_differ_only_in_spaces_are_different_leases(make_lease: MakeLease) -> None:
    plain, padded = make_lease("jobs"), make_lease(" jobs ")
    assert plain.try_acquire("node-a").acquired
    assert padded.try_acquire("node-b").acquired, "a padded name must not be trimmed"
    plain_holder, padded_holder = plain.current(), padded.current()
    assert plain_holder is not None and plain_holder.node_id == "node-a"
    assert padded_holder is not None and padded_holder.node_id == "node-b"


def test_a_node_id_is_taken_as_given_and_a_blank_one_refused(make_lease: MakeLease) -> None:
    lease = make_lease("jobs")
    for node_id in ["", "  ", "x" * 1001, "no\x00de"]:
        with pytest.raises(ConfigError, match="node_id"):
            lease.try_acquire(node_id)
    attempt = lease.try_acquire(" node a ")
    assert attempt.acquired and attempt.holder is not None
    assert attempt.holder.node_id == " node a "


def _longest_accepted(char: str) -> int:
    """How many ``char`` the name rule accepts at most (whatever unit it counts in)."""
    count = 0
    for step in (1024, 256, 64, 16, 4, 1):
        while True:
            try:
                check_name(char * (count + step))
            except ConfigError:
                break
            count += step
    return count


def test_the_longest_names_in_four_byte_characters_lead_and_hand_over(
    backend: Backend,
) -> None:
    """A lease name and node ids of the most four-byte characters the rule accepts: they
    are acquired and handed over on both backends. When the rule counted characters,
    1,000 of them (4,000 bytes) were accepted and never acquired on Postgres ("payload
    string too long": its notifications carry the names)."""
    n = _longest_accepted("\U0001f986")
    name = "\U0001f986" * n
    node_a, node_b = "\U0001d51e" * n, "\U0001d51f" * n
    first: rs.Leader = backend.leader(rs.TaskHandler(), name, node_id=node_a, **FAST)
    second: rs.Leader = backend.leader(rs.TaskHandler(), name, node_id=node_b, **FAST)
    try:
        first.start()
        assert first.wait_until_leader(10), f"a name of {n} four-byte characters never led"
        second.start()
        wait_until(lambda: second.leader() is not None, 10, "the follower to see the leader")
        asked = backend.handover.request_handover(backend.url, name, to=node_b, valid_for=10)
        assert asked is not None and asked.node_id == node_a
        assert second.wait_until_leader(10), "the handover to the longest node id failed"
        holder = second.leader()
        assert holder is not None and holder.node_id == node_b
    finally:
        second.stop(timeout=10)
        first.stop(timeout=10)
        backend.forget(name)


def test_one_byte_over_the_limit_is_refused_at_construction(backend: Backend) -> None:
    n = _longest_accepted("\U0001f986")
    assert n * 4 == MAX_NAME
    longest = "\U0001f986" * n
    with pytest.raises(ConfigError, match=rf"lease name .*at most {MAX_NAME} bytes"):
        backend.leader(rs.TaskHandler(), longest + "x", node_id="a")
    with pytest.raises(ConfigError, match=rf"node_id .*at most {MAX_NAME} bytes"):
        backend.leader(rs.TaskHandler(), "jobs", node_id=longest + "x")
    with pytest.raises(ConfigError, match=rf"task name .*at most {MAX_NAME} bytes"):
        rs.TaskHandler().register(longest + "x", rs.GenericTask(longest + "x"))
