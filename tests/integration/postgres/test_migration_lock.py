"""A node cut off in the middle of creating tables must not block every other node."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from rselection.errors import ConfigError
from rselection.postgres import PostgresClaimer, migrate
from rselection.postgres.schema import MIGRATION_LOCK_KEY, create_tables
from tests.support.pg import with_host_port
from tests.support.waiting import wait_until


@pytest.fixture
def pg_dsn(lone_pg_dsn: str) -> str:
    """A database of the test's own: the migration lock is one per database, and these
    tests hold it (or wait for it) for seconds, which in the shared database would make
    the migrations of the other workers' tests wait as long."""
    return lone_pg_dsn


def test_a_client_cut_off_mid_migration_frees_the_migration_lock(
    pg_dsn: str, make_tcp_proxy: Callable[[str, int], Any]
) -> None:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    proxy = make_tcp_proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    admin = psycopg.connect(pg_dsn, autocommit=True)
    cut_off = psycopg.connect(with_host_port(pg_dsn, proxy.host, proxy.port), autocommit=True)
    pid = cut_off.info.backend_pid
    worker = threading.Thread(
        target=lambda: _swallow(lambda: create_tables(cut_off, nodes="cut_off_nodes")),
        daemon=True,
    )
    try:
        # Hold the migration lock so that the other client waits for it, then cut its
        # link: it gets the lock the moment we let go, but never hears of it, so its
        # transaction sits idle on the server holding the lock.
        admin.execute("BEGIN")
        admin.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        worker.start()

        def waiting() -> bool:
            row = admin.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            return row is not None and row[0] == "Lock"

        wait_until(waiting, 5, "the other client to wait for the migration lock")
        proxy.blackhole()
        admin.execute("COMMIT")
        began = time.monotonic()
        other = psycopg.connect(pg_dsn, autocommit=True)
        try:
            other.execute("SET lock_timeout = '15s'")
            other.execute("BEGIN")
            other.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            other.execute("COMMIT")
        finally:
            other.close()
        took = time.monotonic() - began
        assert took < 10.0, f"the migration lock was freed after {took:.1f} s"
    finally:
        # End the cut-off client's round trip and its thread before closing its
        # connection: a connection closed under a thread still inside libpq can crash.
        proxy.sever()
        if worker.ident is not None:  # started
            worker.join(10)
            assert not worker.is_alive(), "the cut-off client did not return when its link was cut"
        proxy.heal()
        admin.close()
        cut_off.close()


def _swallow(fn: Callable[[], object]) -> None:
    # The cut-off client fails one way or another; that is not what this test is about.
    with contextlib.suppress(Exception):
        fn()


def test_a_claimer_in_an_open_transaction_never_holds_the_migration_lock(pg_dsn: str) -> None:
    """Creating tables inside the application's transaction would hold the migration
    lock until that transaction ends, and every new leader and ``rselection migrate``
    would wait for it: the claimer refuses instead, and claims in it once they exist."""
    app = psycopg.connect(pg_dsn)  # not autocommit: the application's transaction
    try:
        app.execute("SELECT 1")
        assert app.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        claimer = PostgresClaimer(app)
        with pytest.raises(ConfigError, match="inside the caller's open transaction"):
            claimer.claim("purge@1")
        assert app.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        # The application's transaction is still open, and holds no lock of ours.
        began = time.monotonic()
        changes = migrate(pg_dsn, timeout=5)
        assert time.monotonic() - began < 5
        assert {c.kind: c.action for c in changes}["claims"] == "created"
        app.rollback()
        app.execute("SELECT 1")  # the application's next transaction
        assert claimer.claim("purge@1")  # now it joins the transaction, as documented
        app.commit()
    finally:
        app.close()
    with psycopg.connect(pg_dsn, autocommit=True) as check:
        row = check.execute("SELECT count(*) FROM rselection_claims").fetchone()
        assert row == (1,)


def test_rselection_migrate_waits_for_the_migration_lock_at_most_its_timeout(
    pg_dsn: str,
) -> None:
    admin = psycopg.connect(pg_dsn, autocommit=True)
    try:
        admin.execute("BEGIN")
        admin.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        began = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "rselection", "migrate", "--dsn", pg_dsn, "--timeout", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - began
        admin.execute("COMMIT")
    finally:
        admin.close()
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "waited 1 s for the migration lock (held by pid" in out.stderr
    assert took < 15, f"rselection migrate --timeout 1 took {took:.1f} s"
    bad = subprocess.run(
        [sys.executable, "-m", "rselection", "migrate", "--dsn", pg_dsn, "--timeout", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "positive number of seconds" in bad.stderr
