"""Fenced writes: make a transaction fail unless its term still holds the lease.

Call :func:`fenced` (or :func:`afenced`) as the *first* statement of the transaction
that performs a leader's write::

    with conn.transaction():
        fenced(conn, "billing", ctx.term)
        conn.execute("UPDATE accounts SET ...")

It reads the lease row ``FOR KEY SHARE`` and raises :class:`StaleLeaderError` when the
term is not the live holder; a takeover's ``FOR UPDATE`` waits for it, so every write
of term ``T`` commits before term ``T + 1`` exists. It also bounds how long the
transaction may stay idle (``idle_in_transaction_session_timeout``). See
``docs/how-to/fencing.md`` and ``docs/explanation/how-it-works.md`` ("Durable task
state").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from ..errors import BackendUnavailable, ConfigError, StaleLeaderError
from ..validation import check_name, check_optional_seconds, check_term
from .schema import DEFAULT_TABLE, table_identifier

__all__ = ["afenced", "fenced"]

logger = logging.getLogger(__name__)


_CHECK = (
    "EXISTS (SELECT 1 FROM {} WHERE name = %s AND term = %s"
    " AND holder IS NOT NULL AND expires_at > clock_timestamp()"
    " FOR KEY SHARE)"
)


@functools.lru_cache(maxsize=64)
def _query(table: str, bound_idle: bool) -> sql.Composed:
    # One round trip. The locking sub-select takes the row lock (it is an init plan,
    # run exactly once); set_config(..., true) is SET LOCAL: it lasts until the end of
    # the caller's transaction.
    head = (
        "SELECT set_config('idle_in_transaction_session_timeout', %s, true), "
        if bound_idle
        else "SELECT NULL, "
    )
    return sql.SQL(head + _CHECK).format(table_identifier(table))


def _prepare_on(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    check_kind: Callable[[object], None],
    name: str,
    term: int,
    table: str,
    idle_timeout: float | None,
) -> tuple[sql.Composed, tuple[Any, ...]]:
    """The check's statement and parameters, once the arguments, the kind of
    connection (``check_kind``) and its open transaction are checked, in that order."""
    # The arguments first (the table's name too), as every entry point that takes a term
    # checks it.
    check_name(name, "lease name")
    check_term(term)
    seconds = check_optional_seconds(idle_timeout, "idle_timeout", minimum=0.001)
    query = _query(table, seconds is not None)
    check_kind(conn)
    _check_transaction(conn)
    if seconds is None:
        return query, (name, term)
    return query, (f"{max(1, round(seconds * 1000))}ms", name, term)


def _verdict(row: Any, name: str, term: int) -> None:
    """Refuse the write unless the check's ``row`` found ``term`` holding ``name``."""
    if row is None or not row[1]:
        logger.debug("fenced write refused: lease %r, term %s", name, term)
        raise _stale(name, term)


def _check_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise ConfigError(
            "fenced() must run inside the transaction it protects, but the connection is "
            "in autocommit mode with no transaction open: wrap the write in "
            "`with conn.transaction():` (or use a connection with autocommit=False)"
        )


def _check_blocking(conn: object) -> None:
    # An AsyncConnection's execute() returns a coroutine: refuse it before calling
    # anything, so no query is left half-sent and no coroutine goes unawaited.
    if isinstance(conn, psycopg.AsyncConnection):
        raise ConfigError(
            "fenced() takes a psycopg Connection, got an AsyncConnection: use "
            "`await afenced(conn, name, term)` (in a task: `await ctx.afence(conn)`)"
        )


def _check_async(conn: object) -> None:
    if isinstance(conn, psycopg.Connection):
        raise ConfigError(
            "afenced() takes a psycopg AsyncConnection, got a blocking Connection: use "
            "`fenced(conn, name, term)` (in a task: `ctx.fence(conn)`)"
        )


def _stale(name: str, term: int) -> StaleLeaderError:
    return StaleLeaderError(
        f"term {term} no longer holds lease {name!r} (it was taken over, released or "
        "expired): roll this transaction back and stop acting as leader; the new "
        "leader's term is higher"
    )


def _wrap(
    exc: psycopg.Error,
    table: str,
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
) -> Exception:
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return ConfigError(
            f"lease table {table!r} does not exist on this connection's database or "
            "search_path: pass the same table (schema-qualified if needed) as the leader"
        )
    if conn.broken or conn.closed:
        return BackendUnavailable(f"fencing check failed, the connection is lost: {exc}")
    return exc  # e.g. SerializationFailure: the caller retries its transaction


def fenced(
    conn: psycopg.Connection[Any],
    name: str,
    term: int,
    *,
    table: str = DEFAULT_TABLE,
    idle_timeout: float | None = 5.0,
) -> None:
    """Check, inside the caller's open transaction, that ``term`` still holds ``name``.

    On success the lease row stays locked ``FOR KEY SHARE`` until the transaction ends,
    so no takeover can commit before it; renewals are not blocked. Call it first in the
    transaction.

    Args:
        conn: a psycopg connection inside the transaction to protect (a connection with
            ``autocommit=False``, or inside ``conn.transaction()``).
        name: the lease name.
        term: the term the writer believes it holds (``ctx.term``).
        table: the lease table, as given to the leader.
        idle_timeout: seconds this transaction may stay idle before the server ends the
            session (``SET LOCAL idle_in_transaction_session_timeout``); ``None`` keeps
            the session's setting.

    Raises:
        StaleLeaderError: ``term`` no longer holds the lease; roll back.
        ConfigError: bad arguments, the wrong kind of connection, no transaction open,
            or no lease table.
        BackendUnavailable: the connection broke.
    """
    query, params = _prepare_on(conn, _check_blocking, name, term, table, idle_timeout)
    try:
        row = conn.execute(query, params).fetchone()
    except psycopg.Error as exc:
        raise _wrap(exc, table, conn) from exc
    _verdict(row, name, term)


async def afenced(
    conn: psycopg.AsyncConnection[Any],
    name: str,
    term: int,
    *,
    table: str = DEFAULT_TABLE,
    idle_timeout: float | None = 5.0,
) -> None:
    """Async version of :func:`fenced` for a :class:`psycopg.AsyncConnection`: the same
    arguments (``conn``: an async connection inside the transaction to protect), the
    same errors."""
    query, params = _prepare_on(conn, _check_async, name, term, table, idle_timeout)
    try:
        row = await (await conn.execute(query, params)).fetchone()
    except psycopg.Error as exc:
        raise _wrap(exc, table, conn) from exc
    _verdict(row, name, term)
