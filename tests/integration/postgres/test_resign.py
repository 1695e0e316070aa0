"""Handover on request with a Postgres lease, what only Postgres has: the lease table
(``--table``, a request row of another term), the lease_renewed signal, and the lease
table's upgrade from schema version 1 to the current one. What handover on request
promises on every backend runs in ``tests/integration/conformance/test_resign.py``.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.errors import ConfigError
from rselection.postgres import migrate
from rselection.postgres.handover import (
    cancel_handover,
    current_holder,
    request_handover,
    request_handovers,
)
from rselection.postgres.leader import PostgresLeader
from rselection.postgres.lease import PostgresLease
from rselection.postgres.schema import LEASES_VERSION
from tests.support.resign_cli import cli, took_ms
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


# ---------------------------------------------------------------------------- resign


def test_resign_on_a_missing_lease_table_says_so(pg_dsn: str) -> None:
    missing = cli("resign", "idle", "--dsn", pg_dsn, "--table", "nope")
    assert missing.returncode == 1 and "does not exist" in missing.stderr


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


def test_the_handover_functions_take_a_connection_or_a_pool_as_conninfo(
    pg_dsn: str, make_lease: Callable[..., PostgresLease]
) -> None:
    class Pool:
        """A duck-typed pool: lends one non-autocommit connection, commits after."""

        def __init__(self) -> None:
            self.conn = psycopg.connect(pg_dsn)
            self.lent = 0

        @contextlib.contextmanager
        def connection(self) -> Iterator[psycopg.Connection[Any]]:
            self.lent += 1
            yield self.conn
            self.conn.commit()

    a = make_lease()
    got = a.try_acquire("A")
    assert got.holder is not None
    term = got.holder.term
    with psycopg.connect(pg_dsn) as conn:  # not autocommit
        holder = current_holder(conn, "direct")
        assert holder is not None and (holder.node_id, holder.term) == ("A", term)
        asked = request_handover(conn, "direct", to="B", valid_for=10)
        assert asked is not None and asked.term == term
        assert a.renew("A", term)  # committed at once: the leader sees it
        request = a.handover_requested()
        assert request is not None and request.to == "B"
        assert not conn.closed  # the caller's connection stays open
    pool = Pool()
    try:
        assert cancel_handover(pool, "direct", term)
        assert pool.lent == 1 and not pool.conn.closed
    finally:
        pool.conn.close()
    with pytest.raises(rs.ConfigError, match="does not exist"):
        current_holder(pg_dsn, "direct", table="nope")


def test_a_request_wakes_the_holder_and_no_follower(
    pg_dsn: str, make_lease: Callable[..., PostgresLease]
) -> None:
    # Before, a request woke every follower, which attempted at once only to find the
    # lease held: in a sharded fleet moving hundreds of shards, those attempts took the
    # rows' locks while the holders released. Only the release wakes them now.
    a, b = make_lease(), make_lease()
    got = a.try_acquire("A")
    assert got.holder is not None
    assert not b.try_acquire("B").acquired
    b.wait_for_change(0.3)  # forget the wake of A's acquisition, if it came late
    request_handover(pg_dsn, "direct", to="B", valid_for=10)
    started = time.monotonic()
    a.wait_for_change(10)
    assert time.monotonic() - started < 5, "the holder was not woken by the request"
    started = time.monotonic()
    b.wait_for_change(1.0)
    assert time.monotonic() - started >= 0.9, "a follower was woken by the request"
    assert a.renew("A", got.holder.term)
    assert a.handover_requested() is not None
    a.release("A", got.holder.term)
    started = time.monotonic()
    b.wait_for_change(10)
    assert time.monotonic() - started < 5, "the follower was not woken by the release"
    assert b.try_acquire("B").acquired


def test_a_handover_costs_each_other_node_one_attempt(
    pg_dsn: str,
) -> None:
    # Before, the request, the release and the new holder's acquisition each woke every
    # follower, which attempted at once, and the old holder attempted just after its
    # release (2 attempts each here): in a sharded fleet moving hundreds of shards, those
    # attempts took the rows' locks and the servers' time while the target attempted.
    # Now only the new holder's acquisition wakes the others, once each (a sharded
    # leader's shards follow it without an attempt: tests/unit/test_driven_leader.py).
    timings = {"ttl": 10.0, "renew_interval": 1.0, "renew_deadline": 5.0, "retry_interval": 5.0}
    seen: dict[str, list[str | None]] = {"a": [], "b": []}

    def on_changed(sender: Any, **kw: Any) -> None:
        node = getattr(sender, "node_id", None)
        if node in seen:
            seen[node].append(kw["leader"].node_id if kw["leader"] is not None else None)

    rs.signals.leader_changed.connect(on_changed, weak=False)
    leaders = []
    try:
        for node in ("a", "b", "c"):
            leader = PostgresLeader(
                pg_dsn, rs.TaskHandler(), name="quiet", node_id=node, claimer=None, **timings
            )
            leader.start()
            leaders.append(leader)
            if node == "a":
                assert leader.wait_until_leader(10)
        a, b, c = leaders
        wait_until(lambda: seen["b"][-1:] == ["a"], 10, "b to follow a")
        attempts: dict[str, int] = {"a": 0, "b": 0}
        for leader in (a, b):
            lease = leader.lease
            assert isinstance(lease, PostgresLease)

            def counted(node_id: str, done: Any, lease: PostgresLease = lease) -> Any:
                attempts[node_id] += 1
                return PostgresLease.acquire_soon(lease, node_id, done)

            lease.acquire_soon = counted  # type: ignore[method-assign]
        request_handover(pg_dsn, "quiet", to="c", valid_for=10)
        wait_until(lambda: c.is_leader, 10, "c to lead")
        wait_until(
            lambda: seen["b"][-1:] == ["c"] and seen["a"][-1:] == ["c"], 5, "a and b to see c"
        )
        assert attempts == {"a": 1, "b": 1}
    finally:
        rs.signals.leader_changed.disconnect(on_changed)
        for leader in leaders:
            leader.stop()


def test_request_handovers_asks_many_leases_in_one_statement(pg_dsn: str) -> None:
    leases = [
        PostgresLease(pg_dsn, name=f"many{i}", ttl=10.0, renew_deadline=5.0) for i in range(5)
    ]
    try:
        terms = []
        for lease in leases[:4]:
            lease.connect()
            got = lease.try_acquire("A")
            assert got.holder is not None
            terms.append(got.holder.term)
        asked = request_handovers(
            pg_dsn,
            {"many0": "B", "many1": "C", "many2": "A", "many4": "B", "missing": "B"},
            valid_for=10,
        )
        # many2's target holds it already, many4 and "missing" are not held.
        assert sorted(asked) == ["many0", "many1"]
        assert (asked["many0"].node_id, asked["many0"].term) == ("A", terms[0])
        assert [lease_row(pg_dsn, f"many{i}")[2:] for i in range(3)] == [  # type: ignore[index]
            (terms[0], "B"),
            (terms[1], "C"),
            (None, None),
        ]
        for lease, term, to in zip(leases[:2], terms[:2], ("B", "C"), strict=True):
            assert lease.renew("A", term)
            request = lease.handover_requested()
            assert request is not None and (request.term, request.to) == (term, to)
        with pytest.raises(rs.ConfigError, match="lease name"):
            request_handovers(pg_dsn, {"": "B"})
        with pytest.raises(rs.ConfigError, match="map lease names"):
            request_handovers(pg_dsn, [("many0", "B")])  # type: ignore[arg-type]
        assert request_handovers(pg_dsn, {}) == {}
    finally:
        for lease in leases:
            lease.close()


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
    assert "nodes table 'rselection_nodes': created (schema version 3)" in out.stdout
    assert versions(pg_dsn)["leases"] == LEASES_VERSION == 5
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


def test_a_version_1_table_is_refused_without_create_tables_until_migrated(
    pg_dsn: str,
) -> None:
    """Nodes of lease protocol 2 refuse a table older than schema version 5 (nodes of an
    older release may use it) with a clear error, and lead once it is migrated."""
    make_v1_table(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, table=None)  # the other tables; the lease table stays at version 1

    def leader(i: int) -> PostgresLeader:
        return PostgresLeader(
            pg_dsn,
            rs.TaskHandler(),
            name="old",
            node_id=f"keep-{i}",
            create_tables=False,
            claimer=None,
            **FAST,
        )

    refused = leader(0)
    with pytest.raises(ConfigError, match=r"schema version 5.*rselection migrate"):
        refused.lead()
    assert not refused.is_leader
    done = cli("migrate", "--dsn", pg_dsn)
    assert done.returncode == 0, done.stderr
    assert f"upgraded (schema version 1 -> {LEASES_VERSION})" in done.stdout
    leaders = [leader(i) for i in range(1, 3)]
    try:
        for each in leaders:
            each.start()
        wait_until(lambda: any(x.is_leader for x in leaders), 10, "a leader")
        first = next(x for x in leaders if x.is_leader)
        assert first.term == 8  # the old row's term 7 was kept and continued
        wait_for_heartbeats(pg_dsn, "old", 2)
        out = cli("resign", "old", "--dsn", pg_dsn)
        assert out.returncode == 0, out.stdout + out.stderr
        other = next(x for x in leaders if x is not first)
        wait_until(lambda: other.is_leader, 10, "the other node to lead")
    finally:
        for each in leaders:
            each.stop(timeout=10)
