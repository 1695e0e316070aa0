"""``rselection status``: leases, holders, nodes and last fires; exit 0, 1 or 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from ._common import (
    _NOT_RECORDED,
    EXIT_HEADLESS,
    EXIT_OK,
    EXIT_UNREACHABLE,
    _ago,
    _connect,
    _dsn,
    _exists,
    _first_line,
    _grid,
    _iso,
    _Unreachable,
)


def _read_status(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """One snapshot of leases, nodes and last fires; raises :class:`_Unreachable`."""
    import psycopg
    from psycopg import sql

    from ..postgres._conn import describe_conninfo, redact
    from ..postgres.schema import table_identifier

    leases_t = table_identifier(args.table)
    with _connect(dsn) as conn:
        try:
            if not _exists(conn, args.table):
                raise _Unreachable(
                    f"lease table {args.table!r} does not exist on {describe_conninfo(dsn)}: "
                    "run `rselection migrate`, or pass the right --table"
                )
            now_row = conn.execute("SELECT clock_timestamp()").fetchone()
            lease_rows = conn.execute(
                sql.SQL(
                    "SELECT name, holder, term, acquired_at, expires_at,"
                    " extract(epoch FROM expires_at - clock_timestamp())::float8"
                    " FROM {} ORDER BY name"
                ).format(leases_t)
            ).fetchall()
            node_rows = None
            if _exists(conn, args.nodes_table):
                node_rows = conn.execute(
                    sql.SQL(
                        "SELECT name, node_id, hostname, pid, host(client_addr), started_at,"
                        " last_seen, extract(epoch FROM clock_timestamp() - last_seen)::float8"
                        " FROM {} ORDER BY name, started_at, node_id"
                    ).format(table_identifier(args.nodes_table))
                ).fetchall()
            fire_rows = None
            if _exists(conn, args.claims_table):
                # Claim keys are "<lease>/<task>@<UTC RFC 3339 nanos>": the key of the
                # latest fire sorts last, and its holder is the node that ran it.
                fire_rows = conn.execute(
                    sql.SQL(
                        "SELECT DISTINCT ON (l.name, k.task) l.name, k.task, k.fire,"
                        " c.holder, c.term, c.claimed_at"
                        " FROM {l} l JOIN {c} c"
                        " ON left(c.fire_key, length(l.name) + 1) = l.name || '/'"
                        " CROSS JOIN LATERAL (SELECT"
                        " regexp_replace(substr(c.fire_key, length(l.name) + 2),"
                        " '@[^@]*$', '') AS task,"
                        " substring(c.fire_key FROM '@([^@]*)$') AS fire) k"
                        " ORDER BY l.name, k.task, k.fire DESC"
                    ).format(l=leases_t, c=table_identifier(args.claims_table))
                ).fetchall()
        except psycopg.Error as exc:
            raise _Unreachable(
                f"cannot read the leases from {describe_conninfo(dsn)}: "
                f"{redact(_first_line(exc), dsn)}"
            ) from exc
    holders: dict[str, str] = {}
    leases = []
    for name, holder, term, acquired_at, expires_at, expires_in in lease_rows:
        live = holder is not None and expires_in is not None and expires_in > 0
        if live:
            holders[name] = holder
        leases.append(
            {
                "name": name,
                "holder": holder if live else None,
                "term": term,
                "acquired_at": _iso(acquired_at) if live else None,
                "expires_at": _iso(expires_at) if live else None,
                "expires_in": round(expires_in, 3) if live else None,
                "live": live,
            }
        )
    nodes = None
    if node_rows is not None:
        nodes = [
            {
                "lease": lease,
                "node_id": node_id,
                "hostname": hostname,
                "pid": pid,
                "client_addr": addr,
                "started_at": _iso(started),
                "last_seen": _iso(seen),
                "seen_ago": round(ago, 3),
                "alive": ago <= args.node_timeout,
                "is_leader": holders.get(lease) == node_id,
            }
            for lease, node_id, hostname, pid, addr, started, seen, ago in node_rows
        ]
    fires = None
    if fire_rows is not None:
        fires = [
            {
                "lease": lease,
                "task": task,
                "last_fire": fire,
                "node": holder,
                "term": term,
                "claimed_at": _iso(claimed_at),
            }
            for lease, task, fire, holder, term, claimed_at in fire_rows
        ]
    return {
        "database": describe_conninfo(dsn),
        "checked_at": _iso(now_row[0] if now_row else None),
        "leases": leases,
        "headless": [lease["name"] for lease in leases if not lease["live"]],
        "nodes": nodes,
        "tasks": fires,
        "not_recorded": _NOT_RECORDED,
    }


def _status_code(status: dict[str, Any]) -> int:
    return EXIT_HEADLESS if status["headless"] else EXIT_OK


def _render(status: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [f"{status['database']}  at {status['checked_at']}", ""]
    if status["leases"]:
        rows = [
            [
                lease["name"],
                lease["holder"] or "(none)",
                str(lease["term"]),
                lease["acquired_at"] or "-",
                f"{lease['expires_in']:.1f}s" if lease["live"] else "-",
            ]
            for lease in status["leases"]
        ]
        lines += _grid(["LEASE", "HOLDER", "TERM", "ACQUIRED", "EXPIRES IN"], rows)
    else:
        lines.append(f"no leases in {args.table!r} yet")
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
            f"(alive = seen within {args.node_timeout:g}s)"
        )
        rows = [
            [
                n["lease"],
                n["node_id"],
                n["hostname"],
                str(n["pid"]),
                n["client_addr"] or "local",
                n["started_at"] or "-",
                _ago(n["seen_ago"]),
                ("leader" if n["is_leader"] else "alive") if n["alive"] else "lost",
            ]
            for n in nodes
        ]
        lines += _grid(
            ["LEASE", "NODE", "HOST", "PID", "ADDRESS", "STARTED", "LAST SEEN", "STATE"], rows
        )
    lines.append("")
    fires = status["tasks"]
    if fires is None:
        lines.append(f"tasks: no claims table {args.claims_table!r}, no fires recorded")
    elif not fires:
        lines.append("tasks: no claimed fires recorded")
    else:
        lines.append("tasks (last claimed fire of each scheduled task):")
        rows = [[f["lease"], f["task"], f["last_fire"], f["node"], str(f["term"])] for f in fires]
        lines += _grid(["LEASE", "TASK", "LAST FIRE", "BY NODE", "TERM"], rows)
    lines.append(f"  ({status['not_recorded']})")
    if status["headless"]:
        lines.append("")
        lines.append("NO LEADER: " + ", ".join(status["headless"]))
    return lines


def run(args: argparse.Namespace) -> int:
    """Print the status once (or every ``--watch`` seconds); return the exit code."""
    dsn = _dsn(args)
    watch = args.watch
    if watch is not None and not watch > 0:
        raise SystemExit(f"--watch needs a positive number of seconds, got {watch}")
    if args.count is not None and (watch is None or args.count < 1):
        raise SystemExit("--count needs --watch and a positive number of refreshes")
    refreshes = args.count if args.count is not None else (None if watch is not None else 1)
    clear = watch is not None and not args.json and sys.stdout.isatty()
    code = EXIT_OK
    done = 0
    try:
        while True:
            began = time.monotonic()
            try:
                status = _read_status(dsn, args)
            except _Unreachable as exc:
                code = EXIT_UNREACHABLE
                print(str(exc), file=sys.stderr)
                if args.json:  # scripts parse stdout: they get a document here too
                    print(json.dumps({"error": str(exc), "exit_code": code}), flush=True)
            else:
                code = _status_code(status)
                if args.json:
                    status["exit_code"] = code
                    indent = None if watch is not None else 2
                    print(json.dumps(status, indent=indent), flush=True)
                else:
                    if clear:
                        sys.stdout.write("\x1b[H\x1b[2J")
                    elif done:
                        print()
                    print("\n".join(_render(status, args)), flush=True)
            done += 1
            if refreshes is not None and done >= refreshes:
                return code
            assert watch is not None
            time.sleep(max(0.0, watch - (time.monotonic() - began)))
    except KeyboardInterrupt:
        return code


# -- resign -----------------------------------------------------------------------------
