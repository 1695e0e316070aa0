"""A node program in its own process, and the JSON events it prints, for fleet tests."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

Events = list[dict[str, Any]]

_out_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """In a node program: print one JSON event line for :class:`NodeProcess` to read.

    One locked write per line: signal receivers, tasks and the main thread all report,
    and two ``print`` calls from two threads could share a line.
    """
    line = json.dumps({"event": event, **fields}) + "\n"
    with _out_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class NodeProcess:
    """Runs ``python -m <module> <args>``; its stdout carries one JSON event per line.

    Closing its stdin (:meth:`stop`) asks it to stop gracefully.
    """

    def __init__(self, module: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: Events = []
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.events.put(json.loads(line))

    def wait_for(self, what: str, predicate: Callable[[Events], bool], timeout: float) -> None:
        """Read events until ``predicate(seen)`` holds; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate(self.seen):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}; last events: {self.seen[-10:]}"
            try:
                self.seen.append(self.events.get(timeout=left))
            except queue.Empty:
                continue

    def of(self, event: str, **match: Any) -> Events:
        """Events seen so far named ``event`` whose fields include ``match``."""
        return [
            e
            for e in self.seen
            if e["event"] == event and all(e.get(k) == v for k, v in match.items())
        ]

    def keys(self, event: str, **match: Any) -> set[str]:
        """The ``key`` field of the matching events."""
        return {e["key"] for e in self.of(event, **match)}

    def stop(self) -> None:
        """Close stdin: the node stops gracefully."""
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()

    def kill(self) -> None:
        """kill -9."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def reap(self) -> None:
        """Stop it gracefully, or kill it after 15 s."""
        self.stop()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def count(event: str, n: int, **match: Any) -> Callable[[Events], bool]:
    """A predicate: at least ``n`` events named ``event`` (with ``match``) were seen."""

    def enough(seen: Events) -> bool:
        found = [
            e for e in seen if e["event"] == event and all(e.get(k) == v for k, v in match.items())
        ]
        return len(found) >= n

    return enough
