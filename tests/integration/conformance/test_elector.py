"""What every elector promises, on Postgres (``PostgresElector``) and Redis (``RedisElector``).

An elector acquires or renews on each ``is_leader()`` call, with no thread of its own:
one candidate leads among many; calls within the ttl keep the leadership and its term;
after the ttl another candidate takes over with the next term; ``resign()`` and the
``with`` block hand over at once; a holder whose lease lapsed with nobody taking it keeps
its term; names and node ids are used verbatim; bad input is refused with
``ConfigError`` before any I/O; an unreachable server raises ``BackendUnavailable`` and
never answers "leader"; a restarted server keeps the term.

How each backend stores an election (rows, keys) is tested in its own suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from rselection.errors import BackendUnavailable, ConfigError
from rselection.validation import MAX_NAME
from tests.support.backends import Backend
from tests.support.waiting import wait_until


@pytest.fixture
def make_elector(backend: Backend) -> Iterator[Callable[..., Any]]:
    """Factory of electors on this test's namespace, all closed after the test."""
    made: list[Any] = []

    def make(**kw: Any) -> Any:
        elector = backend.elector(**kw)
        made.append(elector)
        return elector

    yield make
    for elector in made:
        elector.close()


def server_micros(backend: Backend) -> int:
    """Redis: the server's ``TIME`` in microseconds; Postgres: 0."""
    if backend.kind != "redis":
        return 0
    with redis.Redis.from_url(backend.url) as client:
        seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def assert_first_term(backend: Backend, term: int | None, since: int) -> None:
    """A new election's first term: 1 on Postgres; on Redis the server's clock in
    microseconds when it was taken (``since`` was read before)."""
    if backend.kind == "redis":
        assert term is not None and since <= term <= server_micros(backend), (since, term)
    else:
        assert term == 1


# -- election ----------------------------------------------------------------------------


def test_the_first_caller_leads_and_the_others_follow(
    backend: Backend, make_elector: Callable[..., Any]
) -> None:
    a = make_elector(node_id="node-a")
    b = make_elector(node_id="node-b")
    assert a.term is None and b.term is None
    since = server_micros(backend)
    assert a.is_leader() is True
    assert_first_term(backend, a.term, since)
    first = a.term
    assert b.is_leader() is False and b.term is None
    assert a.is_leader() is True and a.term == first  # renewed, same term
    assert b.is_leader() is False


def test_calls_within_the_ttl_keep_the_leadership_past_it(
    make_elector: Callable[..., Any],
) -> None:
    a = make_elector(node_id="a", ttl=0.5)
    b = make_elector(node_id="b", ttl=0.5)
    assert a.is_leader()
    first = a.term
    deadline = time.monotonic() + 1.5  # three ttls
    while time.monotonic() < deadline:
        assert a.is_leader() and a.term == first  # each call moves the expiry
        assert not b.is_leader()
        time.sleep(0.1)


def test_exactly_one_of_many_concurrent_candidates_wins(
    backend: Backend, make_elector: Callable[..., Any]
) -> None:
    since = server_micros(backend)
    electors = [make_elector(ttl=3600) for _ in range(8)]
    assert len({e.node_id for e in electors}) == 8  # a new node id per instance
    barrier = threading.Barrier(len(electors))

    def run(elector: Any) -> list[bool]:
        barrier.wait(timeout=30)
        return [elector.is_leader() for _ in range(20)]

    with ThreadPoolExecutor(len(electors)) as pool:
        futures = [pool.submit(run, e) for e in electors]
        results = [f.result(timeout=60) for f in futures]
    winners = [i for i, r in enumerate(results) if any(r)]
    assert len(winners) == 1
    assert all(results[winners[0]])  # the winner kept it on every call
    assert_first_term(backend, electors[winners[0]].term, since)


def test_names_are_independent_elections(
    backend: Backend, make_elector: Callable[..., Any]
) -> None:
    a = make_elector(name="reports")
    b = make_elector(name="billing")
    since = server_micros(backend)
    assert a.is_leader() and b.is_leader()
    assert_first_term(backend, a.term, since)
    assert_first_term(backend, b.term, since)
    assert not make_elector(name="reports").is_leader()


# -- expiry and handover -------------------------------------------------------------------


def test_failover_after_the_ttl_increments_the_term(make_elector: Callable[..., Any]) -> None:
    a = make_elector(node_id="a", ttl=0.4)
    b = make_elector(node_id="b", ttl=0.4)
    assert a.is_leader() and a.term is not None
    first = a.term
    assert not b.is_leader()
    waited = wait_until(b.is_leader, 10, "b to take over after the ttl")
    assert 0.2 < waited < 5
    assert b.term == first + 1
    assert a.is_leader() is False and a.term is None


def test_a_holder_renewing_after_its_own_expiry_keeps_its_term(
    backend: Backend, make_elector: Callable[..., Any]
) -> None:
    a = make_elector(node_id="a", ttl=0.1)
    assert a.is_leader() and a.term is not None
    first = a.term
    wait_until(backend.election_expired, 10, "the election to expire on the server")
    assert a.is_leader() and a.term == first  # nobody else held it in between


def test_resign_hands_over_at_once_and_terms_never_go_back(
    make_elector: Callable[..., Any],
) -> None:
    a = make_elector(node_id="a", ttl=3600)
    b = make_elector(node_id="b", ttl=3600)
    assert a.is_leader() and a.term is not None
    first = a.term
    assert b.resign() is False  # not the holder: changes nothing
    assert a.is_leader() and a.term == first
    assert a.resign() is True and a.term is None
    assert b.is_leader() and b.term == first + 1  # no wait for the hour-long ttl
    assert a.resign() is False
    assert b.is_leader() and b.term == first + 1
    assert b.resign()
    assert a.is_leader() and a.term == first + 2  # re-acquiring after a resign is a new term


def test_the_with_block_resigns(backend: Backend, make_elector: Callable[..., Any]) -> None:
    with backend.elector(ttl=3600) as a:
        assert a.is_leader()
        first = a.term
    assert first is not None
    follower = make_elector(ttl=3600)
    assert follower.is_leader() and follower.term == first + 1


def test_a_restarted_server_keeps_the_term(private_backend: Backend) -> None:
    assert private_backend.restart is not None
    a = private_backend.elector(name="k", node_id="a", ttl=30)
    b = private_backend.elector(name="k", node_id="b", ttl=30)
    try:
        assert a.is_leader() and a.term is not None
        first = a.term
        private_backend.restart()
        assert a.is_leader() and a.term == first  # persisted: still a's
        assert a.resign()
        assert b.is_leader() and b.term is not None
        if private_backend.kind == "redis":
            # A restart gives Redis a new replication id: the next term jumps to the
            # server's clock, past any term the restart may have lost.
            assert b.term > first + 1
        else:
            assert b.term == first + 1
    finally:
        a.close()
        b.close()


# -- vocabulary and input ------------------------------------------------------------------


def test_defaults_and_a_new_node_id_per_instance(make_elector: Callable[..., Any]) -> None:
    a, b = make_elector(), make_elector()
    assert a.node_id and b.node_id and a.node_id != b.node_id
    assert (a.name, a.ttl, a.term) == ("default", 30.0, None)


def test_names_and_node_ids_are_used_verbatim(make_elector: Callable[..., Any]) -> None:
    spaced = make_elector(name="  jobs\n", node_id=" a ")
    plain = make_elector(name="jobs", node_id="a")
    assert spaced.name == "  jobs\n" and spaced.node_id == " a "  # never trimmed
    assert spaced.is_leader() and plain.is_leader()  # two elections, two holders
    assert spaced.resign() and plain.resign()


def test_a_name_of_the_longest_length_is_accepted(make_elector: Callable[..., Any]) -> None:
    elector = make_elector(name="n" * MAX_NAME, node_id="i" * MAX_NAME, ttl=5)
    assert elector.is_leader() and elector.resign()


def test_a_one_millisecond_ttl_works(make_elector: Callable[..., Any]) -> None:
    elector = make_elector(ttl=0.001)
    assert elector.ttl == 0.001
    assert elector.is_leader()


@pytest.mark.parametrize(
    "bad", ["", "   ", "\t\n", "a\x00b", "x" * (MAX_NAME + 1), 5, b"name", "\ud800"]
)
def test_bad_names_and_node_ids_are_refused(backend: Backend, bad: Any) -> None:
    url, _ = backend.unreachable()  # refused before any I/O
    with pytest.raises(ConfigError, match="name"):
        backend.elector(url, name=bad)
    with pytest.raises(ConfigError, match="node_id"):
        backend.elector(url, node_id=bad)


def test_a_name_of_none_is_refused_and_a_node_id_of_none_is_a_new_one(
    backend: Backend,
) -> None:
    url, _ = backend.unreachable()
    with pytest.raises(ConfigError, match="name"):
        backend.elector(url, name=None)
    assert backend.elector(url, node_id=None).node_id


@pytest.mark.parametrize(
    "ttl", [0, 0.0005, 0.0009, -3, float("nan"), float("inf"), False, True, "30", None]
)
def test_a_ttl_below_a_millisecond_or_not_a_number_is_refused(backend: Backend, ttl: Any) -> None:
    url, _ = backend.unreachable()
    with pytest.raises(ConfigError, match="ttl"):
        backend.elector(url, ttl=ttl)


@pytest.mark.parametrize("source", [None, "", "   ", 42, object()])
def test_no_usable_connection_is_refused(backend: Backend, source: Any) -> None:
    cls = backend.elector_class
    with pytest.raises(ConfigError, match=f"{cls.__name__} needs"):
        cls(source)


# -- fail closed ---------------------------------------------------------------------------


def test_an_unreachable_server_raises_and_never_says_leader(backend: Backend) -> None:
    url, port = backend.unreachable(password="s3cret-pw")
    elector = backend.elector(url)
    try:
        with pytest.raises(BackendUnavailable) as info:
            elector.is_leader()
        message = str(info.value)
        assert "127.0.0.1" in message and str(port) in message  # says where
        assert "s3cret-pw" not in message
        assert elector.term is None
        with pytest.raises(BackendUnavailable):
            elector.resign()
        assert elector.term is None
    finally:
        elector.close()
