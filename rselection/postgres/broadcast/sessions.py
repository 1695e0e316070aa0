"""The sessions of :class:`~rselection.postgres.PostgresBroadcaster`: lent, opened, bounded.

The writer holds no session of its own: every publish, purge and table check borrows
one of the process's pooled sessions for its connection string
(:class:`~rselection.postgres.session_pool.SessionPool`, shared with claims, checkpoints,
electors and membership), or a connection of the user's pool when ``conninfo`` is one,
for one round at a time (:meth:`Sessions.borrow`). The listeners of a process share one
listening session per connection string (:mod:`.listening`), which LISTEN needs kept
for it; :meth:`Sessions.connect` opens it (keepalives, timeouts). What they need around
them lives here too: bounding each round trip (:data:`DEADLINES`), reconnect backoff,
and error text safe to log.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from ... import forks
from ...errors import BackendUnavailable, ConfigError, first_line
from ...redaction import redact
from .._conn import (
    IoWatchdog,
    describe_conninfo,
    open_session,
    per_call_source,
    session_conninfo,
)
from ..connections import Connections
from ..pooler import check_bound, check_session_pooling
from ..schema import create_tables
from .location import Locator
from .outbox import Outbox
from .settings import Settings

__all__ = [
    "APPLICATION_NAME",
    "DEADLINES",
    "Sessions",
    "query_one",
    "redacted_line",
]

logger = logging.getLogger(__name__)

APPLICATION_NAME = "rselection:broadcast"
"""``application_name`` of the listening session, as ``pg_stat_activity`` shows it."""

DEADLINES = "broadcast-deadlines"
"""The name of the broadcaster's round-trip watchdogs (an
:class:`~rselection.postgres._conn.IoWatchdog` with a ``tick``: a publish wakes no
thread, and a round trip is aborted between its bound and a tick later)."""


def query_one(
    conn: psycopg.Connection[Any], query: Any, params: Any = None
) -> tuple[Any, ...] | None:
    """Run ``query`` on ``conn`` and return its first row as a tuple (``None``: no row).

    Through a cursor of its own with ``tuple_row``: a user's pool may lend connections
    whose row factory makes dicts or objects (``row_factory=dict_row``), and the
    broadcaster reads its rows by position.
    """
    with conn.cursor(row_factory=tuple_row) as cur:
        return cur.execute(query, params).fetchone()


def redacted_line(exc: BaseException, conninfo: str) -> str:
    """The first line of an error, without the password of ``conninfo``, for logs."""
    return redact(first_line(exc), conninfo)


class Sessions:
    """Lends the broadcaster its sessions, opens the listening session, bounds round trips.

    Args:
        source: the broadcaster's ``conninfo``: a connection string, a
            ``psycopg.Connection`` (its parameters are used; the connection itself never
            is) or a pool (publishes and purges borrow its connections).
        outbox: the outbox tables (created on first use with ``create_tables``).
        settings: the broadcaster's settings (timeouts, ``synchronous_commit``).

    Raises:
        ConfigError: ``source`` is not a valid ``conninfo``.
    """

    def __init__(self, source: object, outbox: Outbox, settings: Settings) -> None:
        """Check ``source`` and start the round-trip watchdog; opens nothing yet."""
        self.conninfo = session_conninfo(source, "PostgresBroadcaster")
        """The connection string of the sessions the broadcaster opens or pools itself."""
        self.where = describe_conninfo(self.conninfo)
        self.outbox = outbox
        self.locator = Locator(outbox)
        """Finds the outbox table, the same way for the writer and the listener."""
        self.settings = settings
        self.deadlines = IoWatchdog(DEADLINES, tick=min(0.5, settings.io_timeout / 4))
        lends = per_call_source(source, self.conninfo)
        self.user_pool = lends is not self.conninfo
        """Whether publishes borrow from the user's pool (else the process's pool)."""
        self._lender = self._lender_for(lends)
        self._lender_id = id(source)
        self._probe_io = IoWatchdog(APPLICATION_NAME)  # bounds the pooler check's probe

    def reset_after_fork(self) -> None:
        """In a forked child: the watchdogs' threads (and what they watch) are the
        parent's; new ones start on first use. The lender resets itself."""
        forks.keep_inherited(self.deadlines, self._probe_io)
        self.deadlines = IoWatchdog(DEADLINES, tick=self.deadlines.tick)
        self._probe_io = IoWatchdog(APPLICATION_NAME)
        self.locator.reset_after_fork()

    def _lender_for(self, source: object) -> Connections:
        io_timeout = self.settings.io_timeout
        return Connections(
            source,
            owner="PostgresBroadcaster",
            application_name=APPLICATION_NAME,
            connect_timeout=io_timeout,
            statement_timeout=io_timeout,
            pooled=True,
        )

    @property
    def pool_key(self) -> object:
        """What identifies the pool publishes borrow from (the writers of a process take
        turns on it, see :mod:`.turns`)."""
        return ("user pool", self._lender_id) if self.user_pool else ("pooled", self.conninfo)

    def waiting(self) -> int:
        """Callers waiting now for a session of the pool publishes borrow from."""
        return self._lender.waiting()

    def error_text(self, exc: BaseException) -> str:
        """The first line of ``exc``, without the password, for logs and messages."""
        return redacted_line(exc, self.conninfo)

    @contextlib.contextmanager
    def borrow(self, what: str, *, check: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """Lend a session for one round of the writer (publish, settle, purge), in
        autocommit mode.

        A pooled session of the process (its ``statement_timeout`` set to ``timeout``),
        or a connection of the user's pool. A pool's connection that is not in
        autocommit mode is switched to it for the loan and back afterwards.

        Args:
            what: what the session is for, for messages (``"publish broadcasts"``).
            check: for the table check at start: with a user's pool, borrow a pooled
                session of the process instead, given back to the pool (and the pool
                left) at once, so that a node that never publishes never borrows from
                the user's pool.

        Raises:
            BackendUnavailable: no session could be had within the bounds of its source.
            psycopg.Error: preparing the loan failed (the connection broke).
        """
        lender = self._lender_for(self.conninfo) if check and self.user_pool else self._lender
        with contextlib.ExitStack() as stack:
            if lender is not self._lender:
                stack.callback(lender.close)
            try:
                conn = stack.enter_context(lender.connection())
            except BackendUnavailable as exc:
                raise BackendUnavailable(f"cannot {what}: {exc}") from exc
            if not conn.autocommit:
                conn.autocommit = True
                stack.callback(self._restore_transactions, conn)
            if conn.info.encoding != "utf-8":
                # Publish parameters are sent as UTF-8 bytes (see Writer.write); the
                # connection goes back in its own encoding (psycopg follows both changes).
                encoding = conn.info.parameter_status("client_encoding")
                with self.deadlines.guard(conn, self.settings.io_timeout):
                    conn.execute("SET client_encoding TO 'UTF8'")
                if encoding is not None:
                    stack.callback(self._restore_encoding, conn, encoding)
            yield conn

    def _restore_encoding(self, conn: psycopg.Connection[Any], encoding: str) -> None:
        """Give a pool's connection back in the encoding it was lent in (when usable)."""
        if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
            return
        with (
            contextlib.suppress(psycopg.Error),
            self.deadlines.guard(conn, self.settings.io_timeout),
        ):
            conn.execute("SELECT set_config('client_encoding', %s, false)", (encoding,))

    @staticmethod
    def _restore_transactions(conn: psycopg.Connection[Any]) -> None:
        """Give a pool's connection back in the mode it was lent in (when still usable)."""
        if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
            return
        with contextlib.suppress(psycopg.Error):
            conn.autocommit = False

    def connect(self, what: str, *, deadlines: IoWatchdog | None = None) -> psycopg.Connection[Any]:
        """Open the listening session: autocommit, with keepalives and timeouts.

        Args:
            what: what the session is for, for messages (``"listen for broadcasts"``).
            deadlines: the watchdog that bounds the session's first round trips; this
                broadcaster's own by default.

        Raises:
            BackendUnavailable: the server cannot be reached.
            psycopg.Error: preparing the session failed.
        """
        settings = self.settings
        bound = settings.probe_interval + settings.io_timeout
        try:
            conn = open_session(
                self.conninfo,
                application_name=APPLICATION_NAME,
                connect_timeout=settings.io_timeout,
                # A silent network ends a blocked call within about `bound` seconds even
                # where the watchdog is not armed (the listener's idle wait).
                keepalive_idle=bound / 2,
                user_timeout=settings.io_timeout + 1.0,
                client_encoding="UTF8",
            )
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"cannot {what}: {exc}") from exc
        try:
            with (deadlines or self.deadlines).guard(conn, settings.io_timeout):
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, false),"
                    " set_config('idle_session_timeout', '0', false)",
                    (f"{math.ceil(settings.io_timeout * 1000)}ms",),
                )
        except BaseException:
            conn.close()
            raise
        return conn

    def prepare(self, conn: psycopg.Connection[Any]) -> None:
        """Create (or upgrade) the outbox tables on ``conn`` when ``create_tables`` is set.

        Raises:
            ConfigError: the tables are newer than this release.
            BackendUnavailable: the migration could not run within ``io_timeout``.
        """
        if self.settings.create_tables:
            create_tables(conn, broadcast=self.outbox.table, timeout=self.settings.io_timeout)

    def check_pooling(self, conn: psycopg.Connection[Any]) -> None:
        """Refuse a pooler in transaction or statement mode between the process and
        Postgres (the check of :mod:`rselection.postgres.pooler`, run on ``conn``, a
        session lent for the table check, with a short-lived second connection).

        Behind such a pooler a lent session's backend serves other clients between two
        statements: settling a publish cut in flight would end another client's backend
        (the writer ends the backend that may still hold the batch), and whether the
        batch committed could not be known for certain.

        Raises:
            ConfigError: a pooler that does not keep one session per connection.
            BackendUnavailable: the check could not be run (the probe got no answer).
            psycopg.Error: a round trip failed.
        """
        io_timeout = self.settings.io_timeout
        try:
            with self.deadlines.guard(conn, check_bound(io_timeout)):
                check_session_pooling(
                    conn,
                    lambda: open_session(
                        self.conninfo,
                        application_name=APPLICATION_NAME + ":probe",
                        connect_timeout=io_timeout,
                        keepalive_idle=io_timeout / 2,
                        user_timeout=io_timeout + 1.0,
                    ),
                    where=self.where,
                    io=self._probe_io,
                    timeout=io_timeout,
                )
        except ConfigError as exc:
            raise ConfigError(
                f"PostgresBroadcaster cannot publish through {self.where}: its sessions "
                "are not kept by a pooler in transaction or statement mode (a cut publish "
                "could not be settled exactly once, and settling it would end another "
                "client's backend); run the pooler in session mode (PgBouncer: pool_mode "
                f"= session) for the broadcaster, or connect to Postgres directly ({exc})"
            ) from exc

    def close(self) -> None:
        """Stop the round-trip watchdogs and leave the process's pool."""
        self._lender.close()
        self.deadlines.close()
        self._probe_io.close()
