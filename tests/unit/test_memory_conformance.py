"""The leader conformance suite over the in-memory lease: every path of the one engine's
adapter of blocking leases (:mod:`rselection.blocking_lease`), with no server.

The suite makes one lease object per leader, as nodes would; leaders of one process
share a :class:`~rselection.MemoryLease` to compete, so each leader gets a view of its
own over the shared one (the suite's frozen renewals replace ``renew`` on that view
only, as a paused process stops its own renewals and nobody else's).
"""

from __future__ import annotations

from typing import Any

import pytest

import rselection as rs
from rselection.testing import LeaderConformance

pytestmark = pytest.mark.slow


class MemoryLeaseView:
    """One node's handle on a shared :class:`~rselection.MemoryLease`: every call goes to
    the shared lease, and an attribute set here stays here."""

    def __init__(self, shared: rs.MemoryLease) -> None:
        self._shared = shared

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._shared, attr)


class TestMemoryLease(LeaderConformance):
    """``LeaseLeader`` over ``MemoryLease``, each leader through a view of its own."""

    @pytest.fixture(autouse=True)
    def leases(self) -> None:
        self.shared: dict[str, rs.MemoryLease] = {}

    def make_lease(self, name: str) -> rs.LeaseBackend:
        shared = self.shared.setdefault(name, rs.MemoryLease(name, ttl=self.timings.ttl))
        view: Any = MemoryLeaseView(shared)
        return view  # type: ignore[no-any-return]
