"""The leader conformance suite over the in-memory lease: every path of the one engine's
adapter of blocking leases (:mod:`rselection.blocking_lease`), with no server: a lease
its leader waits in (a thread each), and one that calls back on every change.

The suite makes one lease object per leader, as nodes would; leaders of one process
share a :class:`~rselection.MemoryLease` to compete, so each leader gets a view of its
own over the shared one (the suite's frozen renewals replace ``renew`` on that view
only, as a paused process stops its own renewals and nobody else's).
"""

from __future__ import annotations

import threading

import pytest

import rselection as rs
from rselection.testing import LeaderConformance
from tests.support.lease_view import LeaseView, NotifyingLeaseView
from tests.support.waiting import wait_until


class TestMemoryLease(LeaderConformance):
    """``LeaseLeader`` over ``MemoryLease``, each leader through a view of its own."""

    @pytest.fixture(autouse=True)
    def leases(self) -> None:
        self.shared: dict[str, rs.MemoryLease] = {}

    def make_lease(self, name: str) -> rs.LeaseBackend:
        shared = self.shared.setdefault(name, rs.MemoryLease(name=name, ttl=self.timings.ttl))
        return LeaseView(shared)


class TestNotifyingMemoryLease(TestMemoryLease):
    """The same over views that call back on every change: the leaders wait in no
    thread of their own (:class:`~rselection.abc.NotifiesChanges`)."""

    def make_lease(self, name: str) -> rs.LeaseBackend:
        shared = self.shared.setdefault(name, rs.MemoryLease(name=name, ttl=self.timings.ttl))
        return NotifyingLeaseView(shared)


def test_memory_leaders_add_no_thread_per_leader() -> None:
    # Before, each leader over a memory lease kept a thread waiting in the lease: 200
    # leaders added 207 threads (one "rselection-wait-<name>" each).
    before = threading.active_count()
    leaders = [
        rs.LeaseLeader(rs.MemoryLease(name=f"many-{i}", ttl=15.0), rs.TaskHandler(), node_id="n")
        for i in range(200)
    ]
    try:
        for leader in leaders:
            leader.start()
        wait_until(lambda: all(leader.is_leader for leader in leaders), 20, "every lease led")
        added = threading.active_count() - before
        waiting = [t.name for t in threading.enumerate() if t.name.startswith("rselection-wait")]
        assert not waiting, waiting[:3]
        assert added <= 30, f"200 memory leaders added {added} threads"
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
