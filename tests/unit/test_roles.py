"""The backend roles of :mod:`rselection.abc`: one base class per role whose defaults
count as "no such ability", one helper per role that asks for an ability, and the old
protocol names where they were."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import rselection as rs
import rselection.abc as roles
from rselection import checkpoints, claiming, context, lease
from rselection.abc import (
    CheckpointStoreBase,
    ClaimerBase,
    LeaseBase,
    claimer_ability,
    lease_ability,
    store_ability,
)
from rselection.checkpoints import Key, Snapshot
from rselection.claiming import LeaseClaims
from rselection.memory import MemoryCheckpointStore, MemoryClaimer, MemoryLease
from rselection.postgres.membership import PostgresMembership
from rselection.redis.membership import RedisMembership
from rselection.testing import LeaderConformance
from tests.support.waiting import wait_until

LEASE_ABILITIES = [
    "handover",
    "shared_schedule",
    "non_blocking",
    "announces_holder",
    "non_blocking_release",
]
CLAIMER_ABILITIES = [
    "claim_missed",
    "claim_many",
    "claim_missed_many",
    "cleanup",
    "ran_before",
    "ran_before_many",
]


class BaseLease(LeaseBase):
    """A lease of one's own, written on :class:`LeaseBase`: every call goes to a shared
    memory lease; no optional ability is overridden."""

    concurrent_calls = True  # as the memory lease it goes to: calls may overlap a wait

    def __init__(self, shared: MemoryLease) -> None:
        self._shared = shared
        self.name = shared.name
        self.ttl = shared.ttl

    def connect(self) -> None:
        self._shared.connect()

    def try_acquire(self, node_id: str) -> rs.Acquisition:
        return self._shared.try_acquire(node_id)

    def renew(self, node_id: str, term: int) -> bool:
        return self._shared.renew(node_id, term)

    def release(self, node_id: str, term: int) -> None:
        self._shared.release(node_id, term)

    def current(self) -> rs.LeaderInfo | None:
        return self._shared.current()

    def wait_for_change(self, timeout: float) -> None:
        self._shared.wait_for_change(timeout)

    def interrupt(self) -> None:
        self._shared.interrupt()

    def close(self) -> None:
        self._shared.close()


class HandingOverLease(BaseLease):
    """A :class:`BaseLease` that overrides the ``"handover"`` ability."""

    def handover_hinted(self) -> bool:
        return False

    def handover_requested(self) -> lease.HandoverRequest | None:
        return None


class CountingClaimer(ClaimerBase):
    """A claimer written on :class:`ClaimerBase` with ``claim`` only."""

    def __init__(self) -> None:
        self.ttl = 600.0
        self.held: set[str] = set()
        self.calls = 0

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        self.calls += 1
        if fire_key in self.held:
            return False
        self.held.add(fire_key)
        return True


class CleaningClaimer(CountingClaimer):
    """A :class:`CountingClaimer` that overrides the ``"cleanup"`` ability."""

    def cleanup(self, *, batch: int | None = None) -> int:
        return 7


class DictStore(CheckpointStoreBase):
    """A store written on :class:`CheckpointStoreBase`, fencing nothing."""

    def __init__(self) -> None:
        self.inner = MemoryCheckpointStore()

    def load(self, key: Key) -> Snapshot | None:
        return self.inner.load(key)

    def save(
        self, key: Key, state: Any, *, term: int | None = None, name: str = "default"
    ) -> Snapshot:
        return self.inner.save(key, state)

    def delete(self, key: Key, *, term: int | None = None, name: str = "default") -> bool:
        return self.inner.delete(key)


class FencingStore(DictStore):
    """A :class:`DictStore` that overrides the ``"add_lease"`` ability."""

    def __init__(self) -> None:
        super().__init__()
        self.given: list[rs.LeaseBackend] = []

    def add_lease(self, lease: rs.LeaseBackend) -> None:
        self.given.append(lease)
        self.inner.add_lease(lease)

    def save(
        self, key: Key, state: Any, *, term: int | None = None, name: str = "default"
    ) -> Snapshot:
        return self.inner.save(key, state, term=term, name=name)


@pytest.fixture
def lease_leaders() -> Iterator[Callable[..., rs.LeaseLeader]]:
    made: list[rs.LeaseLeader] = []

    def make(lease: Any, handler: rs.TaskHandler | None = None, **kw: Any) -> rs.LeaseLeader:
        leader = rs.LeaseLeader(lease, handler or rs.TaskHandler(), **kw)
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


def test_the_old_names_are_the_roles_of_the_one_module() -> None:
    assert rs.LeaseBackend is roles.LeaseBackend
    assert rs.CheckpointStore is roles.CheckpointStore
    # The lease and checkpoint modules hold the values the roles exchange, and import
    # no role: the roles module imports those values, and the two did so in a circle.
    for module in (lease, checkpoints):
        assert not [name for name in module.__all__ if hasattr(roles, name)], module
    assert rs.FireClaimer is claiming.FireClaimer is roles.FireClaimer
    for name in [
        "MissedFireClaimer",
        "BatchFireClaimer",
        "BatchMissedFireClaimer",
        "CleanupClaimer",
        "FireHistory",
        "BatchFireHistory",
    ]:
        assert getattr(claiming, name) is getattr(roles, name) and name in claiming.__all__
    assert rs.TransactionFence is context.TransactionFence is roles.TransactionFence
    assert rs.Membership is roles.Membership


def test_the_memory_backends_have_the_abilities_they_had() -> None:
    memory_lease = MemoryLease(name="x")
    assert all(lease_ability(memory_lease, name) is None for name in LEASE_ABILITIES)  # type: ignore[call-overload]
    claimer = MemoryClaimer()
    assert all(claimer_ability(claimer, name) is claimer for name in CLAIMER_ABILITIES)  # type: ignore[call-overload]
    store = MemoryCheckpointStore()
    assert store_ability(store, "add_lease") is store
    assert claimer_ability(None, "cleanup") is None and store_ability(None, "add_lease") is None


def test_a_duck_typed_lease_with_an_ability_has_it() -> None:
    class Hinting:
        def handover_hinted(self) -> bool:
            return True

        def handover_requested(self) -> None:
            return None

    hinting = Hinting()
    assert lease_ability(hinting, "handover") is hinting
    assert lease_ability(hinting, "shared_schedule") is None


def test_a_base_class_default_is_no_ability_and_an_override_is_one() -> None:
    plain = BaseLease(MemoryLease(name="x"))
    assert isinstance(plain, rs.LeaseBackend)
    assert all(lease_ability(plain, name) is None for name in LEASE_ABILITIES)  # type: ignore[call-overload]
    # The old protocols see the inherited defaults: ask the helper, not isinstance().
    assert isinstance(plain, roles.SupportsHandover)
    handing = HandingOverLease(MemoryLease(name="x"))
    assert lease_ability(handing, "handover") is handing
    assert lease_ability(handing, "non_blocking") is None

    counting = CountingClaimer()
    assert isinstance(counting, rs.FireClaimer)
    assert all(claimer_ability(counting, name) is None for name in CLAIMER_ABILITIES)  # type: ignore[call-overload]
    cleaning = CleaningClaimer()
    assert claimer_ability(cleaning, "cleanup") is cleaning
    assert claimer_ability(cleaning, "claim_many") is None

    assert isinstance(DictStore(), rs.CheckpointStore)
    assert store_ability(DictStore(), "add_lease") is None
    fencing = FencingStore()
    assert store_ability(fencing, "add_lease") is fencing


def test_an_unknown_ability_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no such ability 'teleport'"):
        lease_ability(MemoryLease(name="x"), "teleport")  # type: ignore[call-overload]


def test_a_base_class_requires_its_abstract_members() -> None:
    class NoClaim(ClaimerBase):
        ttl = 1.0

    with pytest.raises(TypeError, match="claim"):
        NoClaim()  # type: ignore[abstract]


def test_the_claimer_defaults_do_what_the_leader_does_without_the_ability() -> None:
    claimer = CountingClaimer()
    claimer.held.add("t@2")
    assert claimer.claim_missed(["t@1", "t@2", "t@3", "t@4"]) == ["t@3", "t@4"]
    assert claimer.claim_many(["a", "b", "t@4"]) == {"a", "b"}
    assert claimer.claim_missed_many([["u@1"], ["v@1", "a"]]) == [["u@1"], []]
    assert claimer.cleanup() == 0
    assert claimer.ran_before("x@") is True
    assert claimer.ran_before_many(["x@", "y@"]) == {"x@", "y@"}


def test_a_claimer_on_the_base_is_claimed_through_fire_by_fire() -> None:
    claimer = CountingClaimer()
    claims = LeaseClaims(claimer, "billing")
    won, failed = claims.claim_each(["a", "b"], term=1)
    assert (won, failed) == ({"a", "b"}, {})
    assert claimer.calls == 2 and claimer.held == {"billing/a", "billing/b"}
    assert claims.claim_missed(["a", "c"], term=1) == ["c"]
    assert claims.cleanup() == 0 and claims.ran_before("x@") is True
    assert LeaseClaims(CleaningClaimer(), "billing").cleanup() == 7


def test_a_lease_on_the_base_leads_through_the_blocking_adapter(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    handler = rs.TaskHandler()
    ran: list[int] = []

    @handler.persistent("work", restart="never")
    def work(ctx: rs.TaskContext) -> None:
        ran.append(ctx.term)
        ctx.cancelled.wait(10)

    leader = lease_leaders(
        BaseLease(MemoryLease(name="roles", ttl=3.0)),
        handler,
        renew_interval=0.2,
        renew_deadline=1.0,
        retry_interval=0.2,
    )
    leader.start()
    wait_until(lambda: leader.is_leader and ran, what="the leader to lead and run its task")
    assert ran == [leader.term]


def test_a_store_on_the_base_is_given_the_lease_only_when_it_fences() -> None:
    with pytest.raises(rs.ConfigError, match="add_lease"):
        rs.SingleNodeLeader(rs.TaskHandler(), checkpoint_store=DictStore())
    fencing = FencingStore()
    leader = rs.SingleNodeLeader(rs.TaskHandler(), checkpoint_store=fencing)
    assert fencing.given == [leader.lease]


def test_the_postgres_and_redis_memberships_play_the_membership_role() -> None:
    # Built without a server: neither connects before start().
    postgres = PostgresMembership(
        "postgresql://nobody@127.0.0.1:1/none",
        name="jobs",
        node_id="n1",
        table="rselection_nodes",
        lease_table="rselection_leases",
        heartbeat_interval=1.0,
        node_timeout=3.0,
        create_tables=False,
    )
    client = redis.Redis(port=1)
    red = RedisMembership(
        client, name="jobs", node_id="n1", lease_key="k", heartbeat_interval=1.0, node_timeout=3.0
    )
    try:
        assert isinstance(postgres, rs.Membership) and isinstance(red, rs.Membership)
    finally:
        postgres.stop()
        red.stop()
        client.close()


class TestLeaseBase(LeaderConformance):
    """The leader conformance suite over a lease written on :class:`LeaseBase`."""

    @pytest.fixture(autouse=True)
    def leases(self) -> None:
        self.shared: dict[str, MemoryLease] = {}

    def make_lease(self, name: str) -> rs.LeaseBackend:
        shared = self.shared.setdefault(name, MemoryLease(name=name, ttl=self.timings.ttl))
        return BaseLease(shared)
