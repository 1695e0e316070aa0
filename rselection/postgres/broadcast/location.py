"""Where a broadcaster's outbox table is: found the same way by its writer and its listener.

A table name without a schema means the first schema of a search path that holds it,
read once per broadcaster; writer and listener find the table through that list with
the same query (:meth:`Locator.find`), name it schema-qualified in every statement, and
check in the same statement that the name still finds that table, so both follow it to
the same place. See ``docs/explanation/broadcaster.md``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from ...errors import ConfigError
from ..schema import validate_table_name
from .outbox import FIND_TABLE, Outbox, text_array

__all__ = ["Location", "Locator", "Relocated", "parse_search_path"]


def _one(conn: psycopg.Connection[Any], query: Any, params: Any = None) -> tuple[Any, ...] | None:
    with conn.cursor(row_factory=tuple_row) as cur:  # whatever the connection's own
        return cur.execute(query, params).fetchone()


class Relocated(Exception):
    """A publish found that the table's name now finds another table, or none: it
    inserted nothing (the writer finds the table again and writes the batch there)."""


def parse_search_path(setting: str, user: str) -> tuple[str, ...]:
    """The schemas of a ``search_path`` setting, in order, as Postgres reads them:
    comma-separated, double-quoted names kept as written (``""`` is a quote), other
    names in lower case, ``$user`` for the session's role; ``pg_catalog`` first unless
    the path places it.

    Args:
        setting: ``current_setting('search_path')``.
        user: ``current_user``.
    """
    names: list[str] = []
    part: list[str] = []
    quoted = False
    was_quoted = False
    i = 0
    while i <= len(setting):
        ch = setting[i] if i < len(setting) else ","
        if quoted:
            if ch == '"':
                if setting[i + 1 : i + 2] == '"':
                    part.append('"')
                    i += 1
                else:
                    quoted = False
            else:
                part.append(ch)
        elif ch == '"':
            quoted = was_quoted = True
        elif ch == ",":
            name = "".join(part) if was_quoted else "".join(part).strip().lower()
            if name == "$user":
                name = user
            if name:
                names.append(name)
            part, was_quoted = [], False
        elif not ch.isspace() or part:
            part.append(ch)
        i += 1
    if "pg_catalog" not in names:
        names.insert(0, "pg_catalog")
    return tuple(names)


@dataclass(frozen=True)
class Location:
    """The outbox table as found: where it is and what publishing there uses."""

    schema: str
    """Its schema."""
    oid: int
    """Its oid: the statements check that the name still finds this table."""
    outbox: Outbox
    """Both tables named in :attr:`schema`: what every statement runs on."""
    channel: str
    """Its NOTIFY channel."""


class Locator:
    """Finds a broadcaster's outbox table for its writer and its listener alike.

    Args:
        outbox: the outbox table, as configured.
    """

    def __init__(self, outbox: Outbox) -> None:
        """Nothing read yet (see :meth:`read_path`)."""
        self._outbox = outbox
        parts = validate_table_name(outbox.table)
        self.name = parts[-1]
        """The table's own name (without the schema)."""
        self._lock = threading.Lock()
        self._path: tuple[str, ...] | None = (parts[0],) if len(parts) == 2 else None

    def reset_after_fork(self) -> None:
        """In a forked child: the lock is made anew (a parent's thread may have held it)."""
        self._lock = threading.Lock()

    @property
    def path(self) -> tuple[str, ...]:
        """The schemas searched, in order (read by :meth:`read_path`)."""
        assert self._path is not None, "read_path() first"
        return self._path

    @property
    def path_param(self) -> bytes:
        """:attr:`path` as a text array literal, a statement parameter."""
        return text_array(name.encode() for name in self.path)

    def read_path(self, conn: psycopg.Connection[Any]) -> tuple[str, ...]:
        """The schemas searched: for a name without a schema, the ``search_path`` of
        ``conn`` (a session of the broadcaster's own ``conninfo``, never a user's pool's)
        read on first use and kept, so that the writer and the listener search the same
        schemas.

        Raises:
            psycopg.Error: the round trip failed.
        """
        if self._path is not None:
            return self._path
        row = _one(conn, "SELECT current_setting('search_path'), current_user")
        assert row is not None
        path = parse_search_path(str(row[0]), str(row[1]))
        with self._lock:
            if self._path is None:
                self._path = path
            return self._path

    def find(self, conn: psycopg.Connection[Any]) -> Location:
        """Find the table through :attr:`path` (on any session: its ``search_path`` does
        not matter).

        Raises:
            ConfigError: no schema of the path holds the table.
            psycopg.Error: the round trip failed.
        """
        query = sql.SQL(
            "SELECT f.oid, n.nspname FROM (" + FIND_TABLE.format(path="%s", rel="%s") + ") f"
            " JOIN pg_catalog.pg_class c ON c.oid = f.oid"
            " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        )
        row = _one(conn, query, (list(self.path), self.name))
        if row is None:
            raise ConfigError(
                f"broadcast table {self._outbox.table!r} does not exist (searched in "
                f"{', '.join(self.path[1:] or self.path)}): create the broadcaster with "
                "create_tables=True, or run rselection.postgres.migrate(conninfo, "
                "broadcast_table=...) (or `rselection migrate`) once with a role that may "
                "run DDL"
            )
        oid, schema = int(row[0]), str(row[1])
        channel = Outbox.channel(f"{schema}.{self.name}")
        return Location(schema, oid, self._outbox.in_schema(schema), channel)

    @staticmethod
    def at(conn: psycopg.Connection[Any], oid: int) -> sql.Identifier | None:
        """The table of oid ``oid`` wherever it is now (``None``: it was dropped)."""
        row = _one(
            conn,
            "SELECT n.nspname, c.relname FROM pg_catalog.pg_class c"
            " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
            (oid,),
        )
        return None if row is None else sql.Identifier(str(row[0]), str(row[1]))
