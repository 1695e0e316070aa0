"""A node process that runs one ``PostgresShardedLeader``, for the sharding tests and bench.

Prints one JSON object per line on stdout (from a writer thread of its own, see
``scale_node.Reporter``). Every line carries ``event``, ``node``, ``mono``
(``time.monotonic()``: CLOCK_MONOTONIC, which every process of the machine shares) and
``t`` (``time.time()``):

- ``ready``: the leader was started (``pid``, ``shards``, ``rselection``: the file the
  library was imported from).
- ``elected`` / ``demoted``: one shard's leader began or ended a term (``shard``,
  ``term``, and for a demotion ``reason``: ``"handover"`` when the coordinator moved it).
- ``activity``: the shard's task started (``end`` null) or ended, in the activity
  ledger's format (``ev``, ``term``, ``task`` = ``"work/<shard>"``, ``run``, ``start``,
  ``end``, wall clock; see ``tests/support/activity.py``), plus ``shard``.
- ``stopping`` / ``stopped``: SIGTERM or SIGINT arrived; the leader's ``stop()`` returned.

The task of each shard runs until its term is cancelled, checking ``ctx.shard`` and
``ctx.shards``. The connection string comes from ``SHARD_NODE_DSN``. Run it from the
repository's root (it imports ``tests.support``):

    SHARD_NODE_DSN=postgresql://... python -m tests.support.shard_node \\
        --name pollers --shards 32 --node n0 --ttl 3 --renew-interval 0.5 \\
        --renew-deadline 2 --retry-interval 0.5
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import threading
import time
from typing import Any

import rselection as rs
from rselection import signals
from tests.support.scale_node import Reporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--shards", type=int, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--ttl", type=float, default=15.0)
    parser.add_argument("--renew-interval", type=float, default=2.0)
    parser.add_argument("--renew-deadline", type=float, default=10.0)
    parser.add_argument("--retry-interval", type=float, default=2.0)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--rebalance-interval", type=float, default=0.5)
    parser.add_argument("--settle", type=float, default=None)
    parser.add_argument("--task", choices=("def", "async"), default="def")
    args = parser.parse_args()

    out = Reporter(args.node)
    runs = itertools.count(1)
    tasks = rs.TaskHandler()

    def begin(ctx: rs.TaskContext) -> int:
        assert ctx.shard is not None and ctx.shards == args.shards, (ctx.shard, ctx.shards)
        run = next(runs)
        fields: dict[str, Any] = {"ev": "activity", "term": ctx.term, "run": run}
        fields.update(task=f"work/{ctx.shard}", shard=ctx.shard, start=time.time(), end=None)
        out.emit("activity", **fields)
        return run

    def end(ctx: rs.TaskContext, run: int, start: float) -> None:
        fields: dict[str, Any] = {"ev": "activity", "term": ctx.term, "run": run}
        fields.update(task=f"work/{ctx.shard}", shard=ctx.shard, start=start, end=time.time())
        out.emit("activity", **fields)

    if args.task == "def":

        @tasks.persistent("work", restart="never")
        def work(ctx: rs.TaskContext) -> None:
            start = time.time()
            run = begin(ctx)
            ctx.cancelled.wait()
            end(ctx, run, start)

    else:

        @tasks.persistent("work", restart="never")
        async def awork(ctx: rs.TaskContext) -> None:
            start = time.time()
            run = begin(ctx)
            try:
                while await ctx.asleep(3600):
                    pass
            finally:
                end(ctx, run, start)

    leader = rs.PostgresShardedLeader(
        os.environ["SHARD_NODE_DSN"],
        tasks,
        name=args.name,
        shards=args.shards,
        node_id=args.node,
        ttl=args.ttl,
        renew_interval=args.renew_interval,
        renew_deadline=args.renew_deadline,
        retry_interval=args.retry_interval,
        heartbeat_interval=args.heartbeat_interval,
        rebalance_interval=args.rebalance_interval,
        settle=args.settle,
    )

    def on_elected(sender: Any, **kw: Any) -> None:
        if "shard" in kw:
            out.emit("elected", shard=kw["shard"], term=kw["term"])

    def on_demoted(sender: Any, **kw: Any) -> None:
        if "shard" in kw:
            out.emit("demoted", shard=kw["shard"], term=kw["term"], reason=kw["reason"])

    signals.elected.connect(on_elected, weak=False)
    signals.demoted.connect(on_demoted, weak=False)

    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    leader.start()
    out.emit("ready", pid=os.getpid(), shards=args.shards, rselection=rs.__file__)
    while not done.wait(0.2):
        pass
    out.emit("stopping")
    leader.stop()
    out.emit("stopped")
    out.close()


if __name__ == "__main__":
    main()
