"""The ``rselection`` command (also ``python -m rselection``).

Each subcommand is a module of :mod:`rselection.commands` with its own ``add_parser``
and ``run``: ``status`` (leases, handover requests, nodes, last fires), ``migrate``
(create or upgrade the tables), ``resign`` (ask the leader to hand over), ``forget``
(retire a lease no service uses any more) and ``demo``. The database comes from
``--dsn``, else ``$RSELECTION_DSN``, else the libpq ``PG*`` variables (``PGHOST``,
``PGPORT``, ``PGDATABASE``, ``PGUSER``, ``PGPASSWORD``, ``PGSERVICE``, ...). Passwords are
never printed.
"""

from __future__ import annotations

import argparse

from .commands import demo, forget, migrate, resign, status

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS = (status, migrate, resign, forget, demo)
"""The subcommand modules, in the order ``rselection --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The ``rselection`` argument parser, with every subcommand's options."""
    parser = argparse.ArgumentParser(
        prog="rselection",
        description="Leader-scoped tasks over a Postgres lease: inspect and operate a fleet.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code
