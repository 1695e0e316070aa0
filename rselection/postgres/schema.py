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

The claims table (:class:`~rselection.postgres.PostgresClaimer`) holds one row per
claimed fire::

    fire_key        text primary key   -- e.g. "purge@2026-11-30T02:40:00.000000000Z"
    format_version  int not null       -- fire key format the claimer wrote (1 today)
    holder          text not null      -- identity of the claiming process
    term            bigint null        -- fencing term given with the claim, if any
    claimed_at      timestamptz        -- server time of the claim
    expires_at      timestamptz        -- server time until which the claim binds

The elections table (:class:`~rselection.postgres.PostgresElector`) holds one row per
election name: ``name``, ``holder`` (NULL after a resign), ``term`` (+1 on every change
of holder), ``acquired_at``, ``renewed_at``, ``expires_at``. It is not a lease table: an
elector holds no session lock, so it never shares a table with :class:`PostgresLease`.

``rselection_schema_version`` (in the same schema as each table) keeps one row per
component, e.g. ``('leases', 1)``, ``('claims', 1)``, ``('elections', 1)`` (a custom
table name is recorded as ``'leases:<table>'`` and so on), so later versions know what to
upgrade.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from ..errors import BackendUnavailable, ConfigError

__all__ = [
    "CLAIMS_TABLE",
    "CLAIMS_VERSION",
    "DEFAULT_TABLE",
    "ELECTIONS_TABLE",
    "ELECTIONS_VERSION",
    "LEASES_VERSION",
    "VERSION_TABLE",
    "create_tables",
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

CLAIMS_TABLE = "rselection_claims"
"""The claims table of :class:`~rselection.postgres.PostgresClaimer` by default."""

CLAIMS_VERSION = 1
"""Schema version of the claims table that this release creates and understands."""

ELECTIONS_TABLE = "rselection_elections"
"""The elections table of :class:`~rselection.postgres.PostgresElector` by default."""

ELECTIONS_VERSION = 1
"""Schema version of the elections table that this release creates and understands."""

NODES_TABLE = "rselection_nodes"
"""The table of node heartbeats (membership) by default."""

NODES_VERSION = 1
"""Schema version of the nodes table that this release creates and understands."""

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


def _component(kind: str, default: str, table: str) -> str:
    parts = validate_table_name(table)
    return kind if parts[-1] == default else f"{kind}:{parts[-1]}"


def _index_name(table: str, suffix: str) -> sql.Identifier:
    """An index name for ``table`` (its schema is the table's), at most 63 characters."""
    name = f"{validate_table_name(table)[-1]}_{suffix}"
    if len(name) > _MAX_PART:
        digest = hashlib.blake2b(name.encode(), digest_size=6).hexdigest()
        name = f"{name[: _MAX_PART - len(digest) - 1]}_{digest}"
    return sql.Identifier(name)


def _lease_ddl(table: str) -> list[sql.Composed]:
    ident = table_identifier(table)
    return [
        sql.SQL(
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
    ]


def _claims_ddl(table: str) -> list[sql.Composed]:
    ident = table_identifier(table)
    index = _index_name(table, "format_version_idx")
    return [
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            " fire_key text PRIMARY KEY,"
            " format_version integer NOT NULL CHECK (format_version >= 1),"
            " holder text NOT NULL,"
            " term bigint NULL CHECK (term >= 0),"
            " claimed_at timestamptz NOT NULL,"
            " expires_at timestamptz NOT NULL)"
        ).format(ident),
        # Lets a claim find claims written in another fire-key format at once.
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (format_version)").format(index, ident),
    ]


def _elections_ddl(table: str) -> list[sql.Composed]:
    ident = table_identifier(table)
    return [
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            " name text PRIMARY KEY,"
            " holder text NULL,"
            " term bigint NOT NULL CHECK (term >= 1),"
            " acquired_at timestamptz NOT NULL,"
            " renewed_at timestamptz NOT NULL,"
            " expires_at timestamptz NOT NULL)"
        ).format(ident)
    ]


def _nodes_ddl(table: str) -> list[sql.Composed]:
    ident = table_identifier(table)
    return [
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            " name text NOT NULL,"
            " node_id text NOT NULL,"
            " hostname text NOT NULL,"
            " pid integer NOT NULL,"
            " client_addr inet NULL,"
            " started_at timestamptz NOT NULL,"
            " last_seen timestamptz NOT NULL,"
            " PRIMARY KEY (name, node_id))"
        ).format(ident)
    ]


#: kind -> (default table, schema version, DDL builder, what the table is, for messages)
_KINDS: dict[str, tuple[str, int, Callable[[str], list[sql.Composed]], str]] = {
    "leases": (DEFAULT_TABLE, LEASES_VERSION, _lease_ddl, "lease table"),
    "claims": (CLAIMS_TABLE, CLAIMS_VERSION, _claims_ddl, "claims table"),
    "elections": (ELECTIONS_TABLE, ELECTIONS_VERSION, _elections_ddl, "elections table"),
    "nodes": (NODES_TABLE, NODES_VERSION, _nodes_ddl, "nodes table"),
}


def create_tables(conn: psycopg.Connection[Any], **tables: str | None) -> None:
    """Create the named tables (and the schema-version table) if they do not exist.

    The building block of :func:`migrate` for callers that need only some tables, such
    as a claimer created with ``create_tables=True``. Same guarantees as :func:`migrate`.

    Args:
        conn: an open psycopg connection (autocommit or not).
        tables: ``leases=``, ``claims=``, ``elections=`` and ``nodes=`` table names; ``None`` (or
            leaving one out) skips that table.

    Raises:
        ConfigError: unknown keyword, unsafe table name, or a schema version newer than
            this release understands.
        BackendUnavailable: the database refused; the message says which.
    """
    wanted: list[tuple[str, str]] = []
    for kind, table in tables.items():
        if kind not in _KINDS:
            raise ConfigError(
                f"unknown table kind {kind!r}: use leases, claims, elections or nodes"
            )
        if table is not None:
            validate_table_name(table)
            wanted.append((kind, table))
    if not wanted:
        return
    what = " and ".join(f"the {_KINDS[k][3]} {t!r}" for k, t in wanted)
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            for kind, table in wanted:
                _create_one(conn, kind, table)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise BackendUnavailable(
            f"cannot create {what}: {exc}; run `rselection migrate` "
            "with a role that may create tables and pass create_tables=False"
        ) from exc
    except psycopg.errors.InvalidSchemaName as exc:
        raise BackendUnavailable(f"cannot create {what}: {exc}; create the schema first") from exc
    except psycopg.Error as exc:
        raise BackendUnavailable(f"cannot create {what}: {exc}") from exc
    for kind, table in wanted:
        logger.debug("%s %s ready (schema version %s)", _KINDS[kind][3], table, _KINDS[kind][1])


def _create_one(conn: psycopg.Connection[Any], kind: str, table: str) -> None:
    default, version, ddl, label = _KINDS[kind]
    version_ident = version_table_identifier(table)
    component = _component(kind, default, table)
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            " component text PRIMARY KEY,"
            " version integer NOT NULL,"
            " migrated_at timestamptz NOT NULL DEFAULT now())"
        ).format(version_ident)
    )
    row = conn.execute(
        sql.SQL("SELECT version FROM {} WHERE component = %s").format(version_ident),
        (component,),
    ).fetchone()
    if row is not None and row[0] > version:
        raise ConfigError(
            f"{label} {table!r} has schema version {row[0]}, newer than the "
            f"{version} this release of rselection understands: upgrade "
            "rselection on this node"
        )
    for statement in ddl(table):
        conn.execute(statement)
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (component, version) VALUES (%s, %s) ON CONFLICT (component) DO NOTHING"
        ).format(version_ident),
        (component, version),
    )


def migrate(
    conn: psycopg.Connection[Any],
    *,
    table: str | None = DEFAULT_TABLE,
    claims_table: str | None = CLAIMS_TABLE,
    elections_table: str | None = ELECTIONS_TABLE,
    nodes_table: str | None = NODES_TABLE,
) -> None:
    """Create every rselection table and the schema-version table if they do not exist.

    Creates the lease table (:class:`~rselection.PostgresLeader`), the claims table
    (:class:`~rselection.postgres.PostgresClaimer`), the elections table
    (:class:`~rselection.postgres.PostgresElector`) and the nodes table (heartbeats of
    every leader's nodes); pass ``None`` for one to skip it.
    Safe to run from many processes at once: the DDL runs in a transaction under a
    transaction-level advisory lock, so concurrent ``CREATE ... IF NOT EXISTS`` never
    race on the catalogs. Runs in its own transaction (or a savepoint when ``conn`` is
    already in one). Needs the privilege to create tables in the target schema; where
    the application role may not run DDL, run ``rselection migrate --dsn ...`` once with
    a privileged role and pass ``create_tables=False``.

    Args:
        conn: an open psycopg connection (autocommit or not).
        table: lease table name, optionally schema-qualified (``"ops.leases"``).
        claims_table: claims table name, optionally schema-qualified.
        elections_table: elections table name, optionally schema-qualified.
        nodes_table: nodes table name, optionally schema-qualified.

    Raises:
        ConfigError: a table name is not safe, or the database holds a newer schema
            version than this release understands.
        BackendUnavailable: the database refused (missing schema, no privilege, broken
            connection); the message says which.
    """
    create_tables(
        conn,
        leases=table,
        claims=claims_table,
        elections=elections_table,
        nodes=nodes_table,
    )
