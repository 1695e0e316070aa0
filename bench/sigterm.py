"""SIGTERM handover: a program whose last line is ``leader.lead()``, stopped as a
container, systemd or gunicorn stops it.

Each round starts a node process (``python -m tests.support.signal_node KIND ...``: a
leader with one persistent task, then ``leader.lead()``, with no signal handling of its
own), waits until its task runs, starts a follower in this process, sends SIGTERM to the
node and times how long until the follower leads (for the sharded leader: until the
follower leads every shard). The node must exit 0 with its task joined. Without a
graceful SIGTERM the follower would wait for the lease to expire (``ttl``): that bound
is printed beside the figures, with the ratio.

Usage::

    python bench/sigterm.py [--rounds 10] [--dsn DSN] [--redis-url URL]
                            [--kinds postgres,redis,sharded]

It uses the local servers given (default: ``postgresql://postgres@127.0.0.1:5432/test``
and ``redis://127.0.0.1:6379/0``); every round has a lease name of its own. Prints one
line per kind and exits 1 if a p95 exceeds the target (1 s, well inside ``ttl``).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import rselection as rs  # noqa: E402
from tests.support.node_process import NodeProcess  # noqa: E402
from tests.support.signal_node import TTL  # noqa: E402

TARGET_P95 = 1.0
SHARDS = 4


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def idle_tasks() -> rs.TaskHandler:
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.sleep(3600)

    return tasks


def follower(kind: str, target: str, name: str) -> rs.Leader:
    if kind == "postgres":
        return rs.PostgresLeader(target, idle_tasks(), name=name, **TTL)
    if kind == "redis":
        return rs.RedisLeader(target, idle_tasks(), name=name, **TTL)
    return rs.PostgresShardedLeader(target, idle_tasks(), name=name, shards=SHARDS, **TTL)


def one_round(kind: str, target: str) -> float:
    """Seconds from SIGTERM to the follower leading (every shard, for ``sharded``)."""
    name = f"sigterm-{uuid.uuid4().hex[:8]}"
    node = NodeProcess("tests.support.signal_node", kind, target, name)
    try:
        wanted = SHARDS if kind == "sharded" else 1
        node.wait_for("tasks running", lambda seen: len(node.of("running")) >= wanted, 30)
        with follower(kind, target, name) as other:
            # The follower is settled: heartbeating, listening, and a sharded one owns
            # its share (so the round times the hand-off of the node's own shards).
            if isinstance(other, rs.PostgresShardedLeader):
                if not other.wait_until_balanced(30):
                    raise SystemExit("sharded: the two nodes did not balance within 30 s")
            else:
                time.sleep(1.0)
            sent = time.monotonic()
            node.proc.send_signal(signal.SIGTERM)
            deadline = sent + 2 * TTL["ttl"]
            while time.monotonic() < deadline:
                leads = (
                    len(other.owned()) == SHARDS
                    if isinstance(other, rs.PostgresShardedLeader)
                    else other.is_leader
                )
                if leads:
                    break
                time.sleep(0.002)
            took = time.monotonic() - sent
            if node.proc.wait(10) != 0:
                raise SystemExit(f"{kind}: the node exited {node.proc.returncode}, not 0")
            node.wait_for("lead() to return", lambda seen: bool(node.of("returned")), 10)
            if len(node.of("joined")) != len(node.of("running")):
                raise SystemExit(f"{kind}: a task was not joined: {node.seen}")
            return took
    finally:
        if node.proc.poll() is None:
            node.kill()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--kinds", default="postgres,redis,sharded")
    args = parser.parse_args(argv)
    failed = False
    print(f"SIGTERM to the leading process until the follower leads; {args.rounds} rounds")
    print(f"without a graceful SIGTERM the follower waits for expiry: ttl = {TTL['ttl']:.0f} s")
    for kind in args.kinds.split(","):
        target = args.redis_url if kind == "redis" else args.dsn
        times = [one_round(kind, target) for _ in range(args.rounds)]
        p50, p95 = percentile(times, 0.5), percentile(times, 0.95)
        verdict = "PASS" if p95 <= TARGET_P95 else "FAIL"
        failed |= verdict == "FAIL"
        print(
            f"{kind:>9}: p50 {p50 * 1000:6.0f} ms  p95 {p95 * 1000:6.0f} ms  "
            f"max {max(times) * 1000:6.0f} ms  (ttl / p95 = {TTL['ttl'] / p95:5.0f}x)  "
            f"target p95 <= {TARGET_P95:.0f} s: {verdict}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
