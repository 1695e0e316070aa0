"""A queue processor that survives failover: it checkpoints its cursor, the next leader resumes.

Run two (or more) copies, then kill the one that leads (kill -9 or Ctrl-C):

    python examples/resumable_queue.py --dsn postgresql://postgres@127.0.0.1:5432/test

The leader's persistent task takes the items of ``example_queue`` in order. For each
item it *processes* it (a fenced insert into ``example_queue_done``, and a line on
stdout), then saves its cursor with ``ctx.checkpoint.save({"cursor": item})``. When the
leader dies, another copy is elected within a second, loads the checkpoint and goes on
with the item after the cursor.

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

import psycopg

import rselection as rs

SETUP = """
CREATE TABLE IF NOT EXISTS example_queue (id bigint PRIMARY KEY, payload text NOT NULL);
CREATE TABLE IF NOT EXISTS example_queue_done (
    seq bigserial PRIMARY KEY,
    item bigint NOT NULL,
    node text NOT NULL,
    term bigint NOT NULL,
    done_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

tasks = rs.TaskHandler()
settings = argparse.Namespace(dsn="", delay=0.2)


def say(text: str) -> None:
    print(text, flush=True)


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
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        while ctx.is_live():
            row = conn.execute(
                "SELECT id, payload FROM example_queue WHERE id > %s ORDER BY id LIMIT 1",
                (cursor,),
            ).fetchone()
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
                with conn.transaction():  # "process" the item: a fenced write
                    ctx.fence(conn)
                    conn.execute(
                        "INSERT INTO example_queue_done (item, node, term) VALUES (%s, %s, %s)",
                        (item, ctx.node_id, ctx.term),
                    )
                say(f"[{ctx.node_id}] term {ctx.term}: processed item {item} ({payload})")
                cursor = item
                saved = ctx.checkpoint.save({"cursor": cursor})
            except rs.StaleLeaderError:
                say(f"[{ctx.node_id}] term {ctx.term} is over; another node continues")
                return
            say(f"[{ctx.node_id}] term {ctx.term}: checkpoint cursor={cursor} v{saved.version}")
            if not ctx.sleep(settings.delay):
                return


def setup(dsn: str, items: int) -> None:
    """Create the example's tables and put items 1..``items`` in the queue (idempotent)."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('rselection-example-queue'))")
        conn.execute(SETUP)
        conn.execute(
            "INSERT INTO example_queue (id, payload)"
            " SELECT g, 'job-' || g FROM generate_series(1, %s) AS g ON CONFLICT DO NOTHING",
            (items,),
        )


def on_elected(sender: object, **kw: object) -> None:
    say(f"*** {kw['node_id']} is now the leader (term {kw['term']})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("RSELECTION_DSN"))
    parser.add_argument("--items", type=int, default=100, help="queue items 1..N to add")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds between items")
    parser.add_argument("--name", default="resumable-queue", help="the lease name")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("pass --dsn postgresql://... or set RSELECTION_DSN")
    settings.dsn, settings.delay = args.dsn, args.delay
    logging.basicConfig(level=logging.WARNING)
    setup(args.dsn, args.items)
    rs.signals.elected.connect(on_elected)
    leader = rs.PostgresLeader(args.dsn, tasks, name=args.name)
    say(f"node {leader.node_id} is following; Ctrl-C stops it")
    leader.lead()  # returns after Ctrl-C, once the task is joined and the lease released
