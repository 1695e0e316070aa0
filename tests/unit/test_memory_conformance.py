"""The leader conformance suite over the in-memory lease: every path of the one engine's
adapter of blocking leases (:mod:`rselection.blocking_lease`), with no server.

The suite makes one lease object per leader, as nodes would; leaders of one process
share a :class:`~rselection.MemoryLease` to compete, so each leader gets a view of its
own over the shared one (the suite's frozen renewals replace ``renew`` on that view
only, as a paused process stops its own renewals and nobody else's).
"""

from __future__ import annotations

import pytest

import rselection as rs
from rselection.testing import LeaderConformance
from tests.support.lease_view import LeaseView

pytestmark = pytest.mark.slow


class TestMemoryLease(LeaderConformance):
    """``LeaseLeader`` over ``MemoryLease``, each leader through a view of its own."""

    @pytest.fixture(autouse=True)
    def leases(self) -> None:
        self.shared: dict[str, rs.MemoryLease] = {}

    def make_lease(self, name: str) -> rs.LeaseBackend:
        shared = self.shared.setdefault(name, rs.MemoryLease(name, ttl=self.timings.ttl))
        return LeaseView(shared)
