"""``rselection status [NAME ...]``: leases, holders, handover requests, nodes, last fires.

Without names it shows every lease but the retired ones (``rselection forget``); with
names, only those leases (retired or not), their nodes and their fires; ``--all`` also
shows the retired leases. The exit code is judged on the leases shown, retired ones
only when named: 0 when each has a live leader, 1 when one has none (a named lease
that does not exist has none), 3 when the database cannot be read (2: a usage error).
With ``--redis-url`` it reads the Redis leases under ``--key-prefix`` instead
(:mod:`rselection.commands.redis_status`), their nodes from the leases' heartbeats.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..redaction import redact
from .connections import (
    Unreachable,
    connect,
    describe,
    first_line,
    resolve_dsn,
    table_exists,
)
from .leases import has_columns
from .options import (
    add_database_options,
    add_nodes_options,
    add_redis_options,
    lease_name,
    node_timeout,
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
    import psycopg

__all__ = [
    "NOT_RECORDED",
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

_SHARD = re.compile(r"0|[1-9][0-9]*")  # a shard's number in its lease name, as written


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``status`` and its options to the command line.

    Args:
        subparsers: the ``rselection`` command's subparsers.
    """
    parser = subparsers.add_parser(
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
    add_database_options(parser)
    add_redis_options(parser)
    add_nodes_options(parser, redis=True)
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
    return parser


def _lease_rows(conn: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    """Every lease row: name, holder, term, acquired_at, expires_at, seconds to expiry,
    retired, and the pending handover request (term, node asked, node named, its end,
    seconds left) or NULLs. Columns a table of an older schema version lacks read NULL."""
    from psycopg import sql

    from ..postgres.schema import (
        LEASE_HANDOVER_COLUMNS,
        LEASE_RETIRED_COLUMNS,
        table_identifier,
    )

    retired: sql.Composable
    handover: sql.Composable
    if has_columns(conn, table, LEASE_RETIRED_COLUMNS):
        retired = sql.SQL("coalesce(retired_term = term, false)")
    else:
        retired = sql.SQL("false")
    if has_columns(conn, table, LEASE_HANDOVER_COLUMNS):
        # A request lasts until its window ends or the next acquisition clears it; the
        # asked node stays kept out even after it released, so show it until then.
        pending = sql.SQL("resign_until > clock_timestamp()")
        handover = sql.SQL(
            "CASE WHEN {p} THEN resign_term END, CASE WHEN {p} THEN resign_from END,"
            " CASE WHEN {p} THEN resign_to END, CASE WHEN {p} THEN resign_until END,"
            " CASE WHEN {p} THEN"
            " extract(epoch FROM resign_until - clock_timestamp())::float8 END"
        ).format(p=pending)
    else:
        handover = sql.SQL("NULL::bigint, NULL::text, NULL::text, NULL::timestamptz, NULL::float8")
    return conn.execute(
        sql.SQL(
            "SELECT name, holder, term, acquired_at, expires_at,"
            " extract(epoch FROM expires_at - clock_timestamp())::float8, {retired}, {handover}"
            " FROM {t} ORDER BY name"
        ).format(retired=retired, handover=handover, t=table_identifier(table))
    ).fetchall()


def _last_fires_sql() -> Any:
    """The newest claimed fire of each task of each lease, as (lease, task, fire, node,
    term, claimed_at), in a few index probes per task whatever the table's size.

    Claim keys are ``"<lease>/<task>@<UTC RFC 3339 nanos>"``, with ``%`` and ``/`` in the
    lease name written ``%25`` and ``%2F`` (:mod:`rselection.keys`): in byte order (the
    claims table's ``fire_key COLLATE "C"`` index) one lease's keys are one range, one
    task's keys are one range within it, and its newest fire sorts last. The walk visits
    each task once: the first key of the lease's range, the newest key of that key's
    task (same length, before ``"<lease>/<task>@["``), then the first key after it, and
    so on. A key that is not a fire key (no instant) counts as a task of its own.
    """
    from psycopg import sql

    key = '(c.fire_key COLLATE "C")'
    end = "((left(p.prefix, -1) || '0') COLLATE \"C\")"  # "/" + 1: past the lease's keys
    instant = "'@[0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}}T[0-9]{{2}}:[0-9]{{2}}:[0-9]{{2}}[.][0-9]{{9}}Z$'"
    newest = (
        f"CASE WHEN s.k ~ {instant} THEN (SELECT c.fire_key FROM {{c}} c"
        f' WHERE {key} >= (s.k COLLATE "C")'
        f" AND {key} < ((left(s.k, -30) || '[') COLLATE \"C\")"
        f" AND length(c.fire_key) = length(s.k) ORDER BY {key} DESC LIMIT 1) ELSE s.k END"
    )

    def first(op: str, bound: str) -> str:
        return (
            f'(SELECT c.fire_key FROM {{c}} c WHERE {key} {op} ({bound} COLLATE "C")'
            f" AND {key} < {end} ORDER BY {key} LIMIT 1)"
        )

    return sql.SQL(
        "WITH RECURSIVE p AS ("
        " SELECT l.name, replace(replace(l.name, '%', '%25'), '/', '%2F') || '/' AS prefix"
        " FROM {l} l"
        "), walk(name, prefix, newest) AS ("
        " SELECT p.name, p.prefix, f.newest FROM p"
        f" CROSS JOIN LATERAL (SELECT {first('>=', 'p.prefix')} AS k) s"
        f" CROSS JOIN LATERAL (SELECT {newest} AS newest) f WHERE s.k IS NOT NULL"
        " UNION ALL"
        " SELECT p.name, p.prefix, f.newest FROM walk p"
        f" CROSS JOIN LATERAL (SELECT {first('>', 'p.newest')} AS k) s"
        f" CROSS JOIN LATERAL (SELECT {newest} AS newest) f WHERE s.k IS NOT NULL"
        ") SELECT DISTINCT ON (w.name, k.task) w.name, k.task, k.fire,"
        " c.holder, c.term, c.claimed_at"
        " FROM walk w CROSS JOIN LATERAL (SELECT c.holder, c.term, c.claimed_at"
        " FROM {c} c WHERE c.fire_key = w.newest LIMIT 1) c"
        " CROSS JOIN LATERAL (SELECT"
        " regexp_replace(substr(w.newest, length(w.prefix) + 1), '@[^@]*$', '') AS task,"
        " substring(w.newest FROM '@([^@]*)$') AS fire) k"
        " ORDER BY w.name, k.task, k.fire DESC"
    )


def read_status(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """One snapshot of the leases, handover requests, nodes and last fires asked for.

    Args:
        dsn: the Postgres connection string.
        args: the parsed ``status`` command line.

    Raises:
        Unreachable: the database cannot be reached or read, or has no lease table.
    """
    import psycopg
    from psycopg import sql

    from ..postgres.schema import LEASE_HANDOVER_COLUMNS, table_identifier

    with connect(dsn) as conn:
        try:
            if not table_exists(conn, args.table):
                raise Unreachable(
                    f"lease table {args.table!r} does not exist on {describe(dsn)}: "
                    "run `rselection migrate`, or pass the right --table"
                )
            now_row = conn.execute("SELECT clock_timestamp()").fetchone()
            handovers_recorded = has_columns(conn, args.table, LEASE_HANDOVER_COLUMNS)
            lease_rows = _lease_rows(conn, args.table)
            node_rows = None
            if table_exists(conn, args.nodes_table):
                node_rows = conn.execute(
                    sql.SQL(
                        "SELECT name, node_id, hostname, pid, host(client_addr), started_at,"
                        " last_seen, extract(epoch FROM clock_timestamp() - last_seen)::float8"
                        " FROM {} ORDER BY name, started_at, node_id"
                    ).format(table_identifier(args.nodes_table))
                ).fetchall()
            fire_rows = None
            if table_exists(conn, args.claims_table):
                # A few index probes per task: compiling the query (JIT, tempted by the
                # recursive walk's estimates) would take longer than running it.
                conn.execute("SET jit = off")
                fire_rows = conn.execute(
                    _last_fires_sql().format(
                        l=table_identifier(args.table), c=table_identifier(args.claims_table)
                    )
                ).fetchall()
        except psycopg.Error as exc:
            raise Unreachable(
                f"cannot read the leases from {describe(dsn)}: {redact(first_line(exc), dsn)}"
            ) from exc
    named: list[str] = list(dict.fromkeys(args.names))  # in the order given, once each
    wanted = set(named)
    holders: dict[str, str] = {}
    leases = []
    handovers = []
    hidden: list[str] = []
    judged: list[dict[str, Any]] = []
    for row in lease_rows:
        name, holder, term, acquired_at, expires_at, expires_in, retired = row[:7]
        asked_term, asked_node, asked_to, asked_until, asked_left = row[7:]
        if wanted and name not in wanted:
            continue
        if retired and not wanted and not args.all:
            hidden.append(name)
            continue
        live = holder is not None and expires_in is not None and expires_in > 0
        if live:
            holders[name] = holder
        lease = {
            "name": name,
            "holder": holder if live else None,
            "term": term,
            "acquired_at": iso(acquired_at) if live else None,
            "expires_at": iso(expires_at) if live else None,
            "expires_in": round(expires_in, 3) if live else None,
            "live": live,
            "retired": bool(retired),
        }
        leases.append(lease)
        if wanted or not retired:
            judged.append(lease)
        if asked_until is not None:
            handovers.append(
                {
                    "lease": name,
                    "term": asked_term,
                    "node_id": asked_node,
                    "to": asked_to,
                    "until": iso(asked_until),
                    "expires_in": round(asked_left, 3),
                }
            )
    shown = {lease["name"] for lease in leases}
    unknown = [name for name in named if name not in shown]
    hidden_set = set(hidden)

    def selected(lease: str) -> bool:
        return lease in wanted if wanted else lease not in hidden_set

    nodes = None
    if node_rows is not None:
        nodes = [
            {
                "lease": lease,
                "node_id": node_id,
                "hostname": hostname,
                "pid": pid,
                "client_addr": addr,
                "started_at": iso(started),
                "last_seen": iso(seen),
                "seen_ago": round(seen_ago, 3),
                "alive": seen_ago <= node_timeout(args),
                "is_leader": holders.get(lease) == node_id,
            }
            for lease, node_id, hostname, pid, addr, started, seen, seen_ago in node_rows
            if selected(lease)
        ]
    shards = sharded_names(lease_rows, {lease["name"] for lease in leases}, selected)
    fires = None
    if fire_rows is not None:
        fires = [
            {
                "lease": lease,
                "task": task,
                "last_fire": fire,
                "node": holder,
                "term": term,
                "claimed_at": iso(claimed_at),
            }
            for lease, task, fire, holder, term, claimed_at in fire_rows
            if selected(lease)
        ]
    return {
        "database": describe(dsn),
        "checked_at": iso(now_row[0] if now_row else None),
        "names": named or None,
        "leases": leases,
        "unknown": unknown,
        "hidden": hidden,
        "headless": [lease["name"] for lease in judged if not lease["live"]] + unknown,
        "handovers": handovers if handovers_recorded else None,
        "nodes": nodes,
        "tasks": fires,
        "shards": shards,
        "not_recorded": NOT_RECORDED,
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
            ]
            for lease in status["leases"]
        ]
        lines += grid(["LEASE", "HOLDER", "TERM", "ACQUIRED", "EXPIRES IN"], rows)
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
                ("leader" if n["is_leader"] else "alive") if n["alive"] else "lost",
            ]
            for n in nodes
        ]
        lines += grid(
            ["LEASE", "NODE", "HOST", "PID", "ADDRESS", "STARTED", "LAST SEEN", "STATE"], rows
        )
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
    if args.redis_url is None:
        dsn = resolve_dsn(args)
        return lambda: read_status(dsn, args)
    if args.dsn is not None:
        raise UsageError("pass either --dsn (Postgres) or --redis-url (Redis), not both")
    from .connections import redis_client
    from .redis_status import read_redis_status

    url = args.redis_url
    client = redis_client(url)
    args.node_timeout = node_timeout(args)
    return lambda: read_redis_status(client, url, args)


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
