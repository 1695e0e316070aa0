"""Bounded waiting for tests: poll a condition, fail the test when time runs out."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

__all__ = ["wait_until"]


def wait_until(
    predicate: Callable[[], object],
    timeout: float = 5.0,
    what: str = "the condition",
    interval: float = 0.005,
) -> float:
    """Poll ``predicate`` every ``interval`` seconds; fail the test after ``timeout``.

    Returns the seconds it took.
    """
    start = time.monotonic()
    deadline = start + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start
