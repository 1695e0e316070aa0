"""``rselection demo``: nodes compete for one lease; watch a crash failover and a handover.

The demo starts node processes (:mod:`rselection.commands.demo_fleet`), each a
:class:`~rselection.PostgresLeader` with a ticking task and a fenced ledger writer,
prints what they report, kills the leader with SIGKILL and measures how long the fleet
takes to elect another one, then stops the new leader gracefully and measures the
handover. At the end it cleans up what it created: it retires its lease (as
``rselection forget`` does: the row and its term stay, hidden from ``rselection
status``) and drops its ledger table, so a demo run against a shared database leaves no
headless lease behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

from .demo_fleet import Fleet
from .options import subcommand
from .output import UsageError, say

__all__ = ["add_parser", "run", "run_demo"]


@subcommand("demo", help="three nodes, a crash and a handover, measured")
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Start node processes that compete for one lease, kill the leader (kill -9) and measure
    the failover, then stop the next leader gracefully and measure the handover. On a
    database of yours (--dsn) it cleans up at the end: its lease is retired (as `rselection
    forget` does) and its ledger table dropped."""
    parser.add_argument(
        "--dsn",
        help="Postgres to use (default: $RSELECTION_DSN, else a private one from pgserver, "
        "deleted at the end)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=3,
        metavar="N",
        help="how many node processes compete for the lease (default 3, at least 3: one is "
        "killed, one stopped, one takes over)",
    )
    parser.add_argument("--forever", action="store_true", help="keep running until Ctrl-C")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo from its command line; return the exit code."""
    from .connections import given_dsn

    if args.nodes < 3:
        # One node is killed, the next is stopped: a third must be there to take over.
        raise UsageError(
            f"--nodes needs at least 3 nodes (one is killed, one stopped, one takes over), "
            f"got {args.nodes}"
        )
    return run_demo(given_dsn(args) or None, args.nodes, args.forever)


@contextlib.contextmanager
def _database(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    _refuse_root()
    with tempfile.TemporaryDirectory(prefix="rselection-demo-") as data:
        with warnings.catch_warnings():
            # pgserver finds its lock directory with platformdirs, which warns when
            # XDG_RUNTIME_DIR is unset (containers, cron, sudo) and falls back to a private
            # directory that works: nothing for the user to act on.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            try:
                from pgserver.postgres_server import get_server
            except ImportError:
                raise UsageError(
                    "rselection demo needs a Postgres: pass --dsn postgresql://... (or set "
                    "RSELECTION_DSN), or install the embedded server: "
                    "pip install 'rselection[embedded]'"
                ) from None
            say("starting a private Postgres (pgserver) ...")
            server = get_server(data, cleanup_mode="stop")
        try:
            yield server.get_uri()
        finally:
            server.cleanup()


def _refuse_root() -> None:
    """Refuse to start the embedded server as root, before anything is touched.

    Postgres does not run as root, so pgserver then adds a system user to run it as and
    makes every directory above its data directory (under ``$TMPDIR``) and above its
    binaries readable and searchable by all users: a private home (0700) became 0755.
    """
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        raise UsageError(
            "the demo's embedded Postgres (pgserver) does not run as root: it would add a "
            "system user and make every directory above $TMPDIR readable by all users. "
            "Run the demo as a normal user, or give it a Postgres: --dsn postgresql://... "
            "(or RSELECTION_DSN)"
        )


def _describe(event: dict[str, Any]) -> str | None:
    kind = event["ev"]
    if kind == "elected":
        return f"{event['node']} now LEADS (term {event['term']})"
    if kind == "demoted":
        return f"{event['node']} stopped leading term {event['term']} ({event['reason']})"
    if kind == "tick":
        return f"  {event['node']} ran task 'tick' in term {event['term']}"
    if kind == "ready":
        return f"{event['node']} started (pid {event['pid']}), following"
    if kind == "stopped":
        return f"{event['node']} stopped gracefully"
    return None


def _show(event: dict[str, Any] | None) -> dict[str, Any] | None:
    if event is not None and (text := _describe(event)):
        say(text)
    return event


def _await_leader(fleet: Fleet, timeout: float, exclude: str | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        event = _show(fleet.next_event(left))
        if event and event["ev"] == "elected" and event["node"] != exclude:
            return event
    raise SystemExit(f"no node became leader within {timeout:.0f}s")


def _watch(fleet: Fleet, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        _show(fleet.next_event(left))


def run_demo(dsn: str | None, nodes: int = 3, forever: bool = False) -> int:
    """Run the demo; return the process exit code.

    Args:
        dsn: the Postgres to use; ``None`` starts a private one (``pgserver``).
        nodes: how many node processes compete for the lease.
        forever: after the measurements, keep the fleet running until Ctrl-C.
    """
    import uuid

    with _database(dsn) as url:
        suffix = uuid.uuid4().hex[:6]
        name = f"demo-{suffix}"
        ledger = f"rselection_demo_ledger_{suffix}"  # this run's own: dropped at the end
        try:
            with Fleet(url, name, ["--ledger", ledger]) as fleet:
                for i in range(1, nodes + 1):
                    fleet.spawn(f"node-{i}")
                leader = _await_leader(fleet, 30)
                _watch(fleet, 3)

                say(f"\n*** kill -9 {leader['node']} (the leader) ***")
                killed_at = time.time()
                fleet.kill(leader["node"])
                successor = _await_leader(fleet, 30, exclude=leader["node"])
                crash_ms = (successor["t"] - killed_at) * 1000
                say(f"*** failover after a crash took {crash_ms:.0f} ms (ttl is 15 s) ***\n")
                _watch(fleet, 3)

                say(f"*** graceful stop of {successor['node']} ***")
                stopped_at = time.time()
                fleet.kill(successor["node"], signal.SIGTERM)
                heir = _await_leader(fleet, 30, exclude=successor["node"])
                handover_ms = (heir["t"] - stopped_at) * 1000
                say(f"*** graceful handover took {handover_ms:.0f} ms ***\n")
                _watch(fleet, 2)
                if forever:
                    say("running until Ctrl-C")
                    with contextlib.suppress(KeyboardInterrupt):
                        while True:
                            _watch(fleet, 3600)
            rows, terms, late = _ledger_summary(url, name, ledger)
        finally:
            _clean_up(url, name, ledger)
        say(f"summary: crash failover {crash_ms:.0f} ms, graceful handover {handover_ms:.0f} ms")
        say(f"ledger: {rows} fenced writes in {terms} terms, {late} written after a newer term")
    return 0 if late == 0 else 1


def _clean_up(dsn: str, name: str, ledger: str) -> None:
    """Retire the demo's lease once its nodes stopped (its row and term stay, as with
    ``rselection forget``) and drop its ledger table."""
    import psycopg
    from psycopg import sql

    from ..admin import Refused
    from ..errors import BackendUnavailable
    from ..postgres import PostgresAdmin
    from ..redaction import redact
    from .connections import first_line, reason

    try:
        with PostgresAdmin(dsn) as admin:
            if admin.lease_table_exists():
                admin.retire(name, check_nodes=False)
    except (Refused, BackendUnavailable) as exc:
        say(f"could not retire the demo's lease {name!r}: {redact(reason(exc), dsn)}")
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(ledger)))
    except psycopg.Error as exc:
        say(f"could not drop the demo's table {ledger!r}: {redact(first_line(exc), dsn)}")


def _ledger_summary(dsn: str, lease: str, ledger: str) -> tuple[int, int, int]:
    """Rows, terms, and rows of an older term written after a newer term's row."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*), count(DISTINCT term),"
                " (SELECT count(*) FROM {t} a JOIN {t} b"
                "  ON a.lease = b.lease AND a.term < b.term AND a.id > b.id WHERE a.lease = %s)"
                " FROM {t} WHERE lease = %s"
            ).format(t=sql.Identifier(ledger)),
            (lease, lease),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])
