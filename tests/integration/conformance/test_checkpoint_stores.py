"""One set of checkpoint store rules, checked on both stores that ship.

``MemoryCheckpointStore`` (the single node's) must behave as
``PostgresCheckpointStore`` does, so a task tested under a ``SingleNodeLeader`` meets
the same versions, JSON limits and fencing in production. Each check runs on both, with
a lease of the matching kind (a ``MemoryLease``, a ``PostgresLease``).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import rselection as rs
from rselection.memory import MemoryLease


@dataclass
class Setup:
    """A store and a factory of leases it fences against."""

    store: rs.CheckpointStore
    lease: Callable[[str], Any]


@pytest.fixture(params=["memory", "postgres"])
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    if request.param == "memory":
        store = rs.MemoryCheckpointStore(max_state_bytes=1024)
        memory: dict[str, MemoryLease] = {}

        def memory_lease(name: str) -> MemoryLease:
            # Nodes of one process share the lease object: it is the lease server.
            if name not in memory:
                memory[name] = MemoryLease(name=name, ttl=3)
                store.add_lease(memory[name])
            return memory[name]

        yield Setup(store, memory_lease)
        return
    from rselection.postgres import PostgresCheckpointStore, PostgresLease

    dsn = request.getfixturevalue("pg_dsn")
    pg_store = PostgresCheckpointStore(dsn, max_state_bytes=1024)
    leases: list[PostgresLease] = []

    def pg_lease(name: str) -> PostgresLease:
        lease = PostgresLease(dsn, name=name, ttl=3, renew_deadline=2)
        leases.append(lease)
        return lease

    try:
        yield Setup(pg_store, pg_lease)
    finally:
        for lease in leases:
            lease.close()
        pg_store.close()


def test_versions_grow_on_save_and_delete_and_never_repeat(setup: Setup) -> None:
    store = setup.store
    assert store.load("k") is None
    assert [store.save("k", {"n": n}).version for n in range(3)] == [1, 2, 3]
    assert store.delete("k") is True and store.delete("k") is False
    assert store.load("k") is None
    snap = store.save("k", [1])
    assert (snap.version, snap.term, snap.state) == (5, None, [1])
    loaded = store.load("k")
    assert loaded is not None and (loaded.version, loaded.state) == (5, [1])


def test_keys_and_states_round_trip_as_json(setup: Setup) -> None:
    store = setup.store
    saved = store.save(("owner", "repo"), {"t": (1, 2), "s": "é", "n": None})
    assert saved.key == ("owner", "repo") and saved.state == {"t": [1, 2], "s": "é", "n": None}
    loaded = store.load(("owner", "repo"))
    assert loaded is not None and loaded.state == saved.state and loaded.key == saved.key
    assert store.save(("one",), 1).key == "one"


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (1e16, 10**16),
        (-1e300, -(10**300)),
        (1.5e16, 15 * 10**15),
        (1e15, 1e15),  # "1000000000000000.0": a fractional digit, stays a float
        (2.5e-7, 2.5e-7),
        (5e-324, 5e-324),
        (10**40, 10**40),
        ({"bb": 1, "a": 2, "é": 3, "ab": 4, "Z": 5}, {"Z": 5, "a": 2, "ab": 4, "bb": 1, "é": 3}),
        ([{"y": 1.0, "x": [1e20, 0.1]}], [{"x": [10**20, 0.1], "y": 1.0}]),
    ],
    ids=["1e16", "-1e300", "1.5e16", "1e15", "2.5e-7", "5e-324", "10**40", "keys", "nested"],
)
def test_states_come_back_as_postgres_jsonb_returns_them(
    setup: Setup, state: Any, expected: Any
) -> None:
    def exact(value: Any) -> str:  # types, key order and float spelling, not just ==
        return json.dumps(value) + repr(type(value))

    saved = setup.store.save("k", state)
    loaded = setup.store.load("k")
    assert loaded is not None
    assert exact(loaded.state) == exact(expected)
    assert exact(saved.state) == exact(expected)  # save returns what load will


def test_negative_zero_comes_back_as_zero(setup: Setup) -> None:
    setup.store.save("k", [-0.0, {"z": -0.0}])
    loaded = setup.store.load("k")
    assert loaded is not None and loaded.state == [0.0, {"z": 0.0}]
    assert math.copysign(1, loaded.state[0]) == 1 and math.copysign(1, loaded.state[1]["z"]) == 1


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({"when": object()}, TypeError, "cannot be stored as JSON"),
        ({"n": float("inf")}, rs.ConfigError, "NaN and infinities"),
        ({"s": "a\x00b"}, rs.ConfigError, "NUL"),
        ("x" * 2000, rs.ConfigError, "max_state_bytes=1024"),
    ],
)
def test_the_same_states_are_refused(
    setup: Setup, state: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        setup.store.save("k", state)
    assert setup.store.load("k") is None


def test_saves_and_deletes_are_fenced_to_the_live_holders_term(setup: Setup) -> None:
    store = setup.store
    name = f"t-{uuid.uuid4().hex[:6]}"
    a, b = setup.lease(name), setup.lease(name)
    first = a.try_acquire("a").holder
    assert first is not None
    old = first.term
    assert store.save("job", {"by": "a"}, term=old, name=name).term == old
    with pytest.raises(rs.StaleLeaderError):
        store.save("job", {"by": "?"}, term=old + 1, name=name)
    a.release("a", old)
    with pytest.raises(rs.StaleLeaderError):  # released: over even before a successor
        store.save("job", {"by": "a"}, term=old, name=name)
    second = b.try_acquire("b").holder
    assert second is not None and second.term == old + 1
    with pytest.raises(rs.StaleLeaderError):
        store.save("job", {"by": "a"}, term=old, name=name)
    with pytest.raises(rs.StaleLeaderError):
        store.delete("job", term=old, name=name)
    assert store.save("job", {"by": "b"}, term=second.term, name=name).version == 2
    assert store.delete("job", term=second.term, name=name) is True
    snap = store.save("job", {"by": "anyone"})  # not fenced
    assert (snap.version, snap.term) == (4, None)
