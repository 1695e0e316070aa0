"""``rselection migrate``: create or upgrade every table, say what was done."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from ._common import EXIT_UNREACHABLE, _connect, _dsn, _exists, _first_line, _Unreachable

# -- migrate ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Create or upgrade every table; print what was done; return the exit code."""
    import psycopg

    from ..errors import BackendUnavailable, ConfigError
    from ..postgres import PostgresCheckpointStore, migrate
    from ..postgres._conn import describe_conninfo, redact
    from ..postgres.broadcast import create_broadcast_tables

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
            for change in changes:
                print(change.describe())
            existed = _exists(conn, "rselection_broadcast")
            create_broadcast_tables(conn)
            done = "already present" if existed else "created"
            print(f"broadcast table 'rselection_broadcast': {done}")
            checkpoints_existed = _exists(conn, "rselection_checkpoints")
    except (BackendUnavailable, ConfigError) as exc:
        print(f"migrate failed on {where}: {redact(str(exc), dsn)}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        print(f"migrate failed on {where}: {redact(_first_line(exc), dsn)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        with PostgresCheckpointStore(dsn, lease_table=args.table, create_tables=False) as store:
            applied = store.apply_migrations()
    except (BackendUnavailable, ConfigError) as exc:
        print(f"migrate failed on {where}: {redact(str(exc), dsn)}", file=sys.stderr)
        return 1
    numbers = ", ".join(map(str, applied))
    if not applied:
        print("checkpoint tables 'rselection_checkpoint*': already present (no migration needed)")
    elif checkpoints_existed:
        print(
            f"checkpoint tables 'rselection_checkpoint*': upgraded (migrations applied: {numbers})"
        )
    else:
        print(
            f"checkpoint tables 'rselection_checkpoint*': created (migrations applied: {numbers})"
        )
    return 0
