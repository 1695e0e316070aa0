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
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailable
from ..redaction import redact
from .connections import (
    Unreachable,
    describe,
    postgres_session,
    reason,
    redis_admin,
    resolve_dsn,
    wants_redis,
)
from .options import (
    add_lease_options,
    lease_name,
    node_timeout,
    subcommand,
)
from .output import (
    EXIT_NO_LEADER,
    EXIT_OK,
    EXIT_UNREACHABLE,
    UsageError,
    ago,
    grid,
    iso,
    printable,
    say,
)

if TYPE_CHECKING:
    from ..admin import StatusSnapshot

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

_SHARD = re.compile(r"0|[1-9][0-9]*")  # a shard's number in its lease name, as written


@subcommand(
    "status",
    help="leases, holders, handover requests, nodes and last fires; exit 0 when every "
    "lease shown has a leader, 1 when one has none, 3 when the database cannot be read",
    description="Show leases, their holders, pending handover requests, nodes and last "
    "fires. Retired leases (rselection forget) are hidden unless named or --all is "
    "given. The exit code is judged on the leases shown (retired ones only when "
    "named): 0 when each has a leader, 1 when one has none (a named lease that does "
    "not exist has none), 3 when the database cannot be read, 2 on a usage error. "
    "With --redis-url, the Redis leases under --key-prefix and their nodes.",
)
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``status`` to its parser."""
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


def read_status(
    snapshot: StatusSnapshot,
    where: str,
    args: argparse.Namespace,
    drained: set[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """What ``status`` shows of a snapshot: the leases asked for, their handover
    requests, nodes, last fires and shards, and which leases have no leader.

    Args:
        snapshot: the snapshot the backend's admin read for ``args.names``.
        where: the server, for people (never with a password).
        args: the parsed ``status`` command line.
        drained: the (lease, node) pairs drained (``rselection drain``).
    """
    named: list[str] = list(dict.fromkeys(args.names))  # in the order given, once each
    wanted = set(named)
    pending = {h.lease: h for h in snapshot.handovers or ()}
    leases: list[dict[str, Any]] = []
    handovers = []
    hidden: list[str] = []
    judged: list[dict[str, Any]] = []
    for found in snapshot.leases:
        if wanted and found.name not in wanted:
            continue
        if found.retired and not wanted and not args.all:
            hidden.append(found.name)
            continue
        lease = {
            "name": found.name,
            "holder": found.holder,
            "term": found.term,
            "acquired_at": iso(found.acquired_at),
            "expires_at": iso(found.expires_at),
            "expires_in": None if found.expires_in is None else round(found.expires_in, 3),
            "live": found.live,
            "retired": found.retired,
            "last_change": None if found.last_change is None else found.last_change.as_json(),
        }
        leases.append(lease)
        if wanted or not found.retired:
            judged.append(lease)
        asked = pending.get(found.name)
        if asked is not None:
            handovers.append(
                {
                    "lease": asked.lease,
                    "term": asked.term,
                    "node_id": asked.node_id,
                    "to": asked.to,
                    "until": iso(asked.until),
                    "expires_in": round(asked.expires_in, 3),
                }
            )
    shown = {lease["name"] for lease in leases}
    unknown = [name for name in named if name not in shown]
    hidden_set = set(hidden)

    def selected(lease: str) -> bool:
        return lease in wanted if wanted else lease not in hidden_set

    nodes = None
    if snapshot.nodes is not None:
        nodes = [
            {
                "lease": node.name,
                "node_id": node.node_id,
                "hostname": node.hostname,
                "pid": node.pid,
                "client_addr": node.client_addr,
                "started_at": iso(node.started_at),
                "last_seen": iso(node.last_seen),
                "seen_ago": round(
                    max(0.0, (snapshot.checked_at - node.last_seen).total_seconds()), 3
                ),
                "alive": node.alive,
                "is_leader": node.is_leader,
                "version": node.version,
                "eligible": node.eligible,
                "drained": (node.name, node.node_id) in (drained or ()),
            }
            for node in snapshot.nodes
            if selected(node.name)
        ]
    rows = [  # every lease read, the shards of a name asked for among them
        (lease.name, lease.holder, lease.term, None, None, lease.expires_in)
        for lease in snapshot.leases
    ]
    fires = None
    if snapshot.fires is not None:
        fires = [
            {
                "lease": fire.lease,
                "task": fire.task,
                "last_fire": fire.fire,
                "node": fire.node,
                "term": fire.term,
                "claimed_at": iso(fire.claimed_at),
            }
            for fire in snapshot.fires
            if selected(fire.lease)
        ]
    return {
        "database": where,
        "checked_at": iso(snapshot.checked_at),
        "names": named or None,
        "leases": leases,
        "unknown": unknown,
        "hidden": hidden,
        "headless": [lease["name"] for lease in judged if not lease["live"]] + unknown,
        "handovers": None if snapshot.handovers is None else handovers,
        "nodes": nodes,
        "tasks": fires,
        "shards": sharded_names(rows, shown, selected),
        "not_recorded": NOT_RECORDED_REDIS if args.redis_url else NOT_RECORDED,
    }


def sharded_names(
    lease_rows: list[tuple[Any, ...]], shown: set[str], selected: Callable[[str], bool]
) -> list[dict[str, Any]]:
    """The sharded names among the leases, with the shards each node leads.

    A sharded name is a lease ``NAME`` (its coordinator) with leases ``NAME/<k>`` beside
    it (its shards, see ``PostgresShardedLeader``).

    Args:
        lease_rows: the lease rows (name, holder, term, acquired_at, expires_at, seconds
            to expiry, ...).
        shown: the leases the status shows.
        selected: whether a lease was asked for.
    """
    held: dict[str, dict[int, str | None]] = {}
    for row in lease_rows:
        name, holder, expires_in = row[0], row[1], row[5]
        base, _, tail = name.rpartition("/")
        if base and "/" not in base and _SHARD.fullmatch(tail):
            live = holder is not None and expires_in is not None and expires_in > 0
            held.setdefault(base, {})[int(tail)] = holder if live else None
    out = []
    for name in sorted(held):
        if name not in shown or not selected(name):
            continue
        owners: dict[str, list[int]] = {}
        for shard, holder in sorted(held[name].items()):
            if holder is not None:
                owners.setdefault(holder, []).append(shard)
        out.append(
            {
                "name": name,
                "shards": len(held[name]),
                "unled": sorted(k for k, v in held[name].items() if v is None),
                "nodes": {node: mine for node, mine in sorted(owners.items())},
            }
        )
    return out


def exit_code(status: dict[str, Any]) -> int:
    """The exit code of a :func:`read_status` snapshot: 1 when a lease judged has no leader.

    Args:
        status: the snapshot.
    """
    return EXIT_NO_LEADER if status["headless"] else EXIT_OK


def render(status: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The lines ``status`` prints for people.

    Args:
        status: a :func:`read_status` snapshot.
        args: the parsed ``status`` command line.
    """
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


def shard_ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


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
            snapshot = admin.status(args.names or None)
            drained = admin.drained_of(node.name for node in snapshot.nodes or ())
        except BackendUnavailable as exc:
            raise Unreachable(
                f"cannot read the leases from Redis {admin.where}: "
                f"{redact(reason(exc), args.redis_url)}"
            ) from exc
        return read_status(snapshot, where, args, drained)

    return read


def _read_postgres(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``status`` of the Postgres leases, on a connection of its own.

    Raises:
        Unreachable: the database cannot be reached or read, or has no lease table.
    """
    hint = "run `rselection migrate`, or pass the right --table"
    try:
        with postgres_session(args, dsn, hint=hint) as admin:
            snapshot = admin.status(args.names or None)
            drained = admin.drained_of(node.name for node in snapshot.nodes or ())
    except BackendUnavailable as exc:
        raise Unreachable(
            f"cannot read the leases from {describe(dsn)}: {redact(reason(exc), dsn)}"
        ) from exc
    return read_status(snapshot, describe(dsn), args, drained)


def run(args: argparse.Namespace) -> int:
    """Print the status once (or every ``--watch`` seconds); return the exit code.

    Args:
        args: the parsed ``status`` command line.
    """
    watch = args.watch
    if watch is not None and not watch > 0:
        raise UsageError(f"--watch needs a positive number of seconds, got {watch}")
    if args.count is not None and (watch is None or args.count < 1):
        raise UsageError("--count needs --watch and a positive number of refreshes")
    refreshes = args.count if args.count is not None else (None if watch is not None else 1)
    try:
        read = _reader(args)
    except Unreachable as exc:
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    clear = watch is not None and not args.json and sys.stdout.isatty()
    code = EXIT_OK
    done = 0
    try:
        while True:
            began = time.monotonic()
            try:
                status = read()
            except Unreachable as exc:
                code = EXIT_UNREACHABLE
                say(str(exc), err=True)
                if args.json:  # scripts parse stdout: they get a document here too
                    print(json.dumps({"error": str(exc), "exit_code": code}), flush=True)
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
