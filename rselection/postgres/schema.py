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
    resign_term  bigint null        -- term asked to hand over (``rselection resign``)
    resign_from  text null          -- its holder, kept out until another node took over
    resign_to    text null          -- node the lease is reserved for, if one was named
    resign_until timestamptz null   -- server time at which the request lapses
    holder_server text null         -- identity of the server of the holder's session
    retired_term bigint null        -- term at which ``rselection forget`` retired the lease

The four ``resign_*`` columns came with schema version 2, ``holder_server`` with version
3, ``retired_term`` with version 4; :func:`migrate` adds what an older table lacks
(``ALTER TABLE ... ADD COLUMN IF NOT EXISTS``, nullable, no default: a catalog-only
change) and records the version. Code of
this release also works on an older table that was not upgraded (``create_tables=False``):
on version 1 handover requests are unavailable; on versions 1 and 2 the lease cannot
record which server its holder's session is on, so a crashed holder is replaced only
when its lease expires (no fast failover) until ``rselection migrate`` runs.

``holder_server`` is ``"<system identifier>/<timeline>/<postmaster start time>"`` of
the server the holder's keeper session was on when it acquired the lease (see
:mod:`rselection.postgres.lease`): a holder's ``holder_pid`` and advisory lock mean
something only on that server. A row without it (acquired before the upgrade) counts
as held on an unknown server.

A lease is retired (``rselection forget``: no service uses it any more) while
``retired_term = term``: its row stays, so its term never restarts, and the next
acquisition, which increments the term, brings it back without touching the column.

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
component, e.g. ``('leases', 3)``, ``('claims', 1)``, ``('elections', 1)`` (a custom
table name is recorded as ``'leases:<table>'`` and so on), so later versions know what to
upgrade. :func:`migrate` returns a :class:`TableChange` per table saying what it did.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
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
    "TableChange",
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

LEASES_VERSION = 4
"""Schema version of the lease table that this release creates and understands.

Version 2 added the nullable ``resign_term``, ``resign_from``, ``resign_to`` and
``resign_until`` columns (handover requests), version 3 the nullable ``holder_server``
(the server identity of the holder's session), version 4 the nullable ``retired_term``
(``rselection forget``); :func:`migrate` upgrades an older table in place."""

LEASE_HANDOVER_COLUMNS = ("resign_term", "resign_from", "resign_to", "resign_until")
"""Columns of the lease table that handover requests need (schema version 2)."""

LEASE_SERVER_COLUMNS = ("holder_server",)
"""Columns of the lease table that record the server of the holder's session (version 3)."""

LEASE_RETIRED_COLUMNS = ("retired_term",)
"""Columns of the lease table that mark a lease retired by ``rselection forget`` (version 4)."""

#: Longest an upgrade waits for its exclusive lock on a live table. While an ALTER waits,
#: every later statement on the table (a leader's renewal) queues behind it; failing
#: fast and retrying keeps a busy fleet's renewals from stalling.
UPGRADE_LOCK_TIMEOUT = 1.0

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
            " expires_at timestamptz NULL,"
            " resign_term bigint NULL,"
            " resign_from text NULL,"
            " resign_to text NULL,"
            " resign_until timestamptz NULL,"
            " holder_server text NULL,"
            " retired_term bigint NULL)"
        ).format(ident)
    ]


def _lease_v2(table: str) -> list[sql.Composed]:
    """Version 1 -> 2: the handover request columns (nullable, no default: no rewrite)."""
    return [
        sql.SQL(
            "ALTER TABLE {} ADD COLUMN IF NOT EXISTS resign_term bigint NULL,"
            " ADD COLUMN IF NOT EXISTS resign_from text NULL,"
            " ADD COLUMN IF NOT EXISTS resign_to text NULL,"
            " ADD COLUMN IF NOT EXISTS resign_until timestamptz NULL"
        ).format(table_identifier(table))
    ]


def _lease_v3(table: str) -> list[sql.Composed]:
    """Version 2 -> 3: the holder's server identity (nullable, no default: no rewrite)."""
    return [
        sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS holder_server text NULL").format(
            table_identifier(table)
        )
    ]


def _lease_v4(table: str) -> list[sql.Composed]:
    """Version 3 -> 4: the retired mark (nullable, no default: no rewrite)."""
    return [
        sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS retired_term bigint NULL").format(
            table_identifier(table)
        )
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

#: kind -> upgrades of an existing table: (version reached, columns it adds, statements)
_UPGRADES: dict[str, list[tuple[int, tuple[str, ...], Callable[[str], list[sql.Composed]]]]] = {
    "leases": [
        (2, LEASE_HANDOVER_COLUMNS, _lease_v2),
        (3, LEASE_SERVER_COLUMNS, _lease_v3),
        (4, LEASE_RETIRED_COLUMNS, _lease_v4),
    ],
}


@dataclass(frozen=True)
class TableChange:
    """What :func:`migrate` did to one table.

    Attributes:
        kind: ``"leases"``, ``"claims"``, ``"elections"`` or ``"nodes"``.
        table: the table name as given.
        action: ``"created"``, ``"upgraded"`` or ``"present"`` (already current).
        version: the table's schema version now.
        previous: the version recorded before (``None`` when none was recorded).
    """

    kind: str
    table: str
    action: str
    version: int
    previous: int | None

    @property
    def label(self) -> str:
        """What the table is, for messages (``"lease table"``)."""
        return _KINDS[self.kind][3]

    def describe(self) -> str:
        """One line for people: ``lease table 'x': upgraded (schema version 2 -> 3)``."""
        if self.action == "created":
            done = f"created (schema version {self.version})"
        elif self.action == "upgraded":
            before = "unrecorded" if self.previous is None else str(self.previous)
            done = f"upgraded (schema version {before} -> {self.version})"
        else:
            done = f"already present (schema version {self.version})"
        return f"{self.label} {self.table!r}: {done}"


MIGRATION_IDLE_TIMEOUT = "5s"
"""How long a migration transaction may sit idle before the server ends it: a client cut
off in the middle of one must not keep every other node from creating its tables."""


def lock_migrations(conn: psycopg.Connection[Any]) -> None:
    """Take the migration lock in the caller's transaction (``MIGRATION_LOCK_KEY``); if the
    client then vanishes mid-migration, the server ends the transaction after
    :data:`MIGRATION_IDLE_TIMEOUT`, freeing the lock."""
    conn.execute(
        sql.SQL("SET LOCAL idle_in_transaction_session_timeout = {}").format(
            sql.Literal(MIGRATION_IDLE_TIMEOUT)
        )
    )
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))


def create_tables(conn: psycopg.Connection[Any], **tables: str | None) -> list[TableChange]:
    """Create the named tables (and the schema-version table), or upgrade older ones.

    Returns one :class:`TableChange` per table, in the order given. The building block
    of :func:`migrate` for callers that need only some tables, such as a claimer
    created with ``create_tables=True``. Same guarantees as :func:`migrate`.

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
        return []
    what = " and ".join(f"the {_KINDS[k][3]} {t!r}" for k, t in wanted)
    try:
        with conn.transaction():
            lock_migrations(conn)
            changes = [_create_one(conn, kind, table) for kind, table in wanted]
    except psycopg.errors.LockNotAvailable as exc:
        raise BackendUnavailable(
            f"cannot upgrade {what}: the table stayed locked for more than "
            f"{UPGRADE_LOCK_TIMEOUT:g} s (long fenced transactions?); nothing was changed, "
            "try again"
        ) from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        raise BackendUnavailable(
            f"cannot create {what}: {exc}; run `rselection migrate` "
            "with a role that may create tables and pass create_tables=False"
        ) from exc
    except psycopg.errors.InvalidSchemaName as exc:
        raise BackendUnavailable(f"cannot create {what}: {exc}; create the schema first") from exc
    except psycopg.Error as exc:
        raise BackendUnavailable(f"cannot create {what}: {exc}") from exc
    for change in changes:
        log = logger.info if change.action == "upgraded" else logger.debug
        log("%s", change.describe())
    return changes


def _missing_columns(conn: psycopg.Connection[Any], table: str, columns: tuple[str, ...]) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_catalog.pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attname = ANY(%s) AND NOT attisdropped",
        (table_identifier(table).as_string(conn), list(columns)),
    ).fetchone()
    return row is None or row[0] < len(columns)


def _upgrade(conn: psycopg.Connection[Any], statements: list[sql.Composed]) -> None:
    """Run ALTERs under a short lock timeout, then restore the caller's setting."""
    row = conn.execute("SELECT current_setting('lock_timeout')").fetchone()
    previous = row[0] if row is not None else "0"
    ms = f"{round(UPGRADE_LOCK_TIMEOUT * 1000)}ms"
    conn.execute("SELECT set_config('lock_timeout', %s, true)", (ms,))
    for statement in statements:
        conn.execute(statement)
    conn.execute("SELECT set_config('lock_timeout', %s, true)", (previous,))


def _create_one(conn: psycopg.Connection[Any], kind: str, table: str) -> TableChange:
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
    recorded: int | None = row[0] if row is not None else None
    if recorded is not None and recorded > version:
        raise ConfigError(
            f"{label} {table!r} has schema version {recorded}, newer than the "
            f"{version} this release of rselection understands: upgrade "
            "rselection on this node"
        )
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (table_identifier(table).as_string(conn),)
    ).fetchone()
    existed = bool(exists and exists[0])
    action = "present" if existed else "created"
    if existed and recorded is not None and recorded < version:
        action = "upgraded"
    for statement in ddl(table):
        conn.execute(statement)  # IF NOT EXISTS: a no-op on an existing table
    if existed:
        for reached, columns, upgrade in _UPGRADES.get(kind, []):
            # Only ALTER when columns are missing: even a no-op ALTER TABLE takes an
            # exclusive lock, and this runs on every connect of every node.
            if (recorded is None or recorded < reached) and _missing_columns(conn, table, columns):
                _upgrade(conn, upgrade(table))
                action = "upgraded"
    if recorded is None or recorded < version:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} AS v (component, version) VALUES (%s, %s)"
                " ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,"
                " migrated_at = now() WHERE v.version < EXCLUDED.version"
            ).format(version_ident),
            (component, version),
        )
    return TableChange(kind, table, action, version, recorded)


def migrate(
    conn: psycopg.Connection[Any],
    *,
    table: str | None = DEFAULT_TABLE,
    claims_table: str | None = CLAIMS_TABLE,
    elections_table: str | None = ELECTIONS_TABLE,
    nodes_table: str | None = NODES_TABLE,
) -> list[TableChange]:
    """Create every rselection table and the schema-version table, or upgrade old ones.

    Creates the lease table (:class:`~rselection.PostgresLeader`), the claims table
    (:class:`~rselection.postgres.PostgresClaimer`), the elections table
    (:class:`~rselection.postgres.PostgresElector`) and the nodes table (heartbeats of
    every leader's nodes); pass ``None`` for one to skip it. A lease table of an older
    schema version is upgraded in place (rows kept); the upgrade waits at most
    :data:`UPGRADE_LOCK_TIMEOUT` for its table lock and otherwise fails, changing nothing.
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

    Returns:
        One :class:`TableChange` per table (created, upgraded or already present).

    Raises:
        ConfigError: a table name is not safe, or the database holds a newer schema
            version than this release understands.
        BackendUnavailable: the database refused (missing schema, no privilege, broken
            connection); the message says which.
    """
    return create_tables(
        conn,
        leases=table,
        claims=claims_table,
        elections=elections_table,
        nodes=nodes_table,
    )
