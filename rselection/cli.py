"""The ``rselection`` command (also ``python -m rselection``)."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _dsn(args: argparse.Namespace) -> str:
    dsn: str | None = args.dsn or os.environ.get("RSELECTION_DSN")
    if not dsn:
        raise SystemExit("no database given: pass --dsn postgresql://... or set RSELECTION_DSN")
    return dsn


def _migrate(args: argparse.Namespace) -> int:
    import psycopg

    from .errors import BackendUnavailable
    from .postgres import PostgresCheckpointStore, migrate
    from .postgres._conn import describe_conninfo
    from .postgres.broadcast import create_broadcast_tables

    dsn = _dsn(args)
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            migrate(conn, table=args.table)
            create_broadcast_tables(conn)
    except psycopg.Error as exc:
        raise BackendUnavailable(f"cannot migrate {describe_conninfo(dsn)}: {exc}") from exc
    print(f"lease, claims, elections, nodes and broadcast tables ready (lease table {args.table})")
    with PostgresCheckpointStore(dsn, lease_table=args.table, create_tables=False) as store:
        applied = store.apply_migrations()
    done = ", ".join(map(str, applied)) if applied else "none needed"
    print(f"checkpoint tables ready (migrations applied: {done})")
    return 0


def _status(args: argparse.Namespace) -> int:
    import psycopg
    from psycopg import sql

    from .postgres._conn import describe_conninfo
    from .postgres.schema import table_identifier

    dsn = _dsn(args)
    query = sql.SQL(
        "SELECT name, holder, term, acquired_at,"
        " extract(epoch FROM expires_at - now())::float8 AS expires_in"
        " FROM {} ORDER BY name"
    ).format(table_identifier(args.table))
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            rows = conn.execute(query).fetchall()
    except psycopg.Error as exc:
        print(f"cannot read leases from {describe_conninfo(dsn)}: {exc}", file=sys.stderr)
        return 2
    headless = 0
    print(f"{'lease':<24} {'holder':<36} {'term':>6}  expires in")
    for name, holder, term, _acquired, expires_in in rows:
        live = holder is not None and expires_in is not None and expires_in > 0
        headless += not live
        shown = holder if live else "(none)"
        left = f"{expires_in:.1f}s" if live else "-"
        print(f"{name:<24} {shown:<36} {term:>6}  {left}")
    return 1 if headless else 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = argparse.ArgumentParser(prog="rselection", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="three nodes, a crash and a handover, measured")
    demo.add_argument("--dsn", help="Postgres to use (default: a private one from pgserver)")
    demo.add_argument("--nodes", type=int, default=3)
    demo.add_argument("--forever", action="store_true", help="keep running until Ctrl-C")

    for name, text in (("migrate", "create or upgrade the tables"), ("status", "show leases")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--dsn", help="database (default: $RSELECTION_DSN)")
        p.add_argument("--table", default="rselection_leases")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.dsn or os.environ.get("RSELECTION_DSN"), args.nodes, args.forever)
    if args.command == "migrate":
        return _migrate(args)
    return _status(args)
