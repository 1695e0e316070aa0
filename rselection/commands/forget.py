"""``rselection forget NAME``: retire a lease that no service uses any more.

A retired lease is hidden from ``rselection status`` (unless named, or with ``--all``)
and no longer makes it exit 1. Its row (Postgres) or term key (Redis) stays, so its
term never restarts and a term that once fenced writes can never become valid again.
Retiring refuses a lease with a live holder and one whose nodes still heartbeat (Redis:
whose keepers are connected). A lease stays retired only while its term is the one it
was retired at: the next acquisition increments the term and so brings it back, with
nothing to undo. The backend's admin API does it (``retire``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..admin import Retirement
from .connections import act_on_lease
from .options import add_lease_options, lease_name, subcommand
from .output import EXIT_OK, say

if TYPE_CHECKING:
    from ..redis import RedisAdmin

__all__ = ["add_parser", "run"]


@subcommand(
    "forget", help="retire a lease no service uses any more: hidden from status, its term kept"
)
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Retire a lease that no service uses any more. It is hidden from `rselection status`
    (unless named, or with --all) and no longer counts for its exit code. Nothing is
    deleted: the lease keeps its term, so a new leader gets a higher one, and a leader that
    acquires it again brings it back. Refused (exit 1) while the lease has a live holder or
    a node of it heartbeats."""
    parser.add_argument("name", type=lease_name, help="the lease name")
    add_lease_options(parser)
    parser.set_defaults(run=run)


def _retired(done: Retirement, hidden: str) -> int:
    """Say what retiring did; the exit code."""
    name, term = done.name, done.term
    if done.already:
        say(f"lease {name!r} was already retired at term {term}: nothing to do")
    else:
        say(
            f"retired lease {name!r} at term {term}: {hidden}; its term is kept, so a new "
            f"leader gets term {term + 1} or later, and acquiring it brings it back"
        )
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Retire lease ``args.name``; print what was done; return the exit code."""
    hidden = "hidden from `rselection status` (name it, or pass --all, to see it)"

    def on_redis(admin: RedisAdmin) -> int:
        done = admin.retire(args.name)
        return _retired(done, f"marked by {done.marker!r}")

    return act_on_lease(
        args,
        "forget",
        hint="pass the right --table",
        postgres=lambda admin, _dsn: _retired(admin.retire(args.name), hidden),
        redis=on_redis,
    )
