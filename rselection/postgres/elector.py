"""``PostgresElector``: "am I the leader?", renewed on each call, without a thread.

For code that keeps its own scheduler and only needs to know whether this process
should act now::

    elector = PostgresElector("postgresql://...", name="reports", ttl=30)

    def job() -> None:
        if elector.is_leader():
            send_reports()

Each call is one statement on the elections table (server time, a term that grows on
every change of holder); leadership lasts ``ttl`` from the last successful call, and a
failed call never says ``True``. See ``docs/how-to/claims.md`` and
``docs/explanation/how-it-works.md`` ("The other tables").
"""

from __future__ import annotations

import logging
from typing import Any

from psycopg import sql

from ..electing import Elector
from ..validation import check_name, check_seconds
from .claims import MIN_TTL
from .schema import ELECTIONS_TABLE
from .table_client import TableClient

__all__ = ["PostgresElector"]

logger = logging.getLogger(__name__)


class PostgresElector(TableClient, Elector):
    """Leader election that acquires or renews on each :meth:`is_leader` call.

    See the module docstring for how it works. Thread-safe; one instance is one
    candidate (its :attr:`node_id`), whichever thread calls it. The ``with`` block
    resigns if leading, then closes; :meth:`close` alone does not resign.

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

    _kind = "elections"
    _role = "elector"
    _misuse = "; a PostgresLeader lease table cannot be shared with an elector"

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
        super().__init__(
            conninfo,
            owner="PostgresElector",
            application_name=f"rselection:elector:{name}",
            table=table,
            create_tables=create_tables,
            connect_timeout=connect_timeout,
            statement_timeout=statement_timeout,
        )
        self._take_node_id(node_id)
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

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, table={self.table!r}, ttl={self.ttl}, "
            f"node_id={self.node_id!r}, {self._conns.where})"
        )

    def _params(self) -> dict[str, Any]:
        return {"name": self.name, "me": self.node_id, "ttl": self.ttl}

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
        row = self._run(f"run election {self.name!r}", self._elect_sql, self._params())
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
        row = self._run(f"resign from election {self.name!r}", self._resign_sql, self._params())
        if row is not None:
            logger.debug("elector %r: %s resigned term %s", self.name, self.node_id, row[0])
        return row is not None
