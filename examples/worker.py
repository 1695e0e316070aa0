"""A plain worker process: run it on every host; one leads, SIGTERM hands over at once.

With ``RSELECTION_DSN`` (or ``--dsn``) set, the workers compete for a lease in
Postgres; without it the worker leads alone (a single node, no database)::

    python examples/worker.py                                   # leads alone
    RSELECTION_DSN=postgresql://app@db/app python examples/worker.py --node-id w1
    RSELECTION_DSN=postgresql://app@db/app python examples/worker.py --node-id w2
    kill -TERM <pid of the leader>     # w2 takes over within milliseconds

A second replica is the same command in another terminal (or on another host), with
the same ``--name`` (default ``$RSELECTION_NAME``, else ``worker``): the lease they
compete for.

SIGTERM (what systemd, Docker and Kubernetes send) and Ctrl-C stop the worker
gracefully: its tasks are cancelled and joined, then the lease is released, which wakes
the followers so one of them leads at once instead of waiting for the lease to expire.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import rselection as rs

log = logging.getLogger("worker")


def build_tasks() -> rs.TaskHandler:
    """The leader-scoped work: a tick every second and a persistent watcher."""
    tasks = rs.TaskHandler()

    @tasks.interval(1, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        print(f"[{ctx.node_id}] tick {ctx.fire_key} (term {ctx.term})", flush=True)

    @tasks.persistent("watcher")
    def watcher(ctx: rs.TaskContext) -> None:
        # A plain def task: poll in short sleeps; sleep() returns False once we lose.
        while ctx.sleep(5):
            log.info("still leading term %d", ctx.term)

    return tasks


def build_leader(
    tasks: rs.TaskHandler, dsn: str | None, node_id: str | None, name: str = "worker"
) -> rs.Leader:
    """A PostgresLeader when a DSN is given, else a SingleNodeLeader."""
    if dsn:
        return rs.PostgresLeader(dsn, tasks, name=name, node_id=node_id)
    return rs.SingleNodeLeader(tasks, name=name, node_id=node_id or "local")


def main(argv: list[str] | None = None) -> int:
    """Run the worker until SIGTERM or Ctrl-C; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("RSELECTION_DSN"), help="Postgres (default: lead alone)"
    )
    parser.add_argument("--node-id", default=None, help="this worker's id (default: a new one)")
    parser.add_argument(
        "--name",
        default=os.environ.get("RSELECTION_NAME") or "worker",
        help="the lease the workers compete for (default $RSELECTION_NAME, else worker)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    tasks = build_tasks()
    leader = build_leader(tasks, args.dsn, args.node_id, args.name)

    def elected(sender: object, **kw: Any) -> None:
        print(f"elected: {kw['node_id']} leads with term {kw['term']}", flush=True)

    def demoted(sender: object, **kw: Any) -> None:
        print(f"demoted: {kw['node_id']} term {kw['term']} ended ({kw['reason']})", flush=True)

    rs.signals.elected.connect(elected, sender=leader)
    rs.signals.demoted.connect(demoted, sender=leader)

    print(f"worker {leader.node_id} started; SIGTERM or Ctrl-C stops it", flush=True)
    # In the main thread, lead() takes SIGTERM and Ctrl-C as a graceful stop: it cancels
    # and joins the tasks, releases the lease (a follower leads now), then returns.
    leader.lead()
    print("stopped cleanly", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
