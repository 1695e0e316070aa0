"""A node process that runs one sharded leader, for the sharding tests and bench.

``--backend postgres`` (the default) runs a ``PostgresShardedLeader`` on the database of
``SHARD_NODE_DSN``; ``--backend redis`` a ``RedisShardedLeader`` on ``SHARD_NODE_REDIS_URL``.

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

With ``--ledger TABLE`` each shard's task also writes a row ``(shard, term, node)`` into
``TABLE`` every ``--ledger-every`` seconds, each in a transaction fenced to the shard's
term (``ctx.fence``), on one connection of the process that the tasks take in turn; the
table's ``id`` and ``written_at`` (server clock) give the order of the writes. On Redis
the row goes to the list :func:`redis_ledger_key` of the shard, pushed by a script
fenced to the shard's term (:class:`~rselection.redis.RedisFence`); the list's order is
the order of the writes.

The task of each shard runs until its term is cancelled, checking ``ctx.shard`` and
``ctx.shards``. The connection string comes from ``SHARD_NODE_DSN``. Run it from the
repository's root (it imports ``tests.support``):

    SHARD_NODE_DSN=postgresql://... python -m tests.support.shard_node \\
        --name pollers --shards 32 --node n0 --ttl 3 --renew-interval 0.5 \\
        --renew-deadline 2 --retry-interval 0.5
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import itertools
import json
import os
import signal
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

import rselection as rs
from rselection import signals
from rselection.commands.demo_fleet import StopFlag
from rselection.sharding import shard_lease_name
from tests.support.scale_node import Reporter


class Ledger:
    """Fenced writes of every shard's task, on one connection the tasks take in turn."""

    def __init__(self, dsn: str, table: str, node: str) -> None:
        self.dsn = dsn
        self.table = sql.Identifier(table)
        self.node = node
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None
        # Another node may create it at the same moment: IF NOT EXISTS races then, on the
        # table's name or on the name of its row type.
        races = (
            psycopg.errors.UniqueViolation,
            psycopg.errors.DuplicateTable,
            psycopg.errors.DuplicateObject,
        )
        with psycopg.connect(dsn, autocommit=True) as conn, contextlib.suppress(*races):
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY,"
                    " shard int NOT NULL, term bigint NOT NULL, node text NOT NULL,"
                    " written_at timestamptz NOT NULL DEFAULT clock_timestamp())"
                ).format(self.table)
            )

    def write(self, ctx: rs.TaskContext) -> None:
        """One row for this shard's term, committed only while the term holds the shard."""
        with self.lock:
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = psycopg.connect(self.dsn)
                with self.conn.transaction():
                    ctx.fence(self.conn)
                    self.conn.execute(
                        sql.SQL("INSERT INTO {} (shard, term, node) VALUES (%s, %s, %s)").format(
                            self.table
                        ),
                        (ctx.shard, ctx.term, self.node),
                    )
            except rs.StaleLeaderError:
                pass  # the shard moved on: the write was refused, as it must be
            except psycopg.Error:
                if self.conn is not None:  # a broken session: a new one next time
                    self.conn.close()
                self.conn = None


def redis_ledger_key(lease: str, table: str) -> str:
    """The list of the fenced writes of one shard's lease on Redis (its hash slot)."""
    return f"rselection:{{{lease}}}:{table}"


class RedisLedger:
    """Fenced writes of every shard's task on Redis: one push per write, fenced to the
    shard's term in the same script."""

    def __init__(self, url: str, table: str, node: str, name: str) -> None:
        import redis  # only the Redis nodes need it

        # Bounded round trips: a task blocked on a paused Redis would not see its
        # cancellation within stop_grace (and its run would look like an overlap).
        self.client = redis.Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2)
        self.name = name
        self.table = table
        self.node = node
        self.fences: dict[str, Any] = {}
        self.lock = threading.Lock()

    def write(self, ctx: rs.TaskContext) -> None:
        """One entry for this shard's term, pushed only while the term holds the shard."""
        from rselection.redis import RedisFence

        assert ctx.shard is not None
        lease = shard_lease_name(self.name, ctx.shard)
        with self.lock:
            fence = self.fences.get(lease)
            if fence is None:
                fence = self.fences[lease] = RedisFence(self.client, name=lease)
        entry = json.dumps({"shard": ctx.shard, "term": ctx.term, "node": self.node})
        # Refused once the shard moved on (as it must be), or Redis is away: no entry.
        with contextlib.suppress(rs.StaleLeaderError, rs.BackendUnavailable):
            fence.call(ctx.term, "RPUSH", redis_ledger_key(lease, self.table), entry)


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
    parser.add_argument("--max-moves", type=int, default=32)
    parser.add_argument("--task", choices=("def", "async"), default="def")
    parser.add_argument("--ledger", default=None, help="table for fenced writes per shard")
    parser.add_argument("--ledger-every", type=float, default=0.25)
    parser.add_argument("--backend", choices=("postgres", "redis"), default="postgres")
    args = parser.parse_args()
    ledger: Ledger | RedisLedger | None = None
    if args.backend == "redis":
        url = os.environ["SHARD_NODE_REDIS_URL"]
        ledger = RedisLedger(url, args.ledger, args.node, args.name) if args.ledger else None
    else:
        dsn = os.environ["SHARD_NODE_DSN"]
        ledger = Ledger(dsn, args.ledger, args.node) if args.ledger else None

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
            try:
                while not ctx.cancelled.wait(args.ledger_every if ledger else 3600):
                    if ledger is not None:
                        ledger.write(ctx)
            finally:
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

    options: dict[str, Any] = {
        "name": args.name,
        "shards": args.shards,
        "node_id": args.node,
        "ttl": args.ttl,
        "renew_interval": args.renew_interval,
        "renew_deadline": args.renew_deadline,
        "retry_interval": args.retry_interval,
        "heartbeat_interval": args.heartbeat_interval,
        "rebalance_interval": args.rebalance_interval,
        "settle": args.settle,
        "max_moves": args.max_moves,
    }
    leader: rs.PostgresShardedLeader | rs.RedisShardedLeader
    if args.backend == "redis":
        leader = rs.RedisShardedLeader(url, tasks, **options)
    else:
        leader = rs.PostgresShardedLeader(dsn, tasks, **options)

    def on_elected(sender: Any, **kw: Any) -> None:
        if "shard" in kw:
            out.emit("elected", shard=kw["shard"], term=kw["term"])

    def on_demoted(sender: Any, **kw: Any) -> None:
        if "shard" in kw:
            out.emit("demoted", shard=kw["shard"], term=kw["term"], reason=kw["reason"])

    signals.elected.connect(on_elected, weak=False)
    signals.demoted.connect(on_demoted, weak=False)

    # Not a threading.Event: a handler that sets one deadlocks when the signal comes
    # while the main thread is inside that Event's own wait() (it once left a node
    # running 60 s after Ctrl-C, its main thread stuck in the handler).
    done = StopFlag.on_stop_signals()
    # SIGUSR1 writes every thread's stack to stderr (the node's log): how a test shows
    # where a node that does not stop is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
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
