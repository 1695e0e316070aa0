"""``rselection migrate``: create or upgrade every table, say what was done."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from ._common import EXIT_UNREACHABLE, _connect, _dsn, _first_line, _Unreachable

# -- migrate ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Create or upgrade every table; print what was done; return the exit code."""
    import psycopg

    from ..errors import BackendUnavailable, ConfigError
    from ..postgres import migrate
    from ..postgres._conn import describe_conninfo, redact

    dsn = _dsn(args)
    where = describe_conninfo(dsn)
    try:
        conn = _connect(dsn)
    except _Unreachable as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        with conn:
            changes = migrate(conn, table=args.table)
    except (BackendUnavailable, ConfigError) as exc:
        print(f"migrate failed on {where}: {redact(str(exc), dsn)}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        print(f"migrate failed on {where}: {redact(_first_line(exc), dsn)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    for change in changes:
        print(change.describe())
    return 0
