"""Handover on request (``rselection resign``), the lease_renewed signal, and the lease
table's upgrade from schema version 1 to the current one.

Fleet tests run real node processes (``python -m rselection.commands.demo_fleet``) that write
fenced rows to a ledger; each ends by checking that no row of an older term landed after
a row of a newer one.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.commands.demo_fleet import Fleet
from rselection.postgres import migrate
from rselection.postgres.leader import PostgresLeader
from rselection.postgres.lease import PostgresLease, cancel_handover, request_handover
from rselection.postgres.schema import LEASES_VERSION
from tests.support import ledger
from tests.support.resign_cli import cli, elected, seen_or_wait, took_ms
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}

#: The lease table as schema version 1 created it (before the handover columns).
V1_LEASES = """
CREATE TABLE rselection_leases (
    name text PRIMARY KEY,
    holder text NULL,
    term bigint NOT NULL DEFAULT 0 CHECK (term >= 0),
    holder_pid integer NULL,
    lock_key integer NOT NULL,
    acquired_at timestamptz NULL,
    renewed_at timestamptz NULL,
    expires_at timestamptz NULL)
"""
V1_VERSIONS = """
CREATE TABLE rselection_schema_version (
    component text PRIMARY KEY,
    version integer NOT NULL,
    migrated_at timestamptz NOT NULL DEFAULT now());
INSERT INTO rselection_schema_version (component, version) VALUES ('leases', 1)
"""


def wait_for_heartbeats(dsn: str, lease: str, count: int) -> None:
    def seen() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                row = conn.execute(
                    "SELECT count(*) FROM rselection_nodes WHERE name = %s", (lease,)
                ).fetchone()
            except psycopg.errors.UndefinedTable:
                return False  # the first heartbeat creates it
        return row is not None and row[0] >= count

    wait_until(seen, 15, f"{count} heartbeats", interval=0.1)


def lease_row(dsn: str, name: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT holder, term, resign_term, resign_to FROM rselection_leases WHERE name = %s",
            (name,),
        ).fetchone()


@pytest.fixture
def fleet3(pg_dsn: str) -> Iterator[tuple[Fleet, dict[str, Any]]]:
    """Three node processes at the default timings (renewals every 2 s): a fast
    handover can only come from the notification, not from a renewal falling due."""
    fleet = Fleet(pg_dsn, f"r-{uuid.uuid4().hex[:6]}", ["--ttl", "15"])
    with fleet:
        first = fleet.start(3)
        wait_for_heartbeats(pg_dsn, fleet.name, 3)
        yield fleet, first
    assert ledger.overlaps(pg_dsn) == 0
    assert all(len(nodes) == 1 for nodes in ledger.terms(pg_dsn).values())


# --------------------------------------------------------------------- resign, fleet


def test_resign_hands_over_to_another_node_well_under_a_second(
    pg_dsn: str, fleet3: tuple[Fleet, dict[str, Any]]
) -> None:
    fleet, current = fleet3
    figures = []
    for _ in range(5):
        out = cli("resign", fleet.name, "--dsn", pg_dsn)
        assert out.returncode == 0, out.stdout + out.stderr
        figures.append(took_ms(out.stdout))
        heir = elected(fleet, 10, exclude=current["node"])
        assert heir["term"] == current["term"] + 1
        assert f"{heir['node']} leads {fleet.name!r} now with term {heir['term']}" in out.stdout
        demoted = seen_or_wait(fleet, 10, ev="demoted", node=current["node"], term=current["term"])
        assert demoted is not None and demoted["reason"] == "handover"
        current = heir
    print(
        f"resign handover: median {statistics.median(figures):.0f} ms, "
        f"max {max(figures):.0f} ms over {len(figures)} rounds (renew_interval 2 s)"
    )
    assert max(figures) < 1000


def test_resign_to_picks_the_named_node(pg_dsn: str, fleet3: tuple[Fleet, dict[str, Any]]) -> None:
    fleet, current = fleet3
    # Three rounds, each to a follower picked in turn: luck would pass all three only
    # one time in eight.
    for _ in range(3):
        target = sorted(set(fleet.procs) - {current["node"]})[0]
        out = cli("resign", fleet.name, "--dsn", pg_dsn, "--to", target)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"{target} leads {fleet.name!r} now" in out.stdout
        heir = elected(fleet, 10, exclude=current["node"])
        assert heir["node"] == target and heir["term"] == current["term"] + 1
        print(f"resign --to {target}: {took_ms(out.stdout):.0f} ms")
        current = heir
    row = lease_row(pg_dsn, fleet.name)
    assert row is not None and row[0] == current["node"]
    assert row[2:] == (None, None)  # the acquisition cleared the request


def test_resign_to_a_node_that_is_not_live_fails_clearly(
    pg_dsn: str, fleet3: tuple[Fleet, dict[str, Any]]
) -> None:
    fleet, current = fleet3
    out = cli("resign", fleet.name, "--dsn", pg_dsn, "--to", "no-such-node")
    assert out.returncode == 1
    assert "no-such-node is not a live node" in out.stderr
    assert "live followers:" in out.stderr
    same = cli("resign", fleet.name, "--dsn", pg_dsn, "--to", current["node"])
    assert same.returncode == 0 and "already leads" in same.stdout
    row = lease_row(pg_dsn, fleet.name)
    assert row is not None and row[:2] == (current["node"], current["term"])
    assert row[2] is None  # nothing was requested


# --------------------------------------------------------------------- resign, edges


def test_resign_times_out_when_no_leader_process_exists(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
        # A row that says "ghost holds term 4 for a minute", but no process behind it.
        conn.execute(
            "INSERT INTO rselection_leases (name, holder, term, lock_key, acquired_at,"
            " renewed_at, expires_at) VALUES ('ghost', 'ghost-node', 4, 1, now(), now(),"
            " now() + interval '60 seconds')"
        )
    began = time.monotonic()
    out = cli("resign", "ghost", "--dsn", pg_dsn, "--timeout", "1")
    waited = time.monotonic() - began
    assert out.returncode == 1
    assert "no new term within 1s" in out.stderr
    assert "ghost-node did not hand 'ghost' over" in out.stderr
    assert waited < 15  # 1 s plus interpreter start-up, with a wide margin
    assert lease_row(pg_dsn, "ghost") == ("ghost-node", 4, None, None)  # withdrawn


def test_resign_without_a_holder_fails_at_once(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute(
            "INSERT INTO rselection_leases (name, holder, term, lock_key)"
            " VALUES ('idle', NULL, 3, 1)"
        )
    out = cli("resign", "idle", "--dsn", pg_dsn, "--timeout", "30")
    assert out.returncode == 1
    assert "has no leader" in out.stderr
    missing = cli("resign", "idle", "--dsn", pg_dsn, "--table", "nope")
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    closed = cli("resign", "idle", "--dsn", "postgresql://u:hunter2@127.0.0.1:1/x")
    assert closed.returncode == 2
    assert "hunter2" not in closed.stdout + closed.stderr


def test_resign_of_a_lone_leader_is_refused(pg_dsn: str) -> None:
    name = f"lone-{uuid.uuid4().hex[:6]}"
    leader = PostgresLeader(pg_dsn, rs.TaskHandler(), name=name, node_id="lone", **FAST)
    leader.start()
    try:
        assert leader.wait_until_leader(10)
        wait_for_heartbeats(pg_dsn, name, 1)
        out = cli("resign", name, "--dsn", pg_dsn)
        assert out.returncode == 1
        assert "no other live node" in out.stderr
        assert leader.is_leader
    finally:
        leader.stop(timeout=10)


# --------------------------------------------------------------- the lease, directly


@pytest.fixture
def make_lease(pg_dsn: str) -> Iterator[Callable[..., PostgresLease]]:
    made: list[PostgresLease] = []

    def make(**kw: Any) -> PostgresLease:
        lease = PostgresLease(pg_dsn, **{"name": "direct", "ttl": 3.0, "renew_deadline": 2.0, **kw})
        lease.connect()
        made.append(lease)
        return lease

    yield make
    for lease in made:
        lease.close()


def test_a_request_reserves_the_lease_for_the_named_node_until_its_timeout_ends(
    pg_dsn: str, make_lease: Callable[..., PostgresLease]
) -> None:
    a, b, c = make_lease(), make_lease(), make_lease()
    first = a.try_acquire("A")
    assert first.acquired and first.holder is not None
    term = first.holder.term
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        asked = request_handover(conn, "direct", to="C", timeout=1.0)
    assert asked is not None and (asked.node_id, asked.term) == ("A", term)
    assert a.renew("A", term)
    request = a.handover_requested()
    assert request is not None and request.term == term and request.to == "C"
    assert 0 < request.timeout <= 1.0
    assert a.handover_requested() is None  # reported once
    a.release("A", term)

    held_back = b.try_acquire("B")
    assert not held_back.acquired and held_back.holder is None
    assert 0 < held_back.expires_in <= 1.0  # how long the reservation lasts
    taken = c.try_acquire("C")
    assert taken.acquired and taken.holder is not None and taken.holder.term == term + 1
    row = lease_row(pg_dsn, "direct")
    assert row == ("C", term + 1, None, None)  # the acquisition cleared the request

    # A reservation nobody uses ends with its timeout.
    c.release("C", term + 1)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE rselection_leases SET resign_term = term, resign_to = 'C',"
            " resign_until = clock_timestamp() + interval '0.5 seconds' WHERE name = 'direct'"
        )
    assert not b.try_acquire("B").acquired
    time.sleep(0.6)
    assert b.try_acquire("B").acquired


def test_without_a_named_node_only_the_old_holder_is_kept_out(
    pg_dsn: str, make_lease: Callable[..., PostgresLease]
) -> None:
    a, b = make_lease(), make_lease()
    first = a.try_acquire("A")
    assert first.holder is not None
    term = first.holder.term
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert request_handover(conn, "direct", timeout=5.0) is not None
    assert a.renew("A", term)
    request = a.handover_requested()
    assert request is not None and request.to is None
    a.release("A", term)
    again = a.try_acquire("A")
    assert not again.acquired and again.holder is None and again.expires_in > 0
    assert b.try_acquire("B").acquired
    assert lease_row(pg_dsn, "direct") == ("B", term + 1, None, None)


def test_a_request_for_another_term_is_ignored(
    pg_dsn: str, make_lease: Callable[..., PostgresLease]
) -> None:
    a = make_lease()
    got = a.try_acquire("A")
    assert got.holder is not None
    term = got.holder.term
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE rselection_leases SET resign_term = term - 1,"
            " resign_until = clock_timestamp() + interval '10 seconds' WHERE name = 'direct'"
        )
        assert a.renew("A", term) and a.handover_requested() is None
        asked = request_handover(conn, "direct", timeout=10)
        assert asked is not None
        assert cancel_handover(conn, "direct", term)
        assert a.renew("A", term) and a.handover_requested() is None  # withdrawn
        conn.execute(
            "UPDATE rselection_leases SET resign_term = term,"
            " resign_until = clock_timestamp() - interval '1 second' WHERE name = 'direct'"
        )
        assert a.renew("A", term) and a.handover_requested() is None  # lapsed


# ------------------------------------------------------------- lease_renewed signal


def test_lease_renewed_is_sent_after_each_renewal(pg_dsn: str) -> None:
    name = f"sig-{uuid.uuid4().hex[:6]}"
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()

    def record(sender: object, **kw: Any) -> None:
        if kw["name"] == name:
            with lock:
                seen.append(kw)

    def explode(sender: object, **kw: Any) -> None:
        raise RuntimeError("a broken receiver")

    rs.signals.lease_renewed.connect(explode)  # first: must not keep the others from running
    rs.signals.lease_renewed.connect(record)
    options = {**FAST, "renew_interval": 0.2}
    leader = PostgresLeader(pg_dsn, rs.TaskHandler(), name=name, node_id="sig", **options)
    try:
        leader.start()
        assert leader.wait_until_leader(10)
        wait_until(lambda: len(seen) >= 5, 10, "five renewals")
        assert leader.is_leader  # the raising receiver did not cost the lease
        term = leader.term
        with lock:
            events = list(seen)
        for event in events:
            assert set(event) == {"name", "term", "latency", "remaining"}
            assert event["term"] == term
            assert 0 <= event["latency"] < 1.0
            # remaining is the leader's own deadline: renew_deadline after sending.
            assert event["remaining"] + event["latency"] == pytest.approx(2.0, abs=1e-6)
        median = statistics.median(e["latency"] for e in events)
        print(f"renewal latency: median {median * 1000:.1f} ms")
    finally:
        rs.signals.lease_renewed.disconnect(record)
        rs.signals.lease_renewed.disconnect(explode)
        leader.stop(timeout=10)


# ------------------------------------------------------------------ schema upgrade


def make_v1_table(dsn: str, name: str = "old", term: int = 7) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(V1_LEASES)
        conn.execute(V1_VERSIONS)
        conn.execute(
            "INSERT INTO rselection_leases (name, holder, term, lock_key) VALUES (%s, NULL, %s, 1)",
            (name, term),
        )


def versions(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT component, version FROM rselection_schema_version").fetchall()
    return {component: version for component, version in rows}


def test_migrate_upgrades_a_version_1_lease_table(pg_dsn: str) -> None:
    make_v1_table(pg_dsn)
    out = cli("migrate", "--dsn", pg_dsn)
    assert out.returncode == 0, out.stderr
    upgraded = f"lease table 'rselection_leases': upgraded (schema version 1 -> {LEASES_VERSION})"
    assert upgraded in out.stdout
    assert "nodes table 'rselection_nodes': created (schema version 1)" in out.stdout
    assert versions(pg_dsn)["leases"] == LEASES_VERSION == 4
    assert lease_row(pg_dsn, "old") == (None, 7, None, None)  # the row was kept
    again = cli("migrate", "--dsn", pg_dsn)
    assert again.returncode == 0, again.stderr
    present = f"lease table 'rselection_leases': already present (schema version {LEASES_VERSION})"
    assert present in again.stdout
    assert "created" not in again.stdout and "upgraded" not in again.stdout


def test_a_leader_with_create_tables_upgrades_a_version_1_table_and_can_resign(
    pg_dsn: str,
) -> None:
    make_v1_table(pg_dsn)
    leaders = [
        PostgresLeader(pg_dsn, rs.TaskHandler(), name="old", node_id=f"up-{i}", **FAST)
        for i in range(2)
    ]
    try:
        for leader in leaders:
            leader.start()
        wait_until(lambda: any(x.is_leader for x in leaders), 10, "a leader")
        first = next(x for x in leaders if x.is_leader)
        assert first.term == 8  # the old row's term 7 was kept and continued
        assert versions(pg_dsn)["leases"] == LEASES_VERSION
        wait_for_heartbeats(pg_dsn, "old", 2)
        out = cli("resign", "old", "--dsn", pg_dsn)
        assert out.returncode == 0, out.stdout + out.stderr
        other = next(x for x in leaders if x is not first)
        wait_until(lambda: other.is_leader, 10, "the other node to lead")
        assert other.term == 9
        print(f"resign on an upgraded table: {took_ms(out.stdout):.0f} ms")
    finally:
        for leader in leaders:
            leader.stop(timeout=10)


def test_a_version_1_table_keeps_working_without_create_tables_until_migrated(
    pg_dsn: str,
) -> None:
    make_v1_table(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, table=None)  # the other tables; the lease table stays at version 1
    leaders = [
        PostgresLeader(
            pg_dsn,
            rs.TaskHandler(),
            name="old",
            node_id=f"keep-{i}",
            create_tables=False,
            claimer=None,
            **FAST,
        )
        for i in range(2)
    ]
    try:
        for leader in leaders:
            leader.start()
        wait_until(lambda: any(x.is_leader for x in leaders), 10, "a leader on a v1 table")
        first = next(x for x in leaders if x.is_leader)
        assert first.term == 8
        wait_for_heartbeats(pg_dsn, "old", 2)
        refused = cli("resign", "old", "--dsn", pg_dsn)
        assert refused.returncode == 1
        assert "schema version 1" in refused.stderr and "rselection migrate" in refused.stderr
        # Upgrade under the running fleet: the leader keeps its lease, and the next
        # request is seen although it connected before the upgrade.
        done = cli("migrate", "--dsn", pg_dsn)
        assert done.returncode == 0, done.stderr
        assert f"upgraded (schema version 1 -> {LEASES_VERSION})" in done.stdout
        assert first.is_leader and first.term == 8
        out = cli("resign", "old", "--dsn", pg_dsn)
        assert out.returncode == 0, out.stdout + out.stderr
        other = next(x for x in leaders if x is not first)
        wait_until(lambda: other.is_leader, 10, "the other node to lead")
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
