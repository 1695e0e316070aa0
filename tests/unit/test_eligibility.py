"""``version=`` and ``eligible=``: what they accept, and an ineligible node never leads.

Over the memory backend: the rule lives in the one engine, so every backend follows it
(the integration tests check Postgres and Redis record both with their heartbeats).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from rselection.memory import MemoryLease
from tests.support.waiting import wait_until

FAST = {"ttl": 2.0, "renew_interval": 0.1, "renew_deadline": 1.0, "retry_interval": 0.1}


@pytest.fixture
def leaders() -> Iterator[Callable[..., rs.LeaseLeader]]:
    made: list[rs.LeaseLeader] = []

    def make(lease: MemoryLease, node_id: str, **kw: Any) -> rs.LeaseLeader:
        handler = kw.pop("handler", rs.TaskHandler())
        leader = rs.LeaseLeader(lease, handler, node_id=node_id, **FAST, **kw)
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


@pytest.mark.parametrize("version", ["1.4.2", "2.0rc1", "2024.6.1", "1!1.0", "1.0.post2.dev3"])
def test_a_pep_440_version_is_kept_as_given(
    leaders: Callable[..., rs.LeaseLeader], version: str
) -> None:
    leader = leaders(MemoryLease(name="jobs", ttl=2.0), "a", version=version)
    assert leader.version == version and leader.eligible is True
    (node,) = leader.nodes()
    assert node.version == version and node.eligible is True


@pytest.mark.parametrize(
    ("version", "says"),
    [
        ("latest", "'latest' is not a PEP 440 version"),
        ("", "'' is not a PEP 440 version"),
        (2, "version must be a string or None, got int"),
        ("1." + "0." * 60 + "0", "at most 100 characters"),
    ],
)
def test_a_version_that_cannot_be_compared_is_refused_at_construction(
    version: object, says: str
) -> None:
    with pytest.raises(rs.ConfigError, match=says):
        rs.LeaseLeader(MemoryLease(name="jobs"), rs.TaskHandler(), version=version)  # type: ignore[arg-type]


def test_eligible_must_be_a_bool() -> None:
    with pytest.raises(rs.ConfigError, match="eligible must be True or False, got 'no'"):
        rs.LeaseLeader(MemoryLease(name="jobs"), rs.TaskHandler(), eligible="no")  # type: ignore[arg-type]


def test_an_ineligible_node_never_leads_even_when_nobody_else_does(
    leaders: Callable[..., rs.LeaseLeader],
) -> None:
    lease = MemoryLease(name="jobs", ttl=2.0)
    ran: list[str] = []

    def handler() -> rs.TaskHandler:
        tasks = rs.TaskHandler()

        @tasks.persistent(name="work")
        def work(ctx: rs.TaskContext) -> None:
            ran.append(ctx.node_id)
            ctx.cancelled.wait()

        return tasks

    canary = leaders(lease, "canary", handler=handler(), eligible=False, version="2.0")
    main = leaders(lease, "main", handler=handler())
    canary.start()
    main.start()
    assert main.wait_until_leader(10)
    main.stop(timeout=10)
    # Free now, and the canary's follower is woken by the release: it still does not
    # attempt. Several retry intervals (0.1 s) must pass with the lease unheld.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert not canary.is_leader
        assert lease.current() is None
        time.sleep(0.02)
    assert ran == ["main"]
    assert canary.leader() is None
    (node,) = canary.nodes()
    assert node.eligible is False and node.version == "2.0"


def test_an_ineligible_node_does_not_take_over_an_expired_lease(
    leaders: Callable[..., rs.LeaseLeader],
) -> None:
    lease = MemoryLease(name="jobs", ttl=2.0)
    taken = threading.Event()
    canary = leaders(lease, "canary", eligible=False)
    canary.start()
    # Another node took the lease and died without a release: the lease expires.
    assert lease.try_acquire("gone").acquired
    wait_until(lambda: lease.current() is None, 10, "the dead holder's lease to expire")
    end = time.monotonic() + 1.0
    while time.monotonic() < end and not taken.is_set():
        if canary.is_leader:
            taken.set()
        time.sleep(0.02)
    assert not taken.is_set() and lease.current() is None


def test_a_memory_membership_records_version_and_eligibility() -> None:
    lease = MemoryLease(name="jobs")
    a = rs.MemoryMembership(lease, "a", version="1.0", heartbeat_interval=0.5, node_timeout=2.0)
    b = rs.MemoryMembership(lease, "b", eligible=False, heartbeat_interval=0.5, node_timeout=2.0)
    a.beat()
    b.beat()
    seen = {n.node_id: (n.version, n.eligible) for n in a.nodes()}
    assert seen == {"a": ("1.0", True), "b": (None, False)}
    with pytest.raises(rs.ConfigError, match="not a PEP 440 version"):
        rs.MemoryMembership(lease, "c", version="v-next")
