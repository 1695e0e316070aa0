"""``PostgresCheckpointStore``: durable task state in Postgres, fenced by term.

A persistent task keeps its progress (a queue cursor, counters) in a *snapshot*: a JSON
document stored under a key. When leadership moves, the new leader loads the last
snapshot and resumes; the old leader can no longer overwrite it, because its saves are
*fenced*:

* ``save(key, state, term=T, lease="billing")`` commits only if term ``T`` still holds
  the leadership lease ``"billing"`` (the lease table of
  :class:`~rselection.PostgresLeader`). The check is :func:`~rselection.postgres.fenced`
  in the same transaction as the write: it locks the lease row ``FOR KEY SHARE``, so a
  takeover waits for the save to end, and once the new term exists the save is refused
  with :class:`~rselection.errors.StaleLeaderError` and nothing is written.
* ``save(key, state, holder="worker-1")`` commits only if ``holder`` holds the key's own
  lease (:meth:`PostgresCheckpointStore.acquire_lease`), for work split by key instead of
  by leader. The per-key lease row is locked ``FOR SHARE`` in the same transaction, so a
  takeover (only possible after expiry) waits for the save to end.
* Without ``term`` or ``holder`` the save is not fenced.

The store is a :class:`~rselection.checkpoints.CheckpointStore`: inside a task,
``ctx.checkpoint`` (a :class:`~rselection.checkpoints.TaskCheckpoint`) does the first
kind for you: the key is the task's name, the term is ``ctx.term`` and the lease is the
leader's. Keys, states and their limits follow :mod:`rselection.checkpoints`.

Every snapshot has a ``version`` that grows by one on every save (and delete) of its key
and is never reused, the fencing ``term`` it was saved under, and ``updated_at`` in
server time. The state is stored as ``jsonb`` with an envelope ``format_version``;
loading a format newer than this release knows raises
:class:`~rselection.errors.ConfigError` rather than returning a partial state.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import select
import threading
from collections.abc import Callable, Iterator
from datetime import UTC
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from ..checkpoints import (
    DEFAULT_MAX_STATE_BYTES,
    FORMAT_VERSION,
    Key,
    Snapshot,
    TaskCheckpoint,
    check_key,
    check_term,
    encode_state,
    key_of,
)
from ..errors import BackendUnavailable, ConfigError, StaleLeaderError
from ._conn import check_conninfo, describe_conninfo, unavailable
from .fencing import fenced
from .migrations import MIGRATIONS, CheckpointTables, apply_migrations
from .schema import DEFAULT_TABLE, validate_table_name

__all__ = [
    "FORMAT_VERSION",
    "Key",
    "PostgresCheckpointStore",
    "Snapshot",
    "TaskCheckpoint",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Fence = Callable[[psycopg.Connection[Any]], int | None]
_RETRIES = 3  # attempts for serialization failures and deadlocks


def _check_holder(holder: object) -> str:
    if not isinstance(holder, str) or not holder or "\x00" in holder:
        raise ConfigError(f"holder must be a non-empty string without NUL, got {holder!r:.80}")
    return holder


def _dropped(conn: psycopg.Connection[Any]) -> bool:
    """True when an idle connection was closed by the server (its socket is readable)."""
    if conn.closed or conn.broken:
        return True
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(readable)


class PostgresCheckpointStore:
    """Durable, versioned, fenced task state in Postgres.

    Thread-safe. With a connection string it keeps a few idle connections of its own
    (``autocommit``, opened on demand, closed by :meth:`close`); with a pool (anything
    with a ``connection()`` context manager, such as ``psycopg_pool.ConnectionPool``) it
    borrows one per call. Each call is one short transaction. Tables are created on first
    use unless ``create_tables=False`` (then call :meth:`apply_migrations` once, with a
    role that may run DDL). The tables must live in the same database as the lease table
    for fenced saves.

    Args:
        conninfo_or_pool: a libpq connection string or URI, or a connection pool.
        table_prefix: prefix of the store's tables, optionally schema-qualified
            (``"ops.rselection_"``): ``<prefix>checkpoints``,
            ``<prefix>checkpoint_leases``, ``<prefix>checkpoint_migrations``.
        lease_table: the leadership lease table that ``save(..., term=...)`` is fenced
            against (the leader's ``table``).
        create_tables: apply the migrations on first use.
        max_state_bytes: largest encoded state :meth:`save` accepts (UTF-8 bytes of the
            JSON text).
        connect_timeout: seconds to wait for a new connection (conninfo only).

    Raises:
        ConfigError: no or unparsable connection, unsafe table names, bad numbers.
    """

    def __init__(
        self,
        conninfo_or_pool: str | Any,
        *,
        table_prefix: str = "rselection_",
        lease_table: str = DEFAULT_TABLE,
        create_tables: bool = True,
        max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
        connect_timeout: float = 5.0,
    ) -> None:
        if conninfo_or_pool is None or (
            isinstance(conninfo_or_pool, str) and not conninfo_or_pool.strip()
        ):
            raise ConfigError(
                "PostgresCheckpointStore needs a connection string (postgresql://...) or a "
                f"connection pool, got {conninfo_or_pool!r}"
            )
        self._conninfo: str | None = None
        self._pool: Any = None
        if isinstance(conninfo_or_pool, str):
            check_conninfo(conninfo_or_pool)
            self._conninfo = conninfo_or_pool
            self._where = describe_conninfo(conninfo_or_pool)
        elif callable(getattr(conninfo_or_pool, "connection", None)):
            self._pool = conninfo_or_pool
            self._where = f"pool {type(conninfo_or_pool).__name__}"
        else:
            raise ConfigError(
                "conninfo_or_pool must be a connection string or a pool with a "
                f"connection() context manager (psycopg_pool.ConnectionPool), got "
                f"{type(conninfo_or_pool).__name__}"
            )
        self.tables = CheckpointTables(table_prefix)  # validates
        validate_table_name(lease_table)
        if isinstance(max_state_bytes, bool) or not isinstance(max_state_bytes, int):
            raise ConfigError(f"max_state_bytes must be an int, got {max_state_bytes!r}")
        if max_state_bytes <= 0:
            raise ConfigError(f"max_state_bytes must be positive, got {max_state_bytes!r}")
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, int | float):
            raise ConfigError(f"connect_timeout must be seconds, got {connect_timeout!r}")
        if not (connect_timeout > 0 and math.isfinite(connect_timeout)):
            raise ConfigError(f"connect_timeout must be positive, got {connect_timeout!r}")
        self.table_prefix = table_prefix
        self.lease_table = lease_table
        self.create_tables = create_tables
        self.max_state_bytes = max_state_bytes
        self.connect_timeout = float(connect_timeout)
        self._lock = threading.Lock()
        self._idle: list[psycopg.Connection[Any]] = []
        self._max_idle = 4
        self._migrated = False
        self._migrate_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(table_prefix={self.table_prefix!r}, "
            f"lease_table={self.lease_table!r}, {self._where})"
        )

    def __enter__(self) -> PostgresCheckpointStore:
        """Return the store; the ``with`` block closes its connections on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the idle connections (see :meth:`close`)."""
        self.close()

    # -- connections ------------------------------------------------------------------

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        if self._pool is not None:
            with self._pool.connection() as conn:
                yield conn
            return
        assert self._conninfo is not None
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None and _dropped(conn):
            # The server ended this idle session (restart, pg_terminate_backend): it sent
            # its goodbye, so the socket is readable. Use a fresh connection instead.
            with contextlib.suppress(Exception):
                conn.close()
            conn = None
        if conn is None:
            try:
                conn = psycopg.Connection.connect(
                    self._conninfo,
                    autocommit=True,
                    connect_timeout=max(2, math.ceil(self.connect_timeout)),
                    application_name="rselection:checkpoints",
                )
            except psycopg.Error as exc:
                raise unavailable("connect to the checkpoint store", self._conninfo, exc) from exc
        reuse = False
        try:
            yield conn
            reuse = True
        except (StaleLeaderError, ConfigError, TypeError):
            reuse = True  # refused by us, the connection is fine
            raise
        finally:
            ok = (
                reuse
                and not conn.closed
                and not conn.broken
                and conn.info.transaction_status == TransactionStatus.IDLE
            )
            with self._lock:
                if ok and len(self._idle) < self._max_idle:
                    self._idle.append(conn)
                    conn = None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def close(self) -> None:
        """Close the store's idle connections (idempotent; later calls reconnect).

        A pool passed in is not closed: it belongs to the caller.
        """
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(Exception):
                conn.close()

    def _run(self, what: str, body: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        """Run ``body`` in a connection, migrating first; wrap driver errors."""
        if self.create_tables and not self._migrated:
            self.apply_migrations()
        for attempt in range(_RETRIES):
            try:
                with self._connection() as conn:
                    return body(conn)
            except (
                psycopg.errors.SerializationFailure,
                psycopg.errors.DeadlockDetected,
            ) as exc:
                if attempt + 1 < _RETRIES:
                    logger.debug("checkpoint %s: retrying after %s", what, type(exc).__name__)
                    continue
                raise self._wrap(what, exc) from exc
            except psycopg.errors.UndefinedTable as exc:
                self._migrated = False  # dropped behind our back: recreate on next call
                raise ConfigError(
                    f"cannot {what}: the checkpoint tables ({self.table_prefix}*) do not "
                    "exist on this connection's database or search_path: call "
                    "apply_migrations() (or create the store with create_tables=True)"
                ) from exc
            except psycopg.Error as exc:
                raise self._wrap(what, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _wrap(self, what: str, exc: psycopg.Error) -> BackendUnavailable:
        if self._conninfo is not None:
            return unavailable(what, self._conninfo, exc)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return BackendUnavailable(f"cannot {what} ({self._where}): {detail}")

    # -- schema -----------------------------------------------------------------------

    def apply_migrations(self) -> list[int]:
        """Create or upgrade the store's tables: numbered migrations, in order, once.

        Idempotent and safe to run from many processes at once (one transaction under an
        advisory lock; see :mod:`rselection.postgres.migrations`).

        Returns:
            The migration numbers this call applied (empty when already current).

        Raises:
            ConfigError: the tables were migrated by a newer release.
            BackendUnavailable: the database refused (no privilege, missing schema) or
                cannot be reached.
        """
        with self._migrate_lock:
            try:
                with self._connection() as conn:
                    applied = apply_migrations(conn, self.tables, MIGRATIONS)
            except psycopg.errors.InsufficientPrivilege as exc:
                raise BackendUnavailable(
                    f"cannot create the checkpoint tables {self.table_prefix}*: {exc}; "
                    "run apply_migrations() with a role that may create tables and pass "
                    "create_tables=False"
                ) from exc
            except psycopg.Error as exc:
                raise self._wrap("create the checkpoint tables", exc) from exc
            self._migrated = True
        return applied

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

        def body(conn: psycopg.Connection[Any]) -> Any:
            return conn.execute(query, (parts,)).fetchone()

        row = self._run("load a checkpoint", body)
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
        lease: str = "default",
        holder: str | None = None,
    ) -> Snapshot:
        """Store ``state`` as the new snapshot of ``key``; fenced when asked.

        The state is encoded with :func:`json.dumps` and stored as ``jsonb``: tuples come
        back as lists, and dict keys must be strings to come back unchanged (``jsonb``
        also does not keep key order).

        Args:
            key: a string or a tuple of strings.
            state: a JSON-encodable value.
            term: fence against the leadership lease: commit only if this term still
                holds ``lease`` (in ``lease_table``), in the same transaction.
            lease: the leadership lease name that ``term`` refers to (the leader's
                ``name``).
            holder: fence against the key's own lease instead: commit only if
                ``holder`` holds it (:meth:`acquire_lease`) and it has not expired.

        Returns:
            The snapshot just written (its new version and server time).

        Raises:
            StaleLeaderError: the fence refused; nothing was written.
            TypeError: ``state`` holds a value JSON cannot encode.
            ConfigError: bad arguments (both ``term`` and ``holder``, a bad key, NaN,
                a state larger than ``max_state_bytes``, a NUL character).
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        return self._save(parts, state, self._fence(parts, term, lease, holder))

    def _fence(self, parts: list[str], term: int | None, lease: str, holder: str | None) -> _Fence:
        if term is not None and holder is not None:
            raise ConfigError(
                "pass term= (fence against the leadership lease) or holder= (fence "
                "against the key's own lease), not both"
            )
        if term is not None:
            number = check_term(term)
            if not isinstance(lease, str) or not lease:
                raise ConfigError(f"lease must be a non-empty lease name, got {lease!r}")
            table = self.lease_table

            def by_term(conn: psycopg.Connection[Any]) -> int | None:
                fenced(conn, lease, number, table=table)
                return number

            return by_term
        if holder is not None:
            name = _check_holder(holder)
            query = sql.SQL(
                "SELECT set_config('idle_in_transaction_session_timeout', '5000ms', true),"
                " (SELECT term FROM {} WHERE key = %s::text[] AND holder = %s"
                " AND expires_at > clock_timestamp() FOR SHARE)"
            ).format(self.tables.leases)

            def by_holder(conn: psycopg.Connection[Any]) -> int | None:
                row = conn.execute(query, (parts, name)).fetchone()
                if row is None or row[1] is None:
                    raise StaleLeaderError(
                        f"{name!r} does not hold the lease of checkpoint {key_of(parts)!r:.80} "
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
        return Snapshot(key_of(parts), json.loads(text), int(row[0]), term, row[1].astimezone(UTC))

    def delete(
        self,
        key: Key,
        *,
        term: int | None = None,
        lease: str = "default",
        holder: str | None = None,
    ) -> bool:
        """Delete the snapshot of ``key``; fenced like :meth:`save`.

        The version counter of the key is kept (the next save continues from it), so
        versions never repeat.

        Args:
            key: a string or a tuple of strings.
            term: fence against the leadership lease (see :meth:`save`).
            lease: the leadership lease name that ``term`` refers to.
            holder: fence against the key's own lease (see :meth:`save`).

        Returns:
            ``True`` if a snapshot was deleted, ``False`` if there was none.

        Raises:
            StaleLeaderError: the fence refused; nothing was deleted.
            ConfigError: bad arguments.
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        return self._delete(parts, self._fence(parts, term, lease, holder))

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

    def acquire_lease(self, key: Key, holder: str, ttl: float) -> bool:
        """Acquire or renew the lease of ``key`` for ``ttl`` seconds (server time).

        The same holder renews (its term is kept while the lease is live; a new tenure
        after expiry or release gets the next term). Another holder gets the lease only
        once it has expired or was released. Expiry is computed by Postgres
        (``clock_timestamp() + ttl``); no client clock is used.

        Args:
            key: a string or a tuple of strings.
            holder: who asks (a node or worker id).
            ttl: lease length in seconds (positive).

        Returns:
            ``True`` if ``holder`` holds the lease now, ``False`` if another holder does.

        Raises:
            ConfigError: bad arguments.
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        name = _check_holder(holder)
        if isinstance(ttl, bool) or not isinstance(ttl, int | float):
            raise ConfigError(f"ttl must be a number of seconds, got {ttl!r}")
        if not (ttl > 0 and math.isfinite(ttl)):
            raise ConfigError(f"ttl must be positive and finite, got {ttl!r}")
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
        params = {"key": parts, "holder": name, "ttl": float(ttl)}

        def body(conn: psycopg.Connection[Any]) -> bool:
            with conn.transaction():
                return conn.execute(query, params).fetchone() is not None

        return self._run("acquire a checkpoint lease", body)

    def release_lease(self, key: Key, holder: str) -> bool:
        """Give the lease of ``key`` up now, so another holder may take it at once.

        Args:
            key: a string or a tuple of strings.
            holder: the current holder.

        Returns:
            ``True`` if ``holder`` held a live lease and released it.

        Raises:
            ConfigError: bad arguments.
            BackendUnavailable: the database cannot be reached.
        """
        parts = check_key(key)
        name = _check_holder(holder)
        query = sql.SQL(
            "UPDATE {} SET expires_at = clock_timestamp()"
            " WHERE key = %s::text[] AND holder = %s AND expires_at > clock_timestamp()"
            " RETURNING 1"
        ).format(self.tables.leases)

        def body(conn: psycopg.Connection[Any]) -> bool:
            with conn.transaction():
                return conn.execute(query, (parts, name)).fetchone() is not None

        return self._run("release a checkpoint lease", body)
