"""``migrate()``: every table, one version record per kind, every wait bounded.

Every test runs in a database of its own (``pg_dsn``): the migration lock is one per
database, and these tests hold it or make it wait.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from rselection.errors import BackendUnavailable, ConfigError
from rselection.postgres import migrate
from rselection.postgres.schema import LEASES_VERSION, MIGRATION_LOCK_KEY, NODES
from tests.support.waiting import wait_until

KINDS = ["leases", "claims", "elections", "nodes", "broadcast", "checkpoints", "drains"]

TABLES = {
    "rselection_leases",
    "rselection_leases_history",
    "rselection_leases_tasks",
    "rselection_leases_task_runs",
    "rselection_leases_task_triggers",
    "rselection_claims",
    "rselection_elections",
    "rselection_nodes",
    "rselection_nodes_drains",
    "rselection_broadcast",
    "rselection_broadcast_state",
    "rselection_checkpoints",
    "rselection_checkpoint_leases",
    "rselection_schema_version",
}

V1_LEASES = """
CREATE TABLE rselection_leases (
    name text PRIMARY KEY,
    holder text NULL,
    term bigint NOT NULL DEFAULT 0 CHECK (term >= 0),
    holder_pid integer NULL,
    lock_key integer NOT NULL,
    acquired_at timestamptz NULL,
    renewed_at timestamptz NULL,
    expires_at timestamptz NULL);
CREATE TABLE rselection_schema_version (
    component text PRIMARY KEY,
    version integer NOT NULL,
    migrated_at timestamptz NOT NULL DEFAULT now());
INSERT INTO rselection_schema_version (component, version) VALUES ('leases', 1)
"""


@pytest.fixture
def pg_dsn(lone_pg_dsn: str) -> str:
    """A database of the test's own: the migration lock is one per database, and these
    tests hold it (or wait for it) for seconds, which in the shared database would make
    the migrations of the other workers' tests wait as long."""
    return lone_pg_dsn


def tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        return {r[0] for r in rows.fetchall()}


def versions(dsn: str) -> dict[str, tuple[int, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT component, version, migrated_at FROM rselection_schema_version")
        return {component: (version, at) for component, version, at in rows.fetchall()}


def test_migrate_on_an_empty_schema_creates_every_table_and_a_second_run_changes_nothing(
    pg_dsn: str,
) -> None:
    assert tables(pg_dsn) == set()
    first = migrate(pg_dsn)
    assert [c.kind for c in first] == KINDS
    assert {c.action for c in first} == {"created"}
    assert all(c.previous is None for c in first)
    assert tables(pg_dsn) == TABLES  # one version table, no other record of versions
    recorded = versions(pg_dsn)
    latest = {"leases": LEASES_VERSION, "nodes": NODES.version}
    assert {k: v for k, (v, _) in recorded.items()} == {kind: latest.get(kind, 1) for kind in KINDS}
    lines = [c.describe() for c in first]
    assert f"lease table 'rselection_leases': created (schema version {LEASES_VERSION})" in lines
    assert (
        "broadcast tables 'rselection_broadcast', 'rselection_broadcast_state': "
        "created (schema version 1)"
    ) in lines

    second = migrate(pg_dsn)
    assert [(c.kind, c.action, c.previous) for c in second] == [
        (c.kind, "present", c.version) for c in first
    ]
    assert versions(pg_dsn) == recorded  # not even migrated_at moved
    assert tables(pg_dsn) == TABLES


def test_migrate_takes_a_connection_or_a_pool(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:  # not autocommit
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '7s'")
            changes = migrate(conn, checkpoint_prefix=None, broadcast_table=None)
            assert {c.action for c in changes} == {"created"}
            # The caller's transaction keeps its own settings.
            row = conn.execute("SELECT current_setting('lock_timeout')").fetchone()
            assert row == ("7s",)
            raise psycopg.Rollback()  # the migration joined the caller's transaction
        assert tables(pg_dsn) == set()

    class Pool:
        def __init__(self) -> None:
            self.lent = 0

        def connection(self) -> Any:
            self.lent += 1
            return psycopg.connect(pg_dsn, autocommit=True)

    pool = Pool()
    assert {c.action for c in migrate(pool)} == {"created"}
    assert pool.lent == 1
    with pytest.raises(ConfigError, match=r"migrate\(\) needs a conninfo"):
        migrate(42)
    with pytest.raises(ConfigError, match="timeout"):
        migrate(pg_dsn, timeout=0)


def test_a_migration_waits_for_another_at_most_its_timeout(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        other.execute("SET application_name = 'other-migration'")
        pid = other.info.backend_pid
        with other.transaction():
            other.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            started = time.monotonic()
            with pytest.raises(BackendUnavailable) as info:
                migrate(pg_dsn, timeout=0.5)
            took = time.monotonic() - started
    assert took < 5.0, f"migrate waited {took:.1f} s with timeout=0.5"
    message = str(info.value)
    assert "waited 0.5 s for the migration lock" in message
    assert f"pid {pid}" in message and "'other-migration'" in message
    assert "nothing was changed" in message
    assert tables(pg_dsn) == set()
    assert {c.action for c in migrate(pg_dsn)} == {"created"}  # free again: it works


def test_an_upgrade_retries_a_busy_table_until_its_timeout(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(V1_LEASES)
    only_leases = {
        "claims_table": None,
        "elections_table": None,
        "nodes_table": None,
        "broadcast_table": None,
        "checkpoint_prefix": None,
    }
    with psycopg.connect(pg_dsn, autocommit=True) as reader:
        # A long transaction that read the table: ALTER TABLE must wait for it.
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM rselection_leases")
        with pytest.raises(BackendUnavailable, match=r"waited 1\.5 s for a lock on the lease"):
            migrate(pg_dsn, timeout=1.5, **only_leases)
        assert {k: v for k, (v, _) in versions(pg_dsn).items()} == {"leases": 1}
        # A lock let go while the upgrade retries: it goes through.
        done: list[Any] = []
        upgrade = threading.Thread(
            target=lambda: done.append(migrate(pg_dsn, timeout=30, **only_leases)), daemon=True
        )
        upgrade.start()
        time.sleep(1.5)  # longer than one attempt's lock wait (UPGRADE_LOCK_TIMEOUT)
        assert upgrade.is_alive()
        reader.execute("COMMIT")
        upgrade.join(30)
    wait_until(lambda: bool(done), 1, "the upgrade to finish")
    (change,) = done[0]
    assert (change.action, change.previous, change.version) == ("upgraded", 1, LEASES_VERSION)


def test_a_claims_table_without_its_indexes_gets_them_without_a_new_version(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A claims table made by an earlier release (schema version 1, no key or expiry
    index) gets both indexes from the next migration and keeps version 1, so that a
    node of the earlier release still accepts it. A claimer does not build them on its
    first call (that would block every claim meanwhile): it says to migrate."""
    from rselection.postgres import PostgresClaimer
    from rselection.postgres.schema import CLAIMS, create_tables

    names = CLAIMS.index_names("old_claims")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        create_tables(conn, claims="old_claims")
        assert all(_index_exists(conn, name) for name in names)  # a new table has them
        for name in names:
            conn.execute(f"DROP INDEX {name}")
        claimer = PostgresClaimer(pg_dsn, table="old_claims")
        try:
            with caplog.at_level("WARNING", logger="rselection.postgres.schema"):
                assert claimer.claim("purge@1")
        finally:
            claimer.close()
        assert "run `rselection migrate`" in caplog.text
        assert not any(_index_exists(conn, name) for name in names)
        changes = {c.kind: c for c in migrate(conn, claims_table="old_claims")}
        assert all(_index_exists(conn, name) for name in names)
        assert (changes["claims"].action, changes["claims"].version) == ("present", 1)
        row = conn.execute(
            "SELECT version FROM rselection_schema_version WHERE component = 'claims:old_claims'"
        ).fetchone()
        assert row == (1,)


def _index_exists(conn: psycopg.Connection[Any], name: str) -> bool:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize(
    ("previous", "dropped"),
    [(1, "version, DROP COLUMN eligible, DROP COLUMN incarnation"), (2, "incarnation")],
)
def test_an_earlier_nodes_table_is_upgraded_and_keeps_its_rows(
    pg_dsn: str, previous: int, dropped: str
) -> None:
    """An earlier nodes table (version 1: no ``version``, ``eligible``; version 2, of a
    development build: no ``incarnation``): the upgrade adds what it lacks (nullable, no
    rewrite); a row of an earlier node reads as eligible, of no version, and a node of
    this release records all three (before, a version 2 table was never given the
    third column, and every heartbeat failed)."""
    import rselection as rs

    migrate(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # back to the earlier version
        conn.execute(f"ALTER TABLE rselection_nodes DROP COLUMN {dropped}")
        conn.execute(
            "UPDATE rselection_schema_version SET version = %s WHERE component = 'nodes'",
            (previous,),
        )
        conn.execute(
            "INSERT INTO rselection_nodes (name, node_id, hostname, pid, client_addr,"
            " started_at, last_seen) VALUES ('jobs', 'old', 'h', 1, NULL, now(), now())"
        )
    changes = {c.kind: c for c in migrate(pg_dsn)}
    assert (changes["nodes"].action, changes["nodes"].previous) == ("upgraded", previous)
    assert changes["nodes"].version == NODES.version == 3
    leader = rs.PostgresLeader(
        pg_dsn, rs.TaskHandler(), name="jobs", node_id="new", version="1.1", heartbeat_interval=0.2
    )
    leader.start()
    try:
        wait_until(lambda: len(leader.nodes()) == 2, 10, "the new node's heartbeat")
        seen = {n.node_id: (n.version, n.eligible) for n in leader.nodes()}
        assert seen == {"old": (None, True), "new": ("1.1", True)}
    finally:
        leader.stop(timeout=10)


def test_a_lease_table_without_its_history_is_refused_until_migrated(pg_dsn: str) -> None:
    """The leadership history table beside the lease table has no version of its own: a
    node that may not create tables refuses a lease table without it (its acquisitions
    write the history), and leads, its term on record, once `rselection migrate` created
    it; the lease table's version stays, so older releases keep using it."""
    import rselection as rs
    from rselection.postgres import PostgresAdmin, PostgresLeader

    migrate(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE rselection_leases_history")
    timings = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}

    def leader() -> PostgresLeader:
        return PostgresLeader(
            pg_dsn, rs.TaskHandler(), name="h", create_tables=False, claimer=None, **timings
        )

    refused = leader()
    with pytest.raises(ConfigError, match=r"no leadership history table.*rselection migrate"):
        refused.lead()
    (change,) = [c for c in migrate(pg_dsn) if c.kind == "leases"]
    assert (change.action, change.previous, change.version) == ("present", 5, 5)
    assert change.describe().endswith(
        "already present (schema version 5); created 'rselection_leases_history'"
    )
    assert versions(pg_dsn)["leases"][0] == 5
    upgraded = leader()
    upgraded.start()
    try:
        assert upgraded.wait_until_leader(10)
        with PostgresAdmin(pg_dsn) as admin:
            (record,) = admin.history("h")
        assert (record.term, record.node_id, record.end_reason) == (
            upgraded.term,
            upgraded.node_id,
            None,
        )
    finally:
        upgraded.stop(timeout=10)
