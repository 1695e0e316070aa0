"""Run this in two or three terminals: the shards of tenant pollers spread over the nodes.

    python examples/sharded_pollers.py --dsn postgresql://postgres@127.0.0.1:5432/test
    python examples/sharded_pollers.py --dsn postgresql://postgres@127.0.0.1:5432/test

Forty tenants are mapped to ``--shards`` shards (default 8) with ``rs.shard_of``; every
node runs one poller per shard it owns, which "polls" the shard's tenants every second
and keeps its poll count in a checkpoint (keyed by task and shard, so it survives a
move). A node prints the shards it owns whenever they change: the first node owns them
all, a second one gets half within a few seconds, and when one stops (Ctrl-C or SIGTERM)
it hands its shards to the others. Every copy with the same ``--name`` (default
``$RSELECTION_NAME``, else ``pollers``) shares the shards. Without ``--dsn`` (or
``RSELECTION_DSN``) there is nothing to share: one ``SingleNodeLeader`` polls every
tenant alone (``ctx.shard`` is ``None`` there).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading

import rselection as rs

TENANTS = [f"tenant-{i}" for i in range(40)]
tasks = rs.TaskHandler()


def tenants_of(shard: int | None, shards: int | None) -> list[str]:
    """The tenants that belong to ``shard`` (the same answer on every node); all of them
    under a leader that is not sharded (``shard`` is ``None``)."""
    if shard is None or shards is None:
        return TENANTS
    return [tenant for tenant in TENANTS if rs.shard_of(tenant, shards) == shard]


@tasks.persistent("poller")
def poller(ctx: rs.TaskContext) -> None:
    """Polls this shard's tenants every second until the shard moves or the node stops."""
    mine = tenants_of(ctx.shard, ctx.shards)
    which = "every tenant" if ctx.shard is None else f"shard {ctx.shard}"
    last = ctx.checkpoint.load()
    polls = last.state if last is not None else 0
    while ctx.sleep(1):
        polls += 1
        ctx.checkpoint.save(polls)  # refused once this shard's term is over
        print(
            f"[{ctx.node_id}] {which} (term {ctx.term}): poll {polls} of {len(mine)} tenants",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    """Lead this node's shards until Ctrl-C or SIGTERM; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("RSELECTION_DSN"), help="Postgres (default: poll alone)"
    )
    parser.add_argument(
        "--name",
        default=os.environ.get("RSELECTION_NAME") or "pollers",
        help="the sharded name the nodes share (default $RSELECTION_NAME, else pollers)",
    )
    parser.add_argument("--shards", type=int, default=8, help="number of shards (default 8)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.dsn:
        alone = rs.SingleNodeLeader(tasks, name=args.name)
        print(f"node {alone.node_id} polls every tenant alone; Ctrl-C stops it", flush=True)
        alone.lead()
        print("stopped cleanly", flush=True)
        return 0
    leader = rs.PostgresShardedLeader(args.dsn, tasks, name=args.name, shards=args.shards)
    done = threading.Event()

    def report() -> None:
        seen: frozenset[int] | None = None
        while not done.wait(0.2):
            owned = leader.owned()
            if owned != seen:
                seen = owned
                print(f"*** {leader.node_id} owns {len(owned)} shards: {sorted(owned)}", flush=True)

    print(f"node {leader.node_id} joins {args.name!r}; Ctrl-C stops it", flush=True)
    threading.Thread(target=report, daemon=True).start()
    try:
        # Ctrl-C or SIGTERM (systemd, Docker, Kubernetes): lead() returns once every
        # shard is handed over and released.
        leader.lead()
    finally:
        done.set()
    print("stopped cleanly", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
