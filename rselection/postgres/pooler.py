"""Refuse a connection pooler that does not keep one session per client connection.

Fast failover rests on session state: the keeper's session advisory lock, its pinned
settings and its ``LISTEN``. A pooler in *transaction* or *statement* mode (PgBouncer,
Supavisor, RDS Proxy, pgcat, ...) hands a client's next transaction to whichever server
connection is free, so that state stays on a server connection that other clients then
use: another node's statement runs as "the session that holds the lock", every node
takes the lease, and every node leads at once. A pooler in *session* mode keeps one
server connection per client connection and works.

:func:`check_session_pooling` runs when the keeper connects, before anything is
acquired, and raises :class:`~rselection.errors.ConfigError` when the keeper's statements
do not keep one backend. Each round of the check looks for three signs, any one of which
proves there is no session (none of them can happen on a real session):

* two consecutive statements of the keeper ran on different backends
  (``pg_backend_pid()`` changed): a pooler that hands out its idle server connections in
  turn (PgBouncer's ``server_round_robin = 1``) shows this at once;
* a second, short-lived connection (the *probe*) ran on the keeper's backend: a pooler
  that hands out the server connection freed last (PgBouncer's default) shows this at
  once;
* a ``NOTIFY`` that the probe sends to a channel only the keeper's session listens on
  does not reach the idle keeper. On a session it arrives at once. Behind a transaction
  pooler an idle client has no server connection a notification could come through
  (PgBouncer drops it: "got packet 'A' from server when not linked"), whatever the
  pooler's policy and whatever other clients do meanwhile.

None of the signs can show on a real session, and a false refusal would stop a healthy
node for good, so the third sign is read with care. A notification counts only when it
reaches the keeper while the keeper is idle; one that comes only with a later result (the
listening backend was slow to send it, and the pooler had linked the keeper to that
backend again by then) proves nothing, and the round is repeated; one that never comes,
after ``wait`` seconds idle and one more statement, means no session. On Postgres 14 and
later a session cannot fail this whatever the timing: the probe's commit has signalled
the keeper's backend before the probe's statement returns, and that backend sends
pending notifications before the ``ReadyForQuery`` of the keeper's next statement. Both
connections must reach the same server and database (checked), or the signs say nothing.

Measured with PgBouncer 1.18 (pool sizes 2 and 10, last-freed-first and round robin, an
idle pool or 4 to 8 other clients running statements and short transactions): 1,200 of
1,200 checks in transaction mode refused, up to 17 % of them by the third sign alone,
within 2.1 s at worst; 600 of 600 in session mode passed. On a session the check costs
one extra connection and a few round trips (9 ms direct, 2 ms through PgBouncer, on one
machine); only when the first two signs miss does it wait (``wait`` seconds, twice).

Limits: the first two signs are certain only on a pool nobody else uses at that moment;
otherwise the third decides, and it relies on the pooler not passing a notification to a
client that is not running a transaction (PgBouncer drops it, logging "got packet 'A' from
server when not linked"); a pooler that routed notifications to idle clients would pass
it, leaving the first two signs and the second line of defence below. In session mode
the probe needs a free server connection for a moment (else it waits up to ``timeout``,
and the keeper retries later). The check runs at every (re)connect: a pooler switched to
transaction mode under a connected keeper is seen only by the second line of defence.

:func:`check_same_backend` is that second line: every acquisition and renewal reads
``pg_backend_pid()`` in the same round trip and refuses a statement that ran on another
backend the same way (it renews nothing there, and a term taken there is given back).
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
