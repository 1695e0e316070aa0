"""What the subcommands report: their exit codes, and times, tables and lines for people.

Everything the command line prints for people goes through :func:`say` (tables through
:func:`grid`), which escapes with :func:`printable` every character a terminal could act
on: lease names, node ids and hostnames are anyone's text, and an escape sequence in one
must never set a window title, hide text or move the cursor. ``--json`` output is
printed as JSON, whose strings escape such characters themselves.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..text import iso, printable

__all__ = [
    "EXIT_NO_LEADER",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "UsageError",
    "ago",
    "fail",
    "grid",
    "iso",
    "printable",
    "say",
]

EXIT_OK = 0
"""Done; for ``status``: every lease judged has a leader."""

EXIT_NO_LEADER = 1
"""For ``status``: a lease it judged has no leader."""

EXIT_REFUSED = 1
"""For the other subcommands: refused or failed; the message on stderr says why."""

EXIT_USAGE = 2
"""The command line cannot be used as given (argparse's code for usage errors): a bad or
missing option, no database given, a connection string that cannot be parsed."""

EXIT_UNREACHABLE = 3
"""The database (or Redis) could not be reached or read."""


class UsageError(Exception):
    """The command line cannot be used as given (exit code 2); the message says how to fix
    it and never quotes a connection string."""


def ago(seconds: float | None) -> str:
    """``"1.5s ago"``, or ``"-"`` when unknown."""
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def say(text: object = "", *, err: bool = False) -> None:
    """Print ``str(text)`` for people (stdout, or stderr with ``err``), escaped by
    :func:`printable` (its newlines kept), and flush."""
    print(printable(str(text), lines=True), file=sys.stderr if err else sys.stdout, flush=True)


def fail(args: argparse.Namespace, message: object, code: int) -> int:
    """Report a failure and return its exit ``code``: ``message`` on stderr for people
    and, under ``--json``, ``{"error": message, "exit_code": code}`` on stdout, so that a
    script that parses stdout gets a document whatever happened."""
    say(message, err=True)
    if getattr(args, "json", False):
        print(json.dumps({"error": str(message), "exit_code": code}), flush=True)
    return code


def grid(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a table: ``headers`` then ``rows``, columns padded to their widest cell;
    each cell escaped by :func:`printable` (a newline too), so that it stays one line."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = []
    for row in [headers, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines
