"""The in-memory checkpoint store and ``ctx.checkpoint`` under a SingleNodeLeader.

The store keeps the Postgres store's rules (versions, JSON limits, saves fenced by
term); ``tests/integration/conformance/test_checkpoint_stores.py`` runs the same checks on both.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import rselection as rs
from rselection.abc import LeaseFencedStore
from rselection.errors import ConfigError, StaleLeaderError
from rselection.keys import lease_scoped
from rselection.memory import MemoryLease
from rselection.task_checkpoint import TaskCheckpoint
from tests.support.waiting import wait_until


def test_versions_grow_on_every_save_and_delete_and_never_repeat() -> None:
    store = rs.MemoryCheckpointStore()
    assert store.load("k") is None
    assert [store.save("k", {"n": n}).version for n in range(3)] == [1, 2, 3]
    assert store.delete("k") is True
    assert store.delete("k") is False
    assert store.load("k") is None
    again = store.save("k", {"n": 9})
    assert again.version == 5 and again.term is None
    assert store.load("k") == again


def test_states_come_back_as_json_would_return_them() -> None:
    store = rs.MemoryCheckpointStore()
    saved = store.save(("owner", "repo"), {"t": (1, 2), "s": "é"})
    assert saved.state == {"t": [1, 2], "s": "é"} and saved.key == ("owner", "repo")
    assert store.load(("owner", "repo")) == saved
    assert store.load(("one",)) is None and store.save(("one",), 1).key == "one"
    state: dict[str, Any] = {"list": []}
    store.save("mutable", state)
    state["list"].append(1)  # the store kept a copy
    loaded = store.load("mutable")
    assert loaded is not None and loaded.state == {"list": []}


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({"when": object()}, TypeError, "cannot be stored as JSON"),
        ({"n": float("nan")}, ConfigError, "NaN"),
        ({"s": "a\x00b"}, ConfigError, "NUL"),
        ({"s": "\ud800"}, ConfigError, "surrogate"),
        ("x" * 100, ConfigError, "max_state_bytes=64"),
    ],
)
def test_states_json_cannot_hold_are_refused(
    state: Any, error: type[Exception], match: str
) -> None:
    store = rs.MemoryCheckpointStore(max_state_bytes=64)
    with pytest.raises(error, match=match):
        store.save("k", state)
    assert store.load("k") is None


@pytest.mark.parametrize("key", ["", (), ("a", ""), ("a", 1), 5, ["a"], "a\x00b"])
def test_bad_keys_are_refused(key: Any) -> None:
    with pytest.raises(ConfigError, match="checkpoint key"):
        rs.MemoryCheckpointStore().load(key)


def test_saves_are_fenced_to_the_live_holders_term() -> None:
    lease = MemoryLease(name="billing")
    store = rs.MemoryCheckpointStore(leases=[lease])
    first = lease.try_acquire("a").holder
    assert first is not None
    saved = store.save("job", {"n": 1}, term=first.term, name="billing")
    assert saved.term == first.term
    with pytest.raises(StaleLeaderError, match="term 2 no longer holds lease 'billing'"):
        store.save("job", {"n": 2}, term=first.term + 1, name="billing")
    lease.release("a", first.term)  # released: the term is over even with no successor
    with pytest.raises(StaleLeaderError):
        store.save("job", {"n": 3}, term=first.term, name="billing")
    with pytest.raises(StaleLeaderError):
        store.delete("job", term=first.term, name="billing")
    second = lease.try_acquire("b").holder
    assert second is not None and second.term == first.term + 1
    with pytest.raises(StaleLeaderError):
        store.save("job", {"n": 4}, term=first.term, name="billing")
    assert store.delete("job", term=second.term, name="billing") is True
    snap = store.save("job", {"n": 5})  # unfenced
    assert snap.version == 3


def test_a_fenced_save_against_a_lease_the_store_was_not_given_is_a_config_error() -> None:
    store = rs.MemoryCheckpointStore(leases=[MemoryLease(name="a")])
    with pytest.raises(ConfigError, match=r"cannot fence against lease 'b' \(it knows 'a'\)"):
        store.save("k", 1, term=1, name="b")
    with pytest.raises(ConfigError, match="LeaseBackend"):
        store.add_lease(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="term"):
        store.save("k", 1, term=-1, name="a")
    with pytest.raises(ConfigError, match="max_state_bytes"):
        rs.MemoryCheckpointStore(max_state_bytes=0)


def test_both_stores_are_checkpoint_stores() -> None:
    store = rs.MemoryCheckpointStore()
    assert isinstance(store, rs.CheckpointStore) and isinstance(store, LeaseFencedStore)


def test_a_save_never_lands_after_the_next_term_began() -> None:
    """Saves of term 1 race a takeover: each either lands before term 2 exists or is
    refused; none is stored after a save of term 2."""
    lease = MemoryLease(name="race")
    store = rs.MemoryCheckpointStore(leases=[lease])
    first = lease.try_acquire("a").holder
    assert first is not None
    stop = threading.Event()
    outcomes: list[str] = []

    def old_leader() -> None:
        while not stop.is_set():
            try:
                store.save("k", {"term": first.term}, term=first.term, name="race")
                outcomes.append("saved")
            except StaleLeaderError:
                outcomes.append("refused")

    thread = threading.Thread(target=old_leader)
    thread.start()
    try:
        wait_until(lambda: "saved" in outcomes, 5, "a save of term 1")
        lease.revoke()
        second = lease.try_acquire("b").holder
        assert second is not None
        store.save("k", {"term": second.term}, term=second.term, name="race")
        wait_until(lambda: "refused" in outcomes, 5, "a refused save of term 1")
    finally:
        stop.set()
        thread.join(5)
    snap = store.load("k")
    assert snap is not None and snap.state == {"term": second.term}


# -- ctx.checkpoint under a SingleNodeLeader --------------------------------------------


def test_ctx_checkpoint_works_under_a_single_node_and_fences_ended_terms(
    leaders: Any,
) -> None:
    handler = rs.TaskHandler(stop_grace=2.0)
    bound: list[TaskCheckpoint] = []
    counts: dict[int, list[int]] = {}

    @handler.persistent("counter", restart="never")
    def counter(ctx: rs.TaskContext) -> None:
        bound.append(ctx.checkpoint)
        snap = ctx.checkpoint.load()
        n = snap.state["n"] if snap is not None else 0
        while ctx.sleep(0.01):
            n += 1
            saved = ctx.checkpoint.save({"n": n})
            assert saved.term == ctx.term
            counts.setdefault(ctx.term, []).append(n)

    leader: rs.SingleNodeLeader = leaders(handler)
    assert isinstance(leader.checkpoint_store, rs.MemoryCheckpointStore)
    leader.start()
    wait_until(lambda: len(counts.get(1, [])) >= 3, 10, "term 1 to save")
    leader.step_down()
    wait_until(lambda: len(counts.get(2, [])) >= 3, 10, "term 2 to save")
    assert counts[2][0] == counts[1][-1] + 1  # resumed where term 1 stopped
    with pytest.raises(StaleLeaderError):
        bound[0].save({"n": -1})  # term 1 is over
    leader.stop(timeout=10)
    snap = leader.checkpoint_store.load(lease_scoped("single-node", "counter"))
    assert snap is not None and snap.term == 2 and snap.state == {"n": counts[2][-1]}
    with pytest.raises(StaleLeaderError):
        bound[1].save({"n": -1})  # stopped: the lease was released


def test_a_store_passed_to_a_single_node_is_seeded_and_fenced_against_its_lease(
    leaders: Any,
) -> None:
    store = rs.MemoryCheckpointStore()
    store.save("seeded/ticker", {"n": 41})
    seen: list[rs.Snapshot] = []
    handler = rs.TaskHandler(stop_grace=2.0)

    @handler.persistent("ticker", restart="never")
    async def ticker(ctx: rs.TaskContext) -> None:
        snap = await ctx.checkpoint.aload()
        assert snap is not None
        seen.append(await ctx.checkpoint.asave({"n": snap.state["n"] + 1}))
        assert ctx.checkpoint.key == "seeded/ticker" and ctx.checkpoint.term == ctx.term
        assert await ctx.checkpoint.adelete() is True

    leader = leaders(handler, checkpoint_store=store, name="seeded")
    assert leader.checkpoint_store is store
    leader.start()
    wait_until(lambda: bool(seen), 10, "the async task to save")
    assert seen[0].state == {"n": 42} and seen[0].version == 2
    wait_until(lambda: store.load("seeded/ticker") is None, 5, "the delete")
    leader.stop(timeout=10)
    with pytest.raises(StaleLeaderError):
        store.save("seeded/ticker", 1, term=1, name="seeded")


def test_run_tasks_hands_its_store_to_the_tasks() -> None:
    from rselection.testing import run_tasks

    store = rs.MemoryCheckpointStore()
    handler = rs.TaskHandler()

    @handler.persistent("once", restart="never")
    def once(ctx: rs.TaskContext) -> None:
        ctx.checkpoint.save({"ran": True})

    with run_tasks(handler, checkpoint_store=store) as running:
        running.wait_runs("once", 1)
        wait_until(lambda: store.load("single-node/once") is not None, 5, "the save")
    snap = store.load("single-node/once")
    assert snap is not None and snap.state == {"ran": True} and snap.term == 1


def test_task_checkpoint_async_variants_do_not_block_the_loop() -> None:
    lease = MemoryLease(name="l")
    holder = lease.try_acquire("n").holder
    assert holder is not None
    checkpoint = TaskCheckpoint(rs.MemoryCheckpointStore(leases=[lease]), "k", holder.term, "l")
    assert (checkpoint.key, checkpoint.name) == ("l/k", "l")

    async def scenario() -> None:
        assert await checkpoint.aload() is None
        assert (await checkpoint.asave([1])).version == 1
        assert await checkpoint.adelete() is True

    asyncio.run(scenario())
    assert repr(checkpoint) == "TaskCheckpoint('l/k', term=1, name='l')"


def test_a_store_fences_one_lease_object_per_name() -> None:
    first, second = MemoryLease(name="shared"), MemoryLease(name="shared")
    store = rs.MemoryCheckpointStore(leases=[first, first])  # the same object again: fine
    store.add_lease(first)
    with pytest.raises(ConfigError, match="already fences lease 'shared' against another"):
        store.add_lease(second)
    with pytest.raises(ConfigError, match="one lease per name"):
        rs.MemoryCheckpointStore(leases=[first, second])
    holder = first.try_acquire("a").holder
    assert holder is not None and second.try_acquire("b").holder is not None
    assert store.save("k", 1, term=holder.term, name="shared").term == holder.term
    first.release("a", holder.term)
    with pytest.raises(StaleLeaderError):  # not taken for the other lease's live term 1
        store.save("k", 2, term=holder.term, name="shared")


def test_two_single_nodes_of_one_name_cannot_share_a_store(leaders: Any) -> None:
    """A second leader of the same name is refused at construction; leaders of two names
    share one store, each fenced against its own lease."""
    store = rs.MemoryCheckpointStore()
    saves: dict[str, list[str]] = {}
    bound: dict[str, TaskCheckpoint] = {}

    def handler(tag: str) -> rs.TaskHandler:
        tasks = rs.TaskHandler(stop_grace=2.0)

        @tasks.persistent("job", restart="never")
        def job(ctx: rs.TaskContext) -> None:
            bound.setdefault(tag, ctx.checkpoint)
            try:
                ctx.checkpoint.save({"term": ctx.term})
                saves.setdefault(tag, []).append("accepted")
            except StaleLeaderError:
                saves.setdefault(tag, []).append("refused")
            ctx.cancelled.wait(10)

        return tasks

    a = leaders(handler("a"), checkpoint_store=store)
    with pytest.raises(ConfigError, match="already fences lease 'single-node'"):
        rs.SingleNodeLeader(handler("b"), checkpoint_store=store)
    b = leaders(handler("b"), checkpoint_store=store, name="other")
    a.start()
    b.start()
    wait_until(lambda: len(saves.get("a", [])) == 1 and "b" in saves, 10, "the first saves")
    a.step_down()
    wait_until(lambda: len(saves["a"]) == 2, 10, "term 2's save")
    assert saves == {"a": ["accepted", "accepted"], "b": ["accepted"]}
    with pytest.raises(StaleLeaderError):  # a's term 1 ended; b's lease is at term 1
        bound["a"].save("stale")
    assert bound["b"].save("live").term == 1


class _UnfencedStore:
    """A checkpoint store that fences against nothing a single node has."""

    def load(self, key: Any) -> rs.Snapshot | None:
        return None

    def save(self, key: Any, state: Any, *, term: int | None = None, name: str = "") -> Any:
        raise StaleLeaderError("never")

    def delete(self, key: Any, *, term: int | None = None, name: str = "") -> bool:
        raise StaleLeaderError("never")


def test_a_single_node_refuses_a_store_that_cannot_fence_against_its_lease() -> None:
    from rselection.testing import run_tasks

    assert isinstance(_UnfencedStore(), rs.CheckpointStore)
    with pytest.raises(ConfigError, match="must fence against its own in-memory lease"):
        rs.SingleNodeLeader(rs.TaskHandler(), checkpoint_store=_UnfencedStore())
    tasks = run_tasks(rs.TaskHandler(), checkpoint_store=_UnfencedStore())
    with pytest.raises(ConfigError, match="MemoryCheckpointStore"), tasks:
        pass
