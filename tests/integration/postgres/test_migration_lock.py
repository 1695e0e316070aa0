"""A node cut off in the middle of creating tables must not block every other node."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from rselection.postgres.schema import MIGRATION_LOCK_KEY, create_tables
from tests.support.pg import with_host_port
from tests.support.waiting import wait_until


def test_a_client_cut_off_mid_migration_frees_the_migration_lock(
    pg_dsn: str, make_tcp_proxy: Callable[[str, int], Any]
) -> None:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    proxy = make_tcp_proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    admin = psycopg.connect(pg_dsn, autocommit=True)
    cut_off = psycopg.connect(with_host_port(pg_dsn, proxy.host, proxy.port), autocommit=True)
    pid = cut_off.info.backend_pid
    try:
        # Hold the migration lock so that the other client waits for it, then cut its
        # link: it gets the lock the moment we let go, but never hears of it, so its
        # transaction sits idle on the server holding the lock.
        admin.execute("BEGIN")
        admin.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        worker = threading.Thread(
            target=lambda: _swallow(lambda: create_tables(cut_off, nodes="cut_off_nodes")),
            daemon=True,
        )
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
        proxy.heal()
        admin.close()
        cut_off.close()


def _swallow(fn: Callable[[], object]) -> None:
    # The cut-off client fails one way or another; that is not what this test is about.
    with contextlib.suppress(Exception):
        fn()


pytestmark = pytest.mark.slow
