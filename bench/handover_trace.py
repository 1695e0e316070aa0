"""Where a Redis graceful handover spends its time, against an earlier tree, in one run.

Runs ``bench/peers.py --systems rs-redis`` from this checkout and from a checkout of
``--base`` (default ``8927718^``, the last tree with a keeper and a watchdog thread per
leader), the two alternating for ``--sittings`` rounds, with every node traced (see
``bench/tracepoints/sitecustomize.py``: a line at the entry and exit of a few methods
that both trees have). For each tree it prints the bench's kill -9 failover and
graceful handover times (SIGKILL or SIGTERM to the next node's ``elected``), pooled over
the sittings, and the median of each segment of a graceful handover:

* the old leader: ``stop()`` to its tasks' end begun, the tasks' end, to the release
  sent, the release's round trip;
* the next leader: from the release sent to its read of the lease channel that saw it,
  to its attempt sent, the attempt, from the attempt's answer to its tasks' start
  begun, and the start of the tasks (``TaskHandler.start_term``, which returns once
  they run: ``elected`` follows).

The same tree's figures move by about 1 ms from one sitting to the next on 2 cores; the
trees alternate so that both see the same machine. Figures go to stdout only.

Usage::

    python bench/handover_trace.py [--base REV] [--rounds 10] [--sittings 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACEPOINTS = ROOT / "bench" / "tracepoints"
BASE = "8927718^"

SCENARIOS = ("kill -9", "handover")  # the rounds of bench/peers.py whose times are pooled

SEGMENTS = (
    "old leader: stop() to tasks' end begun",
    "old leader: tasks' end",
    "old leader: tasks ended to release sent",
    "old leader: release round trip",
    "next leader: release sent to channel read",
    "next leader: channel read to attempt sent",
    "next leader: the winning attempt",
    "next leader: attempt answered to tasks' start begun",
    "next leader: the tasks' start",
    "stop() to the next leader's tasks started",
)

Event = tuple[int, int, str]  # monotonic ns, pid, point


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """A detached work tree of ``rev`` in a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="rselection-base-") as parent:
        path = Path(parent) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--quiet", "--detach", str(path), rev],
            check=True,
        )
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False
            )


def figures(out: str, scenario: str, tree: Path) -> list[int]:
    """The times (ms) of ``scenario``'s rounds in the output of ``bench/peers.py``."""
    found = re.search(rf"  - {scenario} \(ms, in round order\): ([\d, ]+)", out)
    if found is None:
        raise SystemExit(f"no {scenario} figures in the output of {tree}:\n{out}")
    return [int(x) for x in found.group(1).split(",")]


def sitting(tree: Path, rounds: int) -> tuple[dict[str, list[int]], list[Event]]:
    """One bench run from ``tree``: its kill -9 and handover times (ms) and the nodes'
    trace."""
    with tempfile.TemporaryDirectory(prefix="rselection-trace-") as folder:
        env = dict(os.environ, RS_TRACE=folder, PYTHONPATH=str(TRACEPOINTS))
        command = [
            sys.executable,
            "bench/peers.py",
            "--systems",
            "rs-redis",
            "--rounds",
            str(rounds),
            "--cost-window",
            "2",
            "--no-save",
        ]
        out = subprocess.run(
            command, cwd=tree, env=env, capture_output=True, text=True, check=True
        ).stdout
        times = {scenario: figures(out, scenario, tree) for scenario in SCENARIOS}
        events: list[Event] = []
        for trace in Path(folder).glob("*.txt"):
            for line in trace.read_text().splitlines():
                t, pid, point, *_ = line.split()
                events.append((int(t), int(pid), point))
    events.sort()
    return times, events


def first(window: list[Event], pid: int, point: str, after: int = 0) -> int | None:
    """When ``pid`` first reached ``point`` in ``window``, not before ``after``."""
    return next((t for t, p, at in window if p == pid and at == point and t >= after), None)


def segments(events: list[Event]) -> dict[str, list[float]]:
    """Each handover's segments (ms), from a leader's ``stop()`` (one that released) to
    the tasks of the next leader, a node that ran before that stop."""
    found: dict[str, list[float]] = defaultdict(list)
    for i, (stopped, old, point) in enumerate(events):
        if point != "LeaseLeader.stop>":
            continue
        window: list[Event] = []
        for event in events[i:]:
            window.append(event)
            if event[1] != old and event[2] == "TaskHandler.start_term<":
                break
        else:
            continue  # no next leader in the trace
        started, new = window[-1][0], window[-1][1]
        starting = first(window, new, "TaskHandler.start_term>")
        if new not in {pid for _, pid, _ in events[:i]}:
            continue  # a node of a later fleet: the stop was that of a whole fleet

        ending = first(window, old, "TaskHandler.end_term>")
        ended = first(window, old, "TaskHandler.end_term<")
        sent = first(window, old, "RedisLease.release>")
        answered = first(window, old, "RedisLease.release<")
        if sent is None:
            continue  # a follower's stop: nothing handed over
        attempts = [e[0] for e in window if e[1] == new and e[2] == "RedisLease.try_acquire>"]
        attempt = attempts[-1] if attempts else None
        won = first(window, new, "RedisLease.try_acquire<", attempt) if attempt else None
        read = first(window, new, "RedisLease._drain<", sent)
        if read is not None and (attempt is None or read > attempt):
            read = None  # the attempt was not woken by the release
        pairs = (
            (stopped, ending),
            (ending, ended),
            (ended, sent),
            (sent, answered),
            (sent, read),
            (read, attempt),
            (attempt, won),
            (won, starting),
            (starting, started),
            (stopped, started),
        )
        for name, (a, b) in zip(SEGMENTS, pairs, strict=True):
            if a is not None and b is not None:
                found[name].append((b - a) / 1e6)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=BASE, help=f"the tree to compare with (default {BASE})")
    parser.add_argument("--rounds", type=int, default=10, help="handovers per run (default 10)")
    parser.add_argument("--sittings", type=int, default=2, help="runs per tree (default 2)")
    args = parser.parse_args(argv)
    times: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    found: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with checkout(args.base) as base:
        trees = {f"base ({args.base})": base, "this tree": ROOT}
        for n in range(args.sittings):
            for label, tree in trees.items():
                run_times, events = sitting(tree, args.rounds)
                for scenario, values in run_times.items():
                    times[label][scenario] += values
                for name, values in segments(events).items():
                    found[label][name] += values
                print(
                    f"sitting {n + 1}, {label}: kill -9 p50 "
                    f"{statistics.median(run_times['kill -9'])} ms, handover p50 "
                    f"{statistics.median(run_times['handover'])} ms"
                )
    labels = list(times)
    print()
    print(f"| segment (median, ms) | {' | '.join(labels)} |")
    print(f"| --- |{' --- |' * len(labels)}")
    for scenario in SCENARIOS:
        pooled = [times[label][scenario] for label in labels]
        cells = " | ".join(f"{statistics.median(v):.1f} ({len(v)})" for v in pooled)
        print(f"| bench {scenario} p50 (rounds) | {cells} |")
    for name in SEGMENTS:
        cells = []
        for label in labels:
            values = found[label].get(name, [])
            cells.append(f"{statistics.median(values):.2f} ({len(values)})" if values else "-")
        print(f"| {name} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
