"""One node's handle on a shared :class:`~rselection.MemoryLease`.

Leaders of one process share a memory lease to compete, but a test may replace a method
on one leader's lease object only (the conformance suite's frozen renewals, as a paused
process stops its own renewals and nobody else's). Each leader then gets a view of its
own: every call goes to the shared lease, and an attribute set on the view stays there.

The members are spelled out rather than forwarded by ``__getattr__``: from Python 3.12 a
runtime-checkable protocol looks members up statically, so a forwarding proxy would not
pass as a :class:`~rselection.LeaseBackend`.
"""

from __future__ import annotations

from collections.abc import Callable

import rselection as rs


class LeaseView:
    """A view of ``shared`` with every member of :class:`~rselection.LeaseBackend`."""

    concurrent_calls = True  # as the memory lease it views: calls may overlap a wait

    def __init__(self, shared: rs.MemoryLease) -> None:
        self._shared = shared

    @property
    def name(self) -> str:
        return self._shared.name

    @property
    def ttl(self) -> float:
        return self._shared.ttl

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

    def term_ended(self, term: int) -> None:
        self._shared.term_ended(term)

    def close(self) -> None:
        self._shared.close()


class NotifyingLeaseView(LeaseView):
    """A :class:`LeaseView` that also calls back on every change of the shared lease
    (:class:`~rselection.abc.NotifiesChanges`): its leader has no waiting thread."""

    def subscribe_changes(self, callback: Callable[[], None]) -> Callable[[], None]:
        return self._shared.subscribe_changes(callback)
