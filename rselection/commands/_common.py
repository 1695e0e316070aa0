"""What the subcommands share: where the database is, connecting, formatting."""

from __future__ import annotations

import argparse
import os
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

#: libpq variables that name a server on their own (PGPASSWORD alone does not).
_PG_VARS = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE")

#: ``status`` exit codes.
EXIT_OK, EXIT_HEADLESS, EXIT_UNREACHABLE = 0, 1, 2

_CONNECT_TIMEOUT = 5
_NOT_RECORDED = (
    "next fires, failures and persistent tasks are not recorded in the database "
    "(see TaskHandler.health() on the leader); last fires come from the claims table"
)


class _Unreachable(Exception):
    """The database could not be reached or read (exit code 2)."""


def _dsn(args: argparse.Namespace) -> str:
    dsn: str | None = args.dsn if args.dsn is not None else os.environ.get("RSELECTION_DSN")
    if dsn:
        return dsn
    if any(os.environ.get(var) for var in _PG_VARS):
        return ""  # an empty conninfo: libpq takes everything from the PG* variables
    raise SystemExit(
        "no database given: pass --dsn postgresql://..., set RSELECTION_DSN, "
        "or set the libpq variables (PGHOST, PGPORT, PGDATABASE, PGUSER, ...)"
    )


def _connect(dsn: str) -> psycopg.Connection[Any]:
    import psycopg

    from ..postgres._conn import describe_conninfo, redact

    try:
        return psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=_CONNECT_TIMEOUT,
            application_name="rselection:cli",
        )
    except psycopg.Error as exc:
        raise _Unreachable(
            f"cannot connect to {describe_conninfo(dsn)}: {redact(_first_line(exc), dsn)}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _short_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def _grid(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = []
    for row in [headers, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines


def _exists(conn: psycopg.Connection[Any], table: str) -> bool:
    from ..postgres.schema import table_identifier

    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (table_identifier(table).as_string(conn),)
    ).fetchone()
    return bool(row and row[0])


# -- status -----------------------------------------------------------------------------
