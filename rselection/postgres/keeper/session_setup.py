"""Setting up a keeper session: its connection parameters, the checks of its server and
table, its place in the ring and its keepalives (see :mod:`.session`)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
from typing import Any

import psycopg
from psycopg import sql

from ...errors import BackendUnavailable, ConfigError, first_line
from .._conn import SESSION_MARGIN, Keepalives, server_keepalives, server_user_timeout
from .._lease_sql import (
    LEASE_PROTOCOL,
    SERVER_IDENTITY_SQL,
    SERVER_START_SQL,
    LeaseTable,
    describe_lease_table,
    server_identity,
    session_sql,
)
from ..ring import new_ring_key

__all__ = [
    "RING_DRAWS",
    "check_keepalives",
    "connect_kwargs",
    "pin_session",
    "read_server",
    "refuse_standby",
    "resolve_table",
    "set_client_keepalives",
    "take_ring_lock",
]

logger = logging.getLogger("rselection.postgres.keeper")

RING_DRAWS = 8
"""Random ring locks a connecting keeper tries before it gives up (one is taken already
only by chance, 1 in 2**32 per lock held)."""


def connect_kwargs(role: str, hold: float, timeout: float) -> dict[str, Any]:
    """The connection parameters of a keeper session (``role``: ``""``, or ``":probe"``
    for the pooler probe) whose leases wind down in up to ``hold`` seconds."""
    ka = server_keepalives(hold)
    return {
        "autocommit": True,
        "prepare_threshold": None,
        "connect_timeout": max(2, math.ceil(timeout)),
        # The client's kernel must not reset the session early either: a keepalive
        # timeout sends a RST, which can reach the server over a one-way partition.
        "keepalives": 1,
        "keepalives_idle": ka.idle,
        "keepalives_interval": ka.interval,
        "keepalives_count": ka.count,
        "tcp_user_timeout": server_user_timeout(hold),
        "application_name": f"rselection:keeper{role}",
    }


def take_ring_lock(conn: psycopg.Connection[Any], table_oid: int, where: str) -> None:
    """Join the ring: hold a ring lock of a random tag, never waiting for one (a tag
    someone holds already is drawn again)."""
    for _ in range(RING_DRAWS):
        row = conn.execute(
            sql.SQL("SELECT pg_try_advisory_lock({})").format(sql.Literal(new_ring_key(table_oid)))
        ).fetchone()
        if row is not None and row[0]:
            return
    raise BackendUnavailable(
        f"cannot join the ring of keeper sessions ({where}): {RING_DRAWS} random "
        "ring locks in a row were held by other sessions; trying again later"
    )


def pin_session(conn: psycopg.Connection[Any], hold: float) -> float:
    """Size the session's keepalives for a wind-down of ``hold`` seconds (the longest of
    its clients'); return ``hold``."""
    ka, user_timeout = server_keepalives(hold), server_user_timeout(hold)
    cur = conn.execute(session_sql(ka, user_timeout))
    cur.nextset()
    effective = cur.fetchone()
    set_client_keepalives(conn, ka, user_timeout)
    check_keepalives(conn, effective, hold)
    return hold


def resolve_table(conn: psycopg.Connection[Any], table: str, where: str) -> LeaseTable:
    """The lease table ``table`` as the session sees it; raise if it is missing or too old."""
    found = describe_lease_table(conn, table)
    if found is None:
        raise BackendUnavailable(
            f"lease table {table!r} does not exist ({where}, on this "
            "connection's search_path): run `rselection migrate` or pass "
            "create_tables=True"
        )
    if not (found.handovers and found.servers and found.protocols):
        raise ConfigError(
            f"lease table {table!r} ({where}) predates schema version 5: this "
            f"release speaks lease protocol {LEASE_PROTOCOL} (one keeper session per "
            "process), which records itself in the table; stop every node of an older "
            "release, then run `rselection migrate` (or pass create_tables=True)"
        )
    if not found.history:
        raise ConfigError(
            f"lease table {table!r} ({where}) has no leadership history table beside it: "
            "this release records every term there; run `rselection migrate` (or pass "
            "create_tables=True) to create it (older releases keep working with it)"
        )
    return found


def _standby(where: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"the lease server ({where}) is a standby in recovery (read-only): "
        "point the connection string at the primary (with several hosts, add "
        "target_session_attrs=read-write)"
    )


def refuse_standby(conn: psycopg.Connection[Any], where: str) -> None:
    """Raise :class:`BackendUnavailable` when the session's server is a standby."""
    row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    if row is not None and row[0]:
        raise _standby(where)


def read_server(conn: psycopg.Connection[Any], where: str) -> str:
    """This session's server identity (see :mod:`rselection.postgres.lease`)."""
    try:
        row = conn.execute(SERVER_IDENTITY_SQL).fetchone()
    except psycopg.DatabaseError as exc:
        if conn.broken or isinstance(exc, psycopg.OperationalError):
            raise
        # A hardened or managed server may refuse pg_control_system() or the WAL
        # functions: the postmaster start time alone still tells servers apart.
        logger.info("keeper: recording the server's start time only (%s)", first_line(exc))
        row = conn.execute(SERVER_START_SQL).fetchone()
    assert row is not None
    in_recovery, system_id, walfile, started = row
    if in_recovery:
        raise _standby(where)
    return server_identity(system_id, walfile, started)


def check_keepalives(conn: psycopg.Connection[Any], effective: Any, hold: float) -> None:
    """Warn when the server's keepalives would drop a partitioned leader before its
    wind-down of ``hold`` seconds."""
    if effective is None or (conn.info.host or "").startswith("/"):
        return  # a Unix socket cannot be partitioned
    idle, interval, count, user_timeout = effective
    bound = hold + SESSION_MARGIN
    if idle and interval and count and idle + interval * count <= bound:
        logger.warning(
            "keeper: the server's TCP keepalives (%s + %s * %s s) would drop a "
            "partitioned leader before its wind-down of %s s + %s s; failover after a "
            "partition may overlap",
            idle,
            interval,
            count,
            hold,
            SESSION_MARGIN,
        )
    if user_timeout and user_timeout <= bound * 1000:
        logger.warning(
            "keeper: the server's tcp_user_timeout (%s ms) would drop a partitioned "
            "leader before its wind-down of %s s + %s s; failover after a partition "
            "may overlap",
            user_timeout,
            hold,
            SESSION_MARGIN,
        )


def set_client_keepalives(conn: psycopg.Connection[Any], ka: Keepalives, user_timeout: int) -> None:
    """Apply keepalives and ``tcp_user_timeout`` to the client's socket (TCP only)."""
    if (conn.info.host or "").startswith("/"):
        return
    try:
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
    except OSError:
        return
    with sock, contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, ka.idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, ka.interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, ka.count)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout)
