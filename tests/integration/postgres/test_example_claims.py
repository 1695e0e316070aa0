"""examples/claims_with_apscheduler.py: three APScheduler processes, each fire runs once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

# The dev extra installs APScheduler 3; a missing one is an error, never a skip.
import apscheduler  # noqa: F401
import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "claims_with_apscheduler.py"
LINE = re.compile(r"^\[(n\d)\] (ran|skipped) (tick@\S+Z)")


@pytest.mark.parametrize("mode", ["claim", "both"])
def test_three_schedulers_run_every_fire_exactly_once(pg_dsn: str, mode: str) -> None:
    args = [sys.executable, str(EXAMPLE), "--dsn", pg_dsn, "--seconds", "4", "--mode", mode]
    procs = [
        subprocess.Popen(
            [*args, "--node", f"n{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for i in range(3)
    ]
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=60))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
        assert out.rstrip().endswith("stopped"), out
        assert "backend error" not in out, out
    events = [m.groups() for out, _ in outputs for m in map(LINE.match, out.splitlines()) if m]
    seen = {key for _, _, key in events}
    ran = Counter(key for _, what, key in events if what == "ran")
    assert len(seen) >= 3, events  # about one fire a second for 4 s
    duplicates = {key: n for key, n in ran.items() if n > 1}
    missed = sorted(seen - set(ran))
    assert duplicates == {}, events
    if mode == "claim":
        assert missed == [], events
    else:
        # The elector hands over when its holder stops: a fire due between the holder's
        # last fire and its resignation is seen by the others while it still holds, and
        # runs nowhere (the example's docstring says so). Any other fire runs.
        assert all(at_a_handover(key, events) for key in missed), (missed, events)
    # Every process saw the fires it was up for; fires are whole seconds, one key each.
    assert all(key.endswith(".000000000Z") for key in seen)
    if mode == "both":
        # One elected process runs the fires. A process that finishes first resigns, so
        # one still running may take over (under load the processes start seconds
        # apart): in fire order, each node's fires form one block, and a node that
        # handed over never runs again.
        runners = [node for node, what, _ in sorted(events, key=lambda e: e[2]) if what == "ran"]
        blocks = [node for i, node in enumerate(runners) if i == 0 or runners[i - 1] != node]
        assert len(blocks) == len(set(blocks)), runners


def at_a_handover(key: str, events: list[tuple[str, str, str]]) -> bool:
    """Whether fire ``key`` fell where the running node changed: the last fire run
    before it and the first run after it ran on different nodes (or none ran after)."""
    runs = sorted((k, node) for node, what, k in events if what == "ran")
    before = [node for k, node in runs if k < key]
    after = [node for k, node in runs if k > key]
    return bool(before) and (not after or after[0] != before[-1])
