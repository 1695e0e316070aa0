"""A process that stops its sharded leader in one of the hard ways, for the tests.

Its tasks' handler has ``on_stuck="exit"``: a task still running ``stop_grace`` after
its term was cancelled makes the process exit with code 70, so a stop that leaves a task
(the coordinator's included) running shows as the exit code. Prints one line per event
on stdout (``ready``, ``stop-returned`` with ``took``, ``lead-returned``), flushed at
once. ``--backend postgres`` (the default) runs a ``PostgresShardedLeader`` on the
database of ``SHARD_NODE_DSN``; ``--backend redis`` a ``RedisShardedLeader`` on
``SHARD_NODE_REDIS_URL``. Modes:

- ``--stop-in def`` / ``--stop-in async``: every shard's task calls ``leader.stop()``
  from inside the task (a ``def`` task, or an ``async def`` one on its event loop)
  while ``lead()`` runs in the main thread; the process exits 0 once ``lead()`` returned.
- ``--stop-in stdin``: ``start()``; once it leads every shard and coordinates, ``ready``;
  then ``stop()`` when a line arrives on stdin; exits 0 once ``stop()`` returned.

Run it from the repository's root (``python -m tests.support.shard_stop_node``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import rselection as rs


def say(event: str, **fields: object) -> None:
    """One event line, flushed at once."""
    extra = "".join(f" {key}={value}" for key, value in fields.items())
    sys.stdout.write(f"{event}{extra}\n")
    sys.stdout.flush()


def coordinates(leader: rs.PostgresShardedLeader | rs.RedisShardedLeader) -> bool:
    """Whether this node holds the coordinator's lease (its rebalancer runs here)."""
    holder = leader.leader()
    return holder is not None and holder.node_id == leader.node_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--stop-in", choices=("def", "async", "stdin"), required=True)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--renew-interval", type=float, default=0.5)
    parser.add_argument("--renew-deadline", type=float, default=2.0)
    parser.add_argument("--retry-interval", type=float, default=0.5)
    parser.add_argument("--rebalance-interval", type=float, default=0.5)
    parser.add_argument("--backend", choices=("postgres", "redis"), default="postgres")
    args = parser.parse_args()

    tasks = rs.TaskHandler(on_stuck="exit")
    leader: rs.PostgresShardedLeader | rs.RedisShardedLeader | None = None

    def stop_from_inside() -> None:
        assert leader is not None
        began = time.monotonic()
        leader.stop()
        say("stop-returned", took=f"{time.monotonic() - began:.3f}")

    if args.stop_in == "def":

        @tasks.persistent("work")
        def work(ctx: rs.TaskContext) -> None:
            if ctx.sleep(0.3):
                stop_from_inside()
            ctx.cancelled.wait()

    elif args.stop_in == "async":

        @tasks.persistent("work")
        async def awork(ctx: rs.TaskContext) -> None:
            if await ctx.asleep(0.3):
                stop_from_inside()
            while await ctx.asleep(3600):
                pass

    else:

        @tasks.persistent("work")
        def idle(ctx: rs.TaskContext) -> None:
            ctx.cancelled.wait()

    options: dict[str, Any] = {
        "name": args.name,
        "shards": args.shards,
        "node_id": "stopper",
        "ttl": args.ttl,
        "renew_interval": args.renew_interval,
        "renew_deadline": args.renew_deadline,
        "retry_interval": args.retry_interval,
        "heartbeat_interval": 0.5,
        "rebalance_interval": args.rebalance_interval,
    }
    if args.backend == "redis":
        leader = rs.RedisShardedLeader(os.environ["SHARD_NODE_REDIS_URL"], tasks, **options)
    else:
        leader = rs.PostgresShardedLeader(os.environ["SHARD_NODE_DSN"], tasks, **options)
    if args.stop_in == "stdin":
        leader.start()
        deadline = time.monotonic() + 30.0
        while len(leader.owned()) < args.shards or not coordinates(leader):
            if time.monotonic() > deadline:
                raise SystemExit("not every shard led, or not the coordinator, after 30 s")
            time.sleep(0.05)
        say("ready")
        sys.stdin.readline()
        began = time.monotonic()
        leader.stop()
        say("stop-returned", took=f"{time.monotonic() - began:.3f}")
        return
    say("ready")
    leader.lead()
    say("lead-returned", owned=len(leader.owned()))


if __name__ == "__main__":
    main()
