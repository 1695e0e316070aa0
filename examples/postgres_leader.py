"""Run this in two or three terminals: one node leads, stop it (Ctrl-C) and another takes over.

    python examples/postgres_leader.py --dsn postgresql://postgres@127.0.0.1:5432/test
    python examples/postgres_leader.py --dsn postgresql://postgres@127.0.0.1:5432/test

A second (or third) replica is the same command in another terminal: every copy with
the same ``--name`` (default ``$RSELECTION_NAME``, else ``example``) competes for one
lease. Each node prints when it is elected or demoted; the leader prints a line every
second from an interval task and keeps a persistent task that writes a fenced row into
``<prefix>audit`` (``--table-prefix``, default ``$RSELECTION_TABLE_PREFIX``, else
``example_``) every 2 s. Without ``--dsn`` (or ``RSELECTION_DSN``) it leads alone (a
``SingleNodeLeader``, no database) and only prints the rows it would write.
Ctrl-C or SIGTERM stops a node gracefully: its tasks are joined, the lease released.

A rolling deploy in two terminals: start a node with ``--version 1.0``, then one with
``--version 1.1``; ten seconds (``--settle``) after the second started, the first hands
the lease over to it, once. ``--ineligible`` starts a node that is listed but never
leads (a canary).
"""

from __future__ import annotations

import argparse
import logging
import os

import rselection as rs

tasks = rs.TaskHandler()
settings = argparse.Namespace(dsn=None, table="example_audit")


@tasks.interval(1, name="report")
def report(ctx: rs.TaskContext) -> None:
    print(f"[{ctx.node_id}] term {ctx.term}: fire {ctx.fire_key}", flush=True)


@tasks.persistent("audit-writer")
def audit_writer(ctx: rs.TaskContext) -> None:
    """Writes one row every 2 s; the fence refuses the write once this term is over."""
    if not settings.dsn:
        while ctx.sleep(2):  # no database: show what would be written
            print(
                f"[{ctx.node_id}] audit row (term {ctx.term}): no database, not written", flush=True
            )
        return
    import psycopg
    from psycopg import sql

    table = sql.Identifier(settings.table)
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (term bigint, node text)").format(table)
        )
        conn.commit()
        while ctx.sleep(2):
            with conn.transaction():
                ctx.fence(conn)  # raises StaleLeaderError if another term took over
                conn.execute(
                    sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(table),
                    (ctx.term, ctx.node_id),
                )


def on_elected(sender: object, **kw: object) -> None:
    print(f"*** {kw['node_id']} is now the leader (term {kw['term']})", flush=True)


def on_demoted(sender: object, **kw: object) -> None:
    print(f"*** {kw['node_id']} stopped leading ({kw['reason']})", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Follow or lead until Ctrl-C or SIGTERM; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("RSELECTION_DSN"), help="Postgres (default: lead alone)"
    )
    parser.add_argument(
        "--name",
        default=os.environ.get("RSELECTION_NAME") or "example",
        help="the lease the nodes compete for (default $RSELECTION_NAME, else example)",
    )
    parser.add_argument(
        "--table-prefix",
        default=os.environ.get("RSELECTION_TABLE_PREFIX") or "example_",
        help="prefix of the table this example creates (default example_: example_audit)",
    )
    parser.add_argument(
        "--version",
        help="the release this node runs (PEP 440): the newest settled release leads",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds a newer release runs before it takes the lease over (default 10)",
    )
    parser.add_argument(
        "--ineligible", action="store_true", help="never lead (a canary, an admin process)"
    )
    args = parser.parse_args(argv)
    settings.dsn, settings.table = args.dsn, f"{args.table_prefix}audit"
    logging.basicConfig(level=logging.WARNING)
    rs.signals.elected.connect(on_elected)
    rs.signals.demoted.connect(on_demoted)
    leader: rs.Leader
    if args.dsn:
        leader = rs.PostgresLeader(
            args.dsn,
            tasks,
            name=args.name,
            version=args.version,
            eligible=not args.ineligible,
            settle=args.settle,
        )
    else:
        leader = rs.SingleNodeLeader(tasks, name=args.name)
    print(f"node {leader.node_id} is following; Ctrl-C stops it", flush=True)
    # Ctrl-C or SIGTERM (systemd, Docker, Kubernetes) stops it gracefully: lead() returns
    # once the tasks are joined and the lease released.
    leader.lead()
    print("stopped cleanly", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
