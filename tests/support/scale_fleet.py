"""Drive ``scale_node`` processes: start them, read their events, kill or stop them.

``ScaleNode`` is one node process (K leaders of ``<prefix>/<i>``); a reader thread keeps
its events in order, and :meth:`ScaleNode.wait_for` waits (bounded) for a condition on
them. ``ScaleFleet`` holds several nodes on one set of leases and answers, from their
``elected`` and ``demoted`` events, who leads what.

Every node runs ``tests/support/scale_node.py`` by path with ``PYTHONPATH`` set to the
code tree to measure (this repository by default), so a benchmark can run the same
node program against another checkout of the library.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["NODE_SCRIPT", "REPO_ROOT", "ScaleFleet", "ScaleNode", "percentile"]

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = Path(__file__).resolve().with_name("scale_node.py")

Event = dict[str, Any]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[min(len(ordered), int(rank)) - 1]


class ScaleNode:
    """One ``scale_node`` process and the events it printed.

    Args:
        node: node id of its leaders.
        dsn: the connection string (handed over in the environment, not the command line).
        prefix: lease names are ``<prefix>/<i>``.
        count: number of leases (leaders) in the process.
        args: more ``scale_node`` options (timings, task kinds, ``--renewals``...).
        code_tree: directory whose ``rselection`` package the node imports.
        log_dir: where the node's stderr goes (``<node>.log``); a temporary directory
            by default.
    """

    def __init__(
        self,
        node: str,
        dsn: str,
        prefix: str,
        count: int,
        args: Iterable[str] = (),
        *,
        code_tree: Path | str = REPO_ROOT,
        log_dir: Path | str | None = None,
    ) -> None:
        self.node = node
        self.prefix = prefix
        self.count = count
        self.events: list[Event] = []
        self._led: dict[str, int] = {}  # lease -> term, kept up to date by the reader
        self._cond = threading.Condition()
        self._closed_stdout = False
        directory = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp("-scale"))
        self.log_path = directory / f"{node}.log"
        env = dict(os.environ, SCALE_NODE_DSN=dsn, PYTHONPATH=str(code_tree))
        env.pop("PYTHONSTARTUP", None)
        cmd = [
            sys.executable,
            str(NODE_SCRIPT),
            "--prefix",
            prefix,
            "--count",
            str(count),
            "--node",
            node,
            *args,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
                env=env,
            )
        assert self.proc.stdout is not None
        self._reader = threading.Thread(
            target=self._read, args=(self.proc.stdout,), name=f"scale-read-{node}", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not an event (a stray print); the log keeps the details
            with self._cond:
                self.events.append(event)
                if event.get("event") == "elected":
                    self._led[event["lease"]] = event["term"]
                elif (
                    event.get("event") == "demoted"
                    and self._led.get(event["lease"]) == event["term"]
                ):
                    del self._led[event["lease"]]
                self._cond.notify_all()
        with self._cond:
            self._closed_stdout = True
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[list[Event]], bool], timeout: float, what: str
    ) -> float:
        """Wait until ``predicate(events)`` holds; return the seconds it took.

        Raises:
            TimeoutError: not within ``timeout`` seconds, or the process ended first;
                the message says ``what`` was awaited and ends with the node's log.
        """
        start = time.monotonic()
        deadline = start + timeout
        with self._cond:
            while not predicate(self.events):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed_stdout:
                    break
                self._cond.wait(min(left, 0.5))
            else:
                return time.monotonic() - start
        ended = "" if self.proc.poll() is None else f" (exited with {self.proc.returncode})"
        raise TimeoutError(
            f"node {self.node}{ended}: no {what} within {timeout:g}s; "
            f"last events: {self.events[-5:]}; log tail:\n{self.log_tail()}"
        )

    def snapshot(self) -> list[Event]:
        """A copy of the events so far."""
        with self._cond:
            return list(self.events)

    def of(self, event: str, since: float = float("-inf")) -> list[Event]:
        """Events named ``event`` reported at or after ``since`` (monotonic)."""
        return [e for e in self.snapshot() if e["event"] == event and e["mono"] >= since]

    def ready(self, timeout: float) -> Event:
        """Wait for the ``ready`` event (every leader built and started) and return it."""
        self.wait_for(lambda evs: any(e["event"] == "ready" for e in evs), timeout, "ready")
        return self.of("ready")[0]

    def leading(self) -> dict[str, int]:
        """Leases this node leads now, by its events: lease name -> term."""
        with self._cond:
            return dict(self._led)

    def signal(self, signum: int) -> float:
        """Send ``signum``; return ``time.monotonic()`` just before it was sent."""
        sent = time.monotonic()
        os.kill(self.proc.pid, signum)
        return sent

    def kill(self) -> float:
        """kill -9; return the monotonic time it was sent (and reap the process)."""
        sent = self.signal(signal.SIGKILL)
        self.proc.wait(10)
        return sent

    def terminate(self) -> float:
        """SIGTERM (graceful stop of every leader); return the monotonic send time."""
        return self.signal(signal.SIGTERM)

    def close(self, timeout: float = 30.0) -> None:
        """Stop gracefully, or kill after ``timeout`` seconds. Idempotent."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)

    def log_tail(self, lines: int = 15) -> str:
        """The end of the node's stderr."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ScaleFleet:
    """Node processes competing for the same ``count`` leases ``<prefix>/<i>``.

    Args:
        dsn: the connection string of every node, unless :meth:`add` gets another.
        prefix: lease name prefix shared by the nodes.
        count: leases per node (every node runs a leader of each lease).
        args: ``scale_node`` options for every node.
        code_tree: the library checkout the nodes import.
        log_dir: where node logs go (a temporary directory by default).
    """

    def __init__(
        self,
        dsn: str,
        prefix: str,
        count: int,
        args: Iterable[str] = (),
        *,
        code_tree: Path | str = REPO_ROOT,
        log_dir: Path | str | None = None,
    ) -> None:
        self.dsn = dsn
        self.prefix = prefix
        self.count = count
        self.args = list(args)
        self.code_tree = code_tree
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp("-scale"))
        self.nodes: dict[str, ScaleNode] = {}
        self.leases = [f"{prefix}/{i}" for i in range(count)]

    def add(self, node: str, extra: Iterable[str] = (), dsn: str | None = None) -> ScaleNode:
        """Start one more node process."""
        proc = ScaleNode(
            node,
            dsn or self.dsn,
            self.prefix,
            self.count,
            [*self.args, *extra],
            code_tree=self.code_tree,
            log_dir=self.log_dir,
        )
        self.nodes[node] = proc
        return proc

    def alive(self) -> list[ScaleNode]:
        """Nodes whose process still runs."""
        return [n for n in self.nodes.values() if n.proc.poll() is None]

    def holders(self, nodes: Iterable[ScaleNode] | None = None) -> dict[str, set[str]]:
        """For each lease, the nodes (of ``nodes``, default the live ones) leading it."""
        out: dict[str, set[str]] = {lease: set() for lease in self.leases}
        for node in nodes if nodes is not None else self.alive():
            for lease in node.leading():
                out.setdefault(lease, set()).add(node.node)
        return out

    def wait_all_led(self, timeout: float, nodes: Iterable[ScaleNode] | None = None) -> float:
        """Wait until every lease is led by some node (of ``nodes``); return seconds taken."""
        chosen = list(nodes) if nodes is not None else None
        start = time.monotonic()
        deadline = start + timeout
        while True:
            holders = self.holders(chosen)
            missing = [lease for lease, who in holders.items() if not who]
            if not missing:
                return time.monotonic() - start
            if time.monotonic() > deadline:
                led = len(self.leases) - len(missing)
                tails = "\n".join(f"--- {n.node}:\n{n.log_tail(5)}" for n in self.nodes.values())
                raise TimeoutError(
                    f"{led} of {len(self.leases)} leases led after {timeout:g}s "
                    f"(missing e.g. {missing[:5]}); node logs:\n{tails}"
                )
            time.sleep(0.05)

    def close(self) -> None:
        """Stop every node (gracefully, killed if that takes too long)."""
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            node.close()

    def __enter__(self) -> ScaleFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
