"""Tables of the Postgres backend: names, validation and :func:`migrate`.

Every table name a user gives is validated here (:func:`validate_table_name`) and
always reaches SQL as :class:`psycopg.sql.Identifier`, never by string formatting. Each
kind of table (:data:`KINDS`) has numbered steps; :func:`migrate` applies those a table
lacks, under one advisory lock, with every wait bounded by its ``timeout``.

See ``docs/explanation/how-it-works.md``, "Tables and their schema versions", for the
columns of every table and how a migration works.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..errors import BackendUnavailable, ConfigError
from ..validation import check_seconds
from .connections import Connections

__all__ = [
    "BROADCAST",
    "BROADCAST_TABLE",
    "CHECKPOINTS",
    "CHECKPOINT_PREFIX",
    "CLAIMS",
    "CLAIMS_TABLE",
    "DEFAULT_TABLE",
    "DRAINS",
    "DRAINS_TABLE",
    "ELECTIONS",
    "ELECTIONS_TABLE",
    "KINDS",
    "LEASES",
    "LEASES_VERSION",
    "MIGRATION_LOCK_KEY",
    "MIGRATION_TIMEOUT",
    "NODES",
    "NODES_TABLE",
    "NODES_RUN_COLUMNS",
    "NODES_VERSION_COLUMNS",
    "UPGRADE_LOCK_TIMEOUT",
    "VERSION_TABLE",
    "CheckpointTables",
    "Step",
    "TableChange",
    "TableKind",
    "create_tables",
    "drains_table_name",
    "has_columns",
    "history_table_name",
    "migrate",
    "task_table_names",
    "run_migrations",
    "suffixed_name",
    "table_exists",
    "table_identifier",
    "validate_table_name",
    "version_table_identifier",
    "version_table_name",
]

logger = logging.getLogger(__name__)

DEFAULT_TABLE = "rselection_leases"
"""The lease table used when none is given."""

VERSION_TABLE = "rselection_schema_version"
"""The table that records the schema version of every kind of table (one row each)."""

CLAIMS_TABLE = "rselection_claims"
"""The claims table of :class:`~rselection.postgres.PostgresClaimer` by default."""

ELECTIONS_TABLE = "rselection_elections"
"""The elections table of :class:`~rselection.postgres.PostgresElector` by default."""

NODES_TABLE = "rselection_nodes"
"""The table of node heartbeats (membership) by default."""

DRAINS_TABLE = "rselection_nodes_drains"
"""The table of drained nodes beside the default nodes table (see
:func:`drains_table_name`)."""

BROADCAST_TABLE = "rselection_broadcast"
"""The outbox table of :class:`~rselection.postgres.PostgresBroadcaster` by default."""

CHECKPOINT_PREFIX = "rselection_"
"""The table prefix of :class:`~rselection.postgres.PostgresCheckpointStore` by default."""

LEASE_HANDOVER_COLUMNS = ("resign_term", "resign_from", "resign_to", "resign_until")
"""Columns of the lease table that handover requests need (schema version 2)."""

LEASE_SERVER_COLUMNS = ("holder_server",)
"""Columns of the lease table that record the server of the holder's session (version 3)."""

LEASE_RETIRED_COLUMNS = ("retired_term",)
"""Columns of the lease table that mark a lease retired by ``rselection forget`` (version 4)."""

LEASE_PROTOCOL_COLUMNS = ("protocol",)
"""Columns of the lease table that record the lease protocol of the holder (version 5)."""

NODES_VERSION_COLUMNS = ("version", "eligible")
"""Columns of the nodes table that record a node's version and eligibility (version 2)."""

NODES_RUN_COLUMNS = ("incarnation",)
"""Columns of the nodes table that record which run of a node heartbeats (version 3)."""

UPGRADE_LOCK_TIMEOUT = 1.0
"""Longest an upgrade waits at a time for its exclusive lock on a live table, seconds.

While an ``ALTER TABLE`` waits, every later statement on the table (a leader's renewal)
queues behind it; giving up after this long and trying again (until the migration's
``timeout``) keeps a busy fleet's renewals from stalling."""

MIGRATION_TIMEOUT = 30.0
"""Default bound of a migration's waits (the migration lock, table locks), seconds."""

MIGRATION_IDLE_TIMEOUT = "5s"
"""How long a migration transaction may sit idle before the server ends it: a client cut
off in the middle of one must not keep every other node from creating its tables."""

#: ``pg_advisory_xact_lock(bigint)`` key serialising DDL of every rselection process.
#: The one-argument form lives in a different lock space than the two-int session locks
#: of the leases, so the two never collide.
MIGRATION_LOCK_KEY = int.from_bytes(
    hashlib.blake2b(b"rselection:migrate", digest_size=8).digest(), "big", signed=True
)

_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_PART = 63  # NAMEDATALEN - 1


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


def version_table_name(table: str) -> str:
    """The name of the schema-version table that sits next to ``table`` (same schema).

    Args:
        table: a table name as the user wrote it.
    """
    parts = validate_table_name(table)
    return ".".join((*parts[:-1], VERSION_TABLE))


def version_table_identifier(table: str) -> sql.Identifier:
    """The schema-version table that sits next to ``table`` (same schema), quoted.

    Args:
        table: a table name as the user wrote it.
    """
    return table_identifier(version_table_name(table))


def suffixed_name(table: str, suffix: str) -> str:
    """``<table>_<suffix>`` in ``table``'s schema, for a companion table or an index.

    Shortened with a hash when the last part would exceed 63 characters, so any valid
    table name has valid companions.

    Args:
        table: a table name as the user wrote it.
        suffix: what to append (``"state"``, ``"created_at_idx"``).
    """
    parts = validate_table_name(table)
    name = f"{parts[-1]}_{suffix}"
    if len(name) > _MAX_PART:
        digest = hashlib.blake2b(name.encode(), digest_size=6).hexdigest()
        name = f"{name[: _MAX_PART - len(digest) - 1]}_{digest}"
    return ".".join((*parts[:-1], name))


def _index(table: str, suffix: str) -> sql.Identifier:
    """An index name for ``table`` (an index lives in its table's schema: unqualified)."""
    return sql.Identifier(validate_table_name(suffixed_name(table, suffix))[-1])


@dataclass(frozen=True)
class CheckpointTables:
    """The tables of a :class:`~rselection.postgres.PostgresCheckpointStore` for one prefix.

    Args:
        prefix: the table prefix, optionally schema-qualified (``"ops.rselection_"``).

    Raises:
        ConfigError: a table name the prefix makes is not valid.
    """

    prefix: str

    def __post_init__(self) -> None:
        """Validate every table name this prefix makes (raises ConfigError)."""
        if not isinstance(self.prefix, str):
            raise ConfigError(f"table_prefix must be a str, got {type(self.prefix).__name__}")
        for name in self.names:
            validate_table_name(name)

    @property
    def names(self) -> tuple[str, str]:
        """The snapshot table's and the per-key lease table's names."""
        return (f"{self.prefix}checkpoints", f"{self.prefix}checkpoint_leases")

    @property
    def checkpoints(self) -> sql.Identifier:
        """The snapshot table."""
        return table_identifier(self.names[0])

    @property
    def leases(self) -> sql.Identifier:
        """The per-key lease table."""
        return table_identifier(self.names[1])


@dataclass(frozen=True)
class Step:
    """One numbered step of a kind of table's schema.

    Args:
        version: its number (1 creates the tables, later ones upgrade them).
        description: what it does, for logs.
        statements: builds the SQL statements for a table name (or prefix).
        columns: columns the step adds; on a table that has them all already (upgraded
            before its version was recorded) the step is skipped, so no exclusive lock
            is taken for nothing.
    """

    version: int
    description: str
    statements: Callable[[str], Sequence[sql.Composed]]
    columns: tuple[str, ...] = ()


def _one_table(table: str) -> tuple[str, ...]:
    return (table,)


def _no_indexes(table: str) -> tuple[tuple[str, sql.Composed], ...]:
    return ()


@dataclass(frozen=True)
class TableKind:
    """A kind of rselection table: its default name, its tables and its numbered steps.

    Args:
        kind: the kind, as recorded in the version table (``"leases"``).
        label: what its tables are, for messages (``"lease table"``).
        default: the default table name (for checkpoints, the default prefix).
        steps: the steps, numbered 1..n in order.
        tables: the table names one name (or prefix) makes, the first one the main
            table; every one must exist for the kind to be present.
        indexes: indexes every table of the kind has whatever its version, as (name,
            ``CREATE INDEX IF NOT EXISTS`` statement) for a table name: created with the
            table, and added to an existing one by an explicit migration; no version
            number records it (an index
            changes no row and no column; every release works with or without it, so
            adding one never makes a table too new for an older release).
        companions: tables beside the kind's that its releases from some point on use and
            older ones ignore, as (name, ``CREATE TABLE IF NOT EXISTS`` statement) for a
            table name: created whenever missing (creating a table locks no other), and
            recorded by no version number, so an older release keeps using the kind's
            tables (the lease table's leadership history).

    Raises:
        ConfigError: the steps are not numbered 1..n in order.
    """

    kind: str
    label: str
    default: str
    steps: tuple[Step, ...]
    tables: Callable[[str], tuple[str, ...]] = _one_table
    indexes: Callable[[str], Sequence[tuple[str, sql.Composed]]] = _no_indexes
    companions: Callable[[str], Sequence[tuple[str, sql.Composed]]] = _no_indexes

    def __post_init__(self) -> None:
        """Check that the steps are numbered 1..n in order."""
        numbers = [step.version for step in self.steps]
        if numbers != list(range(1, len(numbers) + 1)):
            raise ConfigError(f"steps of {self.kind} must be numbered 1..n in order, got {numbers}")

    @property
    def version(self) -> int:
        """The schema version this release creates and understands."""
        return len(self.steps)

    def index_names(self, table: str) -> tuple[str, ...]:
        """The kind's indexes (see ``indexes``) as schema-qualified names, for lookups."""
        schema = validate_table_name(table)[:-1]
        return tuple(".".join((*schema, name)) for name, _ in self.indexes(table))

    def component(self, table: str) -> str:
        """The row recorded in the version table: the kind, plus the name if not default."""
        last = table.split(".")[-1]
        return self.kind if last == self.default else f"{self.kind}:{last}"

    def describe(self, table: str) -> str:
        """``lease table 'x'`` or ``broadcast tables 'x', 'x_state'``, for messages."""
        names = self.tables(table)
        if len(names) == 1:
            return f"{self.label} {names[0]!r}"
        return f"{self.label}s " + ", ".join(repr(n) for n in names)


def _create(ident: sql.Identifier, *columns: str) -> sql.Composed:
    """``CREATE TABLE IF NOT EXISTS`` with ``columns`` (each one's SQL definition)."""
    return sql.SQL("CREATE TABLE IF NOT EXISTS {} (" + ", ".join(columns) + ")").format(ident)


def _adding(*columns: str) -> Callable[[str], list[sql.Composed]]:
    """The statements of a step that adds ``columns`` (name and type each) to a table.

    Each is nullable, without a default: Postgres adds such a column without rewriting
    the table, so the step's exclusive lock is held for an instant.
    """

    def statements(table: str) -> list[sql.Composed]:
        adds = ", ".join(f"ADD COLUMN IF NOT EXISTS {column} NULL" for column in columns)
        return [sql.SQL("ALTER TABLE {} " + adds).format(table_identifier(table))]

    return statements


def _creating(*columns: str) -> Callable[[str], list[sql.Composed]]:
    """The statements of a step that creates a table of ``columns`` (each one's SQL
    definition)."""

    def statements(table: str) -> list[sql.Composed]:
        return [_create(table_identifier(table), *columns)]

    return statements


_lease_v1 = _creating(
    "name text PRIMARY KEY",
    "holder text NULL",  # the holder's node_id (the column keeps its first name)
    "term bigint NOT NULL DEFAULT 0 CHECK (term >= 0)",
    "holder_pid integer NULL",
    "lock_key integer NOT NULL",
    "acquired_at timestamptz NULL",
    "renewed_at timestamptz NULL",
    "expires_at timestamptz NULL",
)


def _claims_v1(table: str) -> list[sql.Composed]:
    ident = table_identifier(table)
    return [
        _create(
            ident,
            "fire_key text PRIMARY KEY",
            "format_version integer NOT NULL CHECK (format_version >= 1)",
            "holder text NOT NULL",  # the claimer's node_id
            "term bigint NULL CHECK (term >= 0)",
            "claimed_at timestamptz NOT NULL",
            "expires_at timestamptz NOT NULL",
        ),
        # Lets a claim find claims written in another fire-key format at once.
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (format_version)").format(
            _index(table, "format_version_idx"), ident
        ),
    ]


_elections_v1 = _creating(
    "name text PRIMARY KEY",
    "holder text NULL",  # the leader's node_id; NULL after a resign
    "term bigint NOT NULL CHECK (term >= 1)",
    "acquired_at timestamptz NOT NULL",
    "renewed_at timestamptz NOT NULL",
    "expires_at timestamptz NOT NULL",
)


def history_table_name(table: str) -> str:
    """The leadership history table of lease table ``table`` (``<table>_history``)."""
    return suffixed_name(table, "history")


def _lease_history(table: str) -> tuple[tuple[str, sql.Composed], ...]:
    # One row per term (rselection.history); the primary key orders a lease's terms,
    # which is what the history is read and trimmed by.
    return (
        (
            history_table_name(table),
            _create(
                table_identifier(history_table_name(table)),
                "name text NOT NULL",
                "term bigint NOT NULL",
                "node_id text NOT NULL",
                "version text NULL",
                "hostname text NULL",
                "pid integer NULL",
                "began_at timestamptz NOT NULL",
                "ended_at timestamptz NULL",
                "end_reason text NULL",
                "handed_to text NULL",
                "ended_by text NULL",
                "PRIMARY KEY (name, term)",
            ),
        ),
    )


def task_table_names(table: str) -> tuple[str, str, str]:
    """The task tables beside lease table ``table``: its leases' tasks and controls
    (``<table>_tasks``), their runs (``<table>_task_runs``) and the fires operators
    asked for (``<table>_task_triggers``); see :mod:`rselection.postgres.task_runs`.

    Args:
        table: the lease table, optionally schema-qualified.
    """
    return (
        suffixed_name(table, "tasks"),
        suffixed_name(table, "task_runs"),
        suffixed_name(table, "task_triggers"),
    )


def _lease_companions(table: str) -> tuple[tuple[str, sql.Composed], ...]:
    tasks, runs, triggers = task_table_names(table)
    return (
        *_lease_history(table),
        (
            tasks,
            # A row per task a leader published, or an operator paused: run_seq numbers
            # the task's runs (their table keeps the newest by it), fire_term is the
            # term that last wrote next_fire (an older leader's late batch writes none).
            _create(
                table_identifier(tasks),
                "name text NOT NULL",
                "task text NOT NULL",
                "kind text NULL",
                "schedule text NULL",
                "next_fire timestamptz NULL",
                "fire_term bigint NULL",
                "node_id text NULL",
                "term bigint NULL",
                "published_at timestamptz NULL",
                "paused_at timestamptz NULL",
                "run_seq bigint NOT NULL DEFAULT 0",
                "PRIMARY KEY (name, task)",
            ),
        ),
        (
            runs,
            _create(
                table_identifier(runs),
                "name text NOT NULL",
                "task text NOT NULL",
                "seq bigint NOT NULL",
                "scheduled_at timestamptz NULL",
                "started_at timestamptz NULL",
                "ended_at timestamptz NULL",
                "outcome text NOT NULL",
                "reason text NULL",
                "node_id text NOT NULL",
                "term bigint NOT NULL",
                "error text NULL",
                "acted_by text NULL",
                "PRIMARY KEY (name, task, seq)",
            ),
        ),
        (
            triggers,
            _create(
                table_identifier(triggers),
                "name text NOT NULL",
                "fire_key text NOT NULL",
                "task text NOT NULL",
                "requested_at timestamptz NOT NULL DEFAULT clock_timestamp()",
                "PRIMARY KEY (name, fire_key)",
            ),
        ),
    )


_nodes_v1 = _creating(
    "name text NOT NULL",
    "node_id text NOT NULL",
    "hostname text NOT NULL",
    "pid integer NOT NULL",
    "client_addr inet NULL",
    "started_at timestamptz NOT NULL",
    "last_seen timestamptz NOT NULL",
    "PRIMARY KEY (name, node_id)",
)


def drains_table_name(nodes_table: str) -> str:
    """The table of the nodes drained by an operator (``rselection drain``) beside
    ``nodes_table``: ``<nodes table>_drains`` in its schema.

    Args:
        nodes_table: the nodes table, optionally schema-qualified.
    """
    return suffixed_name(nodes_table, "drains")


_drains_v1 = _creating(
    "name text NOT NULL",
    "node_id text NOT NULL",
    "drained_at timestamptz NOT NULL DEFAULT clock_timestamp()",
    "PRIMARY KEY (name, node_id)",
)


def _broadcast_tables(table: str) -> tuple[str, str]:
    return (table, suffixed_name(table, "state"))


def _broadcast_v1(table: str) -> list[sql.Composed]:
    ident = table_identifier(table)
    state = table_identifier(suffixed_name(table, "state"))
    return [
        _create(
            ident,
            "id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
            "channel text NOT NULL",
            "payload text NOT NULL",
            "origin bigint NOT NULL",
            "origin_seq bigint NOT NULL",
            "created_at timestamptz NOT NULL DEFAULT clock_timestamp()",
        ),
        # Retention deletes by age; rows are appended in time order, so the index stays
        # small at its left end and the purge never scans the table.
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (created_at)").format(
            _index(table, "created_at_idx"), ident
        ),
        _create(
            state,
            "singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton)",
            "purged_through bigint NOT NULL DEFAULT 0",
            "purged_at timestamptz NULL",
        ),
        sql.SQL("INSERT INTO {} DEFAULT VALUES ON CONFLICT DO NOTHING").format(state),
    ]


def _checkpoint_tables(prefix: str) -> tuple[str, ...]:
    return CheckpointTables(prefix).names


def _checkpoints_v1(prefix: str) -> list[sql.Composed]:
    tables = CheckpointTables(prefix)
    return [
        _create(
            tables.checkpoints,
            "key text[] PRIMARY KEY CHECK (cardinality(key) >= 1)",
            "state jsonb NULL",
            "format_version integer NOT NULL",
            "version bigint NOT NULL CHECK (version >= 1)",
            "term bigint NULL",
            "updated_at timestamptz NOT NULL DEFAULT clock_timestamp()",
        ),
        _create(
            tables.leases,
            "key text[] PRIMARY KEY CHECK (cardinality(key) >= 1)",
            "holder text NOT NULL",  # the node_id holding the key's lease
            "term bigint NOT NULL CHECK (term >= 1)",
            "acquired_at timestamptz NOT NULL",
            "renewed_at timestamptz NOT NULL",
            "expires_at timestamptz NOT NULL",
        ),
    ]


LEASES = TableKind(
    "leases",
    "lease table",
    DEFAULT_TABLE,
    (
        Step(1, "create the lease table", _lease_v1),
        Step(
            2,
            "add the handover request columns",
            _adding(
                "resign_term bigint",
                "resign_from text",
                "resign_to text",
                "resign_until timestamptz",
            ),
            LEASE_HANDOVER_COLUMNS,
        ),
        Step(
            3,
            "add the holder's server identity",
            _adding("holder_server text"),
            LEASE_SERVER_COLUMNS,
        ),
        Step(
            4,
            "add the retired mark (rselection forget)",
            _adding("retired_term bigint"),
            LEASE_RETIRED_COLUMNS,
        ),
        # A row without a protocol was written by protocol 1, one keeper session a lease.
        Step(
            5,
            "add the lease protocol (shared keeper sessions)",
            _adding("protocol smallint"),
            LEASE_PROTOCOL_COLUMNS,
        ),
    ),
    companions=_lease_companions,
)
"""The lease table of :class:`~rselection.PostgresLeader` (and its leadership history
and task tables)."""


def _claims_indexes(table: str) -> tuple[tuple[str, sql.Composed], ...]:
    ident = table_identifier(table)
    key_name = validate_table_name(suffixed_name(table, "fire_key_c_idx"))[-1]
    expiry_name = validate_table_name(suffixed_name(table, "expires_at_idx"))[-1]
    by_key, by_expiry = sql.Identifier(key_name), sql.Identifier(expiry_name)
    return (
        # Byte order of the keys whatever the database's collation, so a range of keys
        # (one lease's, one task's) is one index range: `rselection status` reads the
        # newest fire of each task, and a starting leader asks whether a task ever ran.
        (
            key_name,
            sql.SQL('CREATE INDEX IF NOT EXISTS {} ON {} ((fire_key COLLATE "C"))').format(
                by_key, ident
            ),
        ),
        # The leader's clean-up deletes expired claims oldest first, in batches.
        (
            expiry_name,
            sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (expires_at)").format(by_expiry, ident),
        ),
    )


CLAIMS = TableKind(
    "claims",
    "claims table",
    CLAIMS_TABLE,
    (Step(1, "create", _claims_v1),),
    indexes=_claims_indexes,
)
"""The claims table of :class:`~rselection.postgres.PostgresClaimer` (and its indexes)."""

ELECTIONS = TableKind(
    "elections", "elections table", ELECTIONS_TABLE, (Step(1, "create", _elections_v1),)
)
"""The elections table of :class:`~rselection.postgres.PostgresElector`."""

NODES = TableKind(
    "nodes",
    "nodes table",
    NODES_TABLE,
    (
        Step(1, "create", _nodes_v1),
        # NULLs are rows of nodes that gave neither: of no version, and eligible.
        Step(
            2,
            "add the node's version and eligibility",
            _adding("version text", "eligible boolean"),
            NODES_VERSION_COLUMNS,
        ),
        Step(3, "add the node's run", _adding("incarnation text"), NODES_RUN_COLUMNS),
    ),
)
"""The nodes table (heartbeats of every leader's nodes)."""

DRAINS = TableKind("drains", "drains table", DRAINS_TABLE, (Step(1, "create", _drains_v1),))
"""The drained nodes (``rselection drain``), a table beside the nodes table."""

BROADCAST = TableKind(
    "broadcast",
    "broadcast table",
    BROADCAST_TABLE,
    (Step(1, "create the outbox and its state", _broadcast_v1),),
    _broadcast_tables,
)
"""The outbox tables of :class:`~rselection.postgres.PostgresBroadcaster`."""

CHECKPOINTS = TableKind(
    "checkpoints",
    "checkpoint table",
    CHECKPOINT_PREFIX,
    (Step(1, "create checkpoints and checkpoint_leases", _checkpoints_v1),),
    _checkpoint_tables,
)
"""The tables of :class:`~rselection.postgres.PostgresCheckpointStore` (name: a prefix)."""

KINDS: dict[str, TableKind] = {
    k.kind: k for k in (LEASES, CLAIMS, ELECTIONS, NODES, BROADCAST, CHECKPOINTS, DRAINS)
}
"""Every kind of table, by the keyword :func:`create_tables` takes."""

LEASES_VERSION = LEASES.version
"""Schema version of the lease table that this release creates and understands (5)."""


@dataclass(frozen=True)
class TableChange:
    """What a migration did to one kind of table.

    Attributes:
        kind: ``"leases"``, ``"claims"``, ``"elections"``, ``"nodes"``, ``"broadcast"`` or
            ``"checkpoints"``.
        table: the table name as given (for checkpoints, the table prefix).
        action: ``"created"``, ``"upgraded"`` or ``"present"`` (already current).
        version: the schema version now.
        previous: the version recorded before (``None`` when none was recorded).
        what: the tables, for people (``"lease table 'rselection_leases'"``).
        added: the companion tables it created (see :class:`TableKind`), which no
            version number records.
    """

    kind: str
    table: str
    action: str
    version: int
    previous: int | None
    what: str
    added: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for people: ``lease table 'x': upgraded (schema version 2 -> 3)``."""
        if self.action == "created":
            done = f"created (schema version {self.version})"
        elif self.action == "upgraded":
            before = "unrecorded" if self.previous is None else str(self.previous)
            done = f"upgraded (schema version {before} -> {self.version})"
        else:
            done = f"already present (schema version {self.version})"
        if self.added and self.action != "created":
            done += "; created " + ", ".join(repr(name) for name in self.added)
        return f"{self.what}: {done}"


class _Waited(Exception):
    """A lock wait of a migration ran past its timeout (``what`` says which)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _exists(conn: psycopg.Connection[Any], names: Sequence[str]) -> bool:
    row = conn.execute(
        "SELECT bool_and(to_regclass(t) IS NOT NULL) FROM unnest(%s::text[]) AS t",
        ([table_identifier(n).as_string(conn) for n in names],),
    ).fetchone()
    return bool(row and row[0])


def _recorded(conn: psycopg.Connection[Any], kind: TableKind, table: str) -> int | None:
    """The version recorded for ``table`` (None if none); refuses a newer one."""
    name = version_table_name(kind.tables(table)[0])
    if not _exists(conn, [name]):
        return None
    ident = table_identifier(name)
    row = conn.execute(
        sql.SQL("SELECT version FROM {} WHERE component = %s").format(ident),
        (kind.component(table),),
    ).fetchone()
    recorded = None if row is None else int(row[0])
    if recorded is not None and recorded > kind.version:
        raise ConfigError(
            f"{kind.describe(table)} has schema version {recorded}, newer than the "
            f"{kind.version} this release of rselection understands: upgrade rselection "
            "on this node"
        )
    return recorded


def table_exists(conn: psycopg.Connection[Any], table: str) -> bool:
    """Whether ``table`` (optionally schema-qualified) exists as the server resolves it.

    Args:
        conn: an open connection (its ``search_path`` resolves an unqualified name).
        table: the table name as the user wrote it.
    """
    return _exists(conn, [table])


def has_columns(conn: psycopg.Connection[Any], table: str, columns: tuple[str, ...]) -> bool:
    """Whether the existing ``table`` has every one of ``columns`` (a schema version check,
    such as :data:`LEASE_RETIRED_COLUMNS`).

    Args:
        conn: an open connection.
        table: the table, optionally schema-qualified.
        columns: column names.
    """
    row = conn.execute(
        "SELECT count(*) FROM pg_catalog.pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attname = ANY(%s) AND NOT attisdropped",
        (table_identifier(table).as_string(conn), list(columns)),
    ).fetchone()
    return row is not None and row[0] == len(columns)


def _set_local(conn: psycopg.Connection[Any], name: str, seconds: float) -> None:
    conn.execute("SELECT set_config(%s, %s, true)", (name, f"{max(1, round(seconds * 1000))}ms"))


def _run_step(
    conn: psycopg.Connection[Any],
    statements: Sequence[sql.Composed],
    deadline: float,
    what: str,
) -> None:
    """Run one step on an existing table: its locks are waited for at most
    :data:`UPGRADE_LOCK_TIMEOUT` at a time, and again until ``deadline``."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Waited(f"a lock on the {what} (long transactions on it?)")
        try:
            with conn.transaction():  # a savepoint: a timed-out attempt changes nothing
                _set_local(conn, "lock_timeout", min(UPGRADE_LOCK_TIMEOUT, remaining))
                for statement in statements:
                    conn.execute(statement)
                _set_local(conn, "lock_timeout", max(0.001, deadline - time.monotonic()))
            return
        except psycopg.errors.LockNotAvailable:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _migrate_one(
    conn: psycopg.Connection[Any],
    kind: TableKind,
    table: str,
    deadline: float,
    add_indexes: bool,
) -> TableChange:
    names = kind.tables(table)
    version_ident = version_table_identifier(names[0])
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            " component text PRIMARY KEY,"
            " version integer NOT NULL,"
            " migrated_at timestamptz NOT NULL DEFAULT now())"
        ).format(version_ident)
    )
    recorded = _recorded(conn, kind, table)
    existed = _exists(conn, names)
    # Tables without a record (made before versions were recorded) take every step
    # again: each is idempotent, and a step whose columns are there is skipped. A record
    # without its tables (dropped behind our back) starts over at step 1.
    done = recorded if existed and recorded is not None else 0
    upgraded = False
    for step in kind.steps:
        if step.version <= done:
            continue
        if existed and step.columns and has_columns(conn, names[0], step.columns):
            continue
        statements = step.statements(table)
        if existed:
            _run_step(conn, statements, deadline, kind.describe(table))
            upgraded = upgraded or step.version > 1
        else:
            for statement in statements:
                conn.execute(statement)
    added = []
    for name, statement in kind.companions(table):
        if not _exists(conn, [name]):
            conn.execute(statement)
            added.append(name)
    for name, statement in kind.indexes(table):
        qualified = ".".join((*validate_table_name(names[0])[:-1], name))
        if _exists(conn, [qualified]):
            continue
        if not existed:
            conn.execute(statement)
        elif add_indexes:
            _run_step(conn, [statement], deadline, kind.describe(table))
            logger.info("%s: added the index %s", kind.describe(table), name)
        else:
            _warn_missing_index(kind, table, name)
    if recorded != kind.version:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} AS v (component, version) VALUES (%s, %s)"
                " ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,"
                " migrated_at = now()"
            ).format(version_ident),
            (kind.component(table), kind.version),
        )
    action = "upgraded" if upgraded else ("present" if existed else "created")
    return TableChange(
        kind.kind, table, action, kind.version, recorded, kind.describe(table), tuple(added)
    )


def _lock_holder(conn: psycopg.Connection[Any]) -> str:
    """Who holds the migration lock, for the error message (best effort)."""
    with contextlib.suppress(psycopg.Error), conn.transaction():
        row = conn.execute(
            "SELECT a.pid, a.application_name,"
            " extract(epoch FROM clock_timestamp() - a.xact_start)::float8"
            " FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            " AND l.database = (SELECT oid FROM pg_catalog.pg_database"
            "  WHERE datname = current_database())"
            " AND ((l.classid::bigint << 32) | l.objid::bigint) = %s",
            (MIGRATION_LOCK_KEY,),
        ).fetchone()
        if row is not None:
            app = f" {row[1]!r}" if row[1] else ""
            age = f", in its transaction for {row[2]:.1f} s" if row[2] is not None else ""
            return f" (held by pid {row[0]}{app}{age})"
    return " (held by another process migrating)"


def lock_migrations(conn: psycopg.Connection[Any]) -> None:
    """Take the migration lock in the caller's transaction (:data:`MIGRATION_LOCK_KEY`).

    If the client then vanishes mid-migration, the server ends the transaction after
    :data:`MIGRATION_IDLE_TIMEOUT`, freeing the lock. The wait is bounded by the
    transaction's ``lock_timeout``.
    """
    conn.execute(
        "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
        (MIGRATION_IDLE_TIMEOUT,),
    )
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))


@contextlib.contextmanager
def _bounded(conn: psycopg.Connection[Any], timeout: float) -> Iterator[None]:
    """A transaction (a savepoint inside an open one) whose lock and statement waits
    are bounded by ``timeout``; the caller's settings are back once it ends."""
    with conn.transaction():
        previous = conn.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'),"
            " current_setting('idle_in_transaction_session_timeout')"
        ).fetchone()
        assert previous is not None
        _set_local(conn, "lock_timeout", timeout)
        _set_local(conn, "statement_timeout", timeout)
        yield
        # A savepoint released keeps its SET LOCALs for the rest of the caller's
        # transaction: put the caller's back (a rolled back one drops them itself).
        conn.execute(
            "SELECT set_config('lock_timeout', %s, true),"
            " set_config('statement_timeout', %s, true),"
            " set_config('idle_in_transaction_session_timeout', %s, true)",
            previous,
        )


def _current(conn: psycopg.Connection[Any], kind: TableKind, table: str, add_indexes: bool) -> bool:
    """Whether ``table`` is at its kind's version with every table in place, and its
    indexes too (``add_indexes``; else a missing one is only warned about)."""
    if _recorded(conn, kind, table) != kind.version or not _exists(conn, kind.tables(table)):
        return False
    if not all(_exists(conn, [name]) for name, _ in kind.companions(table)):
        return False
    missing = [
        (qualified, name)
        for qualified, (name, _) in zip(kind.index_names(table), kind.indexes(table), strict=True)
        if not _exists(conn, [qualified])
    ]
    if add_indexes:
        return not missing
    for _, name in missing:
        _warn_missing_index(kind, table, name)
    return True


_warned: set[tuple[str, str]] = set()


def _warn_missing_index(kind: TableKind, table: str, name: str) -> None:
    """Once per process and index: an existing table lacks an index, which only an
    explicit migration adds (building it blocks the table's writes meanwhile)."""
    if (table, name) in _warned:
        return
    _warned.add((table, name))
    logger.warning(
        "%s has no index %s: run `rselection migrate` (or rselection.postgres.migrate()) "
        "once to add it; until then some reads of it scan the whole table",
        kind.describe(table),
        name,
    )


def run_migrations(
    conn: psycopg.Connection[Any],
    wanted: Sequence[tuple[TableKind, str]],
    *,
    timeout: float = MIGRATION_TIMEOUT,
    join: bool = True,
) -> list[TableChange]:
    """Bring each ``(kind, table)`` to its kind's version; one :class:`TableChange` each.

    The building block of :func:`create_tables` and :func:`migrate`. When every table
    exists at its version already, this is a few catalog reads and takes no lock. Else
    it runs the missing steps in one transaction under the migration lock: a savepoint
    inside the caller's open transaction with ``join=True`` (an explicit migration);
    with ``join=False`` (an object's ``create_tables=True``) an open transaction is
    refused instead, so that the lock is never held until a caller's transaction ends,
    and an index missing on an existing table is only warned about: building it would
    block the table's writes, so only an explicit migration adds it.

    Args:
        conn: an open psycopg connection (autocommit or not).
        wanted: the kinds of table and their names (for checkpoints, the prefix).
        timeout: bound of every wait, seconds (see the module docstring).
        join: an explicit migration: it may run inside the caller's open transaction and
            adds the indexes an existing table lacks.

    Raises:
        ConfigError: an unsafe table name, a schema version newer than this release, or
            (``join=False``) tables to create or upgrade inside an open transaction.
        BackendUnavailable: a wait ran past ``timeout``, or the database refused
            (missing schema, no privilege); the message says which.
        psycopg.Error: another driver error; the caller wraps it.
    """
    timeout = check_seconds(timeout, "timeout")
    for kind, table in wanted:
        for name in kind.tables(table):
            validate_table_name(name)
    if not wanted:
        return []
    if len(wanted) == 1:
        what = f"the {wanted[0][0].describe(wanted[0][1])}"
    else:
        what = "the tables (" + ", ".join(kind.kind for kind, _ in wanted) + ")"
    deadline = time.monotonic() + timeout
    waiting = "the catalog"
    try:
        with _bounded(conn, timeout):
            # Every (re)connect of every node gets here: when all is current, no lock
            # and no DDL (even CREATE INDEX IF NOT EXISTS locks a table against writes).
            current = [_current(conn, kind, table, join) for kind, table in wanted]
        if all(current):
            return [
                TableChange(
                    kind.kind, table, "present", kind.version, kind.version, kind.describe(table)
                )
                for kind, table in wanted
            ]
        if not join and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            raise ConfigError(
                f"cannot create or upgrade {what} inside the caller's open transaction: "
                "the migration lock would be held until that transaction ends, and every "
                "other rselection process would wait for it. Run "
                "rselection.postgres.migrate(conninfo) (or `rselection migrate`) once, "
                "make the first call outside a transaction, or pass create_tables=False"
            )
        waiting = "the migration lock"
        with _bounded(conn, timeout):
            lock_migrations(conn)
            waiting = "a statement to finish"
            changes = [_migrate_one(conn, kind, table, deadline, join) for kind, table in wanted]
    except _Waited as exc:
        raise BackendUnavailable(
            f"cannot migrate {what}: waited {timeout:g} s for {exc.what}; nothing was "
            "changed. Try again, or pass a longer timeout"
        ) from None
    except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
        holder = _lock_holder(conn) if waiting == "the migration lock" else ""
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            holder = ""  # the caller's transaction is aborted: no query can tell
        raise BackendUnavailable(
            f"cannot migrate {what}: waited {timeout:g} s for {waiting}{holder}; nothing "
            "was changed. Try again, or pass a longer timeout"
        ) from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        raise BackendUnavailable(
            f"cannot create {what}: {exc}; run `rselection migrate` with a role that may "
            "create tables, and pass create_tables=False"
        ) from exc
    except psycopg.errors.InvalidSchemaName as exc:
        raise BackendUnavailable(f"cannot create {what}: {exc}; create the schema first") from exc
    for change in changes:
        log = logger.debug if change.action == "present" else logger.info
        log("%s", change.describe())
    return changes


def create_tables(
    conn: psycopg.Connection[Any], *, timeout: float = MIGRATION_TIMEOUT, **tables: str | None
) -> list[TableChange]:
    """Create the named kinds of table (and the version table), or upgrade older ones.

    Returns one :class:`TableChange` per table, in the order given. What an object
    created with ``create_tables=True`` runs on first use, for its own tables only.
    Same guarantees as :func:`migrate`, but never inside the caller's open transaction:
    there, tables that are current are fine (catalog reads only), and tables to create
    or upgrade raise :class:`~rselection.errors.ConfigError`, as the migration lock
    would be held until that transaction ends and block every other process.

    Args:
        conn: an open psycopg connection (autocommit or not).
        timeout: bound of every wait, seconds.
        tables: ``leases=``, ``claims=``, ``elections=``, ``nodes=``, ``broadcast=`` and
            ``checkpoints=`` (a table prefix) names; ``None`` (or leaving one out) skips
            that kind.

    Raises:
        ConfigError: unknown keyword, unsafe table name, a schema version newer than
            this release understands, or tables to create inside an open transaction.
        BackendUnavailable: a wait ran past ``timeout``, or the database refused; the
            message says which.
        psycopg.Error: the connection failed.
    """
    return run_migrations(conn, _wanted(tables), timeout=timeout, join=False)


def _wanted(tables: dict[str, str | None]) -> list[tuple[TableKind, str]]:
    wanted: list[tuple[TableKind, str]] = []
    for name, table in tables.items():
        if name not in KINDS:
            raise ConfigError(f"unknown table kind {name!r}: use {', '.join(KINDS)}")
        if table is not None:
            wanted.append((KINDS[name], table))
    return wanted


def migrate(
    conninfo: Any,
    *,
    table: str | None = DEFAULT_TABLE,
    claims_table: str | None = CLAIMS_TABLE,
    elections_table: str | None = ELECTIONS_TABLE,
    nodes_table: str | None = NODES_TABLE,
    broadcast_table: str | None = BROADCAST_TABLE,
    checkpoint_prefix: str | None = CHECKPOINT_PREFIX,
    timeout: float = MIGRATION_TIMEOUT,
) -> list[TableChange]:
    """Create every rselection table and record its schema version, or upgrade old ones.

    Creates the lease table (:class:`~rselection.PostgresLeader`), the claims table
    (:class:`~rselection.postgres.PostgresClaimer`), the elections table
    (:class:`~rselection.postgres.PostgresElector`), the nodes table (heartbeats of
    every leader's nodes), the broadcast tables
    (:class:`~rselection.postgres.PostgresBroadcaster`), the checkpoint tables
    (:class:`~rselection.postgres.PostgresCheckpointStore`) and, beside the nodes table,
    the table of drained nodes (``rselection drain``, see :func:`drains_table_name`);
    pass ``None`` for one to skip it (no nodes table: no drains table either). A table
    of an older schema version is upgraded in place (rows kept). A second run changes
    nothing. Safe to run from many processes at once: the steps run
    in one transaction under a transaction-level advisory lock. Needs the privilege to
    create tables in the target schema; where the application role may not run DDL,
    run ``rselection migrate --dsn ...`` once with a privileged role and pass
    ``create_tables=False`` to every object.

    Args:
        conninfo: a connection string, a ``psycopg.Connection`` (autocommit or not; in
            an open transaction the migration runs in a savepoint of it) or a pool.
        table: lease table name, optionally schema-qualified (``"ops.leases"``).
        claims_table: claims table name, optionally schema-qualified.
        elections_table: elections table name, optionally schema-qualified.
        nodes_table: nodes table name, optionally schema-qualified.
        broadcast_table: broadcast outbox table name, optionally schema-qualified.
        checkpoint_prefix: table prefix of the checkpoint store, optionally
            schema-qualified (``"ops.rselection_"``).
        timeout: bound of every wait (connecting, the migration lock held by another
            process, table locks held by long transactions), seconds.

    Returns:
        One :class:`TableChange` per kind of table (created, upgraded or already
        present), in the order of the arguments, the drains table last.

    Raises:
        ConfigError: a bad ``conninfo``, a table name that is not safe, or a schema
            version newer than this release understands.
        BackendUnavailable: the database cannot be reached, refused (missing schema, no
            privilege), or a wait ran past ``timeout``; the message says which.
    """
    timeout = check_seconds(timeout, "timeout")
    conns = Connections(
        conninfo,
        owner="migrate()",
        application_name="rselection:migrate",
        connect_timeout=timeout,
        statement_timeout=timeout,
    )
    try:
        wanted = _wanted(
            {
                "leases": table,
                "claims": claims_table,
                "elections": elections_table,
                "nodes": nodes_table,
                "broadcast": broadcast_table,
                "checkpoints": checkpoint_prefix,
                "drains": None if nodes_table is None else drains_table_name(nodes_table),
            }
        )
        with conns.connection() as conn:
            # Asked for explicitly, a migration may join the caller's transaction (a
            # migration tool's, whose DDL commits or rolls back as one).
            return run_migrations(conn, wanted, timeout=timeout, join=True)
    except psycopg.Error as exc:
        raise conns.wrap("migrate the rselection tables", exc) from exc
    finally:
        conns.close()
