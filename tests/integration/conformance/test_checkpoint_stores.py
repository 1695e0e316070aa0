"""One set of checkpoint store rules, checked on both stores that ship.

``MemoryCheckpointStore`` (the single node's) must behave as
``PostgresCheckpointStore`` does, so a task tested under a ``SingleNodeLeader`` meets
the same versions, JSON limits and fencing in production. Each check runs on both, with
a lease of the matching kind (a ``MemoryLease``, a ``PostgresLease``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import rselection as rs
from rselection.lease import MemoryLease


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
                memory[name] = MemoryLease(name, ttl=3)
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
    assert store.save("job", {"by": "a"}, term=old, lease=name).term == old
    with pytest.raises(rs.StaleLeaderError):
        store.save("job", {"by": "?"}, term=old + 1, lease=name)
    a.release("a", old)
    with pytest.raises(rs.StaleLeaderError):  # released: over even before a successor
        store.save("job", {"by": "a"}, term=old, lease=name)
    second = b.try_acquire("b").holder
    assert second is not None and second.term == old + 1
    with pytest.raises(rs.StaleLeaderError):
        store.save("job", {"by": "a"}, term=old, lease=name)
    with pytest.raises(rs.StaleLeaderError):
        store.delete("job", term=old, lease=name)
    assert store.save("job", {"by": "b"}, term=second.term, lease=name).version == 2
    assert store.delete("job", term=second.term, lease=name) is True
    snap = store.save("job", {"by": "anyone"})  # not fenced
    assert (snap.version, snap.term) == (4, None)
