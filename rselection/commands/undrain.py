"""``rselection undrain NAME NODE``: a drained node may lead again (see
:mod:`rselection.commands.drain`)."""

from __future__ import annotations

import argparse

from .drain import add_options, change
from .options import subcommand

__all__ = ["add_parser", "run"]


@subcommand("undrain", help="let a drained node lead again")
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Undrain a node of a lease: it may lead again (if started with eligible=True), competing
    as any other node; it does not take the lease back by itself unless versions say so.
    Undraining a node that is not drained changes nothing (exit 0). Refused (exit 1) for an
    unknown lease or node."""
    add_options(parser, run=run)


def run(args: argparse.Namespace) -> int:
    """Undrain node ``args.node`` of lease ``args.name``; the exit code."""
    return change(args, drained=False)
