"""Command-line options that several subcommands share, spelled and explained once."""

from __future__ import annotations

import argparse
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

__all__ = [
    "add_database_options",
    "add_lease_options",
    "add_nodes_options",
    "add_redis_options",
    "lease_name",
    "limit_type",
    "node_timeout",
    "subcommand",
]

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def subcommand(
    name: str, *, help: str
) -> Callable[[Callable[[argparse.ArgumentParser], None]], Callable[[Subparsers], None]]:
    """Make a subcommand module's ``add_parser(subparsers)`` of the function that adds
    the subcommand's options (and its ``run``) to its parser. That function's docstring,
    if any, is the subcommand's ``rselection NAME --help`` description (argparse reflows
    it), as a command's docstring is its help in click.

    Args:
        name: the subcommand's name.
        help: its line in ``rselection --help``.
    """

    def make(options: Callable[[argparse.ArgumentParser], None]) -> Callable[[Subparsers], None]:
        @functools.wraps(options)
        def add_parser(subparsers: Subparsers) -> None:
            description = inspect.getdoc(options)
            options(subparsers.add_parser(name, help=help, description=description))

        add_parser.__doc__ = f"Add ``rselection {name}`` and its options to ``subparsers``."
        return add_parser

    return make


def add_database_options(parser: argparse.ArgumentParser) -> None:
    """``--dsn`` and ``--table``: the Postgres database and its lease table."""
    parser.add_argument("--dsn", help="database (default: $RSELECTION_DSN, else the PG* variables)")
    parser.add_argument("--table", default="rselection_leases", help="lease table")


def add_nodes_options(parser: argparse.ArgumentParser, *, redis: bool = False) -> None:
    """``--nodes-table`` and ``--node-timeout``: where node heartbeats are, and when alive.

    With ``redis`` (the command also reads Redis leases, whose leaders' default node
    timeout is 30 s) ``--node-timeout`` defaults to ``None``: resolve it with
    :func:`node_timeout`.
    """
    parser.add_argument("--nodes-table", default="rselection_nodes", help="node heartbeats table")
    parser.add_argument(
        "--node-timeout",
        type=float,
        default=None if redis else 15.0,
        help="a node is alive when seen within this many seconds (default: the leaders' "
        "default, three heartbeats: 15 on Postgres" + (", 30 with --redis-url)" if redis else ")"),
    )


def node_timeout(args: argparse.Namespace) -> float:
    """The ``--node-timeout`` given, else the leaders' default for the backend read."""
    if args.node_timeout is not None:
        return float(args.node_timeout)
    return 30.0 if getattr(args, "redis_url", None) else 15.0


def add_redis_options(parser: argparse.ArgumentParser) -> None:
    """``--redis-url`` and ``--key-prefix``: a Redis lease instead of a Postgres one."""
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="a Redis lease (redis://...; a cluster node's URL for Redis Cluster) instead of --dsn",
    )
    parser.add_argument(
        "--key-prefix",
        help="with --redis-url: the leaders' key_prefix (default: the leaders' default)",
    )


def add_lease_options(parser: argparse.ArgumentParser, *, redis_nodes: bool = False) -> None:
    """Where a lease is, on Postgres or on Redis: :func:`add_database_options`,
    :func:`add_nodes_options` (``redis_nodes``: its ``redis``) and
    :func:`add_redis_options`, in that order."""
    add_database_options(parser)
    add_nodes_options(parser, redis=redis_nodes)
    add_redis_options(parser)


def lease_name(value: str) -> str:
    """An argparse ``type`` for lease names: non-blank, at most 1,000 bytes, kept as is.

    Raises:
        argparse.ArgumentTypeError: not a usable lease name.
    """
    from ..errors import ConfigError
    from ..validation import check_name

    try:
        return check_name(value, "lease name")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def limit_type(most: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for ``--limit``: a whole number from 1 (to ``most``, if any)."""
    bounds = "from 1" if most is None else f"from 1 to {most}"

    def rows(value: str) -> int:
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count < 1 or (most is not None and count > most):
            raise argparse.ArgumentTypeError(
                f"--limit needs a whole number {bounds}, got {value!r}"
            )
        return count

    return rows
