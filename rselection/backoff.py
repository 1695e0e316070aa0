"""Capped exponential backoff: how long to wait before trying again after failures.

One rule for every reconnect and restart of the machinery (leaders, the ring watcher,
the broadcaster's sessions, heartbeats, persistent tasks): the first wait doubles after
each failure up to a cap, jittered to 50-100 % so that processes that failed together
do not all try again at the same instant.
"""

from __future__ import annotations

import random

__all__ = ["backoff"]

_MOST_DOUBLINGS = 16  # 2**16 times the first wait is past every cap


def backoff(failures: int, *, first: float = 0.1, cap: float = 5.0, jitter: bool = True) -> float:
    """Seconds to wait after ``failures`` failed attempts in a row (>= 1): ``first``,
    doubled for each further failure, at most ``cap``; jittered to 50-100 % of that
    unless ``jitter`` is false."""
    base = min(cap, first * 2.0 ** min(max(failures - 1, 0), _MOST_DOUBLINGS))
    return base * random.uniform(0.5, 1.0) if jitter else base
