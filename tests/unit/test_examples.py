"""The examples run as documented: as a subprocess, until a deadline or Ctrl-C."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "single_node.py"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the single-node example to completion (bounded)."""
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )


def test_single_node_example_runs_for_a_while_and_stops_cleanly() -> None:
    result = run_example("--seconds", "2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "elected: node local leads with term 1" in out
    sent = re.findall(r"sending heartbeat (\d+) \(fire heartbeat@\S+Z, term 1\)", out)
    got = re.findall(r"monitor got heartbeat (\d+)", out)
    assert len(sent) >= 2, out  # every 0.5 s for 2 s
    assert got and set(got) <= set(sent), out
    assert "demoted: term 1 ended (stopped)" in out
    assert out.rstrip().endswith("stopped cleanly")
    assert "missed heartbeats" not in result.stderr
    assert "Traceback" not in result.stderr


def test_single_node_example_flags_missed_heartbeats() -> None:
    result = run_example("--seconds", "2", "--interval", "0.2", "--silent-after", "2")
    assert result.returncode == 0, result.stderr
    assert "sending heartbeat 2" in result.stdout
    assert "sending heartbeat 3" not in result.stdout
    assert re.search(r"WARNING single_node: missed heartbeats: none for [\d.]+ s", result.stderr)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_single_node_example_stops_cleanly_on_a_signal(signum: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        output: list[str] = []
        while not any("monitor got heartbeat" in line for line in output):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no heartbeat within 30 s: {output}")
            try:
                output.append(lines.get(timeout=remaining))
            except queue.Empty:
                continue
        proc.send_signal(signum)
        proc.wait(timeout=30)
        reader.join(10)
        while not lines.empty():
            output.append(lines.get_nowait())
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
        assert output[-1].strip() == "stopped cleanly"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
