"""Recording blinker signals in tests."""

from __future__ import annotations

import threading
from typing import Any


class Recorder:
    """Collects signal kwargs for one sender while connected."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, sender: object, **kwargs: Any) -> None:
        with self._lock:
            self.calls.append(kwargs)

    def of(self, task: str, **match: Any) -> list[dict[str, Any]]:
        """Calls for ``task`` whose kwargs include ``match``."""
        with self._lock:
            calls = list(self.calls)
        return [
            c
            for c in calls
            if c.get("task") == task and all(c.get(k) == v for k, v in match.items())
        ]
