"""``rselection status [NAME ...]``: leases, holders, handover requests, nodes, last fires.

Without names it shows every lease but the retired ones (``rselection forget``); with
names, only those leases (retired or not), their nodes and their fires; ``--all`` also
shows the retired leases. The exit code is judged on the leases shown, retired ones
only when named: 0 when each has a live leader, 1 when one has none (a named lease
that does not exist has none), 3 when the database cannot be read (2: a usage error).
With ``--redis-url`` it reads the Redis leases under ``--key-prefix`` instead, their
nodes from the leases' heartbeats. Both read a snapshot through the backend's admin
API (:class:`~rselection.postgres.PostgresAdmin`, :class:`~rselection.redis.RedisAdmin`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailable
from ..redaction import redact
from ..status_report import shard_ranges, sharded_names, status_document
from .connections import (
    Unreachable,
    describe,
    postgres_session,
    reason,
    redis_admin,
    resolve_dsn,
    wants_redis,
)
from .options import add_lease_options, lease_name, node_timeout, subcommand
from .output import (
    EXIT_NO_LEADER,
    EXIT_OK,
    EXIT_UNREACHABLE,
    UsageError,
    ago,
    fail,
    grid,
    printable,
    say,
)

if TYPE_CHECKING:
    from ..admin import LeaseAdmin

__all__ = [
    "NOT_RECORDED",
    "NOT_RECORDED_REDIS",
    "add_parser",
    "exit_code",
    "read_status",
    "render",
    "run",
    "shard_ranges",
    "sharded_names",
]

NOT_RECORDED = (
    "next fires, failures and persistent tasks are not recorded in the database "
    "(see TaskHandler.health() on the leader); last fires come from the claims table"
)
"""What ``status`` cannot show, said in its output so nobody looks for it there."""

NOT_RECORDED_REDIS = (
    "last fires, next fires, failures and persistent tasks are not read from Redis "
    "(see TaskHandler.health() on the leader)"
)
"""What ``status --redis-url`` cannot show, said in its output."""


@subcommand(
    "status",
    help="leases, holders, handover requests, nodes and last fires; exit 0 when every "
    "lease shown has a leader, 1 when one has none, 3 when the database cannot be read",
)
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Show leases, their holders, pending handover requests, nodes and last fires. Retired
    leases (rselection forget) are hidden unless named or --all is given. The exit code is
    judged on the leases shown (retired ones only when named): 0 when each has a leader, 1
    when one has none (a named lease that does not exist has none), 3 when the database
    cannot be read, 2 on a usage error. With --redis-url, the Redis leases under
    --key-prefix and their nodes."""
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        type=lease_name,
        help="show only these leases (and their nodes and fires), retired or not; the exit "
        "code is judged on them alone (default: every lease that is not retired)",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="also show retired leases (rselection forget); they do not count for the exit code",
    )
    add_lease_options(parser, redis_nodes=True)
    parser.add_argument("--claims-table", default="rselection_claims", help="fire claims table")
    parser.add_argument("--json", action="store_true", help="one JSON document (per refresh)")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    parser.add_argument("--count", type=int, help="with --watch: stop after this many refreshes")
    parser.set_defaults(run=run)


def read_status(admin: LeaseAdmin, where: str, args: argparse.Namespace) -> dict[str, Any]:
    """What ``status`` shows of a snapshot of ``admin``'s leases, read now (see
    :func:`rselection.status_report.status_document`, which the console shares); ``where``
    is the server, for people (never with a password).

    Raises:
        BackendUnavailable: the server cannot be read.
    """
    snapshot = admin.status(args.names or None)
    return status_document(
        snapshot,
        where,
        names=args.names,
        show_all=args.all,
        not_recorded=NOT_RECORDED_REDIS if args.redis_url else NOT_RECORDED,
        drained=admin.drained_of(node.name for node in snapshot.nodes or ()),
    )


def exit_code(status: dict[str, Any]) -> int:
    """The exit code of a :func:`read_status` snapshot: 1 when a lease judged has no leader."""
    return EXIT_NO_LEADER if status["headless"] else EXIT_OK


def render(status: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The lines ``status`` prints for people of a :func:`read_status` snapshot."""
    lines = [f"{status['database']}  at {status['checked_at']}", ""]
    redis_url = getattr(args, "redis_url", None)
    where = f"key prefix {args.key_prefix!r}" if redis_url else repr(args.table)
    if status["leases"]:
        rows = [
            [
                lease["name"],
                lease["holder"] or ("(retired)" if lease["retired"] else "(none)"),
                str(lease["term"]),
                lease["acquired_at"] or "-",
                f"{lease['expires_in']:.1f}s" if lease["live"] else "-",
                _last_change(lease["last_change"]),
            ]
            for lease in status["leases"]
        ]
        lines += grid(["LEASE", "HOLDER", "TERM", "ACQUIRED", "EXPIRES IN", "LAST CHANGE"], rows)
    elif status["unknown"]:
        lines.append(f"no lease named {', '.join(map(printable, status['unknown']))} in {where}")
    else:
        lines.append(f"no leases in {where} yet")
    if status["hidden"]:
        count = len(status["hidden"])
        lines.append(
            f"({count} retired lease{'s' if count > 1 else ''} hidden: name "
            f"{'them' if count > 1 else 'it'} or pass --all to see "
            f"{'them' if count > 1 else 'it'})"
        )
    lines.append("")
    handovers = status["handovers"]
    if handovers is None:
        lines.append(
            f"handover requests: table {args.table!r} predates them (run `rselection migrate`)"
        )
    elif not handovers:
        lines.append("handover requests: none pending")
    else:
        lines.append("handover requests (pending until the next term or the end of the window):")
        rows = [
            [
                h["lease"],
                str(h["term"]),
                h["node_id"],
                h["to"] or "(any other)",
                f"{h['expires_in']:.1f}s",
            ]
            for h in handovers
        ]
        lines += grid(["LEASE", "TERM", "ASKED", "TO", "WINDOW LEFT"], rows)
    lines.append("")
    nodes = status["nodes"]
    if nodes is None:
        lines.append(f"nodes: no table {args.nodes_table!r} (run `rselection migrate`)")
    elif not nodes:
        lines.append("nodes: none heartbeating")
    else:
        alive = sum(1 for n in nodes if n["alive"])
        lines.append(
            f"nodes: {alive} alive, {len(nodes) - alive} lost "
            f"(alive = seen within {node_timeout(args):g}s)"
        )
        rows = [
            [
                n["lease"],
                n["node_id"],
                n["hostname"],
                str(n["pid"]),
                n["client_addr"] or "local",
                n["started_at"] or "-",
                ago(n["seen_ago"]),
                n["version"] or "-",
                _node_state(n),
            ]
            for n in nodes
        ]
        headers = ["LEASE", "NODE", "HOST", "PID", "ADDRESS", "STARTED", "LAST SEEN", "VERSION"]
        lines += grid([*headers, "STATE"], rows)
    lines.append("")
    fires = status["tasks"]
    if fires is None and redis_url:
        lines.append("tasks:")
    elif fires is None:
        lines.append(f"tasks: no claims table {args.claims_table!r}, no fires recorded")
    elif not fires:
        lines.append("tasks: no claimed fires recorded")
    else:
        lines.append("tasks (last claimed fire of each scheduled task):")
        rows = [[f["lease"], f["task"], f["last_fire"], f["node"], str(f["term"])] for f in fires]
        lines += grid(["LEASE", "TASK", "LAST FIRE", "BY NODE", "TERM"], rows)
    lines.append(f"  ({status['not_recorded']})")
    for sharded in status.get("shards") or []:
        lines.append("")
        nodes_of = sharded["nodes"]
        led = sum(len(mine) for mine in nodes_of.values())
        lines.append(
            f"shards of {sharded['name']!r}: {led} of {sharded['shards']} led, by "
            f"{len(nodes_of)} node{'s' if len(nodes_of) != 1 else ''}"
        )
        rows = [[node, str(len(mine)), shard_ranges(mine)] for node, mine in nodes_of.items()]
        if sharded["unled"]:
            rows.append(["(none)", str(len(sharded["unled"])), shard_ranges(sharded["unled"])])
        lines += grid(["NODE", "SHARDS", "WHICH"], rows)
    unknown = status["unknown"]
    headless = [name for name in status["headless"] if name not in unknown]
    if headless or unknown:
        lines.append("")
    if headless:
        lines.append("NO LEADER: " + ", ".join(map(printable, headless)))
    if unknown:
        lines.append(f"NO SUCH LEASE in {where}: " + ", ".join(map(printable, unknown)))
    return lines


def _last_change(change: dict[str, Any] | None) -> str:
    """``"term 4 handed_over to b at <time>"``, or ``"-"`` when none is recorded."""
    if change is None:
        return "-"
    end = change["end_reason"]
    if change["handed_to"]:
        end += f" to {change['handed_to']}"
    return f"term {change['term']} {end} at {change['ended_at']}"


def _reader(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    """What reads one snapshot: from Postgres, or from Redis with ``--redis-url``.

    Raises:
        UsageError: both ``--dsn`` and ``--redis-url``, or a bad URL.
        Unreachable: Redis did not answer.
    """
    if not wants_redis(args):
        dsn = resolve_dsn(args)
        return lambda: _read_postgres(dsn, args)
    admin = redis_admin(args, node_timeout(args))
    args.node_timeout = admin.node_timeout
    args.key_prefix = admin.key_prefix
    where = f"Redis {admin.where}, key prefix {admin.key_prefix!r}"

    def read() -> dict[str, Any]:
        try:
            return read_status(admin, where, args)
        except BackendUnavailable as exc:
            raise Unreachable(
                f"cannot read the leases from Redis {admin.where}: "
                f"{redact(reason(exc), args.redis_url)}"
            ) from exc

    return read


def _read_postgres(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``status`` of the Postgres leases, on a connection of its own.

    Raises:
        Unreachable: the database cannot be reached or read, or has no lease table.
    """
    hint = "run `rselection migrate`, or pass the right --table"
    try:
        with postgres_session(args, dsn, hint=hint) as admin:
            return read_status(admin, describe(dsn), args)
    except BackendUnavailable as exc:
        raise Unreachable(
            f"cannot read the leases from {describe(dsn)}: {redact(reason(exc), dsn)}"
        ) from exc


def run(args: argparse.Namespace) -> int:
    """Print the status once (or every ``--watch`` seconds); return the exit code."""
    watch = args.watch
    if watch is not None and not watch > 0:
        raise UsageError(f"--watch needs a positive number of seconds, got {watch}")
    if args.count is not None and (watch is None or args.count < 1):
        raise UsageError("--count needs --watch and a positive number of refreshes")
    refreshes = args.count if args.count is not None else (None if watch is not None else 1)
    try:
        read = _reader(args)
    except Unreachable as exc:
        return fail(args, exc, EXIT_UNREACHABLE)
    clear = watch is not None and not args.json and sys.stdout.isatty()
    code = EXIT_OK
    done = 0
    try:
        while True:
            began = time.monotonic()
            try:
                status = read()
            except Unreachable as exc:
                code = fail(args, exc, EXIT_UNREACHABLE)
            else:
                code = exit_code(status)
                if args.json:
                    status["exit_code"] = code
                    indent = None if watch is not None else 2
                    print(json.dumps(status, indent=indent), flush=True)
                else:
                    if clear:
                        sys.stdout.write("\x1b[H\x1b[2J")
                    elif done:
                        say()
                    say("\n".join(render(status, args)))
            done += 1
            if refreshes is not None and done >= refreshes:
                return code
            assert watch is not None
            time.sleep(max(0.0, watch - (time.monotonic() - began)))
    except KeyboardInterrupt:
        return code


def _node_state(node: dict[str, Any]) -> str:
    """``leader``, ``alive``, ``drained`` (alive, drained by an operator),
    ``ineligible`` (alive, started never to lead) or ``lost``."""
    if not node["alive"]:
        return "lost"
    if node["is_leader"]:
        return "leader"
    if node.get("drained"):
        return "drained"
    return "alive" if node["eligible"] else "ineligible"
