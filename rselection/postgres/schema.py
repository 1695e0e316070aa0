"""Tables of the Postgres backend: names, validation and :func:`migrate`.

Every table name a user gives is validated here (:func:`validate_table_name`) and
always reaches SQL as :class:`psycopg.sql.Identifier`, never by string formatting.

The lease table holds one row per lease name::

    name         text primary key   -- the lease name
    holder       text null          -- node id of the holder; NULL when free
    term         bigint not null    -- fencing term: +1 on every change of holder, never reused
    holder_pid   int null           -- backend pid of the holder's keeper session
    lock_key     int not null       -- first key of the holder's session advisory lock
    acquired_at  timestamptz        -- server time of the acquisition
    renewed_at   timestamptz        -- server time of the last renewal
    expires_at   timestamptz        -- server time at which the lease lapses

Only ``name`` is a key column: ``term`` must never be part of a unique index, so that a
renewal (a plain ``UPDATE`` of non-key columns, row lock ``FOR NO KEY UPDATE``) does not
conflict with the ``FOR KEY SHARE`` lock of fenced transactions.

``rselection_schema_version`` (in the same schema as the lease table) keeps one row per
component, e.g. ``('leases', 1)``, so later versions know what to upgrade.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

import psycopg
from psycopg import sql

from ..errors import BackendUnavailable, ConfigError

__all__ = [
    "DEFAULT_TABLE",
    "LEASES_VERSION",
    "VERSION_TABLE",
    "migrate",
    "table_identifier",
    "validate_table_name",
    "version_table_identifier",
]

logger = logging.getLogger(__name__)

DEFAULT_TABLE = "rselection_leases"
"""The lease table used when none is given."""

VERSION_TABLE = "rselection_schema_version"
"""The table that records which schema version each component has."""

LEASES_VERSION = 1
"""Schema version of the lease table that this release creates and understands."""

_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_PART = 63  # NAMEDATALEN - 1

#: ``pg_advisory_xact_lock(bigint)`` key serialising DDL of every rselection process.
#: The one-argument form lives in a different lock space than the two-int session locks
#: of the leases, so the two never collide.
MIGRATION_LOCK_KEY = int.from_bytes(
    hashlib.blake2b(b"rselection:migrate", digest_size=8).digest(), "big", signed=True
)


def validate_table_name(table: str) -> tuple[str, ...]:
    """Split ``table`` into its parts, or raise :class:`ConfigError` if it is unsafe.

    A valid name is ``table`` or ``schema.table``; each part matches
    ``[A-Za-z_][A-Za-z0-9_]*`` and has at most 63 characters.

    Args:
        table: the table name as the user wrote it.
    """
    if not isinstance(table, str):
        raise ConfigError(f"table name must be a str, got {type(table).__name__}")
    parts = tuple(table.split("."))
    if not table or len(parts) > 2:
        raise ConfigError(
            f"invalid table name {table!r}: use 'table' or 'schema.table' "
            "(letters, digits and underscores, not starting with a digit)"
        )
    for part in parts:
        if not _PART.match(part):
            raise ConfigError(
                f"invalid table name {table!r}: part {part!r} must match "
                "[A-Za-z_][A-Za-z0-9_]* (letters, digits and underscores, not starting "
                "with a digit)"
            )
        if len(part) > _MAX_PART:
            raise ConfigError(
                f"invalid table name {table!r}: part {part[:20]!r}... has {len(part)} "
                f"characters, Postgres allows at most {_MAX_PART}"
            )
    return parts


def table_identifier(table: str) -> sql.Identifier:
    """The validated, quoted identifier of ``table`` (``"schema"."table"`` when qualified).

    Args:
        table: the table name as the user wrote it.
    """
    return sql.Identifier(*validate_table_name(table))


def version_table_identifier(table: str) -> sql.Identifier:
    """The schema-version table that sits next to ``table`` (same schema).

    Args:
        table: the lease table name as the user wrote it.
    """
    parts = validate_table_name(table)
    return sql.Identifier(*parts[:-1], VERSION_TABLE)


def _component(table: str) -> str:
    parts = validate_table_name(table)
    return "leases" if parts[-1] == DEFAULT_TABLE else f"leases:{parts[-1]}"


def migrate(conn: psycopg.Connection[Any], *, table: str = DEFAULT_TABLE) -> None:
    """Create the lease table and the schema-version table if they do not exist.

    Safe to run from many processes at once: the DDL runs in a transaction under a
    transaction-level advisory lock, so concurrent ``CREATE ... IF NOT EXISTS`` never
    race on the catalogs. Runs in its own transaction (or a savepoint when ``conn`` is
    already in one). Needs the privilege to create tables in the target schema; where
    the application role may not run DDL, run ``rselection migrate --dsn ...`` once with
    a privileged role and pass ``create_tables=False``.

    Args:
        conn: an open psycopg connection (autocommit or not).
        table: lease table name, optionally schema-qualified (``"ops.leases"``).

    Raises:
        ConfigError: ``table`` is not a safe name, or the database holds a newer schema
            version than this release understands.
        BackendUnavailable: the database refused (missing schema, no privilege, broken
            connection); the message says which.
    """
    ident = table_identifier(table)
    version_ident = version_table_identifier(table)
    component = _component(table)
    create_leases = sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} ("
        " name text PRIMARY KEY,"
        " holder text NULL,"
        " term bigint NOT NULL DEFAULT 0 CHECK (term >= 0),"
        " holder_pid integer NULL,"
        " lock_key integer NOT NULL,"
        " acquired_at timestamptz NULL,"
        " renewed_at timestamptz NULL,"
        " expires_at timestamptz NULL)"
    ).format(ident)
    create_versions = sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} ("
        " component text PRIMARY KEY,"
        " version integer NOT NULL,"
        " migrated_at timestamptz NOT NULL DEFAULT now())"
    ).format(version_ident)
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            conn.execute(create_versions)
            row = conn.execute(
                sql.SQL("SELECT version FROM {} WHERE component = %s").format(version_ident),
                (component,),
            ).fetchone()
            if row is not None and row[0] > LEASES_VERSION:
                raise ConfigError(
                    f"table {table!r} has schema version {row[0]}, newer than the "
                    f"{LEASES_VERSION} this release of rselection understands: upgrade "
                    "rselection on this node"
                )
            conn.execute(create_leases)
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (component, version) VALUES (%s, %s)"
                    " ON CONFLICT (component) DO NOTHING"
                ).format(version_ident),
                (component, LEASES_VERSION),
            )
    except psycopg.errors.InsufficientPrivilege as exc:
        raise BackendUnavailable(
            f"cannot create the lease table {table!r}: {exc}; run `rselection migrate` "
            "with a role that may create tables and pass create_tables=False"
        ) from exc
    except psycopg.errors.InvalidSchemaName as exc:
        raise BackendUnavailable(
            f"cannot create the lease table {table!r}: {exc}; create the schema first"
        ) from exc
    except psycopg.Error as exc:
        raise BackendUnavailable(f"cannot create the lease table {table!r}: {exc}") from exc
    logger.debug("lease table %s ready (schema version %s)", table, LEASES_VERSION)
