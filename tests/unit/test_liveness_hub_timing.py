"""When the Redis liveness hub reads a lease due to expire (no server needed)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import redis

from rselection.redis import liveness
from rselection.redis.liveness import LivenessHub, reread_after


class _Lease:
    name = "l"
    key = "k"


def test_a_lease_that_expires_within_the_millisecond_is_read_again_at_once() -> None:
    # PTTL 0 is a key expiring now, not one without an expiry (-1): waiting a second
    # put a takeover off by a second.
    assert reread_after(0) == liveness._REREAD_GAP
    assert reread_after(3) == liveness._REREAD_GAP
    assert reread_after(1500) == 1.5
    assert reread_after(-1) == 1.0


def test_a_hub_whose_connection_failed_looks_at_a_lease_due_before_its_retry() -> None:
    # Without a connection the hub retries after a second; a lease due to expire
    # before that must not wait for the retry: its follower is woken to attempt.
    hub = LivenessHub(redis.Redis(host="127.0.0.1", port=1), "k", "rselection:", 1.0)
    now = time.monotonic()
    hub._retry_at = now + 1.0
    lease = _Lease()
    entry = liveness._Expiry(SimpleNamespace(value=b"v"), now + 0.2)
    hub._expiry[lease] = entry  # type: ignore[index]
    hub._expiry_heap.append((entry.due, 0, lease, entry))  # type: ignore[arg-type]
    assert hub._next_turn() == entry.due


def test_leases_due_to_expire_soon_after_the_first_due_are_read_with_it() -> None:
    # Renewals come at scattered moments, so expiries do too: reading only those due
    # made about one round trip per lease; those due within _GATHER share the first's.
    hub = LivenessHub(redis.Redis(host="127.0.0.1", port=1), "k", "rselection:", 1.0)
    now = time.monotonic()
    offsets = (-0.01, liveness._GATHER - 0.2, liveness._GATHER + 0.2)
    leases = []
    for order, offset in enumerate(offsets):
        lease = _Lease()
        entry = liveness._Expiry(SimpleNamespace(value=b"v"), now + offset)
        hub._expiry[lease] = entry  # type: ignore[index]
        hub._expiry_heap.append((entry.due, order, lease, entry))  # type: ignore[arg-type]
        leases.append(lease)
    assert hub._expiries_due(now - 0.02) == []  # none due yet: nothing is read early
    assert [lease for lease, _ in hub._expiries_due(now)] == leases[:2]
    assert [entry[2] for entry in hub._expiry_heap] == leases[2:]
