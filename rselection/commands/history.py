"""``rselection history NAME``: who led a lease, when, and why each term ended.

The backend's admin API reads the records (``history``); this module prints them, as
a table for people or, with ``--json``, as ``{"terms": [...]}``, newest first, with the
record's field names (see :class:`rselection.history.TermRecord`).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from ..history import TermRecord
from .connections import act_on_lease
from .options import add_lease_options, lease_name, limit_type, subcommand
from .output import EXIT_OK, EXIT_REFUSED, fail, grid, iso, say

if TYPE_CHECKING:
    from ..admin import LeaseAdmin

__all__ = ["DEFAULT_ROWS", "add_parser", "describe_end", "run"]

DEFAULT_ROWS = 20
"""Terms shown unless ``--limit`` says otherwise."""


@subcommand("history", help="the terms of a lease: who led, when, and why each ended")
def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", type=lease_name, help="the lease name")
    add_lease_options(parser)
    parser.add_argument(
        "--limit",
        type=limit_type(),
        default=DEFAULT_ROWS,
        metavar="N",
        help=f"the newest N terms (default {DEFAULT_ROWS})",
    )
    parser.add_argument("--json", action="store_true", help='one JSON document, {"terms": [...]}')
    parser.set_defaults(run=run)


def describe_end(record: TermRecord) -> str:
    """How a term ended, for people: ``handed_over to b``, ``expired``, ``(leading)``."""
    if record.end_reason is None:
        return "(leading)"
    end = record.end_reason
    if record.handed_to:
        end += f" to {record.handed_to}"
    if record.by:
        end += f" (by {record.by})"
    return end


def _lasted(record: TermRecord) -> str:
    seconds = record.lasted
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _show(admin: LeaseAdmin, args: argparse.Namespace) -> int:
    records = admin.history(args.name, limit=args.limit)
    if not records and not admin.exists(args.name):
        return fail(args, f"no lease {args.name!r} here: nothing to show", EXIT_REFUSED)
    if args.json:
        print(json.dumps({"terms": [r.as_json() for r in records]}, indent=2), flush=True)
        return EXIT_OK
    if not records:
        say(f"lease {args.name!r}: no terms recorded yet")
        return EXIT_OK
    say(f"lease {args.name!r}: the last {len(records)} terms, newest first")
    rows = [
        [
            str(r.term),
            r.node_id,
            r.version or "-",
            iso(r.began_at) or "-",
            _lasted(r),
            describe_end(r),
        ]
        for r in records
    ]
    for line in grid(["TERM", "NODE", "VERSION", "BEGAN", "LASTED", "ENDED"], rows):
        say(line)
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Print the leadership history of ``args.name``; return the exit code."""
    return act_on_lease(
        args,
        "history",
        hint="pass the right --table",
        postgres=lambda admin, _dsn: _show(admin, args),
        redis=lambda admin: _show(admin, args),
    )
