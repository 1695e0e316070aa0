"""Run this in three terminals: one node leads, stop it (Ctrl-C) and another takes over.

    python examples/postgres_leader.py --dsn postgresql://postgres@127.0.0.1:5432/test

Each node prints when it is elected or demoted; the leader prints a line every second
from an interval task and keeps a persistent task that writes fenced rows.
"""

from __future__ import annotations

import argparse
import logging
import os

import psycopg

import rselection as rs

tasks = rs.TaskHandler()


@tasks.interval(1, name="report")
def report(ctx: rs.TaskContext) -> None:
    print(f"[{ctx.node_id}] term {ctx.term}: fire {ctx.fire_key}", flush=True)


@tasks.persistent("audit-writer")
def audit_writer(ctx: rs.TaskContext) -> None:
    """Writes one row every 2 s; the fence refuses the write once this term is over."""
    with psycopg.connect(DSN) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS example_audit (term bigint, node text)")
        conn.commit()
        while ctx.sleep(2):
            with conn.transaction():
                ctx.fence(conn)  # raises StaleLeaderError if another term took over
                conn.execute("INSERT INTO example_audit VALUES (%s, %s)", (ctx.term, ctx.node_id))


def on_elected(sender: object, **kw: object) -> None:
    print(f"*** {kw['node_id']} is now the leader (term {kw['term']})", flush=True)


def on_demoted(sender: object, **kw: object) -> None:
    print(f"*** {kw['node_id']} stopped leading ({kw['reason']})", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("RSELECTION_DSN"), required=False)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("pass --dsn postgresql://... or set RSELECTION_DSN")
    DSN = args.dsn
    logging.basicConfig(level=logging.WARNING)
    rs.signals.elected.connect(on_elected)
    rs.signals.demoted.connect(on_demoted)
    leader = rs.PostgresLeader(DSN, tasks, name="example")
    print(f"node {leader.node_id} is following; Ctrl-C stops it", flush=True)
    leader.lead()  # returns after Ctrl-C, once tasks are joined and the lease released
