"""examples/postgres_leader.py: two copies, one leads; Ctrl-C or SIGTERM on it hands over."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "postgres_leader.py"


def _start(
    dsn: str, lines: queue.Queue[tuple[int, str]], index: int, *args: str
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--dsn", dsn, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((index, line.rstrip()))

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _expect(lines: queue.Queue[tuple[int, str]], needle: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            index, line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if needle in line:
            return index
    raise AssertionError(f"{needle!r} not printed within {timeout}s; got {seen}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_two_nodes_hand_over_on_ctrl_c_or_sigterm(pg_dsn: str, signum: signal.Signals) -> None:
    lines: queue.Queue[tuple[int, str]] = queue.Queue()
    procs = [_start(pg_dsn, lines, i) for i in range(2)]
    try:
        first = _expect(lines, "is now the leader", 30)
        _expect(lines, "fire report@", 10)
        procs[first].send_signal(signum)
        assert procs[first].wait(15) == 0
        second = _expect(lines, "is now the leader", 10)
        assert second != first
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_node_of_a_newer_version_takes_over_once_it_settled(pg_dsn: str) -> None:
    lines: queue.Queue[tuple[int, str]] = queue.Queue()
    procs = [_start(pg_dsn, lines, 0, "--version", "1.0", "--settle", "1")]
    try:
        assert _expect(lines, "is now the leader", 30) == 0
        procs.append(_start(pg_dsn, lines, 1, "--version", "1.1", "--settle", "1"))
        assert _expect(lines, "is now the leader", 30) == 1
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(15) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
