"""``rselection migrate``: create or upgrade every table, say what was done."""

from __future__ import annotations

import argparse
import sys

from .connections import Unreachable, connect, describe, first_line, redact, resolve_dsn
from .options import add_database_options
from .output import EXIT_UNREACHABLE

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``migrate`` and its options to the command line.

    Args:
        subparsers: the ``rselection`` command's subparsers.
    """
    parser = subparsers.add_parser(
        "migrate", help="create or upgrade the tables; say what was done"
    )
    add_database_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Create or upgrade every table; print what was done; return the exit code."""
    import psycopg

    from ..errors import BackendUnavailable, ConfigError
    from ..postgres import migrate

    dsn = resolve_dsn(args)
    where = describe(dsn)
    try:
        conn = connect(dsn)
    except Unreachable as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        with conn:
            changes = migrate(conn, table=args.table)
    except (BackendUnavailable, ConfigError) as exc:
        print(f"migrate failed on {where}: {redact(str(exc), dsn)}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        print(f"migrate failed on {where}: {redact(first_line(exc), dsn)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    for change in changes:
        print(change.describe())
    return 0
