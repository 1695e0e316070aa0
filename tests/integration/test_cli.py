"""The command line: migrate and status against a real Postgres."""

from __future__ import annotations

import subprocess
import sys
import time

import psycopg

import rselection as rs


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rselection", *args], capture_output=True, text=True, timeout=60
    )


def test_migrate_then_status_shows_the_holder(pg_dsn: str) -> None:
    done = run("migrate", "--dsn", pg_dsn)
    assert done.returncode == 0, done.stderr
    assert "rselection_leases" in done.stdout
    assert "checkpoint tables ready (migrations applied: 1)" in done.stdout
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            )
        }
    expected = {"rselection_leases", "rselection_claims", "rselection_elections"}
    expected |= {"rselection_nodes", "rselection_broadcast"}
    assert expected <= tables
    empty = run("status", "--dsn", pg_dsn)
    assert empty.returncode == 0, empty.stderr  # no lease yet: nothing is headless

    leader = rs.PostgresLeader(pg_dsn, rs.TaskHandler(), name="cli", node_id="cli-node")
    leader.start()
    try:
        assert leader.wait_until_leader(10)
        shown = run("status", "--dsn", pg_dsn)
        assert shown.returncode == 0, shown.stderr
        assert "cli-node" in shown.stdout
    finally:
        leader.stop(timeout=10)
    deadline = time.monotonic() + 10
    while (released := run("status", "--dsn", pg_dsn)).returncode != 1:
        assert time.monotonic() < deadline, released.stdout
    assert "(none)" in released.stdout


def test_status_on_an_unreachable_server_exits_2() -> None:
    out = run("status", "--dsn", "postgresql://u:hunter2@127.0.0.1:1/x?connect_timeout=2")
    assert out.returncode == 2
    assert "hunter2" not in out.stderr + out.stdout
    assert "127.0.0.1" in out.stderr


def test_no_dsn_is_a_clear_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rselection", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode != 0
    assert "RSELECTION_DSN" in out.stderr


def test_demo_runs_to_the_end_and_reports_its_measurements(pg_dsn: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rselection", "demo", "--dsn", pg_dsn],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "failover after a crash took" in out.stdout
    assert "graceful handover took" in out.stdout
    assert ", 0 written after a newer term" in out.stdout
