"""examples/heartbeat_monitor.py: three nodes, one killed, the leader reports it lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "heartbeat_monitor.py"


def test_the_leader_reports_the_killed_node_lost(pg_dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dsn", pg_dsn],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    leads = [line for line in lines if " leads " in line]
    assert leads, done.stdout
    leader = leads[0].split("]")[0].lstrip("[")
    killed = next(line for line in lines if line.startswith("--- kill -9 ")).split()[-1]
    assert killed != leader
    for node in ("n1", "n2", "n3"):
        assert f"[{leader}] node_joined {node}" in done.stdout
    assert f"[{leader}] node_lost {killed}" in done.stdout
    noticed = next(line for line in lines if "the leader noticed after" in line)
    seconds = float(noticed.split("after ")[1].split(" s")[0])
    # node_timeout (3 heartbeats of 0.5 s) + one heartbeat + one poll, with room to spare.
    assert seconds < 5.0, noticed
