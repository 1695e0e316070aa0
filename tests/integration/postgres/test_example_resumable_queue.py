"""examples/resumable_queue.py: kill -9 the leader; the other copy resumes from its cursor."""

from __future__ import annotations

import collections
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "resumable_queue.py"
ITEMS = 30

Lines = queue.Queue[tuple[int, str]]


def _start(dsn: str, lines: Lines, index: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--dsn", dsn, "--items", str(ITEMS), "--delay", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((index, line.rstrip()))

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _expect(
    lines: Lines, pattern: str, timeout: float, seen: list[tuple[int, str]]
) -> tuple[int, re.Match[str]]:
    """Wait for a line matching ``pattern``; every line read is appended to ``seen``."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            index, line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append((index, line))
        if match := re.search(pattern, line):
            return index, match
    raise AssertionError(f"{pattern!r} not printed within {timeout}s; got {seen[-30:]}")


def test_the_next_leader_resumes_from_the_checkpointed_cursor(pg_dsn: str) -> None:
    lines: Lines = queue.Queue()
    seen: list[tuple[int, str]] = []
    procs = [_start(pg_dsn, lines, i) for i in range(2)]
    try:
        first, _ = _expect(lines, r"no checkpoint, starting at the first item", 30, seen)
        # Let the leader get through a few items, then kill it mid-stream.
        while True:
            index, match = _expect(lines, r"checkpoint cursor=(\d+)", 15, seen)
            if index == first and int(match.group(1)) >= 8:
                break
        time.sleep(random.uniform(0, 0.06))  # anywhere in the next item or its checkpoint
        procs[first].send_signal(signal.SIGKILL)
        assert procs[first].wait(10) == -signal.SIGKILL
        second, resumed = _expect(lines, r"resuming after item (\d+)", 15, seen)
        assert second != first
        _expect(lines, rf"queue drained at item {ITEMS}", 30, seen)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    cursor = int(resumed.group(1))
    # The resumed cursor is the killed leader's last checkpoint: the last one it printed,
    # or one later when it was killed between the commit and the print.
    printed = [
        int(m.group(1))
        for i, line in seen
        if i == first and (m := re.search(r"checkpoint cursor=(\d+)", line))
    ]
    assert cursor in (printed[-1], printed[-1] + 1), (cursor, printed[-3:])

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        done = conn.execute("SELECT item, term FROM example_queue_done ORDER BY seq").fetchall()
    items = [item for item, _ in done]
    counts = collections.Counter(items)
    assert set(items) == set(range(1, ITEMS + 1)), "an item was skipped"
    repeated = {item: n for item, n in counts.items() if n > 1}
    # Only the item in flight at the kill may be processed twice.
    assert set(repeated) <= {cursor + 1} and all(n == 2 for n in repeated.values()), repeated
    terms = [term for _, term in done]
    assert terms == sorted(terms) and len(set(terms)) == 2  # one term, then the next
    print(f"resumed after item {cursor}; repeated items: {repeated or 'none'}")
