"""``TableClient``: the base of the Postgres objects that keep their rows in one table
of their own kind (the claims of a claimer, the elections of an elector).

Nothing here is public API. Such an object runs each call as one short transaction on
the process's pooled sessions, creates its table on first use unless told not to, and
says in its errors when the table is missing or is of another kind.
"""

from __future__ import annotations

from typing import Any, ClassVar

import psycopg
from psycopg import sql

from ..closeable import Closeable
from ..errors import ConfigError, first_line
from ..validation import check_seconds
from .connections import Connections
from .schema import create_tables, table_identifier

__all__ = ["TableClient"]


class TableClient(Closeable):
    """Runs statements on one table of kind :attr:`_kind`, creating it on first use.

    Args:
        conninfo: a libpq connection string or URI, a ``psycopg.Connection``, or a pool
            with a ``connection()`` context manager.
        owner: the public class, for messages (``"PostgresClaimer"``).
        application_name: ``application_name`` of sessions opened for it.
        table: the table, optionally schema-qualified.
        create_tables: create the table on first use.
        connect_timeout: seconds to wait for a connection (connection string only).
        statement_timeout: bound of one call on the server, seconds (connection string
            only); it also bounds the waits of the first call's table creation.

    Raises:
        ConfigError: a bad ``conninfo``, an unsafe table name, bad timeouts.
    """

    _kind: ClassVar[str]
    """The kind of table, as :func:`~rselection.postgres.schema.create_tables` names it."""
    _role: ClassVar[str]
    """What the object is called in messages (``"claimer"``)."""
    _misuse: ClassVar[str] = ""
    """Appended to the message for a table of another kind: the likely mix-up."""

    def __init__(
        self,
        conninfo: str | Any,
        *,
        owner: str,
        application_name: str,
        table: str,
        create_tables: bool,
        connect_timeout: float,
        statement_timeout: float,
    ) -> None:
        self._ident = table_identifier(table)  # validates
        self.table = table
        self.create_tables = bool(create_tables)
        self._statement_timeout = check_seconds(statement_timeout, "statement_timeout")
        self._conns = Connections(
            conninfo,
            owner=owner,
            application_name=application_name[:63],
            connect_timeout=check_seconds(connect_timeout, "connect_timeout"),
            statement_timeout=self._statement_timeout,
            pooled=True,
        )
        self._ready = not self.create_tables

    def close(self) -> None:
        """Close the connection this object opened (idempotent; a later call reopens it).

        A pool or connection passed in is left open: it belongs to the caller.
        """
        self._conns.close()

    def _run(self, what: str, query: sql.Composed, params: dict[str, Any]) -> Any:
        """Run ``query`` in a transaction of its own: its row, or the rows it changed.

        Raises:
            ConfigError: the table is missing or is not of this kind.
            BackendUnavailable: the database cannot be reached or failed.
        """
        kind = f"{self._kind} table"
        with self._conns.connection() as conn:
            try:
                if not self._ready:
                    create_tables(conn, timeout=self._statement_timeout, **{self._kind: self.table})
                    self._ready = True
                with conn.transaction():
                    cur = conn.execute(query, params)
                    return cur.fetchone() if cur.description is not None else cur.rowcount
            except psycopg.errors.UndefinedTable as exc:
                raise ConfigError(
                    f"cannot {what}: the {kind} {self.table!r} does not exist in this "
                    "connection's database or search_path: run "
                    "rselection.postgres.migrate(conninfo) (or `rselection migrate`) once, "
                    f"or create the {self._role} with create_tables=True"
                ) from exc
            except (psycopg.errors.UndefinedColumn, psycopg.errors.NotNullViolation) as exc:
                article = "an" if kind[0] in "aeiou" else "a"
                raise ConfigError(
                    f"cannot {what}: {self.table!r} is not {article} {kind} made by migrate() "
                    f"({first_line(exc)}){self._misuse}"
                ) from exc
            except psycopg.Error as exc:
                raise self._conns.wrap(what, exc) from exc
