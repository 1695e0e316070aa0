"""``rselection forget NAME``: retire a lease that no service uses any more.

A retired lease is hidden from ``rselection status`` (unless named, or with ``--all``)
and no longer makes it exit 1. Its row (Postgres) or term key (Redis) stays, so its
term never restarts and a term that once fenced writes can never become valid again.
Retiring refuses a lease with a live holder and one whose nodes still heartbeat. A
lease stays retired only while its term is the one it was retired at: the next
acquisition increments the term and so brings it back, with nothing to undo.

Postgres marks it with the lease row's ``retired_term`` column (schema version 4:
``rselection migrate``); Redis with the key ``<key_prefix>{<name>}:retired``, holding
the term, next to the lease's term key.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from ..redaction import redact
from .connections import (
    Unreachable,
    connect,
    describe,
    first_line,
    redis_client,
    resolve_dsn,
)
from .leases import has_columns, lease_nodes
from .options import add_database_options, add_nodes_options, add_redis_options, lease_name
from .output import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, UsageError, printable, say

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "LOCK_TIMEOUT",
    "RETIRE_SCRIPT",
    "Refused",
    "add_parser",
    "retire_postgres_lease",
    "retire_redis_lease",
    "retired_key",
    "run",
]

LOCK_TIMEOUT = 5.0
"""Longest ``forget`` waits for the lease row while another statement holds it, seconds."""

#: Retire a Redis lease unless it is held. KEYS: lease key, term key, retired key.
#: Returns {0, lease value, PTTL (ms)} when held, {-1} when the lease never had a term,
#: {2, term} when already retired at the current term, else {1, term} once retired.
RETIRE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}
end
local term = redis.call('GET', KEYS[2])
if not term then return {-1} end
if redis.call('GET', KEYS[3]) == term then return {2, term} end
redis.call('SET', KEYS[3], term)
return {1, term}
"""


class Refused(Exception):
    """The lease was not retired; the message says why and what to do."""


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``forget`` and its options to the command line.

    Args:
        subparsers: the ``rselection`` command's subparsers.
    """
    parser = subparsers.add_parser(
        "forget",
        help="retire a lease no service uses any more: hidden from status, its term kept",
        description="Retire a lease that no service uses any more. It is hidden from "
        "`rselection status` (unless named, or with --all) and no longer counts for its "
        "exit code. Nothing is deleted: the lease keeps its term, so a new leader gets a "
        "higher one, and a leader that acquires it again brings it back. Refused (exit 1) "
        "while the lease has a live holder or a node of it heartbeats.",
    )
    parser.add_argument("name", type=lease_name, help="the lease name")
    add_database_options(parser)
    add_nodes_options(parser)
    add_redis_options(parser)
    parser.set_defaults(run=run)
    return parser


def retired_key(name: str, key_prefix: str = "rselection:") -> str:
    """The Redis key marking lease ``name`` retired (same hash slot as its lease keys).

    Args:
        name: the lease name.
        key_prefix: the leaders' ``key_prefix``.
    """
    return f"{key_prefix}{{{name}}}:retired"


def retire_postgres_lease(
    conn: psycopg.Connection[Any],
    name: str,
    *,
    table: str = "rselection_leases",
    nodes_table: str | None = None,
    node_timeout: float = 15.0,
) -> tuple[int, bool]:
    """Retire Postgres lease ``name`` unless it has a live holder (or live nodes).

    Checks and marks in one transaction holding the row (``FOR NO KEY UPDATE``, which
    fenced transactions do not block), so a leader acquiring at the same moment either
    comes first (and the lease is refused) or comes after (and brings it back).

    Args:
        conn: an open autocommit connection.
        name: the lease name.
        table: the lease table.
        nodes_table: also refuse while a node of the lease heartbeats in this table
            (``None``, or a table that does not exist: no such check).
        node_timeout: a node is alive when seen within this many seconds.

    Returns:
        The lease's term and whether it was retired already.

    Raises:
        Refused: no such lease, a live holder, live nodes, a table without the retired
            mark, or the row stayed locked for :data:`LOCK_TIMEOUT`.
        psycopg.Error: the database failed.
    """
    import psycopg
    from psycopg import sql

    from ..postgres.schema import LEASE_RETIRED_COLUMNS, table_identifier

    if not has_columns(conn, table, LEASE_RETIRED_COLUMNS):
        raise Refused(
            f"lease table {table!r} predates schema version 4, which can retire leases: "
            "run `rselection migrate` to upgrade it (rows are kept)"
        )
    ident = table_identifier(table)
    try:
        with conn.transaction():
            conn.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(f"{round(LOCK_TIMEOUT * 1000)}ms")
                )
            )
            row = conn.execute(
                sql.SQL(
                    "SELECT holder, term, holder IS NOT NULL AND expires_at > clock_timestamp(),"
                    " extract(epoch FROM expires_at - clock_timestamp())::float8,"
                    " coalesce(retired_term = term, false)"
                    " FROM {} WHERE name = %s FOR NO KEY UPDATE"
                ).format(ident),
                (name,),
            ).fetchone()
            if row is None:
                raise Refused(f"no lease {name!r} in {table!r}: nothing to forget")
            holder, term, live, expires_in, retired = row
            if live:
                raise Refused(
                    f"lease {name!r} has a live holder: {printable(holder)} leads term {term} "
                    f"(lease expires in {expires_in:.1f}s unless renewed); stop the service's "
                    "nodes first: forget only retires a lease no service uses any more"
                )
            if nodes_table is not None:
                nodes = lease_nodes(conn, nodes_table, name, node_timeout)
                alive = [node for node, ok in nodes or [] if ok]
                if alive:
                    seen = f"seen within {node_timeout:g}s in {nodes_table!r}"
                    raise Refused(_busy_nodes(name, alive, seen))
            if not retired:
                conn.execute(
                    sql.SQL("UPDATE {} SET retired_term = term WHERE name = %s").format(ident),
                    (name,),
                )
    except psycopg.errors.LockNotAvailable as exc:
        raise Refused(
            f"lease {name!r} stayed locked for more than {LOCK_TIMEOUT:g}s (a leader "
            "acquiring it?); nothing was changed, check `rselection status` and try again"
        ) from exc
    return int(term), bool(retired)


def retire_redis_lease(
    client: Any, name: str, *, key_prefix: str = "rselection:", check_nodes: bool = True
) -> tuple[int, bool]:
    """Retire Redis lease ``name`` unless its lease key is held (present and not expired).

    One script checks and marks: the term key is kept, the retired key set to the term.
    Before it, with ``check_nodes``, refuses while a keeper of the lease is connected.

    Args:
        client: a redis-py client (or ``RedisCluster``).
        name: the lease name.
        key_prefix: the leaders' ``key_prefix``.
        check_nodes: also refuse while a keeper of the lease is connected.

    Returns:
        The lease's term and whether it was retired already.

    Raises:
        Refused: no such lease (it never had a term), a live holder, or live nodes.
        BackendUnavailable: Redis cannot be reached.
        redis.RedisError: Redis failed.
    """
    from ..redis.handover import live_nodes
    from ..redis.lease import lease_keys

    if check_nodes:
        held = _redis_held(client, name, key_prefix)
        if held is not None:
            raise Refused(held)
        nodes = live_nodes(client, name, key_prefix=key_prefix)
        if nodes:
            raise Refused(_busy_nodes(name, nodes, "their keepers are connected"))

    lease_key, term_key, _ = lease_keys(name, key_prefix)
    reply = client.eval(RETIRE_SCRIPT, 3, lease_key, term_key, retired_key(name, key_prefix))
    outcome = int(reply[0])
    if outcome == -1:
        raise Refused(f"no lease {name!r} under key prefix {key_prefix!r}: nothing to forget")
    if outcome == 0:
        raise Refused(_held(name, reply[1], int(reply[2])))
    return int(reply[1]), outcome == 2


def _redis_held(client: Any, name: str, key_prefix: str) -> str | None:
    """Why lease ``name`` cannot be retired because it is held, or ``None``."""
    from ..redis.lease import lease_keys

    key = lease_keys(name, key_prefix)[0]
    pipe = client.pipeline(transaction=False)
    pipe.get(key)
    pipe.pttl(key)
    raw, pttl = pipe.execute()
    return None if raw is None else _held(name, raw, int(pttl))


def _held(name: str, raw: Any, pttl_ms: int) -> str:
    """The refusal for a Redis lease held by the lease value ``raw``."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        value = json.loads(text)
        holder, term = str(value["node"]), str(value["term"])
    except (ValueError, TypeError, KeyError):
        holder, term = "a node", "?"
    return (
        f"lease {name!r} has a live holder: {printable(holder)} leads term {term} (lease expires "
        f"in {pttl_ms / 1000:.1f}s unless renewed); stop the service's nodes first: "
        "forget only retires a lease no service uses any more"
    )


def _retired(name: str, term: int, already: bool, hidden: str) -> str:
    if already:
        return f"lease {name!r} was already retired at term {term}: nothing to do"
    return (
        f"retired lease {name!r} at term {term}: {hidden}; its term is kept, so a new "
        f"leader gets term {term + 1} or later, and acquiring it brings it back"
    )


def _busy_nodes(name: str, nodes: list[str], how: str) -> str:
    return (
        f"lease {name!r} still has live nodes ({how}): {', '.join(map(printable, nodes))}; "
        "stop them first: forget only retires a lease no service uses any more"
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
    import psycopg

    from ..errors import ConfigError
    from .connections import table_exists

    dsn = resolve_dsn(args)
    name = args.name
    try:
        conn = connect(dsn)
    except Unreachable as exc:
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    try:
        with conn:
            if not table_exists(conn, args.table):
                say(
                    f"lease table {args.table!r} does not exist on {describe(dsn)}: "
                    "pass the right --table",
                    err=True,
                )
                return EXIT_REFUSED
            term, already = retire_postgres_lease(
                conn,
                name,
                table=args.table,
                nodes_table=args.nodes_table,
                node_timeout=args.node_timeout,
            )
    except (Refused, ConfigError) as exc:
        say(redact(str(exc), dsn), err=True)
        return EXIT_REFUSED
    except psycopg.Error as exc:
        say(f"forget failed on {describe(dsn)}: {redact(first_line(exc), dsn)}", err=True)
        return EXIT_UNREACHABLE
    hidden = "hidden from `rselection status` (name it, or pass --all, to see it)"
    say(_retired(name, term, already, hidden))
    return EXIT_OK


def _forget_redis(args: argparse.Namespace) -> int:
    """``forget --redis-url``: the same on a Redis lease."""
    import redis

    from ..errors import BackendUnavailable

    name, prefix, url = args.name, args.key_prefix, args.redis_url
    try:
        client = redis_client(url)
    except Unreachable as exc:
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    try:
        term, already = retire_redis_lease(client, name, key_prefix=prefix)
    except Refused as exc:
        say(str(exc), err=True)
        return EXIT_REFUSED
    except (BackendUnavailable, redis.RedisError) as exc:
        say(f"forget failed: {redact(first_line(exc), url)}", err=True)
        return EXIT_UNREACHABLE
    finally:
        client.close()
    say(_retired(name, term, already, f"marked by {retired_key(name, prefix)!r}"))
    return EXIT_OK
