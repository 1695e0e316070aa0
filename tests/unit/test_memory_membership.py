"""MemoryMembership: the membership role in process memory, with the rules of the
Postgres and Redis memberships (heartbeats, a node timeout, leaving on stop)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from tests.support.waiting import wait_until


@pytest.fixture
def memberships() -> Iterator[Callable[..., rs.MemoryMembership]]:
    made: list[rs.MemoryMembership] = []

    def make(lease: rs.LeaseBackend, node_id: str, **kw: Any) -> rs.MemoryMembership:
        membership = rs.MemoryMembership(lease, node_id, **kw)
        made.append(membership)
        return membership

    yield make
    for membership in made:
        membership.stop()


def heartbeat_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rselection-membership")]


def test_it_plays_the_membership_role() -> None:
    assert isinstance(rs.MemoryMembership(rs.MemoryLease(name="jobs"), "n1"), rs.Membership)


def test_the_nodes_of_one_lease_list_each_other_oldest_first_with_the_leader(
    memberships: Callable[..., rs.MemoryMembership],
) -> None:
    lease = rs.MemoryLease(name="jobs")
    first, second = memberships(lease, "n1"), memberships(lease, "n2")
    assert first.nodes() == []
    first.start()
    second.start()
    assert lease.try_acquire("n2").acquired
    nodes = first.nodes()
    assert nodes == second.nodes()
    assert [n.node_id for n in nodes] == ["n1", "n2"]
    assert [(n.alive, n.is_leader) for n in nodes] == [(True, False), (True, True)]
    one = nodes[0]
    assert (one.name, one.hostname, one.pid, one.client_addr) == (
        "jobs",
        socket.gethostname(),
        os.getpid(),
        None,
    )
    assert one.started_at <= one.last_seen and one.started_at.tzinfo is not None
    other = memberships(rs.MemoryLease(name="jobs"), "n3")  # another lease object: apart
    other.start()
    assert [n.node_id for n in other.nodes()] == ["n3"]
    assert [n.node_id for n in first.nodes()] == ["n1", "n2"]


def test_a_stopped_node_leaves_and_does_not_come_back(
    memberships: Callable[..., rs.MemoryMembership],
) -> None:
    lease = rs.MemoryLease(name="jobs")
    staying, leaving = memberships(lease, "n1"), memberships(lease, "n2")
    staying.start()
    leaving.start()
    leaving.stop()
    assert leaving.stopped and [n.node_id for n in staying.nodes()] == ["n1"]
    leaving.start()  # once stopped, start does nothing
    assert [n.node_id for n in staying.nodes()] == ["n1"]
    assert heartbeat_threads() == ["rselection-membership-n1"]
    never = memberships(lease, "n3")
    never.stop()  # never started: nothing to remove, nothing to join
    assert [n.node_id for n in staying.nodes()] == ["n1"]
    staying.stop()
    assert heartbeat_threads() == [] and staying.nodes() == []


def test_a_heartbeating_node_stays_alive_and_a_silent_one_is_lost(
    memberships: Callable[..., rs.MemoryMembership],
) -> None:
    lease = rs.MemoryLease(name="jobs")
    live = memberships(lease, "live", heartbeat_interval=0.05, node_timeout=1.0)
    silent = memberships(lease, "silent", heartbeat_interval=0.05, node_timeout=1.0)
    live.start()
    silent.beat()  # one heartbeat, then none: a node whose process hangs
    started = time.monotonic()
    wait_until(
        lambda: [n.alive for n in live.nodes()] == [True, False],
        timeout=5.0,
        what="the silent node to be lost",
    )
    assert time.monotonic() - started >= 1.0  # not before its node timeout
    before = live.nodes()[0].last_seen
    wait_until(
        lambda: live.nodes()[0].last_seen > before, timeout=5.0, what="a heartbeat of the live node"
    )
    silent.beat()  # heard from again: alive
    assert [n.alive for n in live.nodes()] == [True, True]


def test_bad_arguments_are_refused() -> None:
    lease = rs.MemoryLease(name="jobs")
    with pytest.raises(rs.ConfigError, match="node_timeout"):
        rs.MemoryMembership(lease, "n1", heartbeat_interval=5.0, node_timeout=5.0)
    with pytest.raises(rs.ConfigError, match="heartbeat_interval"):
        rs.MemoryMembership(lease, "n1", heartbeat_interval=-1.0)
    with pytest.raises(rs.ConfigError, match="node_id"):
        rs.MemoryMembership(lease, "")
    with pytest.raises(rs.ConfigError, match="LeaseBackend"):
        rs.MemoryMembership(object(), "n1")  # type: ignore[arg-type]


def test_a_membership_refuses_a_misspelt_or_missing_argument_as_a_signature_would() -> None:
    from rselection.members import MembershipBase

    node: dict[str, Any] = {"name": "m", "node_id": "n1", "heartbeat_interval": 1.0}
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'eligble'"):
        MembershipBase(**node, node_timeout=5.0, eligble=False)
    with pytest.raises(TypeError, match=r"missing keyword argument 'node_timeout'"):
        MembershipBase(**node)
    assert MembershipBase(**node, node_timeout=5.0, eligible=False).eligible is False
