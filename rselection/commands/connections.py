"""Where the servers are and how the subcommands connect to them, never printing a password.

The Postgres database comes from ``--dsn``, else ``$RSELECTION_DSN``, else the libpq
``PG*`` variables; a Redis lease from ``--redis-url``. Every message that may quote a
connection string goes through :func:`~rselection.redaction.redact`; a string whose
driver would misread it (a password with an unescaped ``/``, ``@``, ``?`` or ``#``) is a
usage error, reported with the string redacted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..admin import Refused
from ..errors import BackendUnavailable, ConfigError, first_line
from ..redaction import check_userinfo, has_password, parser_message, redact, redact_dsn
from .output import EXIT_REFUSED, EXIT_UNREACHABLE, UsageError, fail, say

if TYPE_CHECKING:
    import psycopg

    from ..postgres import PostgresAdmin
    from ..redis import RedisAdmin

__all__ = [
    "CONNECT_TIMEOUT",
    "PG_VARS",
    "NoLeaseTable",
    "Unreachable",
    "act_on_lease",
    "check_dsn",
    "connect",
    "describe",
    "first_line",
    "given_dsn",
    "key_prefix",
    "postgres_admin",
    "postgres_session",
    "reason",
    "redis_admin",
    "redis_client",
    "resolve_dsn",
    "wants_redis",
    "warn_of_passwords",
]

PG_VARS = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE")
"""libpq variables that name a server on their own (``PGPASSWORD`` alone does not)."""

CONNECT_TIMEOUT = 5
"""Seconds a subcommand waits for a server to accept its connection."""

_REFUSED = (Refused, ConfigError)  # what refuses a command acting on a lease: exit 1


class Unreachable(Exception):
    """The database could not be reached or read (exit code 3); the message is redacted."""


class NoLeaseTable(Unreachable):
    """The database has no lease table of the name given (a command that acts on a lease
    refuses: exit code 1)."""


def given_dsn(args: argparse.Namespace) -> str:
    """``--dsn``, else ``$RSELECTION_DSN``, checked by :func:`check_dsn`; ``""`` when neither.

    Raises:
        UsageError: the connection string cannot be parsed.
    """
    if args.dsn is not None:
        dsn, source = str(args.dsn), "--dsn"
    else:
        dsn, source = os.environ.get("RSELECTION_DSN") or "", "$RSELECTION_DSN"
    if dsn:
        check_dsn(dsn, source)
    return dsn


def resolve_dsn(args: argparse.Namespace) -> str:
    """The Postgres connection string: :func:`given_dsn`, else ``""`` (an empty conninfo)
    when the libpq ``PG*`` variables name the server.

    Raises:
        UsageError: no database was given at all, or the connection string cannot be
            parsed; the message says how to fix it, without quoting the string.
    """
    dsn = given_dsn(args)
    if dsn:
        return dsn
    if any(os.environ.get(var) for var in PG_VARS):
        return ""  # an empty conninfo: libpq takes everything from the PG* variables
    raise UsageError(
        "no database given: pass --dsn postgresql://..., set RSELECTION_DSN, "
        "or set the libpq variables (PGHOST, PGPORT, PGDATABASE, PGUSER, ...)"
    )


def check_dsn(dsn: str, source: str = "--dsn") -> None:
    """Refuse a connection string libpq cannot parse, or would misread, without repeating it.

    libpq's own message quotes the offending part, which may be the password (an
    ``invalid percent-encoded token`` in a URI, say), so it is never shown. A URI whose
    password holds an unescaped ``/`` or ``@`` parses, but into pieces of the password
    taken for a host, port or database: it is refused with the URI redacted. ``source``
    (``--dsn``, ``$RSELECTION_DSN``) says where it came from.

    Raises:
        UsageError: ``dsn`` cannot be parsed, or would be misread.
    """
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    _check_userinfo(dsn, f"the connection string of {source}")
    try:
        conninfo_to_dict(dsn)
    except (psycopg.Error, ValueError):  # ValueError: bytes that are not UTF-8 (%80)
        raise UsageError(
            f"the connection string of {source} cannot be parsed (not shown: it may hold a "
            "password); write it as 'postgresql://user:password@host:port/dbname' or "
            "'host=... port=... dbname=... user=...', with a '%' in a URI written '%25'"
        ) from None


def describe(dsn: str) -> str:
    """Where ``dsn`` (``""``: the ``PG*`` variables) points, without its password."""
    from ..postgres.admin import describe_conninfo

    return describe_conninfo(dsn)


def reason(exc: BaseException) -> str:
    """The first line of what failed: of the driver's error a
    :class:`~rselection.errors.BackendUnavailable` was raised from, else of ``exc``."""
    cause = exc.__cause__ if isinstance(exc, BackendUnavailable) else None
    return first_line(cause if cause is not None else exc)


def _check_userinfo(conninfo: str, what: str) -> None:
    """:func:`~rselection.redaction.check_userinfo`, as a usage error."""
    try:
        check_userinfo(conninfo, what)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def warn_of_passwords(args: argparse.Namespace) -> None:
    """Warn on stderr, once, of a password given on the command line.

    Any local user can read a command line (``ps``, ``/proc/PID/cmdline``); the
    environment of a process is private to its user. The warning never shows the
    password.
    """
    command = getattr(args, "command", None) or "rselection"
    pgpass = (
        "; set RSELECTION_DSN instead, or leave the password out and use PGPASSWORD or ~/.pgpass"
    )
    for option, advice in (("dsn", pgpass), ("redis_url", "")):
        value = getattr(args, option, None)
        if isinstance(value, str) and has_password(value):
            say(
                f"rselection {command}: warning: --{option.replace('_', '-')} holds a "
                f"password, which other users of this machine can read (ps, /proc){advice}",
                err=True,
            )


def connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection to ``dsn``, given up after :data:`CONNECT_TIMEOUT`.

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


def redis_client(url: str) -> Any:
    """A client for the Redis ``url``: a ``RedisCluster`` when the server is a cluster node.

    Raises:
        UsageError: ``url`` is not a Redis URL.
        Unreachable: the server did not answer.
    """
    import redis
    from redis.cluster import RedisCluster

    from ..redis import RedisAdmin

    if not url.startswith(("redis://", "rediss://", "unix://")):
        shown = redact_dsn(url)
        raise UsageError(
            f"--redis-url needs a redis://, rediss:// or unix:// URL, got {shown!r:.40}"
        )
    _check_userinfo(url, "--redis-url")
    options = {"socket_timeout": CONNECT_TIMEOUT, "socket_connect_timeout": CONNECT_TIMEOUT}
    try:
        client = redis.Redis.from_url(url, **options)
    except ValueError as exc:
        # redis-py's message may quote pieces of the password.
        shown = f"{redact_dsn(url)}: {parser_message(str(exc), url)}"
        raise UsageError(f"bad --redis-url {shown}") from None
    where = RedisAdmin(client).where
    try:
        info = client.info("cluster")
        if info.get("cluster_enabled") in (1, "1"):
            client.close()
            return RedisCluster.from_url(url, **options)
    except redis.RedisError as exc:
        client.close()
        raise Unreachable(
            f"cannot connect to Redis {where}: {redact(first_line(exc), url)}"
        ) from exc
    return client


def key_prefix(args: argparse.Namespace) -> str:
    """The ``--key-prefix`` given, else the leaders' default (Redis is imported here, not
    when the command line is assembled)."""
    from ..redis import DEFAULT_KEY_PREFIX

    return DEFAULT_KEY_PREFIX if args.key_prefix is None else str(args.key_prefix)


def redis_admin(args: argparse.Namespace, node_timeout: float = 30.0) -> RedisAdmin:
    """The admin of the Redis leases of ``--redis-url`` under ``--key-prefix``; its client
    is the caller's to close (``admin.client.close()``); a node is alive when seen within
    ``node_timeout`` seconds.

    Raises:
        UsageError: ``--redis-url`` is not a Redis URL.
        Unreachable: the server did not answer.
    """
    from ..redis import RedisAdmin

    client = redis_client(args.redis_url)
    try:
        return RedisAdmin(client, key_prefix=key_prefix(args), node_timeout=node_timeout)
    except ConfigError as exc:
        client.close()
        raise UsageError(str(exc)) from None


def postgres_admin(conn: psycopg.Connection[Any] | str, args: argparse.Namespace) -> PostgresAdmin:
    """The admin of the lease table ``--table`` (and ``--nodes-table``, ``--claims-table``
    and ``--node-timeout`` where the command has them), on ``conn``: the command's
    connection, or a connection string (``rselection web``: the admin opens its own).

    Raises:
        UsageError: a table name or the node timeout cannot be used.
    """
    from ..postgres import PostgresAdmin

    options = {
        option: getattr(args, option)
        for option in ("nodes_table", "claims_table", "node_timeout")
        if getattr(args, option, None) is not None
    }
    try:
        return PostgresAdmin(conn, table=args.table, **options)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


@contextlib.contextmanager
def postgres_session(args: argparse.Namespace, dsn: str, *, hint: str) -> Iterator[PostgresAdmin]:
    """The admin API of the lease table the command line names (see
    :func:`postgres_admin`), on a connection to ``dsn`` of its own, closed after the block;
    ``hint`` says what to do when the lease table does not exist.

    Raises:
        Unreachable: the database cannot be reached.
        NoLeaseTable: the lease table does not exist.
        BackendUnavailable: the database failed while looking for it.
    """
    with connect(dsn) as conn:
        admin = postgres_admin(conn, args)
        if not admin.lease_table_exists():
            raise NoLeaseTable(
                f"lease table {args.table!r} does not exist on {describe(dsn)}: {hint}"
            )
        yield admin


def wants_redis(args: argparse.Namespace) -> bool:
    """Whether the command line names a Redis lease (``--redis-url``), not a Postgres one.

    Raises:
        UsageError: both were given.
    """
    if args.redis_url is None:
        return False
    if args.dsn is not None:
        raise UsageError("pass either --dsn (Postgres) or --redis-url (Redis), not both")
    return True


def act_on_lease(
    args: argparse.Namespace,
    command: str,
    *,
    hint: str,
    postgres: Callable[[PostgresAdmin, str], int],
    redis: Callable[[RedisAdmin], int],
) -> int:
    """Run a command on the admin API of the lease the command line names, on Postgres or
    on Redis (:func:`wants_redis`), and turn what failed into a message and an exit code.

    Args:
        args: the parsed command line.
        command: the command's name, in the message when the server fails.
        hint: what to do when the Postgres lease table does not exist.
        postgres: the command on Postgres, given the admin and the connection string;
            returns the exit code.
        redis: the command on Redis, given the admin (its client closed after it);
            returns the exit code.

    What the backend refuses (:class:`~rselection.admin.Refused`, a
    :class:`~rselection.errors.ConfigError`) exits 1 with its message, redacted.

    Raises:
        UsageError: both ``--dsn`` and ``--redis-url``, or a bad connection string.
    """
    if wants_redis(args):
        try:
            admin = redis_admin(args)
        except Unreachable as exc:
            return fail(args, exc, EXIT_UNREACHABLE)
        try:
            return redis(admin)
        except _REFUSED as exc:
            return fail(args, redact(str(exc), args.redis_url), EXIT_REFUSED)
        except BackendUnavailable as exc:
            message = f"{command} failed: {redact(reason(exc), args.redis_url)}"
            return fail(args, message, EXIT_UNREACHABLE)
        finally:
            admin.client.close()
    dsn = resolve_dsn(args)
    try:
        with postgres_session(args, dsn, hint=hint) as session:
            return postgres(session, dsn)
    except NoLeaseTable as exc:
        return fail(args, exc, EXIT_REFUSED)
    except Unreachable as exc:
        return fail(args, exc, EXIT_UNREACHABLE)
    except _REFUSED as exc:
        return fail(args, redact(str(exc), dsn), EXIT_REFUSED)
    except BackendUnavailable as exc:
        message = f"{command} failed on {describe(dsn)}: {redact(reason(exc), dsn)}"
        return fail(args, message, EXIT_UNREACHABLE)
