"""The ``rselection`` command (also ``python -m rselection``).

Subcommands: ``status`` (leases, nodes, last fires), ``resign`` (ask the leader to hand
over), ``migrate`` (create or upgrade the tables) and ``demo``. The database comes from
``--dsn``, else ``$RSELECTION_DSN``, else the libpq ``PG*`` variables (``PGHOST``,
``PGPORT``, ``PGDATABASE``, ``PGUSER``, ``PGPASSWORD``, ``PGSERVICE``, ...). Passwords are
never printed.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["main"]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dsn", help="database (default: $RSELECTION_DSN, else the PG* variables)")
    p.add_argument("--table", default="rselection_leases", help="lease table")


def _nodes_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes-table", default="rselection_nodes", help="node heartbeats table")
    p.add_argument(
        "--node-timeout",
        type=float,
        default=15.0,
        help="a node is alive when seen within this many seconds (default 15: the leaders' "
        "default, three heartbeats)",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = argparse.ArgumentParser(
        prog="rselection",
        description="Leader-scoped tasks over a Postgres lease: inspect and operate a fleet.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="three nodes, a crash and a handover, measured")
    demo.add_argument("--dsn", help="Postgres to use (default: a private one from pgserver)")
    demo.add_argument("--nodes", type=int, default=3)
    demo.add_argument("--forever", action="store_true", help="keep running until Ctrl-C")

    migrate = sub.add_parser("migrate", help="create or upgrade the tables; say what was done")
    _common(migrate)

    status = sub.add_parser(
        "status",
        help="leases, holders, nodes and last fires; exit 0 when every lease has a leader, "
        "1 when one has none, 2 when the database cannot be read",
    )
    _common(status)
    _nodes_options(status)
    status.add_argument("--claims-table", default="rselection_claims", help="fire claims table")
    status.add_argument("--json", action="store_true", help="one JSON document (per refresh)")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    status.add_argument("--count", type=int, help="with --watch: stop after this many refreshes")

    resign = sub.add_parser(
        "resign", help="ask the leader of a lease to hand over; wait for the new term"
    )
    resign.add_argument("name", help="the lease name")
    _common(resign)
    _nodes_options(resign)
    resign.add_argument(
        "--redis-url",
        metavar="URL",
        help="a Redis lease (redis://...; a cluster node's URL for Redis Cluster) instead of --dsn",
    )
    resign.add_argument(
        "--key-prefix", default="rselection:", help="with --redis-url: the leaders' key_prefix"
    )
    resign.add_argument("--to", metavar="NODE", help="the node that should take over")
    resign.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for a new term (default 10); also how long the lease stays "
        "reserved for --to",
    )

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.dsn or os.environ.get("RSELECTION_DSN"), args.nodes, args.forever)
    from .commands import migrate as migrate_command
    from .commands import resign as resign_command
    from .commands import status as status_command

    run = {
        "migrate": migrate_command.run,
        "resign": resign_command.run,
        "status": status_command.run,
    }[args.command]
    return run(args)
