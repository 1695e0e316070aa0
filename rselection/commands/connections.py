"""Where the servers are and how the subcommands connect to them, never printing a password.

The Postgres database comes from ``--dsn``, else ``$RSELECTION_DSN``, else the libpq
``PG*`` variables; a Redis lease from ``--redis-url``. Every message that may quote a
connection string goes through :func:`redact` (Postgres) or :func:`redact_url` (Redis).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "CONNECT_TIMEOUT",
    "PG_VARS",
    "Unreachable",
    "connect",
    "describe",
    "first_line",
    "redact",
    "redact_url",
    "redis_client",
    "resolve_dsn",
    "table_exists",
]

PG_VARS = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE")
"""libpq variables that name a server on their own (``PGPASSWORD`` alone does not)."""

CONNECT_TIMEOUT = 5
"""Seconds a subcommand waits for a server to accept its connection."""


class Unreachable(Exception):
    """The database could not be reached or read (exit code 2); the message is redacted."""


def resolve_dsn(args: argparse.Namespace) -> str:
    """The Postgres connection string of ``args``: ``--dsn``, ``$RSELECTION_DSN`` or ``""``.

    ``""`` (an empty conninfo) when only the libpq ``PG*`` variables name the server.

    Args:
        args: the parsed command line (its ``dsn`` attribute).

    Raises:
        SystemExit: no database was given at all; the message says how to give one.
    """
    dsn: str | None = args.dsn if args.dsn is not None else os.environ.get("RSELECTION_DSN")
    if dsn:
        return dsn
    if any(os.environ.get(var) for var in PG_VARS):
        return ""  # an empty conninfo: libpq takes everything from the PG* variables
    raise SystemExit(
        "no database given: pass --dsn postgresql://..., set RSELECTION_DSN, "
        "or set the libpq variables (PGHOST, PGPORT, PGDATABASE, PGUSER, ...)"
    )


def describe(dsn: str) -> str:
    """Where ``dsn`` points (host, port, database, user), without its password.

    Args:
        dsn: a Postgres connection string (``""``: the ``PG*`` variables).
    """
    from ..postgres._conn import describe_conninfo

    return describe_conninfo(dsn)


def redact(text: str, dsn: str) -> str:
    """``text`` with the password of ``dsn`` (or ``$PGPASSWORD``) replaced by ``***``.

    Args:
        text: a message that may quote the connection string (a driver error).
        dsn: the connection string whose password must not leak.
    """
    from ..postgres._conn import redact as redact_conninfo

    return redact_conninfo(text, dsn)


def redact_url(text: str, url: str) -> str:
    """``text`` with the password of the Redis ``url`` (if any) replaced by ``***``.

    Args:
        text: a message that may quote the URL.
        url: the ``--redis-url`` given.
    """
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (a driver's message can run for many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection to ``dsn``, given up after :data:`CONNECT_TIMEOUT`.

    Args:
        dsn: a Postgres connection string (``""``: the ``PG*`` variables).

    Raises:
        Unreachable: the server refused or did not answer; the message names it,
            without the password.
    """
    import psycopg

    try:
        return psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
            application_name="rselection:cli",
        )
    except psycopg.Error as exc:
        raise Unreachable(
            f"cannot connect to {describe(dsn)}: {redact(first_line(exc), dsn)}"
        ) from exc


def table_exists(conn: psycopg.Connection[Any], table: str) -> bool:
    """Whether ``table`` (optionally schema-qualified) exists as the server resolves it.

    Args:
        conn: an open connection.
        table: the table name as the user wrote it (validated).
    """
    from ..postgres.schema import table_identifier

    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (table_identifier(table).as_string(conn),)
    ).fetchone()
    return bool(row and row[0])


def redis_client(url: str) -> Any:
    """A client for the Redis ``url``: a ``RedisCluster`` when the server is a cluster node.

    Args:
        url: a ``redis://``, ``rediss://`` or ``unix://`` URL.

    Raises:
        SystemExit: ``url`` is not a Redis URL.
        Unreachable: the server did not answer.
    """
    import redis
    from redis.cluster import RedisCluster

    from ..redis._conn import describe as describe_redis

    if not url.startswith(("redis://", "rediss://", "unix://")):
        shown = redact_url(url, url)
        raise SystemExit(
            f"--redis-url needs a redis://, rediss:// or unix:// URL, got {shown!r:.40}"
        )
    options = {"socket_timeout": CONNECT_TIMEOUT, "socket_connect_timeout": CONNECT_TIMEOUT}
    try:
        client = redis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise SystemExit(f"bad --redis-url: {redact_url(str(exc), url)}") from exc
    where = describe_redis(client)
    try:
        info = client.info("cluster")
        if info.get("cluster_enabled") in (1, "1"):
            client.close()
            return RedisCluster.from_url(url, **options)
    except redis.RedisError as exc:
        client.close()
        raise Unreachable(
            f"cannot connect to Redis {where}: {redact_url(first_line(exc), url)}"
        ) from exc
    return client
