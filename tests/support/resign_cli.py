"""Running ``rselection resign`` and reading a fleet's elections, for the resign tests."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Any

import pytest

from rselection.commands.demo_fleet import Fleet


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m rselection ARGS`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "rselection", *args], capture_output=True, text=True, timeout=timeout
    )


def took_ms(out: str) -> float:
    """The handover time that ``rselection resign`` printed."""
    found = re.search(r"handover took (\d+) ms", out)
    assert found, out
    return float(found.group(1))


def elected(fleet: Fleet, timeout: float, exclude: str | None = None) -> dict[str, Any]:
    """The next election of a node other than ``exclude``; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        event = fleet.next_event(left)
        if event and event["ev"] == "elected" and event["node"] != exclude:
            return event
    pytest.fail(f"no node was elected within {timeout}s; events: {fleet.history[-20:]}")


def seen_or_wait(fleet: Fleet, timeout: float, **match: Any) -> dict[str, Any] | None:
    """An event already read (while waiting for another) or arriving within ``timeout``."""
    for event in fleet.history:
        if all(event.get(k) == v for k, v in match.items()):
            return event
    return fleet.wait_for(timeout, **match)
