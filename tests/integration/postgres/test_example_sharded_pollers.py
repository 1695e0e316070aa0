"""examples/sharded_pollers.py: two copies share the shards; Ctrl-C or SIGTERM on one hands
its shards over."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "sharded_pollers.py"


def _start(dsn: str, lines: queue.Queue[tuple[int, str]], index: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--dsn", dsn, "--name", "example-pollers"],
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
    raise AssertionError(f"{needle!r} not printed within {timeout}s; got {seen[-20:]}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_two_copies_split_the_shards_and_a_stop_signal_hands_them_over(
    pg_dsn: str, signum: signal.Signals
) -> None:
    lines: queue.Queue[tuple[int, str]] = queue.Queue()
    first = _start(pg_dsn, lines, 0)
    procs = [first]
    try:
        assert _expect(lines, "owns 8 shards", 30) == 0
        _expect(lines, "(term 1): poll 1 of", 10)
        procs.append(_start(pg_dsn, lines, 1))
        assert _expect(lines, "owns 4 shards", 30) in (0, 1)
        _expect(lines, "owns 4 shards", 10)
        first.send_signal(signum)
        assert first.wait(15) == 0
        assert _expect(lines, "owns 8 shards", 15) == 1
        # The checkpoint comes along with a shard: the new owner's count goes on from the
        # old owner's (every shard polled at least once on the first node).
        deadline = time.monotonic() + 10
        while True:
            index, line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            found = re.search(r"\(term (\d+)\): poll (\d+) of", line)
            if index == 1 and found and int(found.group(1)) >= 2:
                assert int(found.group(2)) >= 2, line
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
