"""A queue processor that survives failover: it checkpoints its cursor, the next leader resumes.

Run two (or more) copies, then kill the one that leads (kill -9 or Ctrl-C):

    python examples/resumable_queue.py --dsn postgresql://postgres@127.0.0.1:5432/test
    python examples/resumable_queue.py --dsn postgresql://postgres@127.0.0.1:5432/test

A second replica is the same command in another terminal: copies with the same
``--name`` (default ``$RSELECTION_NAME``, else ``resumable-queue``) compete for one
lease. The leader's persistent task takes the items of ``example_queue`` in order (the
tables are ``<prefix>queue`` and ``<prefix>queue_done``, ``--table-prefix`` default
``$RSELECTION_TABLE_PREFIX``, else ``example_``). For each item it *processes* it (a
fenced insert into ``example_queue_done``, and a line on stdout), then saves its cursor
with ``ctx.checkpoint.save({"cursor": item})``. When the leader dies, another copy is
elected within a second, loads the checkpoint and goes on with the item after the
cursor. Without ``--dsn`` (or ``RSELECTION_DSN``) it runs alone: a ``SingleNodeLeader``
with its queue and checkpoint in memory.

What this guarantees:

* No item is skipped: the cursor moves past an item only after the item was processed.
* An item is processed twice at most once per failover, and only the single item that
  was in flight: a leader killed after processing item ``n`` but before its checkpoint
  commits leaves the cursor at ``n - 1``, so the next leader processes ``n`` again. (For
  exactly once, make processing idempotent, e.g. keyed by the item id.)
* A deposed leader cannot write: its fenced insert and its checkpoint save fail with
  ``StaleLeaderError`` as soon as another term holds the lease.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import rselection as rs

SETUP = """
CREATE TABLE IF NOT EXISTS {queue} (id bigint PRIMARY KEY, payload text NOT NULL);
CREATE TABLE IF NOT EXISTS {done} (
    seq bigserial PRIMARY KEY,
    item bigint NOT NULL,
    node text NOT NULL,
    term bigint NOT NULL,
    done_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

tasks = rs.TaskHandler()
settings = argparse.Namespace(dsn="", delay=0.2, prefix="example_", items=100)


def say(text: str) -> None:
    print(text, flush=True)


class PostgresQueue:
    """The queue in Postgres: items in ``<prefix>queue``, results in ``<prefix>queue_done``."""

    def __init__(self, dsn: str, prefix: str) -> None:
        import psycopg
        from psycopg import sql

        self._sql = sql
        self.queue = sql.Identifier(f"{prefix}queue")
        self.done = sql.Identifier(f"{prefix}queue_done")
        self.conn = psycopg.connect(dsn, autocommit=True)

    def next_after(self, cursor: int) -> tuple[int, str] | None:
        row = self.conn.execute(
            self._sql.SQL("SELECT id, payload FROM {} WHERE id > %s ORDER BY id LIMIT 1").format(
                self.queue
            ),
            (cursor,),
        ).fetchone()
        return (int(row[0]), str(row[1])) if row is not None else None

    def process(self, ctx: rs.TaskContext, item: int) -> None:
        with self.conn.transaction():  # "process" the item: a fenced write
            ctx.fence(self.conn)
            self.conn.execute(
                self._sql.SQL("INSERT INTO {} (item, node, term) VALUES (%s, %s, %s)").format(
                    self.done
                ),
                (item, ctx.node_id, ctx.term),
            )

    def close(self) -> None:
        self.conn.close()


class MemoryQueue:
    """The queue without a database (one process leads alone): items 1..N in memory."""

    def __init__(self, items: int) -> None:
        self.items = {i: f"job-{i}" for i in range(1, items + 1)}
        self.done: list[tuple[int, int]] = []

    def next_after(self, cursor: int) -> tuple[int, str] | None:
        later = [i for i in self.items if i > cursor]
        return (min(later), self.items[min(later)]) if later else None

    def process(self, ctx: rs.TaskContext, item: int) -> None:
        ctx.check()  # no transaction to fence: refuse once the term is over
        self.done.append((item, ctx.term))

    def close(self) -> None:
        pass


@tasks.persistent("queue-processor")
def process_queue(ctx: rs.TaskContext) -> None:
    """Process queue items in id order, checkpointing the cursor after each one."""
    snap = ctx.checkpoint.load()
    cursor = int(snap.state["cursor"]) if snap is not None else 0
    if snap is None:
        say(f"*** {ctx.node_id} term {ctx.term}: no checkpoint, starting at the first item")
    else:
        say(
            f"*** {ctx.node_id} term {ctx.term}: resuming after item {cursor} "
            f"(checkpoint version {snap.version}, saved in term {snap.term})"
        )
    drained = False
    queue: Any = PostgresQueue(settings.dsn, settings.prefix) if settings.dsn else MEMORY_QUEUE[0]
    try:
        while ctx.is_live():
            row = queue.next_after(cursor)
            if row is None:
                if not drained:
                    say(f"[{ctx.node_id}] queue drained at item {cursor}; waiting for more")
                    drained = True
                if not ctx.sleep(max(settings.delay, 0.2)):
                    return
                continue
            item, payload = row
            drained = False
            try:
                queue.process(ctx, item)
                say(f"[{ctx.node_id}] term {ctx.term}: processed item {item} ({payload})")
                cursor = item
                saved = ctx.checkpoint.save({"cursor": cursor})
            except (rs.StaleLeaderError, rs.LeadershipLost):
                say(f"[{ctx.node_id}] term {ctx.term} is over; another node continues")
                return
            say(f"[{ctx.node_id}] term {ctx.term}: checkpoint cursor={cursor} v{saved.version}")
            if not ctx.sleep(settings.delay):
                return
    finally:
        if settings.dsn:
            queue.close()


MEMORY_QUEUE: list[MemoryQueue] = []
"""The in-memory queue when there is no database (set up by :func:`main`)."""


def setup(dsn: str, items: int, prefix: str = "example_") -> None:
    """Create the example's tables and put items 1..``items`` in the queue (idempotent)."""
    import psycopg
    from psycopg import sql

    queue, done = sql.Identifier(f"{prefix}queue"), sql.Identifier(f"{prefix}queue_done")
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('rselection-example-queue'))")
        conn.execute(sql.SQL(SETUP).format(queue=queue, done=done))
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (id, payload)"
                " SELECT g, 'job-' || g FROM generate_series(1, %s) AS g ON CONFLICT DO NOTHING"
            ).format(queue),
            (items,),
        )


def on_elected(sender: object, **kw: object) -> None:
    say(f"*** {kw['node_id']} is now the leader (term {kw['term']})")


def main(argv: list[str] | None = None) -> int:
    """Follow or lead until Ctrl-C or SIGTERM; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("RSELECTION_DSN"), help="Postgres (default: run alone)"
    )
    parser.add_argument("--items", type=int, default=100, help="queue items 1..N to add")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds between items")
    parser.add_argument(
        "--name",
        default=os.environ.get("RSELECTION_NAME") or "resumable-queue",
        help="the lease name (default $RSELECTION_NAME, else resumable-queue)",
    )
    parser.add_argument(
        "--table-prefix",
        default=os.environ.get("RSELECTION_TABLE_PREFIX") or "example_",
        help="prefix of the example's tables (default example_: example_queue, ...)",
    )
    args = parser.parse_args(argv)
    settings.dsn, settings.delay, settings.prefix = args.dsn, args.delay, args.table_prefix
    logging.basicConfig(level=logging.WARNING)
    rs.signals.elected.connect(on_elected)
    leader: rs.Leader
    if args.dsn:
        setup(args.dsn, args.items, args.table_prefix)
        leader = rs.PostgresLeader(args.dsn, tasks, name=args.name)
    else:
        MEMORY_QUEUE[:] = [MemoryQueue(args.items)]
        leader = rs.SingleNodeLeader(tasks, name=args.name)
    say(f"node {leader.node_id} is following; Ctrl-C stops it")
    # Ctrl-C or SIGTERM (systemd, Docker, Kubernetes) stops it gracefully: lead() returns
    # once the task is joined and the lease released.
    leader.lead()
    say("stopped cleanly")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
