"""PostgresClaimer against a real Postgres: what only Postgres has.

What a claim row records (format version, server expiry), cleanup, pool and connection
sources, a claim inside the caller's transaction, broken and killed sessions, statement
timeouts, fire-key formats and the claims table. What every claimer promises runs on
both backends in ``tests/integration/conformance/test_claimer.py``.

Every test runs in a schema of its own (the ``pg_dsn`` fixture). Waits for a ttl to pass
poll the server with a deadline; threads are joined through futures with a timeout.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from rselection.errors import BackendUnavailable, ConfigError
from rselection.postgres import PostgresClaimer, migrate
from rselection.postgres.claims import FIRE_KEY_FORMAT
from rselection.postgres.connections import Connections
from rselection.schedules import format_fire_key
from tests.support.backends import closed_port
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_until

# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def dsn(pg_dsn: str) -> str:
    """This test's schema, with every table migrated."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
    return pg_dsn


@pytest.fixture
def make_claimer(dsn: str) -> Iterator[Callable[..., PostgresClaimer]]:
    """Factory of claimers on this test's schema, all closed after the test."""
    made: list[PostgresClaimer] = []

    def make(**kw: Any) -> PostgresClaimer:
        claimer = PostgresClaimer(kw.pop("source", dsn), **kw)
        made.append(claimer)
        return claimer

    yield make
    for claimer in made:
        claimer.close()


@pytest.fixture
def admin(pg_server_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection outside the test's schema, for pg_terminate_backend."""
    with psycopg.connect(pg_server_dsn, autocommit=True, connect_timeout=10) as conn:
        yield conn


def rows(dsn: str, table: str = "rselection_claims") -> dict[str, tuple[Any, ...]]:
    """fire_key -> (format_version, holder, term, claimed_at, expires_at)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            sql.SQL(
                "SELECT fire_key, format_version, holder, term, claimed_at, expires_at FROM {}"
            ).format(sql.Identifier(*table.split(".")))
        ).fetchall()
    return {r[0]: tuple(r[1:]) for r in found}


def tables_in_schema(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            )
        }


def via(proxy: TcpProxy, dsn: str, **extra: str) -> str:
    """``dsn`` pointed at ``proxy`` instead of the server."""
    return make_conninfo(dsn, host=proxy.host, port=str(proxy.port), **extra)


class FakePool:
    """A duck-typed pool: ``connection()`` lends a non-autocommit connection, commits after."""

    def __init__(self, dsn: str, size: int) -> None:
        self.conninfo = dsn
        self._free: queue.Queue[psycopg.Connection[Any]] = queue.Queue()
        for _ in range(size):
            self._free.put(psycopg.connect(dsn))
        self.lent = 0

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        conn = self._free.get(timeout=30)
        self.lent += 1
        try:
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            self._free.put(conn)

    def close(self) -> None:
        while not self._free.empty():
            self._free.get_nowait().close()


KEY = format_fire_key("purge", datetime(2026, 11, 30, 2, 40, tzinfo=UTC))


# ------------------------------------------------------------------------ semantics


def test_claim_records_node_id_term_format_and_server_expiry(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    claimer = make_claimer(ttl=42.5, node_id="worker-7")
    assert claimer.claim(KEY, term=9)
    assert claimer.claim("other@2026-11-30T02:41:00.000000000Z")
    got = rows(dsn)
    fmt, holder, term, claimed_at, expires_at = got[KEY]
    assert (fmt, holder, term) == (FIRE_KEY_FORMAT, "worker-7", 9)
    # server arithmetic, to within the time between the statement's two clock readings
    assert abs(expires_at - claimed_at - timedelta(seconds=42.5)) < timedelta(milliseconds=1)
    assert got["other@2026-11-30T02:41:00.000000000Z"][2] is None  # no term given


def test_cleanup_deletes_only_claims_expired_over_a_minute(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    claimer = make_claimer(ttl=600)
    assert claimer.cleanup() == 0
    for i in range(6):
        assert claimer.claim(f"k{i}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE rselection_claims SET expires_at = now() - interval '2 minutes'"
            " WHERE fire_key IN ('k0', 'k1', 'k2')"
        )
        conn.execute(
            "UPDATE rselection_claims SET expires_at = now() - interval '30 seconds'"
            " WHERE fire_key = 'k3'"
        )
    assert claimer.cleanup() == 3
    assert set(rows(dsn)) == {"k3", "k4", "k5"}
    assert claimer.cleanup() == 0
    assert claimer.claim("k3")  # expired (but kept by cleanup): claimable again
    assert not claimer.claim("k4")


def test_pool_and_connection_sources(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    pool = FakePool(dsn, 2)
    try:
        by_pool = make_claimer(source=pool)
        assert by_pool.claim("p1") and not by_pool.claim("p1")
        assert pool.lent == 2
        with psycopg.connect(dsn) as conn:  # not autocommit
            by_conn = make_claimer(source=conn)
            assert by_conn.claim("c1") and not by_conn.claim("p1")
            assert "c1" in rows(dsn)  # committed at once, visible to others
            by_conn.close()
            assert not conn.closed  # the caller's connection stays open
        assert not make_claimer().claim("c1")
    finally:
        pool.close()


def test_a_claim_inside_an_open_transaction_binds_only_when_it_commits(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")  # opens a transaction
        in_tx = make_claimer(source=conn)
        assert in_tx.claim("tx1")
        assert "tx1" not in rows(dsn)  # not visible yet
        conn.rollback()  # the fire's work failed: so did its claim
        assert "tx1" not in rows(dsn)
        assert make_claimer().claim("tx1")


# ------------------------------------------------------------------------ fail closed


def test_cleanup_on_an_unreachable_server_raises_and_hides_the_password(pg_dsn: str) -> None:
    port = closed_port()
    dsn = make_conninfo(pg_dsn, host="127.0.0.1", port=str(port), password="s3cret-pw")
    claimer = PostgresClaimer(dsn, connect_timeout=2)
    with pytest.raises(BackendUnavailable) as info:
        claimer.cleanup()
    assert "s3cret-pw" not in str(info.value) and f"port={port}" in str(info.value)


def test_severed_connection_raises_then_reconnects(
    dsn: str,
    make_claimer: Callable[..., PostgresClaimer],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    params = conninfo_to_dict(dsn)
    proxy = make_tcp_proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    claimer = make_claimer(source=via(proxy, dsn))
    assert claimer.claim("s1")
    proxy.sever()  # RST: the claimer's idle connection is gone
    proxy.blackhole()  # and no new connection gets through
    results: list[bool] = []
    with pytest.raises(BackendUnavailable):
        results.append(claimer.claim("s2"))
    assert results == []
    proxy.heal()
    assert claimer.claim("s2")  # reconnected; the failed call claimed nothing
    assert not claimer.claim("s1")


def test_session_killed_during_a_claim_raises_and_claims_nothing(
    dsn: str,
    make_claimer: Callable[..., PostgresClaimer],
    admin: psycopg.Connection[Any],
) -> None:
    claimer = make_claimer()
    assert claimer.claim("warm-up")
    with psycopg.connect(dsn) as blocker:
        # An uncommitted claim of the same key makes our claim wait on its row.
        blocker.execute(
            "INSERT INTO rselection_claims VALUES"
            " ('busy', 1, 'blocker', NULL, now(), now() + interval '1 hour')"
        )
        blocker_pid = blocker.info.backend_pid
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(claimer.claim, "busy")

            def waiting_pid() -> int | None:
                row = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    (blocker_pid,),
                ).fetchone()
                return None if row is None else int(row[0])

            wait_until(lambda: waiting_pid() is not None, 10, "the claim to wait")
            admin.execute("SELECT pg_terminate_backend(%s)", (waiting_pid(),))
            with pytest.raises(BackendUnavailable):
                future.result(timeout=10)
        blocker.rollback()
    assert claimer.claim("busy")  # reconnects; nobody held the key after all


def test_server_ended_idle_session_is_replaced_before_the_next_claim(
    make_claimer: Callable[..., PostgresClaimer], admin: psycopg.Connection[Any]
) -> None:
    claimer = make_claimer()
    assert claimer.claim("i1")
    own = claimer._conns.idle_connections()[-1]  # the connection the call used, now idle
    admin.execute("SELECT pg_terminate_backend(%s)", (own.info.backend_pid,))
    wait_until(lambda: not Connections.usable(own), 5, "the termination to arrive")
    assert claimer.claim("i2")
    assert not claimer.claim("i1")


def test_a_claim_over_its_statement_timeout_raises(
    dsn: str, make_claimer: Callable[..., PostgresClaimer]
) -> None:
    claimer = make_claimer(statement_timeout=0.3)
    with psycopg.connect(dsn) as blocker:
        blocker.execute(
            "INSERT INTO rselection_claims VALUES"
            " ('slow', 1, 'blocker', NULL, now(), now() + interval '1 hour')"
        )
        start = time.monotonic()
        with pytest.raises(BackendUnavailable, match="statement timeout"):
            claimer.claim("slow")
        assert time.monotonic() - start < 5
        blocker.rollback()
    assert claimer.claim("slow")


def test_claims_in_another_fire_key_format_stop_claims(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    claimer = make_claimer()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO rselection_claims VALUES"
            " ('purge/2026-11-30 02:40', 2, 'newer', NULL, now(), now() + interval '1 hour')"
        )
    with pytest.raises(ConfigError, match="fire-key format 2"):
        claimer.claim(KEY)
    assert KEY not in rows(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE rselection_claims SET expires_at = now() - interval '1 second'")
    assert claimer.claim(KEY)  # expired claims of another format no longer matter


# --------------------------------------------------------------------------- tables


def test_without_create_tables_a_missing_table_says_what_to_do(pg_dsn: str) -> None:
    claimer = PostgresClaimer(pg_dsn, create_tables=False)
    assert claimer.table == "rselection_claims"
    with pytest.raises(ConfigError, match=r"does not exist.*migrate"):
        claimer.claim(KEY)
    claimer.close()
    assert tables_in_schema(pg_dsn) == set()
    with PostgresClaimer(pg_dsn) as made:  # create_tables=True by default
        assert made.claim(KEY)
    assert tables_in_schema(pg_dsn) == {"rselection_claims", "rselection_schema_version"}


def test_custom_and_schema_qualified_tables(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
        assert row is not None
        schema = row[0]
        migrate(conn, table=None, elections_table=None, claims_table="app_claims")
    default = make_claimer()
    custom = make_claimer(table="app_claims")
    qualified = make_claimer(table=f"{schema}.other_claims", create_tables=True)
    assert default.claim(KEY) and custom.claim(KEY) and qualified.claim(KEY)
    assert not make_claimer(table=f"{schema}.app_claims").claim(KEY)  # same table
    assert set(rows(dsn, "app_claims")) == {KEY}
    assert set(rows(dsn, "other_claims")) == {KEY}
    with psycopg.connect(dsn, autocommit=True) as conn:
        versions = dict(
            conn.execute("SELECT component, version FROM rselection_schema_version").fetchall()
        )
    assert versions["claims:app_claims"] == 1 and versions["claims:other_claims"] == 1


def test_a_table_that_is_not_a_claims_table_is_refused(
    make_claimer: Callable[..., PostgresClaimer],
) -> None:
    with pytest.raises(ConfigError, match="not a claims table"):
        make_claimer(table="rselection_elections").claim(KEY)


@pytest.mark.parametrize(
    "table",
    [
        "claims; DROP TABLE rselection_leases",
        'claims"--',
        "a.b.c",
        "",
        "1claims",
        "claims-table",
        "x" * 64,
        "public.",
        " claims",
    ],
)
def test_hostile_table_names_are_refused_at_construction(pg_dsn: str, table: str) -> None:
    with pytest.raises(ConfigError, match="invalid table name"):
        PostgresClaimer(pg_dsn, table=table)


# ----------------------------------------------------------------------- validation


def test_closed_connection_and_bad_conninfo_are_refused(pg_dsn: str) -> None:
    conn = psycopg.connect(pg_dsn)
    conn.close()
    with pytest.raises(ConfigError, match="closed"):
        PostgresClaimer(conn)
    with pytest.raises(ConfigError, match="cannot be parsed"):
        PostgresClaimer("host=x port")


def test_cleanup_goes_in_bounded_batches_and_keeps_each_tasks_newest_claim(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    claimer = make_claimer(ttl=600)
    assert claimer.claim("live@2026-01-01T00:00:00.000000000Z")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    old = [
        format_fire_key(f"l/task{t}", start + timedelta(seconds=i))
        for t in range(5)
        for i in range(500)
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO rselection_claims"
            " (fire_key, format_version, holder, term, claimed_at, expires_at)"
            " SELECT k, 1, 'old', 1, now() - interval '3 hours', now() - interval '2 hours'"
            " FROM unnest(%s::text[]) AS k",
            ([*old, "plain-1", "plain-2"],),
        )
    assert claimer.cleanup(batch=1000) == 1000  # one statement, at most one batch
    assert claimer.cleanup() == 2500 + 2 - 5 - 1000
    assert claimer.cleanup() == 0
    # The newest claim of each task stays: it tells a starting leader the task ran.
    newest = {format_fire_key(f"l/task{t}", start + timedelta(seconds=499)) for t in range(5)}
    assert set(rows(dsn)) == newest | {"live@2026-01-01T00:00:00.000000000Z"}
    assert all(claimer.ran_before(f"l/task{t}@") for t in range(5))
    assert not claimer.ran_before("l/task5@") and not claimer.ran_before("l/task@")
    with pytest.raises(ConfigError, match="batch"):
        claimer.cleanup(batch=0)


def test_a_leader_deletes_expired_claims_itself_at_least_once_per_claim_ttl(dsn: str) -> None:
    import rselection as rs
    from rselection.postgres.leader import PostgresLeader

    ttl = 2.0
    claimer = PostgresClaimer(dsn, ttl=ttl)
    handler = rs.TaskHandler()
    handler.interval(0.1, name="tick", misfire_grace=1.0)(lambda ctx: None)
    timings = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}
    leader = PostgresLeader(dsn, handler, claimer=claimer, **timings)
    start = datetime(2026, 1, 1, tzinfo=UTC)

    def add_expired(task: str, count: int) -> None:
        keys = [format_fire_key(task, start + timedelta(seconds=i)) for i in range(count)]
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO rselection_claims"
                " (fire_key, format_version, holder, term, claimed_at, expires_at)"
                " SELECT k, 1, 'old', 1, now() - interval '3 hours', now() - interval '2 hours'"
                " FROM unnest(%s::text[]) AS k",
                (keys,),
            )

    def left(task: str) -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM rselection_claims WHERE fire_key LIKE %s", (task + "@%",)
            ).fetchone()
        assert row is not None
        return int(row[0])

    try:
        assert claimer.claim("warm-up")  # creates the table
        add_expired("gone/before", 3000)
        leader.start()
        assert leader.wait_until_leader(20)
        wait_until(lambda: left("gone/before") == 1, 30, "the expired claims to be deleted")
        add_expired("gone/during", 500)
        waited = wait_until(lambda: left("gone/during") == 1, 30, "the next clean-up")
        assert waited < ttl + 3  # once per half ttl here; 3 s for a busy machine
    finally:
        leader.stop(timeout=10)
        claimer.close()
