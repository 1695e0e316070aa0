"""``rselection resign``: ask a lease's leader to hand over; wait for the new term."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

from ..redaction import redact
from .connections import (
    Unreachable,
    connect,
    describe,
    first_line,
    redis_client,
    resolve_dsn,
)
from .leases import lease_exists, lease_nodes, live_holder
from .options import add_database_options, add_nodes_options, add_redis_options, lease_name
from .output import EXIT_REFUSED, EXIT_UNREACHABLE, UsageError, printable, say

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``resign`` and its options to the command line.

    Args:
        subparsers: the ``rselection`` command's subparsers.
    """
    parser = subparsers.add_parser(
        "resign", help="ask the leader of a lease to hand over; wait for the new term"
    )
    parser.add_argument("name", type=lease_name, help="the lease name")
    add_database_options(parser)
    add_nodes_options(parser)
    add_redis_options(parser)
    parser.add_argument("--to", metavar="NODE", help="the node that should take over")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for a new term (default 10); also how long the lease stays "
        "reserved for --to",
    )
    parser.set_defaults(run=run)
    return parser


def _took_over(node: str, name: str, term: int, took: float) -> str:
    """The line that reports a handover (tests read its time)."""
    return (
        f"{printable(node)} leads {name!r} now with term {term} "
        f"(handover took {took * 1000:.0f} ms)"
    )


def run(args: argparse.Namespace) -> int:
    """Ask the leader of ``args.name`` to hand over, wait for the new term, return the code."""
    if args.redis_url is not None:
        if args.dsn is not None:
            raise UsageError("pass either --dsn (Postgres) or --redis-url (Redis), not both")
        return _resign_redis(args)
    import psycopg
    from psycopg import sql

    from ..errors import BackendUnavailable, ConfigError
    from ..postgres.lease import (
        cancel_handover,
        lease_channel,
        request_handover,
        resolve_lease_table,
    )

    if not args.timeout > 0:
        raise UsageError(f"--timeout needs a positive number of seconds, got {args.timeout}")
    dsn = resolve_dsn(args)
    name = args.name
    try:
        conn = connect(dsn)
    except Unreachable as exc:
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    try:
        with conn:
            found = resolve_lease_table(conn, args.table)
            if found is None:
                say(
                    f"lease table {args.table!r} does not exist on {describe(dsn)}: "
                    "run `rselection migrate`, or pass the right --table",
                    err=True,
                )
                return 1
            holder = live_holder(conn, args.table, name)
            if holder is None:
                if not lease_exists(conn, args.table, name):
                    say(
                        f"no lease {name!r} in {args.table!r} on {describe(dsn)}: check the "
                        "name (`rselection status` lists the leases) and --table",
                        err=True,
                    )
                    return EXIT_REFUSED
                say(f"lease {name!r} has no leader: nothing to hand over", err=True)
                return EXIT_REFUSED
            nodes = lease_nodes(conn, args.nodes_table, name, args.node_timeout)
            alive = [n for n, ok in nodes or [] if ok]
            if args.to is not None:
                if args.to == holder[0]:
                    say(f"{printable(args.to)} already leads {name!r} (term {holder[1]})")
                    return 0
                if nodes is None:
                    say(
                        f"cannot check that {printable(args.to)} is a live node: no nodes table "
                        f"{args.nodes_table!r} (run `rselection migrate`)",
                        err=True,
                    )
                    return 1
                if args.to not in alive:
                    others = ", ".join(printable(n) for n in alive if n != holder[0]) or "none"
                    say(
                        f"{printable(args.to)} is not a live node of lease {name!r} (no "
                        f"heartbeat within {args.node_timeout:g}s); live followers: {others}",
                        err=True,
                    )
                    return 1
            elif nodes and not [n for n in alive if n != holder[0]]:
                say(
                    f"no other live node of lease {name!r} to hand over to "
                    f"({printable(holder[0])} leads term {holder[1]}); start another node first",
                    err=True,
                )
                return 1
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(lease_channel(found[1], name))))
            asked_at = time.monotonic()
            try:
                asked = request_handover(
                    conn, name, table=args.table, to=args.to, valid_for=args.timeout
                )
            except ConfigError as exc:
                say(redact(str(exc), dsn), err=True)
                return 1
            if asked is None:
                say(f"lease {name!r} has no leader: nothing to hand over", err=True)
                return 1
            say(
                f"asked {printable(asked.node_id)} to hand {name!r} over (term {asked.term}"
                + (f", to {printable(args.to)}" if args.to else "")
                + ")",
            )
            new = _await_new_term(conn, args, asked.term, asked_at + args.timeout)
            took = time.monotonic() - asked_at
            if new is None:
                cancel_handover(conn, name, asked.term, table=args.table)
                say(
                    f"no new term within {args.timeout:g}s: {printable(asked.node_id)} did "
                    f"not hand {name!r} over (not running, paused, or an rselection without "
                    "handover support); the request was withdrawn",
                    err=True,
                )
                return 1
            node, term = new
            say(_took_over(node, name, term, took))
            if args.to is not None and node != args.to:
                say(f"{printable(args.to)} did not take over within {args.timeout:g}s", err=True)
                return 1
            if node == asked.node_id:
                say(f"no other node took over: {printable(node)} leads again", err=True)
                return 1
            return 0
    except (psycopg.Error, BackendUnavailable) as exc:
        say(
            f"resign failed on {describe(dsn)}: {redact(first_line(exc), dsn)}",
            err=True,
        )
        return EXIT_UNREACHABLE


def _resign_redis(args: argparse.Namespace) -> int:
    """``resign --redis-url``: the same steps as with Postgres, on a Redis lease."""
    from ..errors import BackendUnavailable, ConfigError
    from ..redis.handover import cancel_handover, current_holder, live_nodes, request_handover

    if not args.timeout > 0:
        raise UsageError(f"--timeout needs a positive number of seconds, got {args.timeout}")
    name, prefix = args.name, args.key_prefix
    try:
        client = redis_client(args.redis_url)
    except Unreachable as exc:
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    try:
        holder = current_holder(client, name, key_prefix=prefix)
        if holder is None:
            if not _redis_lease_exists(client, name, prefix):
                say(
                    f"no lease {name!r} with key prefix {prefix!r} in this Redis: check the "
                    "name and --key-prefix",
                    err=True,
                )
                return EXIT_REFUSED
            say(f"lease {name!r} has no leader: nothing to hand over", err=True)
            return EXIT_REFUSED
        nodes = live_nodes(client, name, key_prefix=prefix)
        if args.to is not None:
            if args.to == holder.node_id:
                say(f"{printable(args.to)} already leads {name!r} (term {holder.term})")
                return 0
            if nodes is None:
                say(
                    f"cannot check that {printable(args.to)} is a live node (PUBSUB CHANNELS "
                    "is not allowed); asking anyway: if it is not running, no node takes over "
                    "until --timeout",
                    err=True,
                )
            elif args.to not in nodes:
                others = ", ".join(printable(n) for n in nodes if n != holder.node_id) or "none"
                say(
                    f"{printable(args.to)} is not a live node of lease {name!r} (no keeper "
                    f"connected); live followers: {others}",
                    err=True,
                )
                return 1
        elif nodes and not [n for n in nodes if n != holder.node_id]:
            say(
                f"no other live node of lease {name!r} to hand over to "
                f"({printable(holder.node_id)} leads term {holder.term}); start another node first",
                err=True,
            )
            return 1
        with _RedisTermWatch(client, name, prefix) as watch:
            asked_at = time.monotonic()
            try:
                asked = request_handover(
                    client, name, to=args.to, valid_for=args.timeout, key_prefix=prefix
                )
            except ConfigError as exc:
                say(str(exc), err=True)
                return 1
            if asked is None:
                say(f"lease {name!r} has no leader: nothing to hand over", err=True)
                return 1
            say(
                f"asked {printable(asked.node_id)} to hand {name!r} over (term {asked.term}"
                + (f", to {printable(args.to)}" if args.to else "")
                + ")",
            )
            new = watch.wait(asked.term, asked_at + args.timeout)
            took = time.monotonic() - asked_at
        if new is None:
            cancel_handover(client, name, asked.term, key_prefix=prefix)
            say(
                f"no new term within {args.timeout:g}s: {printable(asked.node_id)} did not hand "
                f"{name!r} over (not running, paused, or an rselection without "
                "handover support); the request was withdrawn",
                err=True,
            )
            return 1
        node, term = new
        say(_took_over(node, name, term, took))
        if args.to is not None and node != args.to:
            say(f"{printable(args.to)} did not take over within {args.timeout:g}s", err=True)
            return 1
        if node == asked.node_id:
            say(f"no other node took over: {printable(node)} leads again", err=True)
            return 1
        return 0
    except BackendUnavailable as exc:
        say(f"resign failed: {redact(str(exc), args.redis_url)}", err=True)
        return EXIT_UNREACHABLE
    finally:
        client.close()


def _redis_lease_exists(client: Any, name: str, prefix: str) -> bool:
    """Whether Redis lease ``name`` ever had a term (its term key outlives every holder)."""
    import redis

    from ..errors import BackendUnavailable
    from ..redis.lease import lease_keys

    try:
        return bool(client.exists(lease_keys(name, prefix)[1]))
    except redis.RedisError as exc:
        raise BackendUnavailable(f"cannot read the term of lease {name!r}: {exc}") from exc


class _RedisTermWatch:
    """Waits for a new term of a Redis lease: woken by the acquire script's ``PUBLISH``,
    and re-reading the lease every half second in case a message was missed."""

    def __init__(self, client: Any, name: str, prefix: str) -> None:
        from redis.cluster import RedisCluster

        from ..redis.lease import lease_keys

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

        from ..errors import BackendUnavailable

        try:
            self._pubsub.subscribe(self._channel)
        except redis.RedisError as exc:
            raise BackendUnavailable(f"cannot subscribe to {self._channel!r}: {exc}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self._pubsub.close()

    def wait(self, old_term: int, deadline: float) -> tuple[str, int] | None:
        import redis

        from ..errors import BackendUnavailable
        from ..redis.handover import current_holder

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
        current = live_holder(conn, args.table, args.name)
        if current is not None and current[1] > old_term:
            return current
    return None
