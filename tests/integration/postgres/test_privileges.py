"""The privileges "The trust boundary" documents are the ones a fleet and its operators need.

The table of ``docs/explanation/security.md`` is read as it is written; roles get
exactly its privileges (plus ``USAGE`` on the schema) on tables an owner created, and
then run what each column names: the nodes a fleet of leaders with fenced, claimed,
checkpointed scheduled tasks, membership, a broadcaster (its retention purge too), an
elector and checkpoint leases; ``rselection status``; ``rselection resign`` and
``forget``. Nothing may be refused.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import rselection as rs
from rselection.postgres import (
    PostgresBroadcaster,
    PostgresCheckpointStore,
    PostgresElector,
    migrate,
)
from tests.support.waiting import wait_until

PAGE = Path(__file__).resolve().parents[3] / "docs" / "explanation" / "security.md"
FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


def documented() -> dict[str, dict[str, str]]:
    """Per column of the page's privilege table (``nodes``, ...), per table, the
    privileges it lists (``""`` for none)."""
    text = PAGE.read_text()
    rows = text.split("<!-- privileges -->\n", 1)[1].split("\n\n", 1)[0].splitlines()
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    found: dict[str, dict[str, str]] = {column: {} for column in header[1:]}
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        table = cells[0].strip("`")
        for column, cell in zip(header[1:], cells[1:], strict=True):
            found[column][table] = "" if cell == "—" else cell
    return found


@pytest.fixture
def roles(pg_dsn: str) -> Iterator[dict[str, str]]:
    """A DSN per column of the table, of a role with exactly its privileges; the tables
    were created by the test's own (owner) role."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("CREATE TABLE app_writes (term bigint NOT NULL)")
        schema = conn.execute("SELECT current_schema()").fetchone()[0]  # type: ignore[index]
    made: dict[str, str] = {}
    names: list[str] = []
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for column, tables in documented().items():
                role = f"rs_{re.sub(r'[^a-z]', '', column)[:12]}_{uuid.uuid4().hex[:8]}"
                ident = sql.Identifier(role)
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
                names.append(role)
                conn.execute(
                    sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), ident)
                )
                for table, privileges in tables.items():
                    if privileges:
                        conn.execute(
                            sql.SQL(f"GRANT {privileges} ON {{}} TO {{}}").format(
                                sql.Identifier(table), ident
                            )
                        )
                if column == "nodes":  # the application's own table, for its fenced writes
                    conn.execute(sql.SQL("GRANT INSERT ON app_writes TO {}").format(ident))
                made[column] = make_conninfo(pg_dsn, user=role)
        yield made
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for role in names:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    (role,),
                )
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rselection", *args, "--dsn", dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )


def messages_left(dsn: str, table: str) -> int:
    """How many messages the broadcast table still holds."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
        row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def test_the_documented_privileges_run_a_fleet_and_its_commands(
    roles: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    reader = "`rselection status`, `history`, `task history`"
    operator = "`rselection resign`, `forget`, `task`"
    assert set(roles) == {"nodes", reader, operator}
    dsn = roles["nodes"]
    assert conninfo_to_dict(dsn)["user"] != conninfo_to_dict(roles[reader])["user"]
    caplog.set_level(logging.WARNING)
    fired: list[int] = []
    handler = rs.TaskHandler()

    @handler.interval(0.2, name="write")
    def write(ctx: rs.TaskContext) -> None:
        with psycopg.connect(dsn) as conn, conn.transaction():
            ctx.fence(conn)
            conn.execute("INSERT INTO app_writes VALUES (%s)", (ctx.term,))
        if ctx.checkpoint is not None:
            ctx.checkpoint.save({"fires": len(fired)})
        fired.append(ctx.term)

    options: dict[str, Any] = {"create_tables": False, **FAST}
    broadcaster = PostgresBroadcaster(dsn, create_tables=False, retention=1.0)
    store = PostgresCheckpointStore(dsn, create_tables=False)
    a = rs.PostgresLeader(dsn, handler, name="jobs", node_id="a", checkpoint_store=store, **options)
    b = rs.PostgresLeader(dsn, rs.TaskHandler(), name="jobs", node_id="b", **options)
    subscription = broadcaster.subscribe("news")
    try:
        a.start()
        assert a.wait_until_leader(10)
        b.start()
        wait_until(lambda: len(fired) >= 3, 10, "fenced, claimed, checkpointed fires")
        wait_until(lambda: len(a.nodes()) == 2, 10, "both nodes' heartbeats")
        broadcaster.publish("news", "hello")
        assert subscription.get(timeout=10) == "hello"
        # The writer purges on its own about a second after its first write, so the
        # message may be gone before this purge gets to it: either purge counts.
        wait_until(
            lambda: broadcaster.purge() >= 1 or not messages_left(dsn, broadcaster.table),
            10,
            "the retention purge",
        )
        elector = PostgresElector(dsn, name="el", node_id="e", ttl=3, create_tables=False)
        assert elector.is_leader()
        assert store.acquire_lease("k", "e", 3)

        shown = cli(roles[reader], "status")
        assert shown.returncode == 0, shown.stderr
        assert "jobs" in shown.stdout and "write" in shown.stdout, shown.stdout

        def task(*args: str) -> str:
            role = roles[reader] if args[0] == "history" else roles[operator]
            done = cli(role, "task", args[0], "jobs", "write", *args[1:])
            assert done.returncode == 0, done.stderr
            return done.stdout

        task("pause")
        wait_until(lambda: "(paused, by operator)" in task("history"), 10, "a skip on record")
        task("trigger")
        task("resume")
        wait_until(lambda: "ok (by operator)" in task("history"), 10, "the triggered run")
        resigned = cli(roles[operator], "resign", "jobs")
        assert resigned.returncode == 0, resigned.stderr
        assert b.wait_until_leader(10)
        history = cli(roles[reader], "history", "jobs")
        assert history.returncode == 0, history.stderr
        assert "stepped_down (by operator)" in history.stdout, history.stdout
    finally:
        subscription.close()
        b.stop(timeout=10)
        a.stop(timeout=10)
        broadcaster.close()
    forgot = cli(roles[operator], "forget", "jobs")
    assert forgot.returncode == 0, forgot.stderr
    refused = [r.getMessage() for r in caplog.records if "permission denied" in r.getMessage()]
    assert not refused, refused
