"""Threads that N leaders add to one process, per backend.

Starts N leaders of N different leases in one process (each leads its own lease), waits
until every one leads and the process settles, and prints how many threads they added,
and how many are left a few seconds after they all stopped; with ``--idle-cpu S``, also
the CPU the process spent (all threads, user and system) over S seconds while they lead,
in percent of one core. Run it on two trees to compare (``--baseline-ref`` runs the same
script on a git ref in a temporary worktree):

    python bench/threads.py --backend redis --leaders 200 --baseline-ref HEAD~1
    python bench/threads.py --leaders 200 --idle-cpu 10 --baseline-ref main

Redis is ``--redis-url`` (default ``redis://127.0.0.1:6379/0``); ``memory`` needs no
server.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(backend: str, leaders: int, redis_url: str, idle_cpu: float) -> dict[str, float]:
    """Threads before, while N leaders lead, and after they stopped, in this process."""
    import rselection as rs

    prefix = f"threads-{uuid.uuid4().hex[:8]}"
    before = threading.active_count()
    made = []
    began = time.monotonic()
    for index in range(leaders):
        handler = rs.TaskHandler()
        name = f"{prefix}-{index}"
        if backend == "redis":
            leader = rs.RedisLeader(redis_url, handler, name=name)
        else:
            leader = rs.LeaseLeader(rs.MemoryLease(name=name), handler)
        leader.start()
        made.append(leader)
    deadline = time.monotonic() + 60
    while not all(x.is_leader for x in made):
        if time.monotonic() > deadline:
            raise SystemExit("not every leader led within 60 s")
        time.sleep(0.05)
    led_after = time.monotonic() - began
    time.sleep(3.0)  # settled: renewals under way
    leading = threading.active_count()
    cpu = -1.0
    if idle_cpu > 0:
        wall, spent = time.monotonic(), time.process_time()
        time.sleep(idle_cpu)
        cpu = 100 * (time.process_time() - spent) / (time.monotonic() - wall)
    for leader in made:
        leader.stop(timeout=10)
    time.sleep(12.0)  # idle pool threads end after 10 s
    after = threading.active_count()
    return {
        "before": before,
        "leading": leading,
        "added": leading - before,
        "left_after_stop": after - before,
        "all_led_after_s": round(led_after, 2),
        "idle_cpu_percent": round(cpu, 1),
    }


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child"]  # this script, importing the tree's package
    cmd += ["--backend", args.backend, "--leaders", str(args.leaders)]
    cmd += ["--redis-url", args.redis_url, "--idle-cpu", str(args.idle_cpu)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=300)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=["redis", "memory"], default="redis")
    p.add_argument("--leaders", type=int, default=200)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument(
        "--idle-cpu",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also measure the process's CPU over this many seconds while leading",
    )
    p.add_argument("--baseline-ref", help="a git ref to measure too, in a temporary worktree")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.backend, args.leaders, args.redis_url, args.idle_cpu)))
        return
    rows = {"this tree": run_tree(REPO, args)}
    if args.baseline_ref:
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "baseline"
            subprocess.run(
                [
                    "git",
                    "-C",
                    str(REPO),
                    "worktree",
                    "add",
                    "--detach",
                    str(tree),
                    args.baseline_ref,
                ],
                check=True,
                capture_output=True,
            )
            try:
                rows[args.baseline_ref] = run_tree(tree, args)
            finally:
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                    check=False,
                    capture_output=True,
                )
    print(f"{args.leaders} {args.backend} leaders in one process")
    cpu = args.idle_cpu > 0
    print(
        f"{'tree':<12}{'added':>8}{'left after stop':>17}{'all led after':>15}"
        + (f"{'idle CPU':>10}" if cpu else "")
    )
    for tree_name, row in rows.items():
        print(
            f"{tree_name:<12}{row['added']:>8.0f}{row['left_after_stop']:>17.0f}"
            f"{row['all_led_after_s']:>14.2f}s"
            + (f"{row['idle_cpu_percent']:>9.1f}%" if cpu else "")
        )


if __name__ == "__main__":
    main()
