"""The command line: migrate and status against a real Postgres (resign: test_resign.py)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import rselection as rs
from rselection.commands.demo_fleet import Fleet
from rselection.postgres import migrate
from rselection.postgres.handover import cancel_handover, request_handover
from tests.support.waiting import wait_until

FAST = ["--ttl", "3", "--renew-interval", "0.5", "--renew-deadline", "2", "--retry-interval", "0.5"]
CLOSED = "postgresql://u:hunter2@127.0.0.1:1/x?connect_timeout=2"


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rselection", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any database settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "RSELECTION_DSN"}
    env.update(extra)
    return env


def status_json(dsn: str, *more: str) -> tuple[int, dict[str, Any]]:
    out = run("status", "--dsn", dsn, "--json", *more)
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)


def test_migrate_then_status_shows_the_holder(pg_dsn: str) -> None:
    done = run("migrate", "--dsn", pg_dsn)
    assert done.returncode == 0, done.stderr
    for line in (
        "lease table 'rselection_leases': created (schema version 5)",
        "claims table 'rselection_claims': created (schema version 1)",
        "elections table 'rselection_elections': created (schema version 1)",
        "nodes table 'rselection_nodes': created (schema version 3)",
        "broadcast tables 'rselection_broadcast', 'rselection_broadcast_state': created "
        "(schema version 1)",
        "checkpoint tables 'rselection_checkpoints', 'rselection_checkpoint_leases': "
        "created (schema version 1)",
        "drains table 'rselection_nodes_drains': created (schema version 1)",
    ):
        assert line in done.stdout.splitlines(), done.stdout
    again = run("migrate", "--dsn", pg_dsn)
    assert again.returncode == 0, again.stderr
    assert "created" not in again.stdout and "upgraded" not in again.stdout
    assert again.stdout.count("already present") == 7, again.stdout
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


def test_status_on_an_unreachable_server_exits_3() -> None:
    out = run("status", "--dsn", "postgresql://u:hunter2@127.0.0.1:1/x?connect_timeout=2")
    assert out.returncode == 3
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
    assert out.returncode == 2  # a usage error, not "a lease has no leader" (1)
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
    # The demo cleans up: its lease is retired (the row and its term stay), its ledger
    # table is dropped, so a shared database keeps no headless lease and no table from it.
    code, doc = status_json(pg_dsn)
    assert code == 0 and doc["leases"] == []
    (hidden,) = doc["hidden"]
    assert hidden.startswith("demo-")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT term, retired_term FROM rselection_leases WHERE name = %s", (hidden,)
        ).fetchone()
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
                " AND tablename LIKE 'rselection_demo%%'"
            )
        ]
    assert row is not None and row[0] >= 3 and row[1] == row[0]
    assert tables == []


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="as root the demo refuses its embedded server (the test below); run as a user",
)
def test_demo_on_its_own_postgres_shows_no_runtime_directory_warning(tmp_path: Any) -> None:
    pytest.importorskip("pgserver")
    env = clean_env()
    env.pop("XDG_RUNTIME_DIR", None)  # as in containers, cron jobs and sudo
    out = subprocess.run(
        [sys.executable, "-m", "rselection", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "graceful handover took" in out.stdout
    assert "XDG_RUNTIME_DIR" not in out.stdout + out.stderr
    assert "Warning" not in out.stderr, out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="what the embedded server does as root")
def test_the_demo_as_root_refuses_the_embedded_server_and_changes_no_directory() -> None:
    """As root, pgserver adds a system user and makes every directory above the data
    directory readable by all (a 0700 home became 0755); the demo refuses instead, before
    it touches anything, and says what to do."""
    with tempfile.TemporaryDirectory() as top:
        home = pathlib.Path(top) / "home"
        tmp = home / "tmp"
        tmp.mkdir(parents=True)
        for private in (home, tmp):
            private.chmod(0o700)
        modes = {d: stat.S_IMODE(d.stat().st_mode) for d in (home, tmp)}
        out = subprocess.run(
            [sys.executable, "-m", "rselection", "demo"],
            capture_output=True,
            text=True,
            timeout=300,
            env=clean_env(TMPDIR=str(tmp)),
            cwd=top,
        )
        after = {d: stat.S_IMODE(d.stat().st_mode) for d in (home, tmp)}
        left = list(tmp.iterdir())
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "as root" in out.stderr and "--dsn" in out.stderr, out.stderr
    assert "starting a private Postgres" not in out.stdout
    assert after == modes, {str(d): oct(m) for d, m in after.items()}
    assert left == []


# ------------------------------------------------------------------------- status


@pytest.fixture
def fleet(pg_dsn: str) -> Iterator[Fleet]:
    fleet = Fleet(pg_dsn, f"c-{uuid.uuid4().hex[:6]}", FAST)
    with fleet:
        yield fleet


def test_status_table_and_json_with_a_live_fleet(pg_dsn: str, fleet: Fleet) -> None:
    first = fleet.start(3)

    def complete() -> bool:
        _, doc = status_json(pg_dsn)
        alive = [n for n in doc["nodes"] or [] if n["alive"]]
        return len(alive) == 3 and bool(doc["tasks"])

    wait_until(complete, 30, "three heartbeats and a claimed fire", interval=0.3)
    code, doc = status_json(pg_dsn)
    assert code == 0 and doc["exit_code"] == 0 and doc["headless"] == []
    (lease,) = doc["leases"]
    assert lease["name"] == fleet.name and lease["live"]
    assert (lease["holder"], lease["term"]) == (first["node"], first["term"])
    assert 0 < lease["expires_in"] <= 3.0
    nodes = {n["node_id"]: n for n in doc["nodes"]}
    assert set(nodes) == {"n0", "n1", "n2"}
    assert all(n["alive"] and n["lease"] == fleet.name for n in nodes.values())
    assert [n for n, info in nodes.items() if info["is_leader"]] == [first["node"]]
    (tick,) = [t for t in doc["tasks"] if t["task"] == "tick"]
    assert tick["lease"] == fleet.name and tick["node"] == first["node"]
    assert tick["term"] == first["term"] and tick["last_fire"].endswith("Z")
    assert "not recorded" in doc["not_recorded"]
    assert "127.0.0.1" in doc["database"]

    table = run("status", "--dsn", pg_dsn)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert any(
        line.split()[:3] == [fleet.name, first["node"], str(first["term"])] for line in lines
    ), table.stdout
    node_lines = [line.split() for line in lines if line.startswith(fleet.name + " ")]
    assert [row[-1] for row in node_lines if row[1] == first["node"]][-1] == "leader"
    assert "3 alive, 0 lost" in table.stdout
    assert any(line.split()[:2] == [fleet.name, "tick"] for line in lines), table.stdout
    assert "not recorded" in table.stdout
    print(table.stdout)

    fleet.stop_all()  # graceful: the lease is released, nobody leads
    code, doc = status_json(pg_dsn)
    assert code == 1 and doc["headless"] == [fleet.name]
    assert doc["leases"][0]["holder"] is None
    headless = run("status", "--dsn", pg_dsn)
    assert headless.returncode == 1 and f"NO LEADER: {fleet.name}" in headless.stdout


def test_status_finds_the_fires_of_a_lease_with_a_slash_in_its_name(pg_dsn: str) -> None:
    # Claim keys write "/" in a lease name as "%2F": the fires of lease "x/y" are found,
    # and lease "x"'s task "y/tock" is not taken for a task "tock" of lease "x/y".
    fired: dict[str, int] = {}
    leaders = []
    for name, task in (("x/y", "tick"), ("x", "y/tock")):
        handler = rs.TaskHandler()

        def tick(ctx: rs.TaskContext, name: str = name) -> None:
            fired[name] = fired.get(name, 0) + 1

        handler.interval(0.2, name=task)(tick)
        leaders.append(
            rs.PostgresLeader(pg_dsn, handler, name=name, node_id=f"n-{task}", **LEASE_TIMINGS)
        )
    try:
        for leader in leaders:
            leader.start()
        wait_until(lambda: len(fired) == 2, 15, "a fire of each lease")
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
    _, doc = status_json(pg_dsn)
    assert sorted((t["lease"], t["task"]) for t in doc["tasks"]) == [
        ("x", "y/tock"),
        ("x/y", "tick"),
    ]


def test_status_reads_the_newest_fire_of_each_task_through_the_key_index(pg_dsn: str) -> None:
    """Every task of every lease, its newest fire and who claimed it, also for names with
    "@", "/" or "%"; read in a few index probes per task, not a scan of the claims."""
    assert run("migrate", "--dsn", pg_dsn).returncode == 0
    start = datetime(2026, 1, 1, tzinfo=UTC)
    expected = {}
    keys: list[tuple[str, str, int]] = []
    for lease, prefix, task, count in (
        ("a", "a/", "t", 30),
        ("a", "a/", "t@1", 3),  # its keys sort among those of task "t"
        ("a", "a/", "b/c", 4),
        ("a/b", "a%2Fb/", "c", 5),
        ("x%y", "x%25y/", "t", 2),
        ("quiet", "quiet/", "", 0),
    ):
        for i in range(count):
            keys.append((prefix + rs.format_fire_key(task, start + timedelta(seconds=i)), lease, i))
        if count:
            newest = rs.format_fire_key(task, start + timedelta(seconds=count - 1))
            expected[(lease, task)] = (newest.rsplit("@", 1)[1], f"node-{count - 1}")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for i, lease in enumerate(("a", "a/b", "x%y", "quiet", "ab")):
            conn.execute(
                "INSERT INTO rselection_leases (name, lock_key, term) VALUES (%s, %s, 1)",
                (lease, i),
            )
        conn.execute(
            "INSERT INTO rselection_claims"
            " (fire_key, format_version, holder, term, claimed_at, expires_at)"
            " SELECT k, 1, 'node-' || n, 1, now(), now() FROM unnest(%s::text[], %s::int[]) AS"
            " x(k, n)",
            ([k for k, _, _ in keys] + ["a/plain", "ab/t"], [n for _, _, n in keys] + [7, 8]),
        )
        # Enough rows for the planner to prefer the index whatever the statistics.
        conn.execute(
            "INSERT INTO rselection_claims"
            " (fire_key, format_version, holder, term, claimed_at, expires_at)"
            " SELECT 'other/t@' || g, 1, 'n', 1, now(), now() FROM generate_series(1, 20000) g"
        )
        conn.execute("ANALYZE rselection_claims")
        from psycopg import sql

        from rselection.postgres.snapshot import last_fires_sql

        conn.execute("SET jit = off")
        plan = "\n".join(
            row[0]
            for row in conn.execute(
                sql.SQL("EXPLAIN ")
                + last_fires_sql().format(
                    l=sql.Identifier("rselection_leases"), c=sql.Identifier("rselection_claims")
                )
            ).fetchall()
        )
    assert "Seq Scan on rselection_claims" not in plan, plan
    _, doc = status_json(pg_dsn, "--all")
    got = {(t["lease"], t["task"]): (t["last_fire"], t["node"]) for t in doc["tasks"]}
    expected[("a", "plain")] = (None, "node-7")
    expected[("ab", "t")] = (None, "node-8")
    assert got == expected


def test_status_json_on_an_unreachable_server_exits_3() -> None:
    out = run("status", "--dsn", CLOSED, "--json")
    assert out.returncode == 3
    assert "cannot connect to host=127.0.0.1 port=1" in out.stderr
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == 3 and "127.0.0.1" in doc["error"]
    assert "hunter2" not in out.stdout + out.stderr


def test_status_on_a_missing_lease_table_exits_3(pg_dsn: str) -> None:
    out = run("status", "--dsn", pg_dsn, "--table", "nope")
    assert out.returncode == 3
    assert "lease table 'nope' does not exist" in out.stderr


def test_status_watch_prints_every_refresh_then_stops(pg_dsn: str) -> None:
    assert run("migrate", "--dsn", pg_dsn).returncode == 0
    began = time.monotonic()
    out = run("status", "--dsn", pg_dsn, "--json", "--watch", "0.2", "--count", "3")
    took = time.monotonic() - began
    assert out.returncode == 0, out.stderr
    docs = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(docs) == 3 and all(d["exit_code"] == 0 for d in docs)
    assert len({d["checked_at"] for d in docs}) == 3
    assert took >= 0.4  # two pauses between three refreshes

    table = run("status", "--dsn", pg_dsn, "--watch", "0.2", "--count", "2")
    assert table.returncode == 0, table.stderr
    assert table.stdout.count("host=127.0.0.1") == 2

    errors = run("status", "--dsn", CLOSED, "--json", "--watch", "0.2", "--count", "2")
    assert errors.returncode == 3
    lines = [json.loads(line) for line in errors.stdout.splitlines()]
    assert [d["exit_code"] for d in lines] == [3, 3]
    assert "hunter2" not in errors.stdout + errors.stderr


def test_status_watch_runs_until_interrupted(pg_dsn: str) -> None:
    assert run("migrate", "--dsn", pg_dsn).returncode == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "rselection", "status", "--dsn", pg_dsn, "--json", "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        docs = []
        deadline = time.monotonic() + 30
        while len(docs) < 4 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            docs.append(json.loads(line))
        assert len(docs) == 4, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_status_takes_the_database_from_rselection_dsn_and_pg_variables(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute(
            "INSERT INTO rselection_leases (name, holder, term, lock_key)"
            " VALUES ('env', NULL, 2, 1)"
        )
    from_env = run("status", "--json", env=clean_env(RSELECTION_DSN=pg_dsn))
    assert from_env.returncode == 1, from_env.stderr
    assert json.loads(from_env.stdout)["headless"] == ["env"]

    params = conninfo_to_dict(pg_dsn)
    names = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE"}
    pg_vars = {var: str(params[key]) for key, var in names.items() if key in params}
    pg_vars["PGOPTIONS"] = str(params["options"])  # the test's schema
    pg_vars["PGPASSWORD"] = "hunter2"  # ignored by a trusting server, never printed
    from_pg = run("status", "--json", env=clean_env(**pg_vars))
    assert from_pg.returncode == 1, from_pg.stderr
    doc = json.loads(from_pg.stdout)
    assert doc["headless"] == ["env"]
    assert doc["database"].startswith(f"host={params['host']} port={params['port']}")
    table = run("status", env=clean_env(**pg_vars))
    assert table.returncode == 1
    assert "hunter2" not in from_pg.stdout + from_pg.stderr + table.stdout + table.stderr

    unreachable = run("status", env=clean_env(PGHOST="127.0.0.1", PGPORT="1", PGPASSWORD="hunter2"))
    assert unreachable.returncode == 3
    assert "host=127.0.0.1 port=1" in unreachable.stderr
    assert "hunter2" not in unreachable.stdout + unreachable.stderr


def test_status_never_prints_the_password(pg_dsn: str, fleet: Fleet) -> None:
    fleet.start(2)
    with_password = make_conninfo(pg_dsn, password="hunter2")  # a trusting server ignores it
    outputs = [
        run("status", "--dsn", with_password),
        run("status", "--dsn", with_password, "--json"),
        run("status", "--dsn", with_password, "--json", "--watch", "0.1", "--count", "2"),
        run("migrate", "--dsn", with_password),
        run("resign", fleet.name, "--dsn", with_password, "--to", "nobody"),
        run("forget", fleet.name, "--dsn", with_password),
    ]
    assert [o.returncode for o in outputs] == [0, 0, 0, 0, 1, 1]
    for out in outputs:
        assert "hunter2" not in out.stdout + out.stderr


# ------------------------------------------------------------ status NAME, handovers

LEASE_TIMINGS = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


def lead(dsn: str, name: str, node_id: str) -> rs.PostgresLeader:
    """A started leader of ``name`` that leads (bounded wait)."""
    leader = rs.PostgresLeader(dsn, rs.TaskHandler(), name=name, node_id=node_id, **LEASE_TIMINGS)
    leader.start()
    assert leader.wait_until_leader(15), f"{node_id} did not lead {name!r}"
    return leader


def lead_once(dsn: str, name: str, node_id: str) -> int:
    """Lead ``name`` once and stop (the lease is released); return the term it had."""
    leader = lead(dsn, name, node_id)
    term = leader.term
    leader.stop(timeout=10)
    assert term is not None
    return term


def retired_row(dsn: str, name: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT holder, term, retired_term FROM rselection_leases WHERE name = %s", (name,)
        ).fetchone()


def test_status_filters_by_name_and_judges_only_the_named_leases(pg_dsn: str) -> None:
    lead_once(pg_dsn, "gone", "g1")  # released: a lease nobody leads any more
    live = lead(pg_dsn, "live", "l1")
    try:
        code, doc = status_json(pg_dsn)
        assert code == 1 and doc["headless"] == ["gone"]  # every lease is judged
        assert [lease["name"] for lease in doc["leases"]] == ["gone", "live"]

        code, doc = status_json(pg_dsn, "live")
        assert code == 0 and doc["exit_code"] == 0 and doc["headless"] == []
        assert doc["names"] == ["live"]
        assert [lease["name"] for lease in doc["leases"]] == ["live"]
        assert {n["lease"] for n in doc["nodes"]} == {"live"}  # nodes of that lease only

        code, doc = status_json(pg_dsn, "gone")
        assert code == 1 and doc["headless"] == ["gone"]
        assert {n["lease"] for n in doc["nodes"]} <= {"gone"}

        code, doc = status_json(pg_dsn, "live", "nowhere")
        assert code == 1 and doc["unknown"] == ["nowhere"] and doc["headless"] == ["nowhere"]
        assert [lease["name"] for lease in doc["leases"]] == ["live"]

        table = run("status", "live", "nowhere", "--dsn", pg_dsn)
        assert table.returncode == 1, table.stderr
        assert "NO SUCH LEASE in 'rselection_leases': nowhere" in table.stdout
        assert "NO LEADER" not in table.stdout
        assert run("status", "live", "--dsn", pg_dsn).returncode == 0
    finally:
        live.stop(timeout=10)


def test_status_shows_a_pending_handover_request(pg_dsn: str) -> None:
    leader = lead(pg_dsn, "asked", "a1")
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            # Reserved for a node that is not running: the leader hands over, nobody may
            # take the lease until its timeout ends, and the request stays pending.
            asked = request_handover(conn, "asked", to="n9", valid_for=60)
        assert asked is not None
        wait_until(lambda: not leader.is_leader, 10, "the leader to hand over")
    finally:
        leader.stop(timeout=10)
    code, doc = status_json(pg_dsn)
    assert code == 1
    (request,) = doc["handovers"]
    assert (request["lease"], request["term"], request["node_id"], request["to"]) == (
        "asked",
        asked.term,
        "a1",
        "n9",
    )
    assert 0 < request["expires_in"] <= 60 and request["until"].endswith("Z")
    table = run("status", "--dsn", pg_dsn)
    assert "handover requests (pending" in table.stdout, table.stdout
    rows = [line.split() for line in table.stdout.splitlines() if line.startswith("asked ")]
    assert ["asked", str(asked.term), "a1", "n9"] in [row[:4] for row in rows], table.stdout

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert cancel_handover(conn, "asked", asked.term)
    code, doc = status_json(pg_dsn)
    assert doc["handovers"] == []
    assert "handover requests: none pending" in run("status", "--dsn", pg_dsn).stdout


# ----------------------------------------------------------------------- forget


def test_forget_refuses_a_lease_with_a_live_holder_or_live_nodes(pg_dsn: str) -> None:
    leader = lead(pg_dsn, "busy", "b1")
    try:
        out = run("forget", "busy", "--dsn", pg_dsn)
        assert out.returncode == 1
        assert "lease 'busy' has a live holder: b1 leads term" in out.stderr
        assert "stop the service's nodes first" in out.stderr
        assert retired_row(pg_dsn, "busy") == ("b1", leader.term, None)
    finally:
        leader.stop(timeout=10)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a follower still heartbeats
        conn.execute(
            "INSERT INTO rselection_nodes (name, node_id, hostname, pid, started_at, last_seen)"
            " VALUES ('busy', 'b2', 'h', 1, now(), now())"
        )
    out = run("forget", "busy", "--dsn", pg_dsn)
    assert out.returncode == 1
    assert "lease 'busy' still has live nodes (seen within 15s" in out.stderr and "b2" in out.stderr
    # Its heartbeat is older than --node-timeout: the node is gone, the lease may go.
    out = run("forget", "busy", "--dsn", pg_dsn, "--node-timeout", "0.001")
    assert out.returncode == 0, out.stderr
    missing = run("forget", "never-was", "--dsn", pg_dsn)
    assert missing.returncode == 1 and "no lease 'never-was'" in missing.stderr


def test_forget_hides_a_lease_keeps_its_term_and_a_new_leader_brings_it_back(
    pg_dsn: str,
) -> None:
    old_term = lead_once(pg_dsn, "old", "o1")
    assert status_json(pg_dsn)[0] == 1  # the released lease makes status exit 1

    out = run("forget", "old", "--dsn", pg_dsn)
    assert out.returncode == 0, out.stderr
    assert f"retired lease 'old' at term {old_term}" in out.stdout
    assert retired_row(pg_dsn, "old") == (None, old_term, old_term)  # never deleted
    again = run("forget", "old", "--dsn", pg_dsn)
    assert again.returncode == 0 and "already retired" in again.stdout

    code, doc = status_json(pg_dsn)
    assert code == 0 and doc["leases"] == [] and doc["hidden"] == ["old"]
    assert "1 retired lease hidden" in run("status", "--dsn", pg_dsn).stdout
    code, doc = status_json(pg_dsn, "--all")  # shown, but not judged
    assert code == 0 and doc["leases"][0]["retired"] and doc["headless"] == []
    code, doc = status_json(pg_dsn, "old")  # named: shown and judged
    assert code == 1 and doc["leases"][0]["retired"] and doc["headless"] == ["old"]
    assert "(retired)" in run("status", "old", "--dsn", pg_dsn).stdout

    leader = lead(pg_dsn, "old", "o2")  # acquiring the lease again brings it back
    try:
        assert leader.term is not None and leader.term > old_term
        code, doc = status_json(pg_dsn)
        assert code == 0 and doc["hidden"] == []
        (lease,) = doc["leases"]
        assert (lease["name"], lease["holder"], lease["retired"]) == ("old", "o2", False)
    finally:
        leader.stop(timeout=10)
    assert status_json(pg_dsn)[1]["headless"] == ["old"]  # no longer retired


def test_forget_on_a_lease_table_before_version_4_asks_for_migrate(pg_dsn: str) -> None:
    lead_once(pg_dsn, "v3", "v1")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE rselection_leases DROP COLUMN retired_term")
        conn.execute("UPDATE rselection_schema_version SET version = 3 WHERE component = 'leases'")
    code, doc = status_json(pg_dsn)  # status still reads the older table
    assert code == 1 and doc["headless"] == ["v3"] and not doc["leases"][0]["retired"]
    out = run("forget", "v3", "--dsn", pg_dsn)
    assert out.returncode == 1 and "run `rselection migrate`" in out.stderr
    assert run("migrate", "--dsn", pg_dsn).returncode == 0
    assert run("forget", "v3", "--dsn", pg_dsn).returncode == 0
    assert status_json(pg_dsn)[0] == 0


def test_forget_a_redis_lease_keeps_its_term_key_and_a_new_leader_brings_it_back(
    redis_url: str,
) -> None:
    import redis

    from rselection.redis import RedisLeader
    from rselection.redis.keys import retired_key
    from rselection.redis.lease import lease_keys, term_origin_key

    prefix = f"forget-{uuid.uuid4().hex[:6]}:"
    where = ["--redis-url", redis_url, "--key-prefix", prefix]

    def leader(node_id: str) -> RedisLeader:
        made = RedisLeader(
            redis_url,
            rs.TaskHandler(),
            name="r",
            node_id=node_id,
            key_prefix=prefix,
            **LEASE_TIMINGS,
        )
        made.start()
        assert made.wait_until_leader(15)
        return made

    client = redis.Redis.from_url(redis_url)
    try:
        first = leader("r1")
        term = first.term
        assert term is not None
        try:
            out = run("forget", "r", *where)
            assert out.returncode == 1
            assert "lease 'r' has a live holder: r1 leads term" in out.stderr
            assert client.get(retired_key("r", prefix)) is None
        finally:
            first.stop(timeout=10)
        out = run("forget", "r", *where)
        assert out.returncode == 0, out.stderr
        assert f"retired lease 'r' at term {term}" in out.stdout
        term_key = lease_keys("r", prefix)[1]
        kept = str(term).encode()
        assert client.get(term_key) == kept and client.get(retired_key("r", prefix)) == kept
        assert "already retired" in run("forget", "r", *where).stdout

        second = leader("r2")
        assert second.term == term + 1  # the kept term key: a new leader gets a higher term
        second.stop(timeout=10)
        out = run("forget", "r", *where)
        assert out.returncode == 0 and f"retired lease 'r' at term {term + 1}" in out.stdout

        missing = run("forget", "never-was", *where)
        assert missing.returncode == 1 and "no lease 'never-was'" in missing.stderr
    finally:
        client.delete(*lease_keys("r", prefix), term_origin_key("r", prefix))
        client.delete(retired_key("r", prefix))
        client.close()


def test_forget_never_prints_a_password() -> None:
    pg = run("forget", "x", "--dsn", CLOSED)
    assert pg.returncode == 3 and "127.0.0.1" in pg.stderr
    rd = run("forget", "x", "--redis-url", "redis://u:hunter2@127.0.0.1:1/0")
    assert rd.returncode == 3 and "127.0.0.1:1" in rd.stderr
    for out in (pg, rd):
        assert "hunter2" not in out.stdout + out.stderr
