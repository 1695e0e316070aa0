"""``PostgresElector``: "am I the leader?", renewed on each call, without a thread.

For code that keeps its own scheduler and only needs to know whether this process
should act now::

    elector = PostgresElector("postgresql://...", name="reports", ttl=30)

    def job() -> None:
        if elector.is_leader():
            send_reports()

How it works
------------

One row per election name in the elections table (see
:mod:`rselection.postgres.schema`). :meth:`PostgresElector.is_leader` is one
``INSERT ... ON CONFLICT DO UPDATE``: it renews the row when this elector holds it, takes
it over when it is free (never held, resigned) or expired, and otherwise changes
nothing and returns ``False``. Expiry is ``clock_timestamp() + ttl`` on the server; no
client clock is compared. The row's ``term`` grows by one on every change of holder
(including a re-acquisition after :meth:`~PostgresElector.resign`) and never
decreases; the elector exposes it as :attr:`PostgresElector.term` for fencing or logs.

There is no background thread: leadership lasts ``ttl`` seconds from the last
successful call. Call :meth:`~PostgresElector.is_leader` more often than ``ttl`` (for
example every ``ttl / 3``) to keep it, and finish the work a ``True`` allows within
``ttl`` of the call; work that may run longer needs :class:`~rselection.PostgresLeader`,
which cancels it when leadership ends. :meth:`~PostgresElector.resign` frees the row at
once, so another elector's next call takes over.

An elector holds no session lock, so its table must not be a
:class:`~rselection.PostgresLeader` lease table; the default is ``rselection_elections``.
Backend errors raise :class:`~rselection.errors.BackendUnavailable` (fail closed: a
failed call never says ``True``).
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql

from .. import forks
from ..closeable import Closeable
from ..errors import ConfigError, first_line
from ..validation import check_name, check_node_id, check_seconds, new_node_id
from .claims import MIN_TTL
from .connections import Connections
from .schema import ELECTIONS_TABLE, create_tables, table_identifier

__all__ = ["PostgresElector"]

logger = logging.getLogger(__name__)


class PostgresElector(Closeable):
    """Leader election that acquires or renews on each :meth:`is_leader` call.

    See the module docstring for how it works. Thread-safe; one instance is one
    candidate (its :attr:`node_id`), whichever thread calls it.

    Args:
        conninfo: a libpq connection string or URI, a ``psycopg.Connection``, or a pool
            with a ``connection()`` context manager (``psycopg_pool.ConnectionPool``);
            see :mod:`rselection.postgres.claims`.
        name: the election; electors with the same name and table compete.
        ttl: seconds a call keeps the leadership, server time (at least 1 ms; default 30).
        table: elections table, optionally schema-qualified.
        node_id: this candidate's node id; a new one
            (:func:`~rselection.validation.new_node_id`) by default, taken anew in a
            process forked from this one (which is another candidate).
        create_tables: create the table on first use. Pass ``False`` where the
            application role may not run DDL, and run :func:`~rselection.postgres.migrate`
            (or ``rselection migrate``) once with one that may.
        connect_timeout: seconds to wait for a connection (connection string only).
        statement_timeout: bound of one call on the server, seconds (connection string
            only).

    Raises:
        ConfigError: a bad ``conninfo``, a blank name or node_id, a ttl below 1 ms, an
            unsafe table name, bad timeouts.
    """

    def __init__(
        self,
        conninfo: str | Any,
        *,
        name: str = "default",
        ttl: float = 30.0,
        table: str = ELECTIONS_TABLE,
        node_id: str | None = None,
        create_tables: bool = True,
        connect_timeout: float = 5.0,
        statement_timeout: float = 10.0,
    ) -> None:
        self.name = check_name(name, "name")
        self.ttl = check_seconds(ttl, "ttl", minimum=MIN_TTL)
        self._ident = table_identifier(table)  # validates
        self.table = table
        self.node_id: str = new_node_id() if node_id is None else check_node_id(node_id)
        """This candidate's node id, recorded as the holder (in the ``holder`` column)."""
        self._default_node_id = node_id is None
        self.term: int | None = None
        """The term this elector leads with after a ``True`` from :meth:`is_leader`, else None."""
        self.create_tables = bool(create_tables)
        self._statement_timeout = check_seconds(statement_timeout, "statement_timeout")
        self._conns = Connections(
            conninfo,
            owner="PostgresElector",
            application_name=f"rselection:elector:{name}"[:63],
            connect_timeout=check_seconds(connect_timeout, "connect_timeout"),
            statement_timeout=self._statement_timeout,
            pooled=True,
        )
        self._ready = not self.create_tables
        self._elect_sql = sql.SQL(
            "INSERT INTO {t} AS e (name, holder, term, acquired_at, renewed_at, expires_at)"
            " VALUES (%(name)s, %(me)s, 1, clock_timestamp(), clock_timestamp(),"
            " clock_timestamp() + make_interval(secs => %(ttl)s::float8))"
            " ON CONFLICT (name) DO UPDATE SET"
            " holder = EXCLUDED.holder,"
            " term = CASE WHEN e.holder = EXCLUDED.holder THEN e.term ELSE e.term + 1 END,"
            " acquired_at = CASE WHEN e.holder = EXCLUDED.holder THEN e.acquired_at"
            " ELSE clock_timestamp() END,"
            " renewed_at = clock_timestamp(),"
            " expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8)"
            " WHERE e.holder = EXCLUDED.holder OR e.holder IS NULL"
            " OR e.expires_at <= clock_timestamp()"
            " RETURNING term"
        ).format(t=self._ident)
        self._resign_sql = sql.SQL(
            "UPDATE {} SET holder = NULL, renewed_at = clock_timestamp(),"
            " expires_at = clock_timestamp() WHERE name = %(name)s AND holder = %(me)s"
            " RETURNING term"
        ).format(self._ident)
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): a default node id is the
        parent's, so the child takes one of its own (with the same id, both processes
        would lead at once); it leads nothing yet. The connections reset themselves."""
        if self._default_node_id:
            self.node_id = new_node_id()
        self.term = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, table={self.table!r}, ttl={self.ttl}, "
            f"node_id={self.node_id!r}, {self._conns.where})"
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Resign if leading (errors are logged, not raised), then close (the ``with``
        block of :class:`~rselection.closeable.Closeable`, resigning first)."""
        try:
            if self.term is not None:
                self.resign()
        except Exception as err:  # the lease then simply expires after ttl
            logger.warning("elector %r: resign on exit failed: %s", self.name, err)
        finally:
            self.close()

    def close(self) -> None:
        """Close the connection the elector opened (idempotent); does not resign.

        A pool or connection passed in is left open: it belongs to the caller.
        """
        self._conns.close()

    def _run(self, what: str, query: sql.Composed) -> Any:
        params = {"name": self.name, "me": self.node_id, "ttl": self.ttl}
        with self._conns.connection() as conn:
            try:
                if not self._ready:
                    create_tables(conn, elections=self.table, timeout=self._statement_timeout)
                    self._ready = True
                with conn.transaction():
                    return conn.execute(query, params).fetchone()
            except psycopg.errors.UndefinedTable as exc:
                raise ConfigError(
                    f"cannot {what}: the elections table {self.table!r} does not exist in "
                    "this connection's database or search_path: run "
                    "rselection.postgres.migrate(conninfo) (or `rselection migrate`) once, "
                    "or create the elector with create_tables=True"
                ) from exc
            except (psycopg.errors.UndefinedColumn, psycopg.errors.NotNullViolation) as exc:
                raise ConfigError(
                    f"cannot {what}: {self.table!r} is not an elections table made by "
                    f"migrate() ({first_line(exc)}); a PostgresLeader lease "
                    "table cannot be shared with an elector"
                ) from exc
            except psycopg.Error as exc:
                raise self._conns.wrap(what, exc) from exc

    def is_leader(self) -> bool:
        """Acquire or renew the leadership; ``True`` while this elector holds it.

        One statement: renews when this elector holds the row, takes it over when it is
        free or expired (the term then grows by one), else returns ``False``. Sets
        :attr:`term`.

        Raises:
            ConfigError: the elections table is missing or is not one.
            BackendUnavailable: the database cannot be reached or failed; treat it as
                "not leader" (the lease may still be held and expires after ttl).
        """
        self.term = None
        row = self._run(f"run election {self.name!r}", self._elect_sql)
        if row is None:
            return False
        self.term = int(row[0])
        return True

    def resign(self) -> bool:
        """Give the leadership up at once, so another elector's next call takes it.

        Returns ``True`` if this elector held it. The term is kept; the next holder gets
        the next one.

        Raises:
            BackendUnavailable: the database cannot be reached (the lease then expires
                after ttl).
        """
        self.term = None
        row = self._run(f"resign from election {self.name!r}", self._resign_sql)
        if row is not None:
            logger.debug("elector %r: %s resigned term %s", self.name, self.node_id, row[0])
        return row is not None
