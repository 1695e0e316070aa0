"""Refuse a connection pooler that does not keep one session per client connection.

Fast failover rests on the keeper's session state (its advisory lock, pinned settings
and ``LISTEN``), which a pooler in transaction or statement mode does not keep: every
node would lead at once. :func:`check_session_pooling` runs when the keeper connects,
before anything is acquired, and raises :class:`~rselection.errors.ConfigError` when the
keeper's statements do not keep one backend. :func:`check_same_backend` is the second
line of defence, run at every acquisition and renewal.

See ``docs/explanation/how-it-works.md``, "Connection poolers", for the signs the check
reads, its limits and its measurements.
"""

from __future__ import annotations

import logging
import secrets
import selectors
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from ..errors import BackendUnavailable, ConfigError
from ._conn import IoWatchdog

__all__ = [
    "BACKEND_PID",
    "NOTIFY_WAIT",
    "ROUNDS",
    "check_bound",
    "check_same_backend",
    "check_session_pooling",
]

logger = logging.getLogger(__name__)

#: The statement that names the backend a statement runs on.
BACKEND_PID = sql.SQL("SELECT pg_backend_pid()")

#: Rounds of the check; one is conclusive with PgBouncer's policies on an idle pool, the
#: second covers a pool that other clients use at the same moment.
ROUNDS = 2

#: Inconclusive rounds tolerated (a notification that came only with a statement).
_EXTRA_ROUNDS = 2

#: Seconds the idle keeper waits for the probe's notification (on a session it comes at
#: once; the wait only matters behind a transaction pooler, where it never comes).
NOTIFY_WAIT = 1.0

#: Which server and database a statement ran on (a restart changes the start time).
_SERVER = sql.SQL("pg_postmaster_start_time(), current_database()")

_ADVICE = (
    "leader election needs a real database session (its advisory lock, settings and "
    "LISTEN), which a pooler in transaction or statement mode (PgBouncer, Supavisor, RDS "
    "Proxy) does not keep: run the pooler in session mode (PgBouncer: pool_mode = "
    "session) for these connections, or connect to Postgres directly"
)


def _refuse(where: str, what: str) -> ConfigError:
    return ConfigError(f"the connection to the lease server ({where}) {what}; {_ADVICE}")


def check_bound(timeout: float, wait: float = NOTIFY_WAIT) -> float:
    """The longest :func:`check_session_pooling` may take with these arguments, seconds.

    Only for bounding the keeper's round trips: on a session the check takes a few
    milliseconds plus one connect.
    """
    attempts = ROUNDS + _EXTRA_ROUNDS
    return (1 + attempts) * timeout + attempts * 2 * wait


def check_same_backend(expected: int, seen: int, where: str) -> None:
    """Raise :class:`ConfigError` when a keeper statement ran on another backend.

    Args:
        expected: the keeper session's backend pid, read when it connected.
        seen: ``pg_backend_pid()`` as a later statement of the keeper read it.
        where: the server, as :func:`~rselection.postgres._conn.describe_conninfo` names it.
    """
    if seen != expected:
        raise _refuse(
            where,
            f"does not keep one database session: the keeper's statements ran on backend "
            f"{expected}, then on backend {seen}",
        )


def check_session_pooling(
    conn: psycopg.Connection[Any],
    open_probe: Callable[[], psycopg.Connection[Any]],
    *,
    where: str,
    io: IoWatchdog,
    timeout: float,
    wait: float = NOTIFY_WAIT,
) -> int:
    """Check that ``conn`` is one database session; return its backend pid.

    Runs only autocommit statements (a pooler in statement mode accepts them), and leaves
    ``conn`` as it found it (it ``UNLISTEN``\\ s its own channel; other handlers and
    channels are untouched).

    Args:
        conn: the keeper's new autocommit connection (the caller bounds its round trips).
        open_probe: opens a second autocommit connection with the same conninfo; it is
            closed before this returns.
        where: the server, for messages.
        io: bounds each of the probe's round trips by ``timeout`` seconds.
        timeout: seconds one round trip of the probe may take (also bounds its connect).
        wait: seconds the idle keeper waits for the probe's notification (the wait ends
            when it arrives, at once on a session).

    Raises:
        ConfigError: the statements do not keep one session (the message says what was
            seen and what to do).
        BackendUnavailable: the probe connection got no answer within ``timeout``, or it
            reached another server or database (a failover between the two connects), or
            notifications took longer than ``wait`` again and again.
        psycopg.Error: any other driver error (the caller wraps it).
    """
    channel = "rselection_probe_" + secrets.token_hex(8)
    received: set[str] = set()  # notifications that came with a statement's results

    def on_notify(notify: psycopg.Notify) -> None:
        if notify.channel == channel:
            received.add(notify.payload)

    conn.add_notify_handler(on_notify)
    try:
        cur = conn.execute(
            sql.SQL("LISTEN {}; SELECT pg_backend_pid(), {}").format(
                sql.Identifier(channel), _SERVER
            )
        )
        cur.nextset()
        first = cur.fetchone()
        assert first is not None
        pid, server = int(first[0]), tuple(first[1:])
        with open_probe() as probe:
            passed = attempts = 0
            while passed < ROUNDS:
                if attempts == ROUNDS + _EXTRA_ROUNDS:
                    raise BackendUnavailable(
                        f"cannot check that the connection to the lease server ({where}) "
                        f"keeps its session: notifications to the keeper took longer than "
                        f"{wait:g} s"
                    )
                token = str(attempts)
                attempts += 1
                check_same_backend(pid, _pid(conn), where)
                other, elsewhere = _probe(
                    probe, channel, token, where=where, io=io, timeout=timeout
                )
                if elsewhere != server:
                    # Backends of two servers (or databases) say nothing about each other,
                    # and a notification does not cross: try again later.
                    raise BackendUnavailable(
                        f"cannot check that the connection to the lease server ({where}) "
                        "keeps its session: a second connection with the same settings "
                        "reached another server or database"
                    )
                if other == pid:
                    raise _refuse(
                        where,
                        f"does not keep one database session: another connection was "
                        f"handed the keeper's backend {pid}",
                    )
                # Idle first: a session gets the notification now, while an idle client
                # of a transaction pooler has no server connection it could come through.
                idle = _await_notify(conn, channel, token, wait)
                check_same_backend(pid, _pid(conn), where)
                if idle:
                    passed += 1
                elif token not in received and not _await_notify(conn, channel, token, wait):
                    raise _refuse(
                        where,
                        "does not keep one database session: a notification sent to the "
                        f"keeper's session did not reach the keeper within {wait:g} s",
                    )
                # else it came only once the keeper ran a statement again: a server slower
                # than `wait`, or a pooler that just then linked the keeper to the backend
                # that listens. That proves nothing either way: another round.
        conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
    finally:
        conn.remove_notify_handler(on_notify)
    logger.debug("%s: the keeper keeps one session (backend %s)", where, pid)
    return pid


def _pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(BACKEND_PID).fetchone()
    assert row is not None
    return int(row[0])


def _probe(
    probe: psycopg.Connection[Any],
    channel: str,
    token: str,
    *,
    where: str,
    io: IoWatchdog,
    timeout: float,
) -> tuple[int, tuple[Any, ...]]:
    """The probe's backend pid and server; in the same statement it notifies ``channel``."""
    query = sql.SQL("SELECT pg_backend_pid(), {}, pg_notify({}, {})").format(
        _SERVER, sql.Literal(channel), sql.Literal(token)
    )
    try:
        with io.guard(probe, timeout) as fired:
            row = probe.execute(query).fetchone()
    except psycopg.Error as exc:
        if fired[0]:
            # A pooler whose server connections are all taken queues the probe.
            raise BackendUnavailable(
                f"cannot check that the connection to the lease server ({where}) keeps "
                f"its session: a second connection got no answer within {timeout:g} s (a "
                "pooler in session mode needs a free server connection for it)"
            ) from exc
        raise
    assert row is not None
    return int(row[0]), (row[1], row[2])


def _await_notify(conn: psycopg.Connection[Any], channel: str, token: str, wait: float) -> bool:
    """Wait idle on ``conn``'s socket up to ``wait`` seconds for ``token`` on ``channel``."""
    pgconn = conn.pgconn
    deadline = time.monotonic() + wait
    with selectors.DefaultSelector() as sel:
        sel.register(pgconn.socket, selectors.EVENT_READ)
        while True:
            pgconn.consume_input()
            while (notify := pgconn.notifies()) is not None:
                if notify.relname.decode() == channel and notify.extra.decode() == token:
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            sel.select(remaining)
