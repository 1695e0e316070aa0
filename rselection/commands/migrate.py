"""``rselection migrate``: create or upgrade every table, say what was done."""

from __future__ import annotations

import argparse
import math

from ..redaction import redact
from .connections import Unreachable, connect, describe, first_line, resolve_dsn
from .options import add_database_options, subcommand
from .output import EXIT_UNREACHABLE, say

MIGRATION_TIMEOUT = 30.0
"""Default of ``--timeout``, seconds (that of :func:`rselection.postgres.migrate`)."""

__all__ = ["add_parser", "run"]


@subcommand("migrate", help="create or upgrade the tables; say what was done")
def add_parser(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=MIGRATION_TIMEOUT,
        metavar="SECONDS",
        help="longest wait for a lock another process holds (default: %(default)g s)",
    )
    parser.set_defaults(run=run)


def _seconds(text: str) -> float:
    """A positive, finite number of seconds, for ``--timeout``."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


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
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    try:
        with conn:
            changes = migrate(conn, table=args.table, timeout=args.timeout)
    except (BackendUnavailable, ConfigError) as exc:
        say(f"migrate failed on {where}: {redact(str(exc), dsn)}", err=True)
        return 1
    except psycopg.Error as exc:
        say(f"migrate failed on {where}: {redact(first_line(exc), dsn)}", err=True)
        return EXIT_UNREACHABLE
    for change in changes:
        say(change.describe())
    return 0
