"""Rolling deploys: how often leadership changes, and how long no node's task runs, with
versions set (the newest version leads) and without (every earlier release).

Each mode runs a fleet of ``--nodes`` real node processes (``python -m
rselection.commands.demo_fleet``: a leader with a persistent ``work`` task that reports
when each term's run starts and ends) and ``--deploys`` rolling deploys. A deploy
replaces every node, one at a time, as a Kubernetes rolling update with one pod of surge
does: start a node of the next release, wait until it is ready and has been up for
``--settle`` seconds plus a second (``minReadySeconds``), then stop the oldest node of
the earlier release gracefully (SIGTERM) and wait until it has exited. In the
``versions`` mode every node runs with ``--version`` (``1.0``, then ``1.1``, ...) and
``--settle``; in the ``no versions`` mode with neither, as before this feature.

Per deploy it counts the leadership changes (``elected`` events) and adds up the time
between the end of one term's ``work`` run and the start of the next one's: the time no
node ran the task. Target, with versions: exactly one change per deploy and at most
100 ms unled per deploy. Both modes are printed side by side.

Usage::

    python bench/rolling_deploy.py [--backend postgres|redis] [--nodes 3] [--deploys 2]
                                   [--settle 2] [--dsn DSN] [--redis-url URL]

It uses the local servers given (default ``postgresql://postgres@127.0.0.1:5432/test``
and ``redis://127.0.0.1:6379/0``; every run has a lease name of its own) and exits 1
when a target is missed.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rselection.commands.demo_fleet import Fleet  # noqa: E402

READY_TIMEOUT = 30.0
EXIT_TIMEOUT = 30.0
UNLED_TARGET_MS = 100.0


@dataclass
class Deploy:
    """What one rolling deploy did."""

    began: float
    ended: float = 0.0
    changes: int = 0
    unled_ms: float = 0.0
    leaders: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backend", choices=["postgres", "redis"], default="postgres")
    p.add_argument("--nodes", type=int, default=3, help="nodes in the fleet (default 3)")
    p.add_argument("--deploys", type=int, default=2, help="rolling deploys (default 2)")
    p.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds a new node runs before it counts as settled (default 2; the "
        "library's default is 10)",
    )
    p.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.deploys < 1 or not args.settle >= 0:
        p.error("--nodes and --deploys must be at least 1, --settle at least 0")
    return args


def run_mode(args: argparse.Namespace, versions: bool) -> list[Deploy]:
    """Run the deploys of one mode; what each did."""
    url = args.redis_url if args.backend == "redis" else args.dsn
    name = f"deploy-{uuid.uuid4().hex[:8]}"
    fleet = Fleet(
        url,
        name,
        # Default timings; no ledger writes or ticks to speak of: only the work task.
        [
            *("--backend", args.backend, "--settle", str(args.settle)),
            *("--ledger-every", "1e6", "--tick", "1e6"),
        ],
    )

    def start(node: str, release: int) -> None:
        fleet.spawn(node, ["--version", f"1.{release}"] if versions else [])
        fleet.wait_ready(READY_TIMEOUT)

    generation = [f"r0n{i}" for i in range(args.nodes)]
    deploys: list[Deploy] = []
    try:
        for node in generation:
            start(node, 0)
        fleet.first_elected(READY_TIMEOUT)
        time.sleep(args.settle + 1.0)
        for release in range(1, args.deploys + 1):
            deploy = Deploy(began=time.time())
            newer: list[str] = []
            for i, old in enumerate(generation):
                node = f"r{release}n{i}"
                start(node, release)
                newer.append(node)
                time.sleep(args.settle + 1.0)  # minReadySeconds: settled, plus a look
                fleet.kill(old, signal.SIGTERM)
                fleet.procs[old].wait(EXIT_TIMEOUT)
            time.sleep(1.0)  # the last stop's successor reports
            deploy.ended = time.time()
            deploys.append(deploy)
            generation = newer
    finally:
        fleet.stop_all()
    tally(fleet.history, deploys)
    return deploys


def tally(history: list[dict[str, Any]], deploys: list[Deploy]) -> None:
    """Count each deploy's leadership changes and unled time from the nodes' events."""
    runs: dict[tuple[str, int], list[float | None]] = {}
    for event in history:
        if event["ev"] == "activity" and event["task"] == "work":
            key = (event["node"], event["term"])
            span = runs.setdefault(key, [event["start"], None])
            if event["end"] is not None:
                span[1] = event["end"]
    terms = sorted((start, end, node) for (node, _), (start, end) in runs.items())
    for deploy in deploys:
        for event in history:
            if event["ev"] == "elected" and deploy.began <= event["t"] <= deploy.ended:
                deploy.changes += 1
                deploy.leaders.append(event["node"])
        for (_, end, _), (start, _, _) in itertools.pairwise(terms):
            if start is not None and deploy.began <= start <= deploy.ended and end is not None:
                deploy.unled_ms += max(0.0, start - end) * 1000


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"rolling deploys on {args.backend}: {args.nodes} nodes, {args.deploys} deploys, "
        f"settle {args.settle:g} s",
        flush=True,
    )
    modes = {"versions": run_mode(args, True), "no versions": run_mode(args, False)}
    print()
    print(
        "| deploy | changes, versions | unled ms, versions | changes, no versions "
        "| unled ms, no versions |"
    )
    print("| --- | --- | --- | --- | --- |")
    with_v, without = modes["versions"], modes["no versions"]
    for i, (a, b) in enumerate(zip(with_v, without, strict=True), 1):
        print(f"| {i} | {a.changes} | {a.unled_ms:.1f} | {b.changes} | {b.unled_ms:.1f} |")
    for label, deploys in modes.items():
        for i, d in enumerate(deploys, 1):
            print(f"  {label}, deploy {i}: leaders in turn {' -> '.join(d.leaders) or '-'}")
    ok_changes = all(d.changes == 1 for d in with_v)
    ok_unled = all(d.unled_ms <= UNLED_TARGET_MS for d in with_v)
    print()
    print("| target | measured | result |")
    print("| --- | --- | --- |")
    print(
        f"| one leadership change per deploy, versions set | "
        f"{', '.join(str(d.changes) for d in with_v)} | {'PASS' if ok_changes else 'FAIL'} |"
    )
    print(
        f"| at most {UNLED_TARGET_MS:g} ms unled per deploy, versions set | "
        f"{max(d.unled_ms for d in with_v):.1f} ms | {'PASS' if ok_unled else 'FAIL'} |"
    )
    return 0 if ok_changes and ok_unled else 1


if __name__ == "__main__":
    raise SystemExit(main())
