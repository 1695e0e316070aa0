"""``rselection resign``: ask a lease's leader to hand over; wait for the new term.

The backend's admin API does the asking and the waiting (``request_handover``,
``watch_terms``); this module checks the command line against the lease and its nodes
and says what happened.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..admin import Refused
from ..errors import ConfigError
from ..redaction import redact
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
    """Add the options of ``resign`` to its parser."""
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


def _took_over(node: str, name: str, term: int, took: float) -> str:
    """The line that reports a handover (tests read its time)."""
    return (
        f"{printable(node)} leads {name!r} now with term {term} "
        f"(handover took {took * 1000:.0f} ms)"
    )


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
    """Check the lease, its holder and ``--to`` against the live nodes, then hand over.

    Args:
        admin: the backend's admin API.
        args: the command line.
        missing: what to say when the lease does not exist.
        alive: the live nodes' ids (``None``: they cannot be told), and whether the
            lease has nodes at all.
        unchecked: why ``--to`` cannot be checked when the live nodes cannot be told
            (refused); ``None``: ask anyway, with a warning.
        not_live: why a node that is not live does not count as one.
        shown: makes a server's message fit to show.
    """
    name = args.name
    holder = admin.current_holder(name)
    if holder is None:
        say(
            missing
            if not admin.exists(name)
            else f"lease {name!r} has no leader: nothing to hand over",
            err=True,
        )
        return EXIT_REFUSED
    nodes, tracked = alive()
    ineligible = admin.ineligible(name)
    if nodes is not None:
        nodes = [node for node in nodes if node not in ineligible]
    if args.to is not None:
        if args.to == holder.node_id:
            say(f"{printable(args.to)} already leads {name!r} (term {holder.term})")
            return 0
        if args.to in ineligible:
            why = (
                "it is drained (`rselection undrain` makes it eligible again)"
                if args.to in admin.drained(name)
                else "it was started with eligible=False"
            )
            say(
                f"{printable(args.to)} may not lead {name!r}: {why}; hand over to another node",
                err=True,
            )
            return 1
        cannot = f"cannot check that {printable(args.to)} is a live node"
        if nodes is None and unchecked is not None:
            say(f"{cannot}: {unchecked}", err=True)
            return 1
        if nodes is None:
            say(
                f"{cannot} (PUBSUB CHANNELS is not allowed); asking anyway: if it is not "
                "running, no node takes over until --timeout",
                err=True,
            )
        elif args.to not in nodes:
            others = ", ".join(printable(n) for n in nodes if n != holder.node_id) or "none"
            say(
                f"{printable(args.to)} is not a live node of lease {name!r} ({not_live}); "
                f"live followers: {others}",
                err=True,
            )
            return 1
    elif tracked and not [n for n in nodes or [] if n != holder.node_id]:
        say(_nobody_else(name, holder), err=True)
        return 1
    return _hand_over(admin, args, shown)


def _nobody_else(name: str, holder: LeaderInfo) -> str:
    return (
        f"no other live node of lease {name!r} that may lead to hand over to "
        f"({printable(holder.node_id)} leads term {holder.term}); start another node first"
    )


def _hand_over(admin: LeaseAdmin, args: argparse.Namespace, shown: Callable[[str], str]) -> int:
    """Ask for the handover, wait for the new term, say what happened; the exit code.

    Args:
        admin: the lease's backend.
        args: the parsed ``resign`` command line.
        shown: what of an error message may be shown (a password redacted).

    Raises:
        BackendUnavailable: the server failed.
    """
    name = args.name
    with admin.watch_terms(name) as watch:
        asked_at = time.monotonic()
        try:
            asked = admin.request_handover(name, to=args.to, valid_for=args.timeout)
        except (ConfigError, Refused) as exc:
            say(shown(str(exc)), err=True)
            return 1
        if asked is None:
            say(f"lease {name!r} has no leader: nothing to hand over", err=True)
            return 1
        say(
            f"asked {printable(asked.node_id)} to hand {name!r} over (term {asked.term}"
            + (f", to {printable(args.to)}" if args.to else "")
            + ")",
        )
        new = watch.wait(asked.term, asked_at + args.timeout - time.monotonic())
        took = time.monotonic() - asked_at
    if new is None:
        admin.cancel_handover(name, asked.term)
        say(
            f"no new term within {args.timeout:g}s: {printable(asked.node_id)} did not hand "
            f"{name!r} over (not running, paused, or an rselection without "
            "handover support); the request was withdrawn",
            err=True,
        )
        return 1
    say(_took_over(new.node_id, name, new.term, took))
    if args.to is not None and new.node_id != args.to:
        say(f"{printable(args.to)} did not take over within {args.timeout:g}s", err=True)
        return 1
    if new.node_id == asked.node_id:
        say(f"no other node took over: {printable(new.node_id)} leads again", err=True)
        return 1
    return 0
