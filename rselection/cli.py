"""The ``rselection`` command (also ``python -m rselection``).

Subcommands: ``status`` (leases, nodes, last fires), ``resign`` (ask the leader to hand
over), ``migrate`` (create or upgrade the tables) and ``demo``. The database comes from
``--dsn``, else ``$RSELECTION_DSN``, else the libpq ``PG*`` variables (``PGHOST``,
``PGPORT``, ``PGDATABASE``, ``PGUSER``, ``PGPASSWORD``, ``PGSERVICE``, ...). Passwords are
never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

__all__ = ["main"]

#: libpq variables that name a server on their own (PGPASSWORD alone does not).
_PG_VARS = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE")

#: ``status`` exit codes.
EXIT_OK, EXIT_HEADLESS, EXIT_UNREACHABLE = 0, 1, 2

_CONNECT_TIMEOUT = 5
_NOT_RECORDED = (
    "next fires, failures and persistent tasks are not recorded in the database "
    "(see TaskHandler.health() on the leader); last fires come from the claims table"
)


class _Unreachable(Exception):
    """The database could not be reached or read (exit code 2)."""


def _dsn(args: argparse.Namespace) -> str:
    dsn: str | None = args.dsn if args.dsn is not None else os.environ.get("RSELECTION_DSN")
    if dsn:
        return dsn
    if any(os.environ.get(var) for var in _PG_VARS):
        return ""  # an empty conninfo: libpq takes everything from the PG* variables
    raise SystemExit(
        "no database given: pass --dsn postgresql://..., set RSELECTION_DSN, "
        "or set the libpq variables (PGHOST, PGPORT, PGDATABASE, PGUSER, ...)"
    )


def _connect(dsn: str) -> psycopg.Connection[Any]:
    import psycopg

    from .postgres._conn import describe_conninfo, redact

    try:
        return psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=_CONNECT_TIMEOUT,
            application_name="rselection:cli",
        )
    except psycopg.Error as exc:
        raise _Unreachable(
            f"cannot connect to {describe_conninfo(dsn)}: {redact(_first_line(exc), dsn)}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _short_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def _grid(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = []
    for row in [headers, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines


# -- migrate ----------------------------------------------------------------------------


def _migrate(args: argparse.Namespace) -> int:
    import psycopg

    from .errors import BackendUnavailable, ConfigError
    from .postgres import PostgresCheckpointStore, migrate
    from .postgres._conn import describe_conninfo, redact
    from .postgres.broadcast import create_broadcast_tables

    dsn = _dsn(args)
    where = describe_conninfo(dsn)
    try:
        conn = _connect(dsn)
    except _Unreachable as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        with conn:
            changes = migrate(conn, table=args.table)
            for change in changes:
                print(change.describe())
            existed = _exists(conn, "rselection_broadcast")
            create_broadcast_tables(conn)
            done = "already present" if existed else "created"
            print(f"broadcast table 'rselection_broadcast': {done}")
            checkpoints_existed = _exists(conn, "rselection_checkpoints")
    except (BackendUnavailable, ConfigError) as exc:
        print(f"migrate failed on {where}: {redact(str(exc), dsn)}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        print(f"migrate failed on {where}: {redact(_first_line(exc), dsn)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        with PostgresCheckpointStore(dsn, lease_table=args.table, create_tables=False) as store:
            applied = store.apply_migrations()
    except (BackendUnavailable, ConfigError) as exc:
        print(f"migrate failed on {where}: {redact(str(exc), dsn)}", file=sys.stderr)
        return 1
    numbers = ", ".join(map(str, applied))
    if not applied:
        print("checkpoint tables 'rselection_checkpoint*': already present (no migration needed)")
    elif checkpoints_existed:
        print(
            f"checkpoint tables 'rselection_checkpoint*': upgraded (migrations applied: {numbers})"
        )
    else:
        print(
            f"checkpoint tables 'rselection_checkpoint*': created (migrations applied: {numbers})"
        )
    return 0


def _exists(conn: psycopg.Connection[Any], table: str) -> bool:
    from .postgres.schema import table_identifier

    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (table_identifier(table).as_string(conn),)
    ).fetchone()
    return bool(row and row[0])


# -- status -----------------------------------------------------------------------------


def _read_status(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """One snapshot of leases, nodes and last fires; raises :class:`_Unreachable`."""
    import psycopg
    from psycopg import sql

    from .postgres._conn import describe_conninfo, redact
    from .postgres.schema import table_identifier

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


def _status(args: argparse.Namespace) -> int:
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


def _lease_nodes(
    conn: psycopg.Connection[Any], args: argparse.Namespace
) -> list[tuple[str, bool]] | None:
    """``(node id, alive)`` of every node row of the lease, or ``None`` without a table."""
    from psycopg import sql

    from .postgres.schema import table_identifier

    if not _exists(conn, args.nodes_table):
        return None
    rows = conn.execute(
        sql.SQL(
            "SELECT node_id, last_seen >= clock_timestamp() - make_interval(secs => %s)"
            " FROM {} WHERE name = %s ORDER BY started_at, node_id"
        ).format(table_identifier(args.nodes_table)),
        (args.node_timeout, args.name),
    ).fetchall()
    return [(node_id, bool(alive)) for node_id, alive in rows]


def _current(conn: psycopg.Connection[Any], table: str, name: str) -> tuple[str, int] | None:
    from psycopg import sql

    from .postgres.schema import table_identifier

    row = conn.execute(
        sql.SQL(
            "SELECT holder, term FROM {} WHERE name = %s AND holder IS NOT NULL"
            " AND expires_at > clock_timestamp()"
        ).format(table_identifier(table)),
        (name,),
    ).fetchone()
    return (row[0], row[1]) if row is not None else None


def _resign(args: argparse.Namespace) -> int:
    if args.redis_url is not None:
        if args.dsn is not None:
            raise SystemExit("pass either --dsn (Postgres) or --redis-url (Redis), not both")
        return _resign_redis(args)
    import psycopg
    from psycopg import sql

    from .errors import ConfigError
    from .postgres._conn import describe_conninfo, redact
    from .postgres.lease import (
        cancel_handover,
        lease_channel,
        request_handover,
        resolve_lease_table,
    )

    if not args.timeout > 0:
        raise SystemExit(f"--timeout needs a positive number of seconds, got {args.timeout}")
    dsn = _dsn(args)
    name = args.name
    try:
        conn = _connect(dsn)
    except _Unreachable as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        with conn:
            found = resolve_lease_table(conn, args.table)
            if found is None:
                print(
                    f"lease table {args.table!r} does not exist on {describe_conninfo(dsn)}: "
                    "run `rselection migrate`, or pass the right --table",
                    file=sys.stderr,
                )
                return 1
            holder = _current(conn, args.table, name)
            if holder is None:
                print(f"lease {name!r} has no leader: nothing to hand over", file=sys.stderr)
                return 1
            nodes = _lease_nodes(conn, args)
            alive = [n for n, ok in nodes or [] if ok]
            if args.to is not None:
                if args.to == holder[0]:
                    print(f"{args.to} already leads {name!r} (term {holder[1]})")
                    return 0
                if nodes is None:
                    print(
                        f"cannot check that {args.to} is a live node: no nodes table "
                        f"{args.nodes_table!r} (run `rselection migrate`)",
                        file=sys.stderr,
                    )
                    return 1
                if args.to not in alive:
                    others = ", ".join(n for n in alive if n != holder[0]) or "none"
                    print(
                        f"{args.to} is not a live node of lease {name!r} (no heartbeat within "
                        f"{args.node_timeout:g}s); live followers: {others}",
                        file=sys.stderr,
                    )
                    return 1
            elif nodes and not [n for n in alive if n != holder[0]]:
                print(
                    f"no other live node of lease {name!r} to hand over to "
                    f"({holder[0]} leads term {holder[1]}); start another node first",
                    file=sys.stderr,
                )
                return 1
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(lease_channel(found[1], name))))
            asked_at = time.monotonic()
            try:
                asked = request_handover(
                    conn, name, table=args.table, to=args.to, window=args.timeout
                )
            except ConfigError as exc:
                print(str(exc), file=sys.stderr)
                return 1
            if asked is None:
                print(f"lease {name!r} has no leader: nothing to hand over", file=sys.stderr)
                return 1
            print(
                f"asked {asked.node_id} to hand {name!r} over (term {asked.term}"
                + (f", to {args.to}" if args.to else "")
                + ")",
                flush=True,
            )
            new = _await_new_term(conn, args, asked.term, asked_at + args.timeout)
            took = time.monotonic() - asked_at
            if new is None:
                cancel_handover(conn, name, asked.term, table=args.table)
                print(
                    f"no new term within {args.timeout:g}s: {asked.node_id} did not hand "
                    f"{name!r} over (not running, paused, or an rselection without "
                    "handover support); the request was withdrawn",
                    file=sys.stderr,
                )
                return 1
            node, term = new
            print(
                f"{node} leads {name!r} now with term {term} (handover took {took * 1000:.0f} ms)"
            )
            if args.to is not None and node != args.to:
                print(f"{args.to} did not take over within {args.timeout:g}s", file=sys.stderr)
                return 1
            if node == asked.node_id:
                print(f"no other node took over: {node} leads again", file=sys.stderr)
                return 1
            return 0
    except psycopg.Error as exc:
        print(
            f"resign failed on {describe_conninfo(dsn)}: {redact(_first_line(exc), dsn)}",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE


def _redis_client(url: str) -> Any:
    """A client for ``url``: a ``RedisCluster`` when the server is a cluster node."""
    import redis
    from redis.cluster import RedisCluster

    from .redis._conn import describe

    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise SystemExit(f"--redis-url needs a redis://, rediss:// or unix:// URL, got {url!r:.40}")
    options = {"socket_timeout": _CONNECT_TIMEOUT, "socket_connect_timeout": _CONNECT_TIMEOUT}
    try:
        client = redis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise SystemExit(f"bad --redis-url: {exc}") from exc
    where = describe(client)
    try:
        info = client.info("cluster")
        if info.get("cluster_enabled") in (1, "1"):
            client.close()
            return RedisCluster.from_url(url, **options)
    except redis.RedisError as exc:
        client.close()
        raise _Unreachable(f"cannot connect to Redis {where}: {_first_line(exc)}") from exc
    return client


def _resign_redis(args: argparse.Namespace) -> int:
    """``resign --redis-url``: the same steps as with Postgres, on a Redis lease."""
    from .errors import BackendUnavailable, ConfigError
    from .redis.handover import cancel_handover, current_holder, live_nodes, request_handover

    if not args.timeout > 0:
        raise SystemExit(f"--timeout needs a positive number of seconds, got {args.timeout}")
    name, prefix = args.name, args.key_prefix
    try:
        client = _redis_client(args.redis_url)
    except _Unreachable as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        holder = current_holder(client, name, key_prefix=prefix)
        if holder is None:
            print(f"lease {name!r} has no leader: nothing to hand over", file=sys.stderr)
            return 1
        nodes = live_nodes(client, name, key_prefix=prefix)
        if args.to is not None:
            if args.to == holder.node_id:
                print(f"{args.to} already leads {name!r} (term {holder.term})")
                return 0
            if nodes is None:
                print(
                    f"cannot check that {args.to} is a live node (PUBSUB CHANNELS is not "
                    "allowed); asking anyway: if it is not running, no node takes over "
                    "until --timeout",
                    file=sys.stderr,
                )
            elif args.to not in nodes:
                others = ", ".join(n for n in nodes if n != holder.node_id) or "none"
                print(
                    f"{args.to} is not a live node of lease {name!r} (no keeper connected); "
                    f"live followers: {others}",
                    file=sys.stderr,
                )
                return 1
        elif nodes and not [n for n in nodes if n != holder.node_id]:
            print(
                f"no other live node of lease {name!r} to hand over to "
                f"({holder.node_id} leads term {holder.term}); start another node first",
                file=sys.stderr,
            )
            return 1
        with _RedisTermWatch(client, name, prefix) as watch:
            asked_at = time.monotonic()
            try:
                asked = request_handover(
                    client, name, to=args.to, timeout=args.timeout, key_prefix=prefix
                )
            except ConfigError as exc:
                print(str(exc), file=sys.stderr)
                return 1
            if asked is None:
                print(f"lease {name!r} has no leader: nothing to hand over", file=sys.stderr)
                return 1
            print(
                f"asked {asked.node_id} to hand {name!r} over (term {asked.term}"
                + (f", to {args.to}" if args.to else "")
                + ")",
                flush=True,
            )
            new = watch.wait(asked.term, asked_at + args.timeout)
            took = time.monotonic() - asked_at
        if new is None:
            cancel_handover(client, name, asked.term, key_prefix=prefix)
            print(
                f"no new term within {args.timeout:g}s: {asked.node_id} did not hand "
                f"{name!r} over (not running, paused, or an rselection without "
                "handover support); the request was withdrawn",
                file=sys.stderr,
            )
            return 1
        node, term = new
        print(f"{node} leads {name!r} now with term {term} (handover took {took * 1000:.0f} ms)")
        if args.to is not None and node != args.to:
            print(f"{args.to} did not take over within {args.timeout:g}s", file=sys.stderr)
            return 1
        if node == asked.node_id:
            print(f"no other node took over: {node} leads again", file=sys.stderr)
            return 1
        return 0
    except BackendUnavailable as exc:
        print(f"resign failed: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    finally:
        client.close()


class _RedisTermWatch:
    """Waits for a new term of a Redis lease: woken by the acquire script's ``PUBLISH``,
    and re-reading the lease every half second in case a message was missed."""

    def __init__(self, client: Any, name: str, prefix: str) -> None:
        from redis.cluster import RedisCluster

        from .redis.lease import lease_keys

        self._client, self._name, self._prefix = client, name, prefix
        key, _, self._channel = lease_keys(name, prefix)
        node_client = client
        if isinstance(client, RedisCluster):
            # Plain pub/sub reaches every cluster node; listen on the lease slot's master.
            cluster: Any = client
            node_client = cluster.get_redis_connection(cluster.get_node_from_key(key))
        self._pubsub = node_client.pubsub(ignore_subscribe_messages=True)

    def __enter__(self) -> _RedisTermWatch:
        import redis

        from .errors import BackendUnavailable

        try:
            self._pubsub.subscribe(self._channel)
        except redis.RedisError as exc:
            raise BackendUnavailable(f"cannot subscribe to {self._channel!r}: {exc}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self._pubsub.close()

    def wait(self, old_term: int, deadline: float) -> tuple[str, int] | None:
        import redis

        from .errors import BackendUnavailable
        from .redis.handover import current_holder

        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self._pubsub.get_message(timeout=min(left, 0.5))
            except redis.RedisError as exc:
                raise BackendUnavailable(f"lost the subscription: {exc}") from exc
            data = message.get("data") if message else None
            text = data.decode() if isinstance(data, bytes) else str(data or "")
            if message is not None and not text.startswith("acquired:"):
                continue  # other news: no need to read the lease
            holder = current_holder(self._client, self._name, key_prefix=self._prefix)
            if holder is not None and holder.term > old_term:
                return holder.node_id, holder.term
        return None


def _await_new_term(
    conn: psycopg.Connection[Any], args: argparse.Namespace, old_term: int, deadline: float
) -> tuple[str, int] | None:
    """Wait for a term after ``old_term``: woken by the acquisition's NOTIFY, and
    re-reading the row every half second in case a notification was missed."""
    while (left := deadline - time.monotonic()) > 0:
        for notify in conn.notifies(timeout=min(left, 0.5)):
            try:
                event = json.loads(notify.payload)
            except ValueError:
                continue
            if (
                isinstance(event, dict)
                and event.get("event") == "acquired"
                and isinstance(event.get("term"), int)
                and event["term"] > old_term
            ):
                return str(event.get("node_id")), int(event["term"])
        current = _current(conn, args.table, args.name)
        if current is not None and current[1] > old_term:
            return current
    return None


# -- entry point ------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dsn", help="database (default: $RSELECTION_DSN, else the PG* variables)")
    p.add_argument("--table", default="rselection_leases", help="lease table")


def _nodes_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes-table", default="rselection_nodes", help="node heartbeats table")
    p.add_argument(
        "--node-timeout",
        type=float,
        default=15.0,
        help="a node is alive when seen within this many seconds (default 15: the leaders' "
        "default, three heartbeats)",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = argparse.ArgumentParser(
        prog="rselection",
        description="Leader-scoped tasks over a Postgres lease: inspect and operate a fleet.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="three nodes, a crash and a handover, measured")
    demo.add_argument("--dsn", help="Postgres to use (default: a private one from pgserver)")
    demo.add_argument("--nodes", type=int, default=3)
    demo.add_argument("--forever", action="store_true", help="keep running until Ctrl-C")

    migrate = sub.add_parser("migrate", help="create or upgrade the tables; say what was done")
    _common(migrate)

    status = sub.add_parser(
        "status",
        help="leases, holders, nodes and last fires; exit 0 when every lease has a leader, "
        "1 when one has none, 2 when the database cannot be read",
    )
    _common(status)
    _nodes_options(status)
    status.add_argument("--claims-table", default="rselection_claims", help="fire claims table")
    status.add_argument("--json", action="store_true", help="one JSON document (per refresh)")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    status.add_argument("--count", type=int, help="with --watch: stop after this many refreshes")

    resign = sub.add_parser(
        "resign", help="ask the leader of a lease to hand over; wait for the new term"
    )
    resign.add_argument("name", help="the lease name")
    _common(resign)
    _nodes_options(resign)
    resign.add_argument(
        "--redis-url",
        metavar="URL",
        help="a Redis lease (redis://...; a cluster node's URL for Redis Cluster) instead of --dsn",
    )
    resign.add_argument(
        "--key-prefix", default="rselection:", help="with --redis-url: the leaders' key_prefix"
    )
    resign.add_argument("--to", metavar="NODE", help="the node that should take over")
    resign.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for a new term (default 10); also how long the lease stays "
        "reserved for --to",
    )

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.dsn or os.environ.get("RSELECTION_DSN"), args.nodes, args.forever)
    if args.command == "migrate":
        return _migrate(args)
    if args.command == "resign":
        return _resign(args)
    return _status(args)
