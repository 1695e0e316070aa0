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

from ..admin import Refused, Retirement
from ..errors import BackendUnavailable, ConfigError
from ..redaction import redact
from .connections import (
    NoLeaseTable,
    Unreachable,
    describe,
    postgres_session,
    reason,
    redis_admin,
    resolve_dsn,
)
from .options import (
    add_database_options,
    add_nodes_options,
    add_redis_options,
    lease_name,
    subcommand,
)
from .output import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, UsageError, say

__all__ = ["add_parser", "run"]


@subcommand(
    "forget",
    help="retire a lease no service uses any more: hidden from status, its term kept",
    description="Retire a lease that no service uses any more. It is hidden from "
    "`rselection status` (unless named, or with --all) and no longer counts for its "
    "exit code. Nothing is deleted: the lease keeps its term, so a new leader gets a "
    "higher one, and a leader that acquires it again brings it back. Refused (exit 1) "
    "while the lease has a live holder or a node of it heartbeats.",
)
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``forget`` to its parser."""
    parser.add_argument("name", type=lease_name, help="the lease name")
    add_database_options(parser)
    add_nodes_options(parser)
    add_redis_options(parser)
    parser.set_defaults(run=run)


def _retired(done: Retirement, hidden: str) -> str:
    name, term = done.name, done.term
    if done.already:
        return f"lease {name!r} was already retired at term {term}: nothing to do"
    return (
        f"retired lease {name!r} at term {term}: {hidden}; its term is kept, so a new "
        f"leader gets term {term + 1} or later, and acquiring it brings it back"
    )


def run(args: argparse.Namespace) -> int:
    """Retire lease ``args.name``; print what was done; return the exit code.

    Args:
        args: the parsed ``forget`` command line.
    """
    if args.redis_url is not None:
        if args.dsn is not None:
            raise UsageError("pass either --dsn (Postgres) or --redis-url (Redis), not both")
        return _forget_redis(args)
    dsn = resolve_dsn(args)
    try:
        with postgres_session(args, dsn, hint="pass the right --table") as admin:
            done = admin.retire(args.name)
    except NoLeaseTable as exc:
        say(str(exc), err=True)
        return EXIT_REFUSED
    except Unreachable as exc:
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    except (Refused, ConfigError) as exc:
        say(redact(str(exc), dsn), err=True)
        return EXIT_REFUSED
    except BackendUnavailable as exc:
        say(f"forget failed on {describe(dsn)}: {redact(reason(exc), dsn)}", err=True)
        return EXIT_UNREACHABLE
    hidden = "hidden from `rselection status` (name it, or pass --all, to see it)"
    say(_retired(done, hidden))
    return EXIT_OK


def _forget_redis(args: argparse.Namespace) -> int:
    """``forget --redis-url``: the same on a Redis lease."""
    try:
        admin = redis_admin(args)
    except Unreachable as exc:
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    try:
        done = admin.retire(args.name)
    except Refused as exc:
        say(str(exc), err=True)
        return EXIT_REFUSED
    except BackendUnavailable as exc:
        say(f"forget failed: {redact(reason(exc), args.redis_url)}", err=True)
        return EXIT_UNREACHABLE
    finally:
        admin.client.close()
    say(_retired(done, f"marked by {done.marker!r}"))
    return EXIT_OK
