"""``rselection resign``: ask a lease's leader to hand over; wait for the new term.

The backend's admin API does the asking and the waiting (``request_handover``,
``watch_terms``), through :mod:`rselection.resigning` (which the console shares); this
module names the lease's backend in its messages and says what happened.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..admin import Refused
from ..errors import ConfigError
from ..redaction import redact
from ..resigning import check_handover, hand_over
from .connections import act_on_lease, describe
from .options import add_lease_options, lease_name, subcommand
from .output import EXIT_REFUSED, UsageError, printable, say

if TYPE_CHECKING:
    from ..admin import LeaseAdmin
    from ..lease import LeaderInfo
    from ..postgres import PostgresAdmin
    from ..redis import RedisAdmin

__all__ = ["add_parser", "run"]


@subcommand("resign", help="ask the leader of a lease to hand over; wait for the new term")
def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", type=lease_name, help="the lease name")
    add_lease_options(parser)
    parser.add_argument("--to", metavar="NODE", help="the node that should take over")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for a new term (default 10); also how long the lease stays "
        "reserved for --to",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Ask the leader of ``args.name`` to hand over, wait for the new term, return the code."""
    # Both --dsn and --redis-url: that usage error is the one to report (act_on_lease).
    if not args.timeout > 0 and (args.redis_url is None or args.dsn is None):
        raise UsageError(f"--timeout needs a positive number of seconds, got {args.timeout}")
    name = args.name

    def on_postgres(admin: PostgresAdmin, dsn: str) -> int:
        def alive() -> tuple[list[str] | None, bool]:
            nodes = admin.nodes(name)
            if nodes is None:
                return None, False
            return [n.node_id for n in nodes if n.alive], bool(nodes)

        return _checked_hand_over(
            admin,
            args,
            missing=f"no lease {name!r} in {args.table!r} on {describe(dsn)}: check the "
            "name (`rselection status` lists the leases) and --table",
            alive=alive,
            unchecked=f"no nodes table {args.nodes_table!r} (run `rselection migrate`)",
            not_live=f"no heartbeat within {args.node_timeout:g}s",
            shown=lambda text: redact(text, dsn),
        )

    def on_redis(admin: RedisAdmin) -> int:
        def alive() -> tuple[list[str] | None, bool]:
            nodes = admin.live_nodes(name)
            return nodes, bool(nodes)

        return _checked_hand_over(
            admin,
            args,
            missing=f"no lease {name!r} with key prefix {admin.key_prefix!r} in this Redis: "
            "check the name and --key-prefix",
            alive=alive,
            unchecked=None,
            not_live="no keeper connected",
            shown=str,
        )

    return act_on_lease(
        args,
        "resign",
        hint="run `rselection migrate`, or pass the right --table",
        postgres=on_postgres,
        redis=on_redis,
    )


def _checked_hand_over(
    admin: LeaseAdmin,
    args: argparse.Namespace,
    *,
    missing: str,
    alive: Callable[[], tuple[list[str] | None, bool]],
    unchecked: str | None,
    not_live: str,
    shown: Callable[[str], str],
) -> int:
    """Check the lease, its holder and ``--to`` against the live nodes (see
    :func:`rselection.resigning.check_handover`, which takes ``missing`` to
    ``not_live``), then hand over; ``shown`` makes a server's message fit to show."""
    try:
        checked = check_handover(
            admin,
            args.name,
            args.to,
            missing=missing,
            alive=alive,
            unchecked=unchecked,
            not_live=not_live,
        )
    except Refused as exc:
        say(shown(str(exc)), err=True)
        return EXIT_REFUSED
    if checked.already:
        say(f"{printable(args.to)} already leads {args.name!r} (term {checked.holder.term})")
        return 0
    if checked.warning is not None:
        say(checked.warning, err=True)
    return _hand_over(admin, args, shown)


def _hand_over(admin: LeaseAdmin, args: argparse.Namespace, shown: Callable[[str], str]) -> int:
    """Ask for the handover, wait for the new term, say what happened; the exit code.

    Raises:
        BackendUnavailable: the server failed.
    """
    name = args.name

    def said(holder: LeaderInfo) -> None:
        say(
            f"asked {printable(holder.node_id)} to hand {name!r} over (term {holder.term}"
            + (f", to {printable(args.to)}" if args.to else "")
            + ")",
        )

    try:
        done = hand_over(admin, name, to=args.to, timeout=args.timeout, asked=said)
    except (ConfigError, Refused) as exc:
        say(shown(str(exc)), err=True)
        return EXIT_REFUSED
    new, line = done.new, done.new_term_line()
    if new is None or line is None:
        say(
            f"no new term within {args.timeout:g}s: {printable(done.asked.node_id)} did not "
            f"hand {name!r} over (not running, paused, or an rselection without "
            "handover support); the request was withdrawn",
            err=True,
        )
        return EXIT_REFUSED
    say(line)  # tests read the handover's time from it
    if args.to is not None and new.node_id != args.to:
        say(f"{printable(args.to)} did not take over within {args.timeout:g}s", err=True)
        return EXIT_REFUSED
    if new.node_id == done.asked.node_id:
        say(f"no other node took over: {printable(new.node_id)} leads again", err=True)
        return EXIT_REFUSED
    return 0
