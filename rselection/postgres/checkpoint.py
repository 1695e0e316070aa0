"""``PostgresCheckpointStore``: durable task state in Postgres, fenced by term.

A snapshot (a JSON document under a key) is saved only while term ``T`` still holds the
named lease (``term=``, checked by :func:`~rselection.postgres.fenced` in the same
transaction), or while ``node_id`` holds the key's own lease (``node_id=``, see
:meth:`PostgresCheckpointStore.acquire_lease`); else unfenced. Inside a task,
``ctx.checkpoint`` (:class:`~rselection.task_checkpoint.TaskCheckpoint`) does the first
kind. See ``docs/how-to/checkpoints.md``; keys and limits follow
:mod:`rselection.checkpoints`.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Callable
from datetime import UTC
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from .. import forks
from ..checkpoints import (
    DEFAULT_MAX_STATE_BYTES,
    FORMAT_VERSION,
    Key,
    Snapshot,
    check_key,
    decode_state,
    encode_state,
    key_of,
)
from ..closeable import Closeable
from ..errors import ConfigError, StaleLeaderError
from ..validation import check_name, check_node_id, check_seconds, check_term
from .claims import MIN_TTL
from .connections import Connections
from .fencing import fenced
from .schema import (
    CHECKPOINT_PREFIX,
    DEFAULT_TABLE,
    CheckpointTables,
    create_tables,
    table_identifier,
)

__all__ = [
    "FORMAT_VERSION",
    "Key",
    "PostgresCheckpointStore",
    "Snapshot",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Fence = Callable[[psycopg.Connection[Any]], int | None]
_RETRIES = 3  # attempts for serialization failures and deadlocks
# The lease of a key (its parts, a parameter) that a node (the next) holds, still live.
_HELD = "key = %s::text[] AND holder = %s AND expires_at > clock_timestamp()"


class PostgresCheckpointStore(Closeable):
    """Durable, versioned, fenced task state in Postgres.

    Thread-safe. Each call is one short transaction on a connection from ``conninfo``:
    with a connection string it borrows one of the process's pooled sessions for that
    string (at most two, shared with the claims and reads of every leader and store of
    the process, see :mod:`rselection.postgres.session_pool`); with a pool it borrows
    one per call; with a ``psycopg.Connection`` calls take turns on it (inside the
    caller's open transaction a save joins it, as a savepoint). Tables are created on
    first use unless ``create_tables=False`` (then run
    :func:`~rselection.postgres.migrate` once, with a role that may run DDL). The tables
    must live in the same database as the lease table for fenced saves.

    Args:
        conninfo: a libpq connection string or URI, a ``psycopg.Connection``, or a pool
            with a ``connection()`` context manager (``psycopg_pool.ConnectionPool``).
        table_prefix: prefix of the store's tables, optionally schema-qualified
            (``"ops.rselection_"``): ``<prefix>checkpoints`` and
            ``<prefix>checkpoint_leases``.
        lease_table: the leadership lease table that ``save(..., term=...)`` is fenced
            against (the leader's ``table``).
        create_tables: create the tables on first use.
        max_state_bytes: largest encoded state :meth:`save` accepts (UTF-8 bytes of the
            JSON text).
        connect_timeout: seconds to wait for a new connection (connection string only).
        statement_timeout: bound of one call on the server, seconds (connection string
            only); a call that overruns raises ``BackendUnavailable``.
        idle_timeout: seconds a fenced save's or delete's transaction may stay idle
            before the server ends its session (``idle_in_transaction_session_timeout``):
            a writer paused inside one holds a takeover back at most this long. A
            ``PostgresLeader`` bounds its tasks' ``ctx.checkpoint`` by its margin
            ``ttl - renew_deadline`` (as ``ctx.fence``) when that is shorter (see
            :meth:`with_idle_timeout`).

    Raises:
        ConfigError: a bad ``conninfo``, unsafe table names, bad numbers.
    """

    def __init__(
        self,
        conninfo: str | Any,
        *,
        table_prefix: str = CHECKPOINT_PREFIX,
        lease_table: str = DEFAULT_TABLE,
        create_tables: bool = True,
        max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
        connect_timeout: float = 5.0,
        statement_timeout: float = 30.0,
        idle_timeout: float = 5.0,
    ) -> None:
        self.tables = CheckpointTables(table_prefix)  # validates
        table_identifier(lease_table)  # validates
        if isinstance(max_state_bytes, bool) or not isinstance(max_state_bytes, int):
            raise ConfigError(f"max_state_bytes must be an int, got {max_state_bytes!r}")
        if max_state_bytes <= 0:
            raise ConfigError(f"max_state_bytes must be positive, got {max_state_bytes!r}")
        self.table_prefix = table_prefix
        self.lease_table = lease_table
        self.create_tables = bool(create_tables)
        self.max_state_bytes = max_state_bytes
        self.connect_timeout = check_seconds(connect_timeout, "connect_timeout")
        self.statement_timeout = check_seconds(statement_timeout, "statement_timeout")
        self.idle_timeout = check_seconds(idle_timeout, "idle_timeout", minimum=0.001)
        self._conns = Connections(
            conninfo,
            owner="PostgresCheckpointStore",
            application_name="rselection:checkpoints",
            connect_timeout=self.connect_timeout,
            statement_timeout=self.statement_timeout,
            pooled=True,
        )
        self._migrated = not self.create_tables
        self._migrate_lock = threading.Lock()
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): its lock is made anew (a
        parent's thread may have held it); the connections reset themselves."""
        self._migrate_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(table_prefix={self.table_prefix!r}, "
            f"lease_table={self.lease_table!r}, {self._conns.where})"
        )

    def with_idle_timeout(self, idle_timeout: float) -> PostgresCheckpointStore:
        """This store with fenced saves and deletes bounded by ``idle_timeout`` seconds,
        if that is shorter than its own bound.

        The result shares the store's tables, settings and connections (closing either
        closes them for both). A ``PostgresLeader`` hands its tasks the view bounded by
        its margin, so a leader paused inside ``ctx.checkpoint.save`` holds a takeover
        back no longer than one paused inside ``ctx.fence``.

        Args:
            idle_timeout: the longest a fenced transaction may stay idle, seconds.

        Raises:
            ConfigError: ``idle_timeout`` is not a positive number.
        """
        seconds = check_seconds(idle_timeout, "idle_timeout", minimum=0.001)
        view = copy.copy(self)
        view.idle_timeout = min(self.idle_timeout, seconds)
        forks.register(view)
        return view

    def close(self) -> None:
        """Close the store's own connections (idempotent; later calls reconnect).

        A pool or connection passed in is not closed: it belongs to the caller.
        """
        self._conns.close()

    def _run(self, what: str, body: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        """Run ``body`` on a lent connection, creating the tables first; wrap driver errors."""
        for attempt in range(_RETRIES):
            try:
                with self._conns.connection() as conn:
                    if not self._migrated:
                        self._create_tables(conn)
                    return body(conn)
            except (
                psycopg.errors.SerializationFailure,
                psycopg.errors.DeadlockDetected,
            ) as exc:
                if attempt + 1 < _RETRIES:
                    logger.debug("checkpoint %s: retrying after %s", what, type(exc).__name__)
                    continue
                raise self._conns.wrap(what, exc) from exc
            except psycopg.errors.UndefinedTable as exc:
                self._migrated = not self.create_tables  # dropped behind our back: recreate
                raise ConfigError(
                    f"cannot {what}: the checkpoint tables ({self.table_prefix}*) do not "
                    "exist on this connection's database or search_path: run "
                    "rselection.postgres.migrate(conninfo) (or `rselection migrate`) once, "
                    "or create the store with create_tables=True"
                ) from exc
            except psycopg.Error as exc:
                raise self._conns.wrap(what, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _row(self, what: str, query: sql.Composed, params: Any) -> Any:
        """The row ``query`` returns (or ``None``), run alone in a transaction."""

        def body(conn: psycopg.Connection[Any]) -> Any:
            with conn.transaction():
                return conn.execute(query, params).fetchone()

        return self._run(what, body)

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:
        with self._migrate_lock:
            if not self._migrated:
                create_tables(conn, checkpoints=self.table_prefix, timeout=self.statement_timeout)
                self._migrated = True

    # -- snapshots --------------------------------------------------------------------

    def load(self, key: Key) -> Snapshot | None:
        """The last saved snapshot of ``key``, or ``None`` if never saved (or deleted).

        Args:
            key: a string or a tuple of strings.

        Raises:
            ConfigError: bad key, or the snapshot has a newer ``format_version`` than
                this release understands (upgrade rselection; nothing is dropped).
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        query = sql.SQL(
            "SELECT state::text, format_version, version, term, updated_at FROM {}"
            " WHERE key = %s::text[] AND state IS NOT NULL"
        ).format(self.tables.checkpoints)
        row = self._row("load a checkpoint", query, (parts,))
        if row is None:
            return None
        text, format_version, version, term, updated_at = row
        if format_version > FORMAT_VERSION:
            raise ConfigError(
                f"checkpoint {key!r:.80} was saved with format_version {format_version}, "
                f"newer than the {FORMAT_VERSION} this release of rselection understands: "
                "upgrade rselection on this node (the snapshot is left untouched)"
            )
        return Snapshot(
            key_of(parts),
            json.loads(text),
            int(version),
            None if term is None else int(term),
            updated_at.astimezone(UTC),
            int(format_version),
        )

    def save(
        self,
        key: Key,
        state: Any,
        *,
        term: int | None = None,
        name: str = "default",
        node_id: str | None = None,
    ) -> Snapshot:
        """Store ``state`` as the new snapshot of ``key``; fenced when asked.

        The state is encoded with :func:`json.dumps` and stored as ``jsonb``: tuples come
        back as lists, dict keys must be strings to come back unchanged, and numbers and
        key order come back as ``jsonb`` keeps them (see
        :func:`~rselection.checkpoints.decode_state`; the snapshot returned is already
        so).

        Args:
            key: a string or a tuple of strings.
            state: a JSON-encodable value.
            term: fence against the leadership lease: commit only if this term still
                holds the lease called ``name`` (in ``lease_table``), in the same
                transaction.
            name: the name of the lease whose term fences the write (the leader's
                ``name``), as in :class:`~rselection.abc.CheckpointStore`.
            node_id: fence against the key's own lease instead: commit only if
                ``node_id`` holds it (:meth:`acquire_lease`) and it has not expired.

        Returns:
            The snapshot just written (its new version and server time).

        Raises:
            StaleLeaderError: the fence refused; nothing was written.
            TypeError: ``state`` holds a value JSON cannot encode.
            ConfigError: bad arguments (both ``term`` and ``node_id``, a bad key, NaN,
                a state larger than ``max_state_bytes``, a NUL character).
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        return self._save(parts, state, self._fence(parts, term, name, node_id))

    def _fence(self, parts: list[str], term: int | None, name: str, node_id: str | None) -> _Fence:
        if term is not None and node_id is not None:
            raise ConfigError(
                "pass term= (fence against the leadership lease) or node_id= (fence "
                "against the key's own lease), not both"
            )
        if term is not None:
            number = check_term(term)
            check_name(name, "lease name")
            table = self.lease_table
            idle_timeout = self.idle_timeout

            def by_term(conn: psycopg.Connection[Any]) -> int | None:
                fenced(conn, name, number, table=table, idle_timeout=idle_timeout)
                return number

            return by_term
        if node_id is not None:
            holder = check_node_id(node_id)
            query = sql.SQL(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, true),"
                " (SELECT term FROM {} WHERE " + _HELD + " FOR SHARE)"
            ).format(self.tables.leases)
            millis = f"{max(1, round(self.idle_timeout * 1000))}ms"

            def by_holder(conn: psycopg.Connection[Any]) -> int | None:
                row = conn.execute(query, (millis, parts, holder)).fetchone()
                if row is None or row[1] is None:
                    raise StaleLeaderError(
                        f"{holder!r} does not hold the lease of checkpoint {key_of(parts)!r:.80} "
                        "(never acquired, expired or taken over): nothing was written; "
                        "acquire_lease() again before writing"
                    )
                return int(row[1])

            return by_holder
        return lambda conn: None

    def _save(self, parts: list[str], state: Any, fence: _Fence) -> Snapshot:
        text = encode_state(key_of(parts), state, self.max_state_bytes)
        upsert = sql.SQL(
            "INSERT INTO {t} AS c (key, state, format_version, version, term, updated_at)"
            " VALUES (%s::text[], %s::jsonb, %s, 1, %s, clock_timestamp())"
            " ON CONFLICT (key) DO UPDATE SET state = EXCLUDED.state,"
            " format_version = EXCLUDED.format_version, version = c.version + 1,"
            " term = EXCLUDED.term, updated_at = EXCLUDED.updated_at"
            " RETURNING version, updated_at"
        ).format(t=self.tables.checkpoints)

        def body(conn: psycopg.Connection[Any]) -> tuple[int | None, Any]:
            with conn.transaction():
                term = fence(conn)
                try:
                    row = conn.execute(upsert, (parts, text, FORMAT_VERSION, term)).fetchone()
                except psycopg.errors.UntranslatableCharacter as exc:
                    raise ConfigError(
                        f"checkpoint state for {key_of(parts)!r:.80} contains a NUL "
                        "character (\\u0000), which Postgres jsonb cannot store"
                    ) from exc
            return term, row

        term, row = self._run("save a checkpoint", body)
        assert row is not None
        return Snapshot(
            key_of(parts), decode_state(text), int(row[0]), term, row[1].astimezone(UTC)
        )

    def delete(
        self,
        key: Key,
        *,
        term: int | None = None,
        name: str = "default",
        node_id: str | None = None,
    ) -> bool:
        """Delete the snapshot of ``key``; fenced like :meth:`save`.

        The version counter of the key is kept (the next save continues from it), so
        versions never repeat.

        Args:
            key: a string or a tuple of strings.
            term: fence against the leadership lease (see :meth:`save`).
            name: the name of the lease whose term fences the delete.
            node_id: fence against the key's own lease (see :meth:`save`).

        Returns:
            ``True`` if a snapshot was deleted, ``False`` if there was none.

        Raises:
            StaleLeaderError: the fence refused; nothing was deleted.
            ConfigError: bad arguments.
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        return self._delete(parts, self._fence(parts, term, name, node_id))

    def _delete(self, parts: list[str], fence: _Fence) -> bool:
        query = sql.SQL(
            "UPDATE {} SET state = NULL, version = version + 1, term = %s,"
            " format_version = %s, updated_at = clock_timestamp()"
            " WHERE key = %s::text[] AND state IS NOT NULL RETURNING version"
        ).format(self.tables.checkpoints)

        def body(conn: psycopg.Connection[Any]) -> bool:
            with conn.transaction():
                term = fence(conn)
                return conn.execute(query, (term, FORMAT_VERSION, parts)).fetchone() is not None

        return self._run("delete a checkpoint", body)

    # -- per-key leases ---------------------------------------------------------------

    def acquire_lease(self, key: Key, node_id: str, ttl: float) -> bool:
        """Acquire or renew the lease of ``key`` for ``ttl`` seconds (server time).

        The same node renews (its term is kept while the lease is live; a new tenure
        after expiry or release gets the next term). Another node gets the lease only
        once it has expired or was released. Expiry is computed by Postgres
        (``clock_timestamp() + ttl``); no client clock is used.

        Args:
            key: a string or a tuple of strings.
            node_id: who asks (a node or worker id).
            ttl: lease length in seconds (at least 1 ms).

        Returns:
            ``True`` if ``node_id`` holds the lease now, ``False`` if another node does.

        Raises:
            ConfigError: bad arguments.
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        holder = check_node_id(node_id)
        seconds = check_seconds(ttl, "ttl", minimum=MIN_TTL)
        query = sql.SQL(
            "INSERT INTO {t} AS l (key, holder, term, acquired_at, renewed_at, expires_at)"
            " VALUES (%(key)s::text[], %(holder)s, 1, clock_timestamp(), clock_timestamp(),"
            " clock_timestamp() + %(ttl)s * interval '1 second')"
            " ON CONFLICT (key) DO UPDATE SET"
            " term = CASE WHEN l.holder = EXCLUDED.holder AND l.expires_at > clock_timestamp()"
            " THEN l.term ELSE l.term + 1 END,"
            " acquired_at = CASE WHEN l.holder = EXCLUDED.holder"
            " AND l.expires_at > clock_timestamp() THEN l.acquired_at ELSE clock_timestamp() END,"
            " holder = EXCLUDED.holder, renewed_at = clock_timestamp(),"
            " expires_at = clock_timestamp() + %(ttl)s * interval '1 second'"
            " WHERE l.holder = EXCLUDED.holder OR l.expires_at <= clock_timestamp()"
            " RETURNING term"
        ).format(t=self.tables.leases)
        params = {"key": parts, "holder": holder, "ttl": seconds}
        return self._row("acquire a checkpoint lease", query, params) is not None

    def release_lease(self, key: Key, node_id: str) -> bool:
        """Give the lease of ``key`` up now, so another node may take it at once.

        Args:
            key: a string or a tuple of strings.
            node_id: the node holding it.

        Returns:
            ``True`` if ``node_id`` held a live lease and released it.

        Raises:
            ConfigError: bad arguments.
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        holder = check_node_id(node_id)
        query = sql.SQL(
            "UPDATE {} SET expires_at = clock_timestamp() WHERE " + _HELD + " RETURNING 1"
        ).format(self.tables.leases)
        return self._row("release a checkpoint lease", query, (parts, holder)) is not None
