"""What every fire claimer promises, on Postgres (``PostgresClaimer``) and Redis
(``RedisClaimer``).

``claim(fire_key)`` is won once across the fleet and kept until its ttl (also by its own
holder), then taken again; each claim records its node id and term; keys are
independent and used verbatim; concurrent claimers win each key exactly once.
``claim_missed(fire_keys)`` (a starting leader's look back) claims every key after the
newest one held, atomically, and takes expired claims again. ``claim_many(fire_keys)``
(the fires due at one instant) claims each key as ``claim`` would, in one call. Bad
input (a key given twice included, on every claimer: memory, Postgres, Redis) is refused with
``ConfigError`` before any I/O; a backend problem raises ``BackendUnavailable`` (fail
closed, never "someone else has it") and the claimer recovers with the server.

How each backend stores a claim, and its own extras (Postgres: pools, transactions,
tables, cleanup; Redis: one round trip, cluster slots, ``holder_of``), are tested in its
own suite.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import rselection as rs
from rselection.claiming import (
    BatchFireClaimer,
    BatchFireHistory,
    BatchMissedFireClaimer,
    FireClaimer,
    MissedFireClaimer,
    claim_each,
    claim_missed,
)
from rselection.errors import BackendUnavailable, ConfigError
from rselection.schedules import format_fire_key
from rselection.validation import MAX_NAME
from tests.support.backends import Backend
from tests.support.waiting import wait_until

KEY = format_fire_key("purge", datetime(2026, 11, 30, 2, 40, tzinfo=UTC))


@pytest.fixture
def make_claimer(backend: Backend) -> Iterator[Callable[..., Any]]:
    """Factory of claimers sharing this test's namespace, all closed after the test."""
    made: list[Any] = []

    def make(**kw: Any) -> Any:
        claimer = backend.claimer(**kw)
        made.append(claimer)
        return claimer

    yield make
    for claimer in made:
        claimer.close()


@pytest.fixture
def offline(backend: Backend) -> Iterator[Any]:
    """A claimer of a server that is never reached (for checks made before any I/O)."""
    url, _ = backend.unreachable()
    claimer = backend.claimer(url)
    yield claimer
    claimer.close()


# -- claim ---------------------------------------------------------------------------------


def test_a_claimer_is_a_missed_fire_claimer(make_claimer: Callable[..., Any]) -> None:
    claimer = make_claimer()
    assert isinstance(claimer, FireClaimer) and isinstance(claimer, MissedFireClaimer)


def test_a_claim_is_won_once_and_kept_until_its_ttl_then_replaced(
    backend: Backend, make_claimer: Callable[..., Any]
) -> None:
    a = make_claimer(ttl=0.5, node_id="node-a")
    b = make_claimer(ttl=0.5, node_id="node-b")
    assert a.claim(KEY) is True
    # Kept, not released: neither the winner nor anyone else wins it again in its ttl.
    assert a.claim(KEY) is False
    assert b.claim(KEY) is False
    assert backend.claim_of(KEY) == ("node-a", None)
    waited = wait_until(lambda: b.claim(KEY), 10, "the expired claim to be replaced")
    assert 0.2 < waited < 5  # not before the ttl has (almost) passed
    assert backend.claim_of(KEY) == ("node-b", None)
    assert a.claim(KEY) is False


def test_a_claim_records_its_node_id_and_term(
    backend: Backend, make_claimer: Callable[..., Any]
) -> None:
    claimer = make_claimer(node_id="worker-7")
    assert claimer.claim(KEY, term=9)
    assert claimer.claim("other", term=1)
    assert claimer.claim("no-term")
    # Terms start at 1 (DESIGN's one term check): 0 is no term, as for every class.
    with pytest.raises(ConfigError, match="term must be"):
        claimer.claim("zero", term=0)
    assert backend.claim_of(KEY) == ("worker-7", 9)
    assert backend.claim_of("other") == ("worker-7", 1)
    assert backend.claim_of("no-term") == ("worker-7", None)
    assert backend.claim_of("zero") is None
    assert backend.claim_of("never") is None


def test_defaults_and_a_new_node_id_per_claimer(make_claimer: Callable[..., Any]) -> None:
    a, b = make_claimer(), make_claimer()
    assert a.node_id and b.node_id and a.node_id != b.node_id
    assert a.ttl == 600.0


def test_many_keys_are_independent(make_claimer: Callable[..., Any]) -> None:
    a, b = make_claimer(), make_claimer()
    start = datetime(2026, 1, 1, tzinfo=UTC)
    keys = [format_fire_key("job", start + timedelta(seconds=i)) for i in range(20)]
    assert all(a.claim(k) for k in keys[::2])
    assert [b.claim(k) for k in keys] == [i % 2 == 1 for i in range(20)]


def test_concurrent_claimers_win_each_key_exactly_once(
    backend: Backend, make_claimer: Callable[..., Any]
) -> None:
    threads, count = 8, 200
    start = datetime(2026, 3, 29, 0, 59, tzinfo=UTC)
    keys = [format_fire_key("tick", start + timedelta(milliseconds=250 * i)) for i in range(count)]
    shared = make_claimer(node_id="shared")
    # Four threads with a claimer each, four sharing one (and so its connection).
    claimers = [make_claimer(node_id=f"own-{i}") for i in range(4)] + [shared] * 4
    barrier = threading.Barrier(threads)

    def run(index: int) -> list[str]:
        order = keys[:]
        random.Random(index).shuffle(order)
        barrier.wait(timeout=30)
        return [k for k in order if claimers[index].claim(k, term=index + 1)]

    with ThreadPoolExecutor(threads) as pool:
        futures: list[Future[list[str]]] = [pool.submit(run, i) for i in range(threads)]
        won = [f.result(timeout=90) for f in futures]
    counts = Counter(k for keys_won in won for k in keys_won)
    assert set(counts) == set(keys)
    assert set(counts.values()) == {1}
    for index, keys_won in enumerate(won):
        for k in keys_won[:10]:
            assert backend.claim_of(k) == (claimers[index].node_id, index + 1)


def test_fire_keys_and_node_ids_are_used_verbatim(
    backend: Backend, make_claimer: Callable[..., Any]
) -> None:
    claimer = make_claimer(node_id=" n1 ")
    assert claimer.node_id == " n1 "
    assert claimer.claim(" purge@1 ") and claimer.claim("purge@1")  # two fires
    assert backend.claim_of(" purge@1 ") == (" n1 ", None)
    assert backend.claim_of("purge@1") == (" n1 ", None)


def test_a_fire_key_of_the_longest_lease_and_task_names_is_claimed(
    make_claimer: Callable[..., Any],
) -> None:
    # What a leader claims: "<lease name>/<task>@<instant>", each name up to 1,000
    # characters, so a fire key may be longer than a name.
    key = "l" * MAX_NAME + "/" + format_fire_key("t" * MAX_NAME, datetime(2026, 1, 1, tzinfo=UTC))
    claimer = make_claimer()
    assert claimer.claim(key) and not claimer.claim(key)
    assert claimer.claim_missed([key]) == []


def test_a_one_millisecond_ttl_is_the_smallest(make_claimer: Callable[..., Any]) -> None:
    claimer = make_claimer(ttl=0.001)
    assert claimer.ttl == 0.001
    assert claimer.claim("quick")


# -- claim_missed: a starting leader's look back ---------------------------------------------


def test_claim_missed_takes_the_keys_after_the_newest_held(
    backend: Backend, make_claimer: Callable[..., Any]
) -> None:
    old = make_claimer(node_id="old-leader")
    new = make_claimer(node_id="new-leader")
    keys = [f"tick@{i:02d}" for i in range(10)]
    assert old.claim(keys[3]) and old.claim(keys[6])  # the old leader got as far as 6
    assert new.claim_missed(keys, term=7) == keys[7:]
    assert [backend.claim_of(k) for k in keys[7:]] == [("new-leader", 7)] * 3
    # Those now bind: a second look back finds nothing, the old leader cannot take them.
    assert new.claim_missed(keys, term=8) == []
    assert not old.claim(keys[8])
    # Keys before the newest held one stay unclaimed (not missed: before the handover).
    assert backend.claim_of(keys[5]) is None
    assert old.claim(keys[5])
    assert new.claim_missed([], term=1) == []


def test_claim_missed_with_nothing_held_takes_everything(
    backend: Backend, make_claimer: Callable[..., Any]
) -> None:
    claimer = make_claimer(node_id="first")
    keys = [f"first@{i:02d}" for i in range(5)]
    assert claimer.claim_missed(keys, term=1) == keys
    assert [backend.claim_of(k) for k in keys] == [("first", 1)] * 5
    assert claimer.claim_missed(keys) == []


# serial: a claim of ttl 0.05 s must still be held at the next call (under four workers
# and a busy CPU it had expired).
@pytest.mark.serial
def test_claim_missed_takes_expired_claims_again(
    backend: Backend, make_claimer: Callable[..., Any]
) -> None:
    short = make_claimer(node_id="short", ttl=0.05)
    later = make_claimer(node_id="later")
    keys = ["exp@1", "exp@2", "exp@3"]
    assert short.claim("exp@3")
    assert later.claim_missed(keys) == []  # exp@3 held, the others before it
    wait_until(lambda: backend.claim_expired("exp@3"), 5.0, "the claim to expire (server time)")
    assert later.claim_missed(keys) == keys  # an expired claim counts as none
    assert backend.claim_of("exp@3") == ("later", None)


def test_claim_missed_is_atomic_between_two_starting_leaders(
    make_claimer: Callable[..., Any],
) -> None:
    keys = [f"race@{i:03d}" for i in range(200)]
    a, b = make_claimer(node_id="a"), make_claimer(node_id="b")
    results: dict[str, list[str]] = {}
    barrier = threading.Barrier(2)

    def run(name: str, claimer: Any) -> None:
        barrier.wait(10)
        results[name] = claimer.claim_missed(keys, term=1)

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(results) == {"a", "b"}
    assert not set(results["a"]) & set(results["b"])  # no key won twice
    assert sorted(results["a"] + results["b"]) == keys  # and none left out


# -- input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [0, 0.0009, -1, float("nan"), float("inf"), True, "600", None])
def test_a_ttl_below_a_millisecond_or_not_a_number_is_refused(backend: Backend, ttl: Any) -> None:
    url, _ = backend.unreachable()
    with pytest.raises(ConfigError, match="ttl"):
        backend.claimer(url, ttl=ttl)


@pytest.mark.parametrize("node_id", ["", "   ", "a\x00b", 7, "n" * (MAX_NAME + 1)])
def test_a_bad_node_id_is_refused(backend: Backend, node_id: Any) -> None:
    url, _ = backend.unreachable()
    with pytest.raises(ConfigError, match="node_id"):
        backend.claimer(url, node_id=node_id)


@pytest.mark.parametrize("source", [None, "", "   ", 42, object()])
def test_no_usable_connection_is_refused(backend: Backend, source: Any) -> None:
    cls = backend.claimer_class
    with pytest.raises(ConfigError, match=f"{cls.__name__} needs"):
        cls(source)


@pytest.mark.parametrize(
    ("fire_key", "term"),
    [
        ("", None),
        ("  ", None),
        ("a\x00", None),
        ("x" * 3000, None),
        (None, None),
        (5, None),
        ("k", -1),
        ("k", True),
        ("k", 2**63),
        ("k", 1.5),
        ("k", "3"),
    ],
)
def test_bad_claim_arguments_are_refused_before_any_io(
    offline: Any, fire_key: Any, term: Any
) -> None:
    with pytest.raises(ConfigError):
        offline.claim(fire_key, term=term)


@pytest.mark.parametrize(
    ("fire_keys", "term", "match"),
    [
        (["ok", ""], None, "fire_key"),
        (["ok", None], None, "fire_key"),
        (["ok", "x" * 3000], None, "fire_key"),
        (["ok"], -1, "term"),
        (["ok"], True, "term"),
    ],
)
def test_bad_claim_missed_arguments_are_refused_before_any_io(
    offline: Any, fire_keys: Any, term: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        offline.claim_missed(fire_keys, term=term)


def test_claim_missed_refuses_a_single_string(
    offline: Any,
) -> None:
    with pytest.raises(ConfigError, match="list"):
        offline.claim_missed("tick@01")


@pytest.fixture(params=["memory", "postgres", "redis"])
def every_claimer(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A claimer of each kind rselection ships: in memory, in Postgres, in Redis."""
    if request.param == "memory":
        yield rs.MemoryClaimer()
        return
    if request.param == "redis":
        found = Backend(
            "redis",
            request.getfixturevalue("redis_url"),
            key_prefix=f"t-{uuid.uuid4().hex[:10]}:",
        )
        claimer = found.claimer()
        yield claimer
        claimer.close()
        found.forget_keys()
        return
    claimer = Backend("postgres", request.getfixturevalue("pg_dsn")).claimer()
    yield claimer
    claimer.close()


def test_every_claimer_refuses_a_fire_key_given_twice_before_any_io(every_claimer: Any) -> None:
    keys = ["dup@1", "dup@2", "dup@1"]
    for call in (every_claimer.claim_missed, lambda k: claim_missed(every_claimer, k, term=1)):
        with pytest.raises(ConfigError, match="'dup@1' is given twice"):
            call(keys)
    # Nothing was claimed: each key is still free.
    assert every_claimer.claim_missed(["dup@1", "dup@2"]) == ["dup@1", "dup@2"]


# -- fail closed ---------------------------------------------------------------------------


def test_an_unreachable_server_raises_and_hides_the_password(backend: Backend) -> None:
    url, port = backend.unreachable(password="s3cret-pw")
    claimer = backend.claimer(url)
    try:
        with pytest.raises(BackendUnavailable) as info:
            claimer.claim(KEY)
        message = str(info.value)
        assert "127.0.0.1" in message and str(port) in message  # says where
        assert "s3cret-pw" not in message
        with pytest.raises(BackendUnavailable):
            claimer.claim_missed(["a@1", "a@2"])
    finally:
        claimer.close()


def test_a_server_down_mid_use_raises_then_recovers(private_backend: Backend) -> None:
    server = private_backend.server
    claimer = private_backend.claimer()
    try:
        assert claimer.claim("a")
        server.stop(mode="fast")
        with pytest.raises(BackendUnavailable):
            claimer.claim("b")  # fail closed: never "someone else has it"
        with pytest.raises(BackendUnavailable):
            claimer.claim_missed(["b"])
        server.start()
        assert claimer.claim("b") and not claimer.claim("a")  # nothing claimed meanwhile
    finally:
        claimer.close()


# -- claim_many: every fire due at one instant in one call ----------------------------------


def instant_keys(count: int, *, lease: str = "") -> list[str]:
    """The keys of ``count`` tasks' fires due at one instant, as a leader claims them."""
    at = datetime(2026, 12, 1, 0, 0, tzinfo=UTC)
    return [lease + format_fire_key(f"task-{i}", at) for i in range(count)]


def test_every_claimer_claims_many_fires_in_one_call(every_claimer: Any) -> None:
    assert isinstance(every_claimer, BatchFireClaimer)
    keys = instant_keys(50)
    assert every_claimer.claim(keys[7]) is True  # held before: not won again
    won = every_claimer.claim_many(keys, term=4)
    assert won == set(keys) - {keys[7]}
    assert every_claimer.claim_many(keys, term=5) == set()  # kept, also by their holder
    assert every_claimer.claim_many([], term=5) == set()


def test_claim_many_records_node_id_and_term_and_takes_expired_claims_again(
    backend: Backend, make_claimer: Callable[..., Any]
) -> None:
    a = make_claimer(ttl=0.5, node_id="node-a")
    b = make_claimer(ttl=0.5, node_id="node-b")
    keys = instant_keys(20)
    assert a.claim_many(keys, term=3) == set(keys)
    assert backend.claim_of(keys[0]) == ("node-a", 3)
    assert backend.claim_of(keys[-1]) == ("node-a", 3)
    assert b.claim_many(keys, term=4) == set()
    wait_until(lambda: backend.claim_expired(keys[-1]), 10, "the claims to expire")
    assert b.claim_many(keys, term=4) == set(keys)
    assert backend.claim_of(keys[5]) == ("node-b", 4)


def test_claim_many_and_claim_agree_on_each_key(make_claimer: Callable[..., Any]) -> None:
    a, b = make_claimer(), make_claimer()
    keys = instant_keys(30)
    assert a.claim_many(keys[::3]) == set(keys[::3])
    assert {k for k in keys if b.claim(k)} == set(keys) - set(keys[::3])
    assert a.claim_many(keys) == set()


def test_concurrent_claim_many_wins_each_key_exactly_once(
    make_claimer: Callable[..., Any],
) -> None:
    """Leaders that claim the same instant's fires at once, in different orders, each
    win some, never the same one, and never deadlock."""
    threads = 6
    keys = instant_keys(300)
    claimers = [make_claimer(node_id=f"node-{i}") for i in range(threads)]
    barrier = threading.Barrier(threads)

    def run(index: int) -> set[str]:
        order = keys[:]
        random.Random(index).shuffle(order)
        barrier.wait(timeout=30)
        won: set[str] = set()
        for start in range(0, len(order), 100):  # three batches each, overlapping others
            won |= claimers[index].claim_many(order[start : start + 100], term=index + 1)
        return won

    with ThreadPoolExecutor(threads) as pool:
        won = [f.result(timeout=90) for f in [pool.submit(run, i) for i in range(threads)]]
    counts = Counter(k for keys_won in won for k in keys_won)
    assert set(counts) == set(keys)
    assert set(counts.values()) == {1}


def test_claim_many_refuses_bad_keys_before_any_io(offline: Any) -> None:
    with pytest.raises(ConfigError, match="given twice"):
        offline.claim_many(["a@1", "a@2", "a@1"])
    with pytest.raises(ConfigError, match="list"):
        offline.claim_many("a@1")
    with pytest.raises(ConfigError, match="term"):
        offline.claim_many(["a@1"], term=-1)
    with pytest.raises(ConfigError):
        offline.claim_many(["ok@1", ""])


def test_claim_many_of_an_unreachable_server_raises(backend: Backend) -> None:
    url, _ = backend.unreachable()
    claimer = backend.claimer(url)
    try:
        with pytest.raises(BackendUnavailable):
            claimer.claim_many(instant_keys(3))
    finally:
        claimer.close()


def test_claim_each_calls_a_batch_claimer_once_and_reports_its_failure_on_every_key(
    backend: Backend,
) -> None:
    url, _ = backend.unreachable()
    claimer = backend.claimer(url)
    try:
        keys = instant_keys(4)
        won, failed = claim_each(claimer, keys, term=1)
        assert won == set() and set(failed) == set(keys)
        assert all(isinstance(exc, BackendUnavailable) for exc in failed.values())
    finally:
        claimer.close()


# -- a starting leader's look back, for every task in one call ------------------------------


def test_every_claimer_claims_the_missed_fires_of_many_tasks_in_one_call(
    every_claimer: Any,
) -> None:
    assert isinstance(every_claimer, BatchMissedFireClaimer)
    tasks = [[f"task-{t}@{i:02d}" for i in range(6)] for t in range(4)]
    assert every_claimer.claim(tasks[0][2])  # task 0: up to fire 2 was claimed
    assert every_claimer.claim(tasks[1][5])  # task 1: the newest was claimed
    won = every_claimer.claim_missed_many(tasks, term=3)
    assert won == [tasks[0][3:], [], tasks[2], tasks[3]]
    assert every_claimer.claim_missed_many(tasks, term=4) == [[], [], [], []]
    assert every_claimer.claim_missed_many([[], ["alone@1"]]) == [[], ["alone@1"]]
    assert every_claimer.claim_missed_many([]) == []
    with pytest.raises(ConfigError, match="given twice"):
        every_claimer.claim_missed_many([["x@1"], ["x@1"]])


def test_every_claimer_tells_which_of_many_tasks_ran_before(every_claimer: Any) -> None:
    """``ran_before_many`` answers as ``ran_before`` of each would (Redis records a
    series when a leader asks about it; Postgres and memory look at the claims)."""
    assert isinstance(every_claimer, BatchFireHistory)
    assert every_claimer.claim("ran@2026-12-01T00:00:00.000000000Z")
    every_claimer.ran_before("ran@")  # as a leader that scheduled it asked
    assert every_claimer.ran_before_many(["ran@", "never@"]) == {"ran@"}
    series = ["ran@", "never@", "other@"]
    every_claimer.ran_before_many(series)  # Redis records these; the others do not
    assert every_claimer.ran_before_many(series) == {
        one for one in series if every_claimer.ran_before(one)
    }
    assert every_claimer.ran_before_many([]) == set()
