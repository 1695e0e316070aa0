"""``PostgresAdmin``: the command line's reads and operations, for programs, on a real
Postgres (the command line itself: test_cli.py and test_resign.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest

import rselection as rs
from rselection.admin import LeaseStatus, Refused, StatusSnapshot
from rselection.errors import ConfigError
from rselection.postgres import PostgresAdmin, migrate
from rselection.postgres.leader import PostgresLeader
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[PostgresAdmin]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
    with PostgresAdmin(pg_dsn) as made:
        yield made


def leader(dsn: str, node_id: str, name: str = "billing") -> PostgresLeader:
    made = PostgresLeader(
        dsn, rs.TaskHandler(), name=name, node_id=node_id, heartbeat_interval=0.2, **FAST
    )
    made.start()
    return made


def lease(snapshot: StatusSnapshot, name: str) -> LeaseStatus:
    (found,) = [lease for lease in snapshot.leases if lease.name == name]
    return found


def test_a_missing_lease_table_is_named_and_reads_refuse(pg_dsn: str) -> None:
    with PostgresAdmin(pg_dsn) as admin:
        assert not admin.lease_table_exists()
        with pytest.raises(ConfigError, match="rselection migrate"):
            admin.status()
        with pytest.raises(ConfigError, match="does not exist"):
            admin.retire("billing")


def test_status_shows_the_holder_the_nodes_and_the_last_fires(
    admin: PostgresAdmin, pg_dsn: str
) -> None:
    assert admin.lease_table_exists() and admin.leases() == []
    fleet = [leader(pg_dsn, "a")]
    try:
        assert fleet[0].wait_until_leader(10)
        fleet.append(leader(pg_dsn, "b"))
        wait_until(lambda: len(admin.nodes("billing") or []) == 2, 10, "both heartbeats")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO rselection_claims"
                " (fire_key, format_version, holder, term, claimed_at, expires_at) VALUES"
                " ('billing/tick@2026-11-30T04:45:00.000000000Z', 1, 'a', 1, now(), now()),"
                " ('billing/tick@2026-11-30T04:46:00.000000000Z', 1, 'a', 1, now(), now())"
            )
        snapshot = admin.status()
    finally:
        for each in fleet:
            each.stop(timeout=10)
    assert snapshot.checked_at.tzinfo is not None
    found = lease(snapshot, "billing")
    assert (found.holder, found.live, found.retired) == ("a", True, False)
    assert found.term is not None and found.term >= 1
    assert found.expires_in is not None and 0 < found.expires_in <= FAST["ttl"]
    assert found.acquired_at is not None and found.acquired_at <= snapshot.checked_at
    assert snapshot.handovers == ()
    assert snapshot.nodes is not None
    assert {(n.node_id, n.is_leader, n.alive) for n in snapshot.nodes} == {
        ("a", True, True),
        ("b", False, True),
    }
    assert snapshot.fires is not None
    (fire,) = snapshot.fires
    assert (fire.lease, fire.task, fire.fire, fire.node) == (
        "billing",
        "tick",
        "2026-11-30T04:46:00.000000000Z",
        "a",
    )
    assert admin.leases() == ["billing"] and admin.exists("billing")
    assert not admin.exists("nope")
    # After a graceful stop: no holder, no nodes left.
    after = admin.status(["billing"])
    assert not lease(after, "billing").live and lease(after, "billing").holder is None
    assert after.nodes == ()
    assert admin.live_nodes("billing") == []


def test_named_status_keeps_the_shards_of_each_name(admin: PostgresAdmin, pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO rselection_leases (name, term, lock_key)"
            " SELECT n, 1, 0 FROM unnest(%s::text[]) AS n",
            (["p", "p/0", "p/1", "pq", "q"],),
        )
    assert [x.name for x in admin.status(["p"]).leases] == ["p", "p/0", "p/1"]
    assert [x.name for x in admin.status(["nope"]).leases] == []
    assert [x.name for x in admin.status().leases] == ["p", "p/0", "p/1", "pq", "q"]


def test_a_handover_request_shows_in_status_until_withdrawn(
    admin: PostgresAdmin, pg_dsn: str
) -> None:
    first = leader(pg_dsn, "a")
    try:
        assert first.wait_until_leader(10)
        asked = admin.request_handover("billing", to="elsewhere", valid_for=30)
        assert asked is not None and asked.node_id == "a"
        pending = admin.status().handovers
        assert pending is not None
        (request,) = pending
        assert (request.lease, request.term, request.node_id, request.to) == (
            "billing",
            asked.term,
            "a",
            "elsewhere",
        )
        assert 0 < request.expires_in <= 30 and request.until > datetime.now(UTC)
        assert admin.cancel_handover("billing", asked.term)
        assert not admin.cancel_handover("billing", asked.term)
        wait_until(lambda: admin.status().handovers == (), 10, "the request gone")
    finally:
        first.stop(timeout=10)


def test_watch_terms_sees_the_takeover_a_request_asked_for(
    admin: PostgresAdmin, pg_dsn: str
) -> None:
    fleet = [leader(pg_dsn, "a")]
    try:
        assert fleet[0].wait_until_leader(10)
        fleet.append(leader(pg_dsn, "b"))
        wait_until(lambda: admin.live_nodes("billing") == ["a", "b"], 10, "both heartbeats")
        with admin.watch_terms("billing") as watch:
            asked = admin.request_handover("billing", to="b")
            assert asked is not None and asked.node_id == "a"
            new = watch.wait(asked.term, 15)
        assert new is not None and (new.node_id, new.term > asked.term) == ("b", True)
        current = admin.current_holder("billing")
        assert current is not None and current.node_id == "b"
        with admin.watch_terms("billing") as watch:
            assert watch.wait(new.term, 0.3) is None  # nobody asked: the term stays
    finally:
        for each in fleet:
            each.stop(timeout=10)


def test_a_watch_on_a_connection_passed_in_listens_on_it(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
        admin = PostgresAdmin(conn)
        fleet = [leader(pg_dsn, "a")]
        try:
            assert fleet[0].wait_until_leader(10)
            fleet.append(leader(pg_dsn, "b"))
            wait_until(lambda: len(admin.live_nodes("billing") or []) == 2, 10, "heartbeats")
            with admin.watch_terms("billing") as watch:
                asked = admin.request_handover("billing")
                assert asked is not None
                new = watch.wait(asked.term, 15)
            assert new is not None and new.node_id == "b"
        finally:
            for each in fleet:
                each.stop(timeout=10)
        admin.close()
        assert not conn.closed  # the caller's connection stays open


def test_retire_refuses_a_live_lease_then_marks_it_and_a_new_term_revives_it(
    admin: PostgresAdmin, pg_dsn: str
) -> None:
    with pytest.raises(Refused, match="no lease 'billing'"):
        admin.retire("billing")
    first = leader(pg_dsn, "a")
    try:
        assert first.wait_until_leader(10)
        with pytest.raises(Refused, match="has a live holder: a leads term"):
            admin.retire("billing")
    finally:
        first.stop(timeout=10)
    done = admin.retire("billing")
    assert (done.name, done.already) == ("billing", False) and "retired_term" in done.marker
    again = admin.retire("billing")
    assert (again.term, again.already) == (done.term, True)
    assert lease(admin.status(), "billing").retired
    second = leader(pg_dsn, "b")
    try:
        assert second.wait_until_leader(10)
        revived = lease(admin.status(), "billing")
        assert not revived.retired and revived.term is not None and revived.term > done.term
    finally:
        second.stop(timeout=10)


def test_retire_refuses_while_a_node_heartbeats_unless_told_not_to_check(
    admin: PostgresAdmin, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO rselection_leases (name, term, lock_key) VALUES ('old', 3, 0)")
        conn.execute(
            "INSERT INTO rselection_nodes (name, node_id, hostname, pid, started_at, last_seen)"
            " VALUES ('old', 'n1', 'h', 1, now(), now())"
        )
    with pytest.raises(Refused, match=r"still has live nodes \(seen within 15s"):
        admin.retire("old")
    assert admin.retire("old", check_nodes=False).term == 3
