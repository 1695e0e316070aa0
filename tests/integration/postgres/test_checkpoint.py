"""PostgresCheckpointStore against a real Postgres: snapshots, fencing, leases, migrations.

Every test runs in a schema of its own (``pg_dsn``), so the default table names are safe.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import rselection as rs
from rselection.checkpoints import decode_state, encode_state
from rselection.errors import BackendUnavailable, ConfigError, StaleLeaderError
from rselection.keys import lease_scoped
from rselection.postgres import PostgresCheckpointStore, PostgresLease, Snapshot, migrate
from rselection.postgres.checkpoint import FORMAT_VERSION
from rselection.postgres.leader import PostgresLeader
from rselection.postgres.schema import Step, TableKind, run_migrations
from rselection.postgres.session_pool import POOL_SIZE
from tests.support.node_process import NodeProcess, count
from tests.support.pg import with_host_port
from tests.support.proxy import TcpProxy

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def store(pg_dsn: str) -> Iterator[PostgresCheckpointStore]:
    with PostgresCheckpointStore(pg_dsn) as s:
        yield s


def server_now(dsn: str) -> datetime:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value.astimezone(UTC)


# -- round trips ----------------------------------------------------------------------


def test_save_load_round_trip_with_versions_and_server_time(
    store: PostgresCheckpointStore, pg_dsn: str
) -> None:
    assert store.load("queue") is None
    before = server_now(pg_dsn)
    first = store.save("queue", {"cursor": 1})
    assert isinstance(first, Snapshot)
    assert (first.key, first.state, first.version, first.term) == ("queue", {"cursor": 1}, 1, None)
    assert first.format_version == FORMAT_VERSION
    assert before <= first.updated_at <= server_now(pg_dsn)
    assert first.updated_at.tzinfo is not None
    second = store.save("queue", {"cursor": 2})
    assert second.version == 2 and second.updated_at >= first.updated_at
    assert store.load("queue") == second


def test_nested_and_unicode_state(store: PostgresCheckpointStore) -> None:
    state = {
        "a": [1, 2.5, None, True, False, {"b": {"c": ["x", [[], {}]]}}],
        "unicodé": "snowman ☃ and emoji 🎉",
        "big": 2**62,
        "neg": -1.25e-300,
        "deep": json.loads("[" * 200 + "]" * 200),
    }
    store.save("nested", state)
    loaded = store.load("nested")
    assert loaded is not None and loaded.state == state


def test_five_megabyte_state(store: PostgresCheckpointStore) -> None:
    blob = "x" * (5 * 2**20)
    rows = [{"id": i, "name": f"item-{i}"} for i in range(20_000)]
    saved = store.save("large", {"blob": blob, "rows": rows})
    loaded = store.load("large")
    assert loaded is not None
    assert loaded.state["blob"] == blob and loaded.state["rows"] == rows
    assert loaded.version == saved.version == 1


def test_tuple_keys(store: PostgresCheckpointStore) -> None:
    store.save(("owner", "repo", "main"), {"n": 1})
    store.save(("owner", "repo", "dev"), {"n": 2})
    store.save("owner/repo/main", {"n": 3})  # a different key, not a path
    main = store.load(("owner", "repo", "main"))
    assert main is not None and main.key == ("owner", "repo", "main") and main.state == {"n": 1}
    dev = store.load(("owner", "repo", "dev"))
    assert dev is not None and dev.state == {"n": 2}
    flat = store.load("owner/repo/main")
    assert flat is not None and flat.state == {"n": 3}
    # A one-element tuple is the same key as its string.
    store.save(("solo",), 1)
    solo = store.load("solo")
    assert solo is not None and solo.key == "solo" and solo.state == 1


def test_delete_keeps_the_version_counter(store: PostgresCheckpointStore) -> None:
    assert store.delete("gone") is False
    store.save("gone", 1)
    store.save("gone", 2)
    assert store.delete("gone") is True
    assert store.load("gone") is None
    assert store.delete("gone") is False
    again = store.save("gone", 3)
    assert again.version == 4  # save, save, delete, save: versions never repeat


def test_unknown_format_version_raises_and_keeps_the_row(
    store: PostgresCheckpointStore, pg_dsn: str
) -> None:
    store.save("future", {"field": 1})
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE rselection_checkpoints SET format_version = %s,"
            " state = '{\"field\": 1, \"new_field\": 2}' WHERE key = ARRAY['future']",
            (FORMAT_VERSION + 1,),
        )
    with pytest.raises(ConfigError, match=r"format_version 2, newer than the 1.*upgrade"):
        store.load("future")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT state FROM rselection_checkpoints WHERE key = ARRAY['future']"
        ).fetchone()
    assert row is not None and row[0] == {"field": 1, "new_field": 2}


def test_table_prefix_and_schema_qualified_prefix(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema = conn.execute("SELECT current_schema()").fetchone()
    assert schema is not None
    with PostgresCheckpointStore(pg_dsn, table_prefix=f"{schema[0]}.app_") as s:
        s.save("k", 1)
    with PostgresCheckpointStore(pg_dsn, table_prefix="other_") as s:
        assert s.load("k") is None
        s.save("k", 2)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            )
        }
    assert {"app_checkpoints", "app_checkpoint_leases", "rselection_schema_version"} <= tables
    assert {"other_checkpoints", "other_checkpoint_leases"} <= tables


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("source", [None, "", "   "])
def test_no_connection_is_a_config_error(source: Any) -> None:
    with pytest.raises(ConfigError, match="PostgresCheckpointStore needs a conninfo"):
        PostgresCheckpointStore(source)


def test_bad_construction_arguments() -> None:
    dsn = "postgresql://u@h/db"
    with pytest.raises(ConfigError, match="connection\\(\\) context manager"):
        PostgresCheckpointStore(42)
    with pytest.raises(ConfigError, match="cannot be parsed"):
        PostgresCheckpointStore("host=a port")
    for prefix in ["x; DROP TABLE t --", "a.b.c", "1abc", "a" * 60]:
        with pytest.raises(ConfigError, match="invalid table name"):
            PostgresCheckpointStore(dsn, table_prefix=prefix)
    with pytest.raises(ConfigError, match="invalid table name"):
        PostgresCheckpointStore(dsn, lease_table="leases; --")
    with pytest.raises(ConfigError, match="max_state_bytes"):
        PostgresCheckpointStore(dsn, max_state_bytes=0)
    with pytest.raises(ConfigError, match="statement_timeout"):
        PostgresCheckpointStore(dsn, statement_timeout=0)


def test_bad_keys_and_states(store: PostgresCheckpointStore, pg_dsn: str) -> None:
    for key in ["", (), ("a", ""), ("a", 1), 5, ["a"], "a\x00b"]:
        with pytest.raises(ConfigError, match="key"):
            store.save(key, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cannot be stored as JSON.*datetime"):
        store.save("k", {"when": datetime.now(UTC)})
    with pytest.raises(TypeError, match="set"):
        store.save("k", {1, 2})
    with pytest.raises(ConfigError, match="NaN"):
        store.save("k", {"x": math.nan})
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ConfigError, match="ircular"):
        store.save("k", loop)
    with pytest.raises(ConfigError, match="NUL"):
        store.save("k", {"s": "a\x00b"})
    with pytest.raises(ConfigError, match="not both"):
        store.save("k", 1, term=1, node_id="h")
    with pytest.raises(ConfigError, match="term must be"):
        store.save("k", 1, term=-1)
    assert store.load("k") is None  # nothing was written by any of these
    small = PostgresCheckpointStore(pg_dsn, max_state_bytes=100)
    with pytest.raises(ConfigError, match="more than max_state_bytes=100"):
        small.save("k", "x" * 200)
    small.close()


def test_unreachable_database_is_backend_unavailable() -> None:
    s = PostgresCheckpointStore("postgresql://nobody:secret@127.0.0.1:1/nowhere", connect_timeout=2)
    with pytest.raises(BackendUnavailable, match=r"127\.0\.0\.1") as info:
        s.load("k")
    assert "secret" not in str(info.value)


def test_an_idle_connection_ended_by_the_server_is_replaced(
    store: PostgresCheckpointStore, pg_dsn: str
) -> None:
    store.save("k", 1)
    pids = [c.info.backend_pid for c in store._conns.idle_connections()]
    assert pids
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    assert store.save("k", 2).version == 2  # no BackendUnavailable from a dead session
    snap = store.load("k")
    assert snap is not None and snap.state == 2


def test_missing_tables_without_create_tables(pg_dsn: str) -> None:
    s = PostgresCheckpointStore(pg_dsn, create_tables=False)
    with pytest.raises(ConfigError, match=r"migrate\(conninfo\)"):
        s.load("k")
    changes = migrate(pg_dsn)
    assert [c.action for c in changes if c.kind == "checkpoints"] == ["created"]
    assert s.load("k") is None
    s.close()


# -- fenced saves (leadership term) ---------------------------------------------------


def test_takeover_refuses_the_old_terms_save_and_keeps_the_new_snapshot(
    store: PostgresCheckpointStore, pg_dsn: str
) -> None:
    name = f"t-{uuid.uuid4().hex[:6]}"
    with (
        PostgresLease(pg_dsn, name=name, ttl=3, renew_deadline=2) as a,
        PostgresLease(pg_dsn, name=name, ttl=3, renew_deadline=2) as b,
    ):
        first = a.try_acquire("a")
        assert first.acquired and first.holder is not None
        old = first.holder.term
        saved = store.save("job", {"by": "a"}, term=old, name=name)
        assert saved.term == old
        a.release("a", old)
        second = b.try_acquire("b")
        assert second.acquired and second.holder is not None
        new = second.holder.term
        assert new == old + 1
        store.save("job", {"by": "b"}, term=new, name=name)
        with pytest.raises(StaleLeaderError, match=f"term {old} no longer holds"):
            store.save("job", {"by": "a", "late": True}, term=old, name=name)
        with pytest.raises(StaleLeaderError):
            store.delete("job", term=old, name=name)
        with pytest.raises(StaleLeaderError):  # a term that never held the lease
            store.save("job", {"by": "?"}, term=new + 5, name=name)
        with pytest.raises(StaleLeaderError):  # the right term, the wrong lease
            store.save("job", {"by": "?"}, term=new, name=name + "-other")
    snap = store.load("job")
    assert snap is not None
    assert (snap.state, snap.term, snap.version) == ({"by": "b"}, new, 2)


def test_a_fenced_save_holds_a_takeover_until_it_commits(
    store: PostgresCheckpointStore, pg_dsn: str
) -> None:
    """The save of term T commits before term T+1 exists: the two never interleave."""
    name = f"t-{uuid.uuid4().hex[:6]}"
    with PostgresLease(pg_dsn, name=name, ttl=3, renew_deadline=2) as a:
        acq = a.try_acquire("a")
        assert acq.holder is not None
        term = acq.holder.term
        store.save("job", 0, term=term, name=name)  # tables exist before we hold locks
        # Hold the checkpoint row so the fenced save stalls after fenced() took its lock.
        blocker = psycopg.connect(pg_dsn)
        blocker.execute("SELECT 1 FROM rselection_checkpoints WHERE key = ARRAY['job'] FOR UPDATE")
        result: dict[str, Any] = {}

        def save() -> None:
            try:
                result["snap"] = store.save("job", 1, term=term, name=name)
            except Exception as exc:  # reported below
                result["error"] = exc

        saver = threading.Thread(target=save)
        saver.start()
        with psycopg.connect(pg_dsn, autocommit=True) as watch:
            wait_until(
                lambda: (
                    watch.execute(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE %s = ANY(pg_blocking_pids(pid))",
                        (blocker.info.backend_pid,),
                    ).fetchone()
                    == (1,)
                ),
                10,
                "the save to wait on the row",
            )
            # Expire the lease by hand; a takeover must still wait for the open save.
            watch.execute(
                "UPDATE rselection_leases SET expires_at = now() WHERE name = %s", (name,)
            )
        with PostgresLease(pg_dsn, name=name, ttl=3, renew_deadline=2) as b:
            # The takeover never waits on the shared keeper session: while the save is
            # open it skips the row the save holds and reports the lease not acquired.
            for _ in range(3):
                assert not b.try_acquire("b").acquired
            assert saver.is_alive()
            blocker.rollback()
            blocker.close()
            saver.join(10)
            assert not saver.is_alive()
            taken = b.try_acquire("b")
        assert "snap" in result, result
        assert result["snap"].term == term
        assert taken.acquired and taken.holder is not None and taken.holder.term == term + 1


# -- per-key leases -------------------------------------------------------------------


def lease_row(dsn: str, key: list[str]) -> tuple[Any, ...]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT holder, term, acquired_at, renewed_at, expires_at,"
            " expires_at - renewed_at FROM rselection_checkpoint_leases WHERE key = %s",
            (key,),
        ).fetchone()
    assert row is not None
    return tuple(row)


def about(length: timedelta, expected: timedelta) -> bool:
    """``length`` is ``expected`` to within a millisecond."""
    return abs(length - expected) < timedelta(milliseconds=1)


def test_per_key_lease_contention_and_renewal(store: PostgresCheckpointStore, pg_dsn: str) -> None:
    key = ("owner", "repo")
    assert store.acquire_lease(key, "w1", 30)
    assert not store.acquire_lease(key, "w2", 30)
    holder, term, acquired, renewed, expires, length = lease_row(pg_dsn, list(key))
    # renewed_at and expires_at come from two clock readings of one statement.
    assert (holder, term) == ("w1", 1) and about(length, timedelta(seconds=30))
    assert store.acquire_lease(key, "w1", 60)  # renewal by the same holder
    holder2, term2, acquired2, renewed2, expires2, length2 = lease_row(pg_dsn, list(key))
    assert (holder2, term2, acquired2) == ("w1", 1, acquired)
    assert renewed2 > renewed and expires2 > expires and about(length2, timedelta(seconds=60))
    assert not store.acquire_lease(key, "w2", 30)
    # Many contenders at once: exactly one wins a fresh key.
    wins: list[str] = []
    barrier = threading.Barrier(8)

    def contend(i: int) -> None:
        barrier.wait(10)
        if store.acquire_lease("fresh", f"c{i}", 30):
            wins.append(f"c{i}")

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(wins) == 1


def test_per_key_lease_takeover_only_after_server_expiry(
    store: PostgresCheckpointStore, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.acquire_lease("k", "w1", 0.5)
    # The client's clock plays no part: a client that believes it is a day later
    # still cannot take a lease the server considers live.
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 86400)
    assert not store.acquire_lease("k", "w2", 5)
    monkeypatch.undo()
    _, _, _, _, expires, _ = lease_row(pg_dsn, ["k"])
    wait_until(lambda: server_now(pg_dsn) > expires, 5, "the lease to expire on the server")
    assert store.acquire_lease("k", "w2", 5)
    holder, term, *_ = lease_row(pg_dsn, ["k"])
    assert (holder, term) == ("w2", 2)
    assert not store.acquire_lease("k", "w1", 5)  # the old holder lost it


def test_holder_fenced_saves_and_release(store: PostgresCheckpointStore) -> None:
    with pytest.raises(StaleLeaderError, match="does not hold the lease"):
        store.save("k", 0, node_id="w1")  # never acquired
    assert store.acquire_lease("k", "w1", 30)
    snap = store.save("k", {"by": "w1"}, node_id="w1")
    assert snap.term == 1
    with pytest.raises(StaleLeaderError):
        store.save("k", {"by": "w2"}, node_id="w2")
    assert store.release_lease("k", "w1")
    assert not store.release_lease("k", "w1")
    with pytest.raises(StaleLeaderError):
        store.save("k", {"by": "w1", "late": True}, node_id="w1")  # released: stale
    assert store.acquire_lease("k", "w2", 30)  # a released lease is free at once
    assert store.save("k", {"by": "w2"}, node_id="w2").term == 2
    with pytest.raises(StaleLeaderError):
        store.delete("k", node_id="w1")
    snap2 = store.load("k")
    assert snap2 is not None and snap2.state == {"by": "w2"} and snap2.term == 2
    # Re-acquiring after a release starts a new tenure with the next term.
    assert store.release_lease("k", "w2")
    assert store.acquire_lease("k", "w2", 30)
    assert store.save("k", 3, node_id="w2").term == 3
    assert store.delete("k", node_id="w2")


def test_bad_lease_arguments(store: PostgresCheckpointStore) -> None:
    for ttl in [0, 0.0005, -1, math.inf, math.nan, True, "5"]:
        with pytest.raises(ConfigError, match="ttl"):
            store.acquire_lease("k", "h", ttl)  # type: ignore[arg-type]
    for node_id in ["", " ", None, 3, "n" * 1001]:
        with pytest.raises(ConfigError, match="node_id"):
            store.acquire_lease("k", node_id, 5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lease name"):
        store.save("k", 1, term=1, name=" ")


# -- migrations -----------------------------------------------------------------------


def versions(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT component, version FROM rselection_schema_version")
        return {component: version for component, version in rows.fetchall()}


def test_the_store_records_its_version_like_every_other_table(
    store: PostgresCheckpointStore, pg_dsn: str
) -> None:
    store.save("k", 1)  # creates the tables on first use
    assert versions(pg_dsn) == {"checkpoints": 1}
    (change,) = [c for c in migrate(pg_dsn) if c.kind == "checkpoints"]
    assert (change.action, change.previous, change.version) == ("present", 1, 1)
    with PostgresCheckpointStore(pg_dsn, table_prefix="app_") as other:
        other.save("k", 1)
    assert versions(pg_dsn)["checkpoints:app_"] == 1


def test_migration_steps_run_in_order_and_roll_back_together(pg_dsn: str) -> None:
    log = psycopg.sql.Identifier("mig_log")

    def step(n: int, fail: bool = False) -> Step:
        def statements(table: str) -> list[psycopg.sql.Composed]:
            out = [
                psycopg.sql.SQL("CREATE TABLE IF NOT EXISTS {} (n int)").format(log),
                psycopg.sql.SQL("INSERT INTO {} VALUES ({})").format(log, psycopg.sql.Literal(n)),
            ]
            if fail:
                out.append(psycopg.sql.SQL("SELECT 1/0").format())
            return out

        return Step(n, f"step {n}", statements)

    def kind(*steps: Step) -> TableKind:
        return TableKind("test", "test table", "mig_log", steps)

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        (created,) = run_migrations(conn, [(kind(step(1)), "mig_log")])
        assert (created.action, created.version) == ("created", 1)
        with pytest.raises(psycopg.errors.DivisionByZero):
            run_migrations(conn, [(kind(step(1), step(2), step(3, fail=True)), "mig_log")])
        # The failed run left nothing behind: neither step 2 nor its record.
        assert [r[0] for r in conn.execute("SELECT n FROM mig_log")] == [1]
        assert versions(pg_dsn) == {"test": 1}
        (upgraded,) = run_migrations(conn, [(kind(step(1), step(2), step(3)), "mig_log")])
        assert (upgraded.action, upgraded.previous, upgraded.version) == ("upgraded", 1, 3)
        assert [r[0] for r in conn.execute("SELECT n FROM mig_log")] == [1, 2, 3]
        assert versions(pg_dsn) == {"test": 3}
        (again,) = run_migrations(conn, [(kind(step(1), step(2), step(3)), "mig_log")])
        assert again.action == "present"
        assert [r[0] for r in conn.execute("SELECT n FROM mig_log")] == [1, 2, 3]
        with pytest.raises(ConfigError, match=r"numbered 1\.\.n"):
            kind(step(2))
        # A database migrated by a newer release is refused, not downgraded.
        with pytest.raises(ConfigError, match=r"schema version 3, newer than the 2 .*upgrade"):
            run_migrations(conn, [(kind(step(1), step(2)), "mig_log")])


def test_store_refuses_tables_of_a_newer_release(
    store: PostgresCheckpointStore, pg_dsn: str
) -> None:
    store.save("k", 1)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE rselection_schema_version SET version = 99 WHERE component = 'checkpoints'"
        )
    fresh = PostgresCheckpointStore(pg_dsn)
    with pytest.raises(ConfigError, match="schema version 99, newer"):
        fresh.save("k", 1)
    fresh.close()


# -- pools ----------------------------------------------------------------------------


class TinyPool:
    """The part of psycopg_pool.ConnectionPool the store uses: connection()."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.borrowed = 0

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        self.borrowed += 1
        conn = psycopg.connect(self.dsn)  # autocommit off, like a pool's default
        try:
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            conn.close()


def test_a_pool_works_like_a_connection_string(pg_dsn: str) -> None:
    pool = TinyPool(pg_dsn)
    s = PostgresCheckpointStore(pool)
    name = f"t-{uuid.uuid4().hex[:6]}"
    with PostgresLease(pg_dsn, name=name, ttl=3, renew_deadline=2) as lease:
        acq = lease.try_acquire("a")
        assert acq.holder is not None
        s.save(("p", "q"), {"n": 1}, term=acq.holder.term, name=name)
        with pytest.raises(StaleLeaderError):
            s.save(("p", "q"), {"n": 2}, term=acq.holder.term + 1, name=name)
    snap = s.load(("p", "q"))
    assert snap is not None and snap.state == {"n": 1} and snap.version == 1
    assert pool.borrowed >= 3
    s.close()  # does not touch the pool


def test_a_connection_works_too_and_a_save_joins_its_open_transaction(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:  # not autocommit
        s = PostgresCheckpointStore(conn)
        s.save("k", 1)  # committed at once: no transaction was open
        with PostgresCheckpointStore(pg_dsn) as other:
            snap = other.load("k")
            assert snap is not None and snap.state == 1
            with conn.transaction():
                s.save("k", 2)
                inside, outside = s.load("k"), other.load("k")
                assert inside is not None and inside.state == 2
                assert outside is not None and outside.state == 1  # not committed yet
                raise psycopg.Rollback()
            after = other.load("k")
            assert after is not None and after.state == 1  # rolled back with the caller's
        s.close()
        assert not conn.closed  # the caller's connection stays open


def test_pooled_sessions_are_bounded_and_close_never_waits_for_a_call(pg_dsn: str) -> None:
    # A connection string of its own: a pool that no other test's objects share.
    store = PostgresCheckpointStore(make_conninfo(pg_dsn, connect_timeout=7))
    store.save("k", 0)
    pool = store._conns._sessions
    assert pool is not None

    def work(i: int) -> None:
        for n in range(20):
            store.save(("w", str(i)), n)

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert not any(w.is_alive() for w in workers)
    assert 1 <= pool.open_sessions <= POOL_SIZE  # 6 threads, never more than the pool's
    with psycopg.connect(pg_dsn) as blocker:
        blocker.execute("SELECT 1 FROM rselection_checkpoints WHERE key = ARRAY['k'] FOR UPDATE")
        done: list[Snapshot] = []
        saver = threading.Thread(target=lambda: done.append(store.save("k", 1)), daemon=True)
        saver.start()

        def blocked() -> bool:
            row = blocker.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE pg_blocking_pids(pid) @> ARRAY[%s::int]",
                (blocker.info.backend_pid,),
            ).fetchone()
            return bool(row and row[0])

        wait_until(blocked, 10, "the save to wait for the row lock")
        started = time.monotonic()
        store.close()  # a call is in flight: close does not wait for it
        assert time.monotonic() - started < 1.0
        blocker.rollback()
        saver.join(10)
    assert done and done[0].version == 2
    assert pool.open_sessions == 0  # the call's session was closed when it ended
    snap = store.load("k")  # and a later call opens a new one
    assert snap is not None and snap.state == 1
    store.close()


def test_a_store_nobody_closed_keeps_no_thread(pg_dsn: str) -> None:
    # Its round-trip watchdog ends once nothing is in flight (a leader's store used
    # after the leader stopped, a script that never closes); the next call restarts it.
    def watchdogs() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "rselection-io-rselection:pool"]

    store = PostgresCheckpointStore(pg_dsn)
    store.save("k", 1)
    wait_until(lambda: not watchdogs(), 5, "the idle watchdog thread to end")
    assert store.save("k", 2).version == 2
    wait_until(lambda: not watchdogs(), 5, "the idle watchdog thread to end again")
    store.close()


# -- inside tasks ---------------------------------------------------------------------


def test_tasks_resume_from_the_previous_leaders_checkpoint(pg_dsn: str) -> None:
    name = f"t-{uuid.uuid4().hex[:6]}"
    progress: dict[str, list[int]] = {}
    bound: list[Any] = []

    def make_handler(node: str) -> rs.TaskHandler:
        tasks = rs.TaskHandler()

        @tasks.persistent("counter", restart="never")
        def counter(ctx: rs.TaskContext) -> None:
            bound.append(ctx.checkpoint)
            snap = ctx.checkpoint.load()
            n = snap.state["n"] if snap is not None else 0
            while ctx.sleep(0.01):
                n += 1
                saved = ctx.checkpoint.save({"n": n, "node": node})
                assert saved.term == ctx.term
                progress.setdefault(node, []).append(n)

        return tasks

    first = PostgresLeader(pg_dsn, make_handler("a"), name=name, node_id="a", **FAST)
    second = PostgresLeader(pg_dsn, make_handler("b"), name=name, node_id="b", **FAST)
    try:
        first.start()
        wait_until(lambda: len(progress.get("a", [])) >= 5, 15, "node a to save")
        first.stop(timeout=10)
        last_a = progress["a"][-1]
        old_term = bound[0].term
        second.start()
        wait_until(lambda: len(progress.get("b", [])) >= 3, 15, "node b to save")
        assert progress["b"][0] == last_a + 1  # resumed exactly where a stopped
        assert second.term == old_term + 1
        # The old term's checkpoint can no longer write.
        with pytest.raises(StaleLeaderError):
            bound[0].save({"n": -1, "node": "a"})
        second.stop(timeout=10)
        snap = second.checkpoint_store.load(lease_scoped(name, "counter"))
        assert snap is not None and snap.state["node"] == "b" and snap.term == old_term + 1
        assert snap.state["n"] == progress["b"][-1]
    finally:
        first.stop(timeout=10)
        second.stop(timeout=10)


def test_async_tasks_and_a_shared_store(pg_dsn: str) -> None:
    name = f"t-{uuid.uuid4().hex[:6]}"
    shared = PostgresCheckpointStore(pg_dsn, table_prefix="shared_")
    shared.save(lease_scoped(name, "ticker"), {"n": 41})
    seen: list[Any] = []
    tasks = rs.TaskHandler()

    @tasks.persistent("ticker", restart="never")
    async def ticker(ctx: rs.TaskContext) -> None:
        snap = await ctx.checkpoint.aload()
        assert snap is not None
        seen.append(await ctx.checkpoint.asave({"n": snap.state["n"] + 1}))
        assert ctx.checkpoint.key == f"{name}/ticker" and ctx.checkpoint.term == ctx.term

    leader = PostgresLeader(pg_dsn, tasks, name=name, checkpoint_store=shared, **FAST)
    try:
        leader.start()
        wait_until(lambda: bool(seen), 15, "the async task to save")
    finally:
        leader.stop(timeout=10)
    assert seen[0].state == {"n": 42} and seen[0].version == 2
    snap = shared.load(lease_scoped(name, "ticker"))
    assert snap is not None and snap.state == {"n": 42}  # the leader left the store open
    shared.close()
    with pytest.raises(ConfigError, match="checkpoint_store must be"):
        PostgresLeader(pg_dsn, rs.TaskHandler(), checkpoint_store="nope")  # type: ignore[arg-type]


def test_tasks_of_the_same_name_under_two_leases_keep_two_checkpoints(pg_dsn: str) -> None:
    # Lease names may contain "/": "<tag>/billing" with task "cursor" and "<tag>" with
    # task "billing/cursor" must not share a key either.
    tag = f"t-{uuid.uuid4().hex[:6]}"
    runs = {f"{tag}-billing": "cursor", f"{tag}-shipping": "cursor", f"{tag}/billing": "cursor"}
    runs[tag] = "billing/cursor"
    seen: dict[str, Any] = {}
    lock = threading.Lock()

    def handler(lease: str, task: str) -> rs.TaskHandler:
        tasks = rs.TaskHandler()

        @tasks.persistent(task, restart="never")
        def cursor(ctx: rs.TaskContext) -> None:
            ctx.checkpoint.save({"lease": lease})
            with lock:
                seen[lease] = ctx.checkpoint.key
            ctx.cancelled.wait()

        return tasks

    leaders = [
        PostgresLeader(pg_dsn, handler(lease, task), name=lease, claimer=None, **FAST)
        for lease, task in runs.items()
    ]
    try:
        for leader in leaders:
            leader.start()
        wait_until(lambda: len(seen) == len(runs), 15, "every lease's task to save")
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
    assert len(set(seen.values())) == len(runs)
    assert seen[f"{tag}/billing"] == f"{tag}%2Fbilling/cursor"
    assert seen[tag] == f"{tag}/billing/cursor"
    with PostgresCheckpointStore(pg_dsn) as store:
        for lease, task in runs.items():
            snap = store.load(lease_scoped(lease, task))
            assert snap is not None and snap.state == {"lease": lease}


def test_a_single_node_refuses_a_postgres_store_at_construction(pg_dsn: str) -> None:
    # Its lease lives in memory, never in the store's lease table: every save would be
    # refused as "taken over".
    with PostgresCheckpointStore(pg_dsn) as store:
        with pytest.raises(ConfigError, match="SingleNodeLeader's checkpoint_store") as refused:
            rs.SingleNodeLeader(rs.TaskHandler(), checkpoint_store=store)
        assert "MemoryCheckpointStore" in str(refused.value)
        assert "PostgresCheckpointStore" in str(refused.value)


@pytest.mark.parametrize("store", ["default", "own"])
def test_a_leader_paused_inside_a_save_holds_a_takeover_back_no_longer_than_its_margin(
    pg_dsn: str, store: str
) -> None:
    """ctx.checkpoint.save's transaction carries the leader's margin (ttl - renew_deadline,
    1 s here) as its idle bound, as ctx.fence does, with the leader's default store or a
    store of its own (idle bound 5 s): a leader stopped inside a save holds the lease row
    only that long, so the takeover comes with the lease's expiry (at most ttl after the
    last renewal), not after 5 s."""
    name = f"t-{uuid.uuid4().hex[:6]}"
    args = ["--lease", name] + (["--own-store"] if store == "own" else [])
    node = NodeProcess("tests.support.checkpoint_pause_node", pg_dsn, *args)
    follower = PostgresLeader(
        pg_dsn, rs.TaskHandler(), name=name, node_id="follower", claimer=None, **FAST
    )
    try:
        node.wait_for("the node to lead", count("elected", 1), 20)
        follower.start()
        node.wait_for("the node to pause inside a save", count("paused", 1), 10)
        paused = time.monotonic()
        assert node.of("paused")[0]["idle_timeout"] == "1s"
        assert follower.wait_until_leader(15)
        waited = time.monotonic() - paused
        print(f"takeover after a pause inside a save: {waited * 1000:.0f} ms (ttl 3 s)")
        assert waited <= 3.0 + 0.5 + 1.0  # ttl + retry_interval, plus scheduling slack
    finally:
        follower.stop(timeout=10)
        node.kill()


def test_a_stores_idle_bound_and_its_bounded_views(pg_dsn: str) -> None:
    with PostgresCheckpointStore(pg_dsn) as store:
        assert store.idle_timeout == 5.0
        view = store.with_idle_timeout(1)
        assert view is not store and (view.idle_timeout, store.idle_timeout) == (1.0, 5.0)
        assert view.with_idle_timeout(30).idle_timeout == 1.0  # never longer than its own
        view.save("k", 1)
        snap = store.load("k")  # the same tables
        assert snap is not None and snap.state == 1
        leader = PostgresLeader(pg_dsn, rs.TaskHandler(), checkpoint_store=store, **FAST)
        leader.stop(timeout=10)
        assert leader.checkpoint_store is store and store.idle_timeout == 5.0
    with pytest.raises(ConfigError, match="idle_timeout"):
        PostgresCheckpointStore(pg_dsn, idle_timeout=0)
    with pytest.raises(ConfigError, match="idle_timeout"):
        PostgresCheckpointStore(pg_dsn).with_idle_timeout(-1)


def test_a_fenced_save_sets_the_stores_idle_bound_in_its_transaction(pg_dsn: str) -> None:
    name = f"t-{uuid.uuid4().hex[:6]}"
    with (
        PostgresLease(pg_dsn, name=name, ttl=3, renew_deadline=2) as lease,
        psycopg.connect(pg_dsn) as conn,
    ):
        holder = lease.try_acquire("a").holder
        assert holder is not None
        store = PostgresCheckpointStore(conn, idle_timeout=0.75)
        store.save("k", 0)  # the tables exist before the transactions below
        for fenced_call in (
            lambda: store.save("k", 1, term=holder.term, name=name),
            lambda: store.delete("k", term=holder.term, name=name),
        ):
            with conn.transaction(force_rollback=True):
                fenced_call()
                row = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
                assert row is not None and row[0] == "750ms"
        assert store.acquire_lease("own", "a", ttl=30)
        with conn.transaction(force_rollback=True):
            store.save("own", 1, node_id="a")
            row = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
            assert row is not None and row[0] == "750ms"


def test_decode_state_is_what_jsonb_returns(store: PostgresCheckpointStore) -> None:
    # The in-memory store returns states through decode_state: any float (random bit
    # patterns: subnormals, huge, integral), and keys of any length and script, come
    # back from Postgres exactly as decode_state gives them.
    rng = random.Random(13)
    floats = [struct.unpack("<d", rng.randbytes(8))[0] for _ in range(2000)]
    floats += [float(rng.randint(-(10**18), 10**18)) for _ in range(200)]
    words = ["a", "bb", "é", "Z", "ab", "\U0001f389", "aa", "b" * 3, "ä"]
    state = {
        "floats": [f for f in floats if math.isfinite(f)] + [-0.0, 0.5, 1e16],
        "keys": {w: i for i, w in enumerate(words)},
    }
    store.save("k", state)
    loaded = store.load("k")
    assert loaded is not None
    expected = decode_state(encode_state("k", state, store.max_state_bytes))
    assert json.dumps(loaded.state) == json.dumps(expected)


def test_a_save_during_a_silent_partition_fails_within_its_bounds(
    pg_dsn: str, make_tcp_proxy: Callable[[str, int], TcpProxy]
) -> None:
    # Every session the library opens has a connect timeout, keepalives,
    # tcp_user_timeout and a statement_timeout, and each call is bounded: a checkpoint
    # save into a network that drops everything fails in about connect_timeout +
    # statement_timeout, not after the kernel's TCP timeout (about 15 minutes).
    params = conninfo_to_dict(pg_dsn)
    proxy = make_tcp_proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    store = PostgresCheckpointStore(
        with_host_port(pg_dsn, proxy.host, proxy.port), connect_timeout=1, statement_timeout=1
    )
    try:
        assert store.save("k", 1).version == 1  # a pooled session is open and idle
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            store.save("k", 2)
        took = time.monotonic() - started
        assert took < 10.0, f"the save took {took:.1f}s in a silent partition"
        proxy.heal()
        wait_until(lambda: _saves(store), 15, "saves to work again once the network heals")
    finally:
        store.close()


def _saves(store: PostgresCheckpointStore) -> bool:
    try:
        store.save("k", 3)
    except BackendUnavailable:
        return False
    return True
