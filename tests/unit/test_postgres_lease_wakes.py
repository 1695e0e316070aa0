"""Which notifications wake a ``PostgresLease`` follower, without a server: the
shared keeper hands the lease its channel's events and the ring's deaths, and the lease
decides from what it last saw of the holder."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from rselection.postgres._lease_sql import LEASE_PROTOCOL
from rselection.postgres.lease import PostgresLease
from rselection.postgres.notices import LeaseNotice, lease_notice

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def state_row(holder: str, term: int, pid: int) -> tuple[Any, ...]:
    """An attempt's state row (``STATE_COLUMNS``) of a lease ``holder`` holds."""
    return ("l", holder, term, 7, T0, T0 + timedelta(seconds=15), 15.0, True, 0.0,
            LEASE_PROTOCOL, False, pid)  # fmt: skip


def notice(event: dict[str, Any]) -> LeaseNotice:
    read = lease_notice("rselection:public.rselection_leases:l", json.dumps(event), 1)
    assert read is not None
    return read


def acquired(node: str, term: int, pid: int) -> LeaseNotice:
    return notice(
        {
            "event": "acquired",
            "name": "l",
            "node_id": node,
            "term": term,
            "acquired_at": T0.isoformat(),
            "expires_at": (T0 + timedelta(seconds=15)).isoformat(),
            "holder_pid": pid,
        }
    )


def released(node: str, term: int) -> LeaseNotice:
    return notice({"event": "released", "name": "l", "node_id": node, "term": term})


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
    lease.notified(acquired("b", 6, 222), sender=222, own_session=False, proven=True)
    lease._acquisition(state_row("a", 5, 111), acquired=False)
    assert woken_by_death(lease, 222)
    assert not woken_by_death(lease, 111)


def test_a_release_forgets_the_holder_and_a_stale_row_does_not_bring_it_back() -> None:
    lease = PostgresLease("postgresql://nowhere/db", name="l")
    lease._acquisition(state_row("a", 5, 111), acquired=False)
    lease.notified(released("a", 5), sender=111, own_session=False, proven=True)
    lease._acquisition(state_row("a", 5, 111), acquired=False)  # read before the release
    assert woken_by_death(lease, 999)  # free: any death may matter


def test_an_unproven_acquisition_names_no_holder_and_every_death_still_counts() -> None:
    # A role that may only connect announces a holder of its own session with a term far
    # ahead: the follower must still wake when the real holder's session dies.
    lease = PostgresLease("postgresql://nowhere/db", name="l")
    lease._acquisition(state_row("a", 5, 111), acquired=False)
    lease.notified(acquired("ghost", 10**15, 666), sender=666, own_session=False, proven=False)
    assert lease.take_announced() is None
    assert woken_by_death(lease, 111)
    lease._acquisition(state_row("a", 5, 111), acquired=False)  # the row still rules
    assert not woken_by_death(lease, 666)


def test_a_proven_session_cannot_announce_another_sessions_holder() -> None:
    # A trusted peer's session names a holder only for itself: holder_pid is its own.
    lease = PostgresLease("postgresql://nowhere/db", name="l")
    lease._acquisition(state_row("a", 5, 111), acquired=False)
    lease.notified(acquired("b", 6, 222), sender=333, own_session=False, proven=True)
    assert lease.take_announced() is None
    assert woken_by_death(lease, 111)


def test_an_unproven_release_cannot_reserve_the_lease_or_forget_the_holder() -> None:
    lease = PostgresLease("postgresql://nowhere/db", name="l")
    lease._acquisition(state_row("a", 5, 111), acquired=False)
    lease._wake.clear()
    reserved = notice({"event": "released", "node_id": "a", "term": 5, "to": "other"})
    lease.notified(reserved, sender=666, own_session=False, proven=False)
    assert lease._wake.is_set()  # a wake-up: the attempt reads the reservation
    assert not woken_by_death(lease, 999)  # the holder seen is still a's session
