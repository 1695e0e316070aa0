"""Which notifications wake a ``PostgresLease`` follower, without a server: the
shared keeper hands the lease its channel's events and the ring's deaths, and the lease
decides from what it last saw of the holder."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from rselection.postgres._lease_sql import LEASE_PROTOCOL
from rselection.postgres.lease import PostgresLease

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def state_row(holder: str, term: int, pid: int) -> tuple[Any, ...]:
    """An attempt's state row (``STATE_COLUMNS``) of a lease ``holder`` holds."""
    return ("l", holder, term, 7, T0, T0 + timedelta(seconds=15), 15.0, True, 0.0,
            LEASE_PROTOCOL, False, pid)  # fmt: skip


def acquired(node: str, term: int, pid: int) -> dict[str, Any]:
    return {
        "event": "acquired",
        "name": "l",
        "node_id": node,
        "term": term,
        "acquired_at": T0.isoformat(),
        "expires_at": (T0 + timedelta(seconds=15)).isoformat(),
        "holder_pid": pid,
    }


def woken_by_death(lease: PostgresLease, pid: int) -> bool:
    lease._wake.clear()
    lease.holder_died(pid)
    return lease._wake.is_set()


def test_a_death_wakes_only_the_followers_of_the_dead_session() -> None:
    lease = PostgresLease("postgresql://nowhere/db", name="l")
    assert woken_by_death(lease, 111)  # the holder is not known yet: attempt
    lease._acquisition(state_row("a", 5, 111), acquired=False)
    assert not woken_by_death(lease, 222)
    assert woken_by_death(lease, 111)


def test_a_row_read_before_a_newer_acquisitions_notification_does_not_replace_it() -> None:
    # Found by review: the notification of b's acquisition (term 6) can be handled while
    # this follower's attempt, which read a's row (term 5), is still in flight; its
    # answer must not make the follower believe the holder's session is a's again (b's
    # death would then go unnoticed until the lease expires).
    lease = PostgresLease("postgresql://nowhere/db", name="l")
    lease.notified(acquired("b", 6, 222), own_session=False)
    lease._acquisition(state_row("a", 5, 111), acquired=False)
    assert woken_by_death(lease, 222)
    assert not woken_by_death(lease, 111)


def test_a_release_forgets_the_holder_and_a_stale_row_does_not_bring_it_back() -> None:
    lease = PostgresLease("postgresql://nowhere/db", name="l")
    lease._acquisition(state_row("a", 5, 111), acquired=False)
    lease.notified({"event": "released", "name": "l", "node_id": "a", "term": 5}, own_session=False)
    lease._acquisition(state_row("a", 5, 111), acquired=False)  # read before the release
    assert woken_by_death(lease, 999)  # free: any death may matter
