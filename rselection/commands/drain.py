"""``rselection drain NAME NODE`` and ``undrain``: make a running node ineligible, or
eligible again.

A drained node never leads, never gets a handover or a shard, until undrained, across
its restarts; a drained holder hands the lease over at once. The backend's admin API
does it (``drain``, ``undrain``); this module says what happened.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from .connections import act_on_lease
from .options import add_lease_options, lease_name, subcommand
from .output import EXIT_OK, printable, say

if TYPE_CHECKING:
    from ..admin import LeaseAdmin

__all__ = ["add_parser", "run"]


def add_options(parser: argparse.ArgumentParser, *, run: object) -> None:
    """The options (and ``run``) of ``drain`` and ``undrain``."""
    parser.add_argument("name", type=lease_name, help="the lease name")
    parser.add_argument("node", help="the node id (as `rselection status NAME` lists it)")
    add_lease_options(parser)
    parser.add_argument("--json", action="store_true", help="one JSON document")
    parser.set_defaults(run=run)


@subcommand(
    "drain", help="make a running node ineligible until undrained; a drained leader hands over"
)
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Drain a node of a lease: from now on, and across its restarts until `rselection
    undrain`, it never leads, never gets a handover or a shard. If it leads, it ends its
    term at once and another eligible node takes over. The node sees it within about a
    second. Draining a drained node changes nothing (exit 0). Refused (exit 1) for an
    unknown lease or node."""
    add_options(parser, run=run)


def run(args: argparse.Namespace) -> int:
    """Drain node ``args.node`` of lease ``args.name``; say what was done; the exit code."""
    return change(args, drained=True)


def change(args: argparse.Namespace, *, drained: bool) -> int:
    """Drain (or, ``drained=False``, undrain) ``args.node`` of ``args.name``; the exit code."""

    def act(admin: LeaseAdmin) -> int:
        holder = admin.current_holder(args.name)
        done = admin.drain(args.name, args.node) if drained else admin.undrain(args.name, args.node)
        led = holder is not None and holder.node_id == done.node_id
        if args.json:
            print(json.dumps({**asdict(done), "leads": led}), flush=True)
            return EXIT_OK
        node = printable(done.node_id)
        if not done.changed:
            state = "already drained" if drained else "not drained"
            say(f"node {node} of lease {done.name!r} was {state}: nothing to do")
        elif drained:
            say(
                f"drained node {node} of lease {done.name!r}: it leads no more until "
                f"`rselection undrain {done.name} {node}`"
                + (f"; it leads term {holder.term}, and hands over now" if led and holder else "")
            )
        else:
            say(f"undrained node {node} of lease {done.name!r}: it may lead again")
        return EXIT_OK

    return act_on_lease(
        args,
        "drain" if drained else "undrain",
        hint="run `rselection migrate`, or pass the right --table",
        postgres=lambda admin, _dsn: act(admin),
        redis=act,
    )
