"""Numbered schema migrations of the checkpoint store.

Each :class:`Migration` has a number, a name and the statements that move the tables
from the previous number to its own. :func:`apply_migrations` runs, in one transaction
and under a transaction-level advisory lock, every migration whose number is not yet
recorded in the version table, in ascending order, recording each as it goes. So:

* it is idempotent: a second run finds every number recorded and does nothing;
* two processes running it at once are serialised by the lock: the second waits, then
  finds the work done;
* a failing migration rolls back the whole run, leaving the tables as they were;
* a database migrated by a newer release (a recorded number this code does not know)
  raises :class:`~rselection.errors.ConfigError` instead of running older code against
  newer tables.

Tables, for a ``table_prefix`` of ``rselection_`` (the default)::

    rselection_checkpoint_migrations   -- one row per applied migration
        version     integer primary key
        name        text not null
        applied_at  timestamptz not null default now()

    rselection_checkpoints             -- one row per key (kept after delete)
        key             text[] primary key   -- a str key is a one-element array
        state           jsonb null           -- NULL once deleted (version kept)
        format_version  integer not null     -- envelope format of ``state``
        version         bigint not null      -- 1, 2, 3, ... per key, never reused
        term            bigint null          -- fencing term of the save, if fenced
        updated_at      timestamptz not null -- server time of the save

    rselection_checkpoint_leases       -- per-key leases (acquire_lease)
        key          text[] primary key
        holder       text not null
        term         bigint not null         -- +1 on every new tenure of the lease
        acquired_at  timestamptz not null
        renewed_at   timestamptz not null
        expires_at   timestamptz not null    -- server time; released leases expire now
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..errors import ConfigError
from .schema import lock_migrations, validate_table_name

__all__ = ["MIGRATIONS", "CheckpointTables", "Migration", "apply_migrations"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointTables:
    """The validated, quoted names of the checkpoint store's tables for one prefix.

    Args:
        prefix: the table prefix, optionally schema-qualified (``"ops.rselection_"``).
    """

    prefix: str

    def _ident(self, suffix: str) -> sql.Identifier:
        # Validating the composed name checks the prefix and the 63-character limit.
        return sql.Identifier(*validate_table_name(self.prefix + suffix))

    def __post_init__(self) -> None:
        """Validate every table name this prefix produces (raises ConfigError)."""
        if not isinstance(self.prefix, str):
            raise ConfigError(f"table_prefix must be a str, got {type(self.prefix).__name__}")
        for suffix in ("checkpoints", "checkpoint_leases", "checkpoint_migrations"):
            self._ident(suffix)

    @property
    def checkpoints(self) -> sql.Identifier:
        """The snapshot table."""
        return self._ident("checkpoints")

    @property
    def leases(self) -> sql.Identifier:
        """The per-key lease table."""
        return self._ident("checkpoint_leases")

    @property
    def migrations(self) -> sql.Identifier:
        """The table recording applied migrations."""
        return self._ident("checkpoint_migrations")


@dataclass(frozen=True)
class Migration:
    """One numbered step of the checkpoint schema.

    Args:
        version: its number (1, 2, ...); migrations run in ascending order.
        name: a short description, recorded with the number.
        statements: builds the SQL statements for the given tables.
    """

    version: int
    name: str
    statements: Callable[[CheckpointTables], Sequence[sql.Composed]]


def _v1(t: CheckpointTables) -> list[sql.Composed]:
    return [
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            " key text[] PRIMARY KEY CHECK (cardinality(key) >= 1),"
            " state jsonb NULL,"
            " format_version integer NOT NULL,"
            " version bigint NOT NULL CHECK (version >= 1),"
            " term bigint NULL,"
            " updated_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ).format(t.checkpoints),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            " key text[] PRIMARY KEY CHECK (cardinality(key) >= 1),"
            " holder text NOT NULL,"
            " term bigint NOT NULL CHECK (term >= 1),"
            " acquired_at timestamptz NOT NULL,"
            " renewed_at timestamptz NOT NULL,"
            " expires_at timestamptz NOT NULL)"
        ).format(t.leases),
    ]


MIGRATIONS: tuple[Migration, ...] = (Migration(1, "create checkpoints and checkpoint_leases", _v1),)
"""Every migration this release knows, in order."""


def apply_migrations(
    conn: psycopg.Connection[Any],
    tables: CheckpointTables,
    migrations: Sequence[Migration] = MIGRATIONS,
) -> list[int]:
    """Apply the migrations not yet recorded, in order, in one transaction.

    Runs under ``pg_advisory_xact_lock`` (the same key as the lease table's
    :func:`~rselection.postgres.migrate`), so concurrent callers run one after another.

    Args:
        conn: an open connection (autocommit or not; a savepoint is used inside an
            open transaction).
        tables: the tables to create or upgrade.
        migrations: the steps, numbered 1..n without gaps (tests pass their own).

    Returns:
        The numbers applied by this call (empty when the schema was current).

    Raises:
        ConfigError: the database has a migration this release does not know.
        psycopg.Error: the database refused; the caller wraps it.
    """
    numbers = [m.version for m in migrations]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ConfigError(f"migrations must be numbered 1..n in order, got {numbers}")
    applied: list[int] = []
    with conn.transaction():
        lock_migrations(conn)
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} ("
                " version integer PRIMARY KEY,"
                " name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(tables.migrations)
        )
        rows = conn.execute(sql.SQL("SELECT version FROM {}").format(tables.migrations))
        done = {int(r[0]) for r in rows.fetchall()}
        unknown = sorted(done - set(numbers))
        if unknown:
            raise ConfigError(
                f"the checkpoint tables ({tables.prefix}*) have migration {unknown[-1]}, "
                f"newer than the {len(numbers)} this release of rselection knows: "
                "upgrade rselection on this node"
            )
        for migration in migrations:
            if migration.version in done:
                continue
            for statement in migration.statements(tables):
                conn.execute(statement)
            conn.execute(
                sql.SQL("INSERT INTO {} (version, name) VALUES (%s, %s)").format(tables.migrations),
                (migration.version, migration.name),
            )
            applied.append(migration.version)
            logger.info(
                "checkpoint tables %s*: applied migration %s (%s)",
                tables.prefix,
                migration.version,
                migration.name,
            )
    return applied
