"""Lease backends with one defect each, for checking that the conformance suite fails them.

Each object is one node's view of a shared :class:`~rselection.MemoryLease` (one per lease
name, as a server would keep it). :class:`HonestLease` passes everything through;
each subclass breaks one rule:

- :class:`RenewNeverExtends`: ``renew()`` says ``True`` without extending, so the lease
  expires under a leader that goes on leading and another node takes it: two leaders.
- :class:`NeverExpires`: a holder's lease never expires (only a release frees it), so a
  crashed or paused leader is never replaced.
- :class:`ExpiresEarly`: the lease expires sooner than the ttl it says, so another node
  may lead before the old leader's deadline.
- :class:`TermsSkip`: correct, with terms that grow by 2 (a global revision counter, as
  etcd's): fencing tokens as good as any, which the suite must accept.
"""

from __future__ import annotations

import dataclasses
import threading

from rselection import Acquisition, LeaderInfo
from rselection.memory import MemoryLease

_shared: dict[str, MemoryLease] = {}
_lock = threading.Lock()


class HonestLease:
    """One node's view of the shared memory lease called ``name``."""

    server_ttl: float | None = None  # the shared lease's ttl, when not the declared one

    def __init__(self, name: str, ttl: float) -> None:
        with _lock:
            self.inner = _shared.setdefault(
                name, MemoryLease(name=name, ttl=self.server_ttl or ttl)
            )
        self.name, self.ttl = name, ttl

    def connect(self) -> None:
        self.inner.connect()

    def try_acquire(self, node_id: str) -> Acquisition:
        return self.inner.try_acquire(node_id)

    def renew(self, node_id: str, term: int) -> bool:
        return self.inner.renew(node_id, term)

    def release(self, node_id: str, term: int) -> None:
        self.inner.release(node_id, term)

    def current(self) -> LeaderInfo | None:
        return self.inner.current()

    def wait_for_change(self, timeout: float) -> None:
        self.inner.wait_for_change(timeout)

    def interrupt(self) -> None:
        self.inner.interrupt()

    def term_ended(self, term: int) -> None:
        pass

    def close(self) -> None:
        pass


class RenewNeverExtends(HonestLease):
    """``renew()`` answers ``True`` and extends nothing."""

    def renew(self, node_id: str, term: int) -> bool:
        return True


class NeverExpires(HonestLease):
    """Says its ttl, but a holder keeps the lease until it releases it."""

    server_ttl = 1e9


class ExpiresEarly(HonestLease):
    """Says its ttl, but the lease expires 1.5 s after a renewal (a ttl of 3 s expected)."""

    server_ttl = 1.5


class TermsSkip(HonestLease):
    """Terms 2, 4, 6, ...: strictly growing, not by one."""

    def try_acquire(self, node_id: str) -> Acquisition:
        attempt = self.inner.try_acquire(node_id)
        return dataclasses.replace(attempt, holder=self._doubled(attempt.holder))

    def renew(self, node_id: str, term: int) -> bool:
        return self.inner.renew(node_id, term // 2)

    def release(self, node_id: str, term: int) -> None:
        self.inner.release(node_id, term // 2)

    def current(self) -> LeaderInfo | None:
        return self._doubled(self.inner.current())

    @staticmethod
    def _doubled(holder: LeaderInfo | None) -> LeaderInfo | None:
        return None if holder is None else dataclasses.replace(holder, term=2 * holder.term)
