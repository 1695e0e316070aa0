"""The ``rselection`` command (also ``python -m rselection``).

Each subcommand is a module of :mod:`rselection.commands` with its own ``add_parser``
and ``run``: ``status`` (leases, handover requests, nodes, last fires), ``migrate``
(create or upgrade the tables), ``resign`` (ask the leader to hand over), ``drain`` and
``undrain`` (make a node ineligible, or eligible again), ``task`` (pause, resume or
trigger a task; its run history), ``forget`` (retire a lease no service uses any more),
``demo`` and ``web`` (the operator's console). The database comes from
``--dsn``, else ``$RSELECTION_DSN``, else the libpq ``PG*`` variables (``PGHOST``,
``PGPORT``, ``PGDATABASE``, ``PGUSER``, ``PGPASSWORD``, ``PGSERVICE``, ...). Passwords are
never printed, however the connection string is spelled; a password given on the
command line (``--dsn``, ``--redis-url``), where any local user can read it, is warned
about once on stderr.

Exit codes: 0 done (``status``: every lease judged has a leader); 1 refused or failed
(``status``: a lease has no leader); 2 the command line cannot be used as given (as
argparse does: a bad option, no database, a connection string that cannot be parsed);
3 the database (or Redis) could not be reached or read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any, NoReturn

from .commands import demo, drain, forget, history, migrate, resign, status, task, undrain, web
from .commands.connections import warn_of_passwords
from .commands.output import EXIT_USAGE, UsageError, printable, say
from .redaction import has_password, misread, redact, redact_dsn

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS = (status, history, migrate, resign, drain, undrain, task, forget, demo, web)
"""The subcommand modules, in the order ``rselection --help`` lists them."""


# What was typed, while it is parsed: argparse's messages may quote any of it.
_typed: ContextVar[tuple[str, ...]] = ContextVar("rselection_typed", default=())


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error messages (which quote what was typed, a name
    with an escape sequence too) are escaped like every other line for people, and
    never show a password typed anywhere on the line: a connection string typed where
    argparse expected something else (``rselection task --dsn URL``, the URL taken for
    the action) is quoted back in its usage error."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        outermost = not _typed.get()
        token = _typed.set(tuple(sys.argv[1:] if args is None else args)) if outermost else None
        try:
            return super().parse_known_args(args, namespace)
        finally:
            if token is not None:
                _typed.reset(token)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message is not None:
            message = printable(_without_passwords(message), lines=True)
        super().exit(status, message)


def _without_passwords(message: str) -> str:
    """``message`` with every connection string typed on the line redacted."""
    for arg in _typed.get():
        value = arg.partition("=")[2] if arg.startswith("--") else arg
        if value and (has_password(value) or misread(value)):
            message = message.replace(value, redact_dsn(value))
    return redact(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``rselection`` argument parser, with every subcommand's options."""
    parser = _Parser(
        prog="rselection",
        description="Leader-scoped tasks over a Postgres lease: inspect and operate a fleet.",
        epilog="Exit codes: 0 done (status: every lease shown has a leader); 1 refused or "
        "failed (status: a lease has no leader); 2 usage error (bad options, no database, "
        "a connection string that cannot be parsed); 3 the database or Redis cannot be "
        "reached or read.",
    )
    import rselection

    parser.add_argument(
        "--version", action="version", version=f"rselection {rselection.__version__}"
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
    warn_of_passwords(args)
    try:
        code: int = args.run(args)
    except UsageError as exc:
        # Reported as argparse reports a usage error: on stderr, exit code 2.
        say(f"rselection {args.command}: error: {exc}", err=True)
        if getattr(args, "json", False):  # scripts parse stdout: they get a document too
            print(json.dumps({"error": str(exc), "exit_code": EXIT_USAGE}), flush=True)
        return EXIT_USAGE
    return code
