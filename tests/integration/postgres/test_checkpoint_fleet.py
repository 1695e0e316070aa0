"""The checkpoint store across processes: concurrent migrations, kill -9 during saves."""

from __future__ import annotations

import hashlib
import json
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

import psycopg
import pytest

from rselection.postgres import PostgresCheckpointStore, migrate
from rselection.postgres.schema import LEASES_VERSION, NODES

MIGRATE_CHILD = """
import json, sys
from rselection.postgres import PostgresCheckpointStore, migrate
store = PostgresCheckpointStore(sys.argv[1], create_tables=False)
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()  # the parent releases every process at once
actions = {change.kind: change.action for change in migrate(sys.argv[1])}
snap = store.save(("child", sys.argv[2]), {"actions": actions})
print(json.dumps({"actions": actions, "version": snap.version}), flush=True)
"""

SAVE_LOOP_CHILD = """
import hashlib, json, os, sys
from rselection.postgres import PostgresCheckpointStore
store = PostgresCheckpointStore(sys.argv[1])
snap = store.load("loop")
counter = snap.state["counter"] if snap is not None else 0
while True:
    counter += 1
    items = [f"item-{i}" for i in range(counter)]
    payload = os.urandom(300_000).hex()  # ~600 kB per save: kills land mid-transfer
    body = json.dumps([counter, items, payload])
    state = {"counter": counter, "items": items, "payload": payload,
             "sha256": hashlib.sha256(body.encode()).hexdigest()}
    saved = store.save("loop", state)
    print(json.dumps({"saved": saved.version, "counter": counter}), flush=True)
"""


def _pump(stream: IO[str], lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line.strip())


def _spawn(
    code: str, *args: str
) -> tuple[subprocess.Popen[str], queue.Queue[str], threading.Thread]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    pump = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
    pump.start()
    return proc, lines, pump


def _next_line(lines: queue.Queue[str], deadline: float, what: str) -> str:
    try:
        return lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        pytest.fail(f"timed out waiting for {what}")


def test_four_processes_migrate_at_once(pg_dsn: str) -> None:
    procs = [_spawn(MIGRATE_CHILD, pg_dsn, str(i)) for i in range(4)]
    try:
        deadline = time.monotonic() + 30
        for _, lines, _ in procs:
            assert _next_line(lines, deadline, "children to start") == "ready"
        for proc, _, _ in procs:  # release all four together
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(_next_line(lines, deadline, "migrations")) for _, lines, _ in procs]
        for proc, _, _ in procs:
            assert proc.wait(30) == 0
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    kinds = ["leases", "claims", "elections", "nodes", "broadcast", "checkpoints", "drains"]
    for kind in kinds:  # exactly one process created each kind of table
        actions = sorted(r["actions"][kind] for r in results)
        assert actions == ["created", "present", "present", "present"], (kind, actions)
    assert all(r["version"] == 1 for r in results)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        recorded = conn.execute(
            "SELECT component, version FROM rselection_schema_version ORDER BY 1"
        ).fetchall()
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            " AND tablename LIKE 'rselection_checkpoint%' ORDER BY 1"
        ).fetchall()
        keys = conn.execute("SELECT count(*) FROM rselection_checkpoints").fetchone()
    latest = {"leases": LEASES_VERSION, "nodes": NODES.version}
    assert dict(recorded) == {kind: latest.get(kind, 1) for kind in kinds}
    assert [t[0] for t in tables] == ["rselection_checkpoint_leases", "rselection_checkpoints"]
    assert keys == (4,)


def _complete(state: dict[str, Any]) -> bool:
    body = json.dumps([state["counter"], state["items"], state["payload"]])
    return (
        len(state["items"]) == state["counter"]
        and state["items"][-1] == f"item-{state['counter'] - 1}"
        and hashlib.sha256(body.encode()).hexdigest() == state["sha256"]
    )


def test_kill_9_during_a_save_loop_leaves_a_complete_snapshot(pg_dsn: str) -> None:
    rng = random.Random(7)
    migrate(pg_dsn, table=None, claims_table=None, elections_table=None, nodes_table=None)
    store = PostgresCheckpointStore(pg_dsn, create_tables=False)
    outcomes: list[str] = []
    for round_ in range(10):
        proc, lines, pump = _spawn(SAVE_LOOP_CHILD, pg_dsn)
        acknowledged = 0
        try:
            deadline = time.monotonic() + 30
            want = rng.randint(2, 6)
            seen = 0
            while seen < want:
                event = json.loads(_next_line(lines, deadline, f"round {round_}: saves"))
                acknowledged = event["saved"]
                seen += 1
            # Kill at a random point of the next save (payload encode, send or commit).
            time.sleep(rng.uniform(0, 0.08))
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        pump.join(10)  # every acknowledgement printed before the kill has been read
        assert not pump.is_alive()
        while not lines.empty():
            acknowledged = json.loads(lines.get_nowait())["saved"]
        snap = store.load("loop")
        assert snap is not None
        assert _complete(snap.state), f"round {round_}: partial snapshot"
        # The stored snapshot is the last acknowledged one or the one in flight.
        assert snap.version in (acknowledged, acknowledged + 1), (snap.version, acknowledged)
        assert snap.state["counter"] == snap.version
        outcomes.append("in-flight committed" if snap.version > acknowledged else "rolled back")
    print(f"kill -9 outcomes: {outcomes}")
    store.close()
