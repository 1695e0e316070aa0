"""``PostgresClaimer``: at most one run per fire across a fleet, for any scheduler.

Every process of a fleet runs the same schedule (APScheduler, celery beat, a cron loop).
Before it runs a fire, it *claims* the fire's key::

    claimer = PostgresClaimer("postgresql://...")
    key = format_fire_key("purge", scheduled_at)  # "purge@2026-11-30T02:40:00.000000000Z"
    if claimer.claim(key):
        purge()

How a claim works
-----------------

A claim is one ``INSERT ... ON CONFLICT DO UPDATE`` on the claims table (see
:mod:`rselection.postgres.schema`). It succeeds when no unexpired claim exists for the
key: a new key is inserted, an expired claim is replaced in the same statement (the
row lock of the upsert makes two replacements of one expired claim impossible: the
second sees the first one's fresh expiry and fails). Every time is the server's
(``clock_timestamp()``); no client clock is ever compared.

A claim is **kept until its ttl** (600 s by default), also after the run ends: a
replica whose scheduler fires late (a GC pause, a slow start, a skewed clock) must not
run the same fire again. So ``ttl`` must be longer than the latest a fire may start
anywhere in the fleet (for APScheduler, its ``misfire_grace_time``). :meth:`cleanup`
deletes claims that expired more than a minute ago; call it now and then (any node).

**Fail closed.** :meth:`PostgresClaimer.claim` returns ``False`` only when another
claim holds the key. Any backend problem (no connection, a broken session, a timeout)
raises :class:`~rselection.errors.BackendUnavailable`, whose message names the server
but never the password; so ``if claimer.claim(key): run()`` never runs a fire it could
not claim, and never hides an outage as "someone else has it".

**Fire-key format.** Each claim records the ``format_version`` of its key
(:data:`FIRE_KEY_FORMAT`, 1 for :func:`~rselection.format_fire_key`'s
``"<task>@<UTC RFC 3339 nanos>Z"``). Two releases that spelled the same fire
differently would both win their claims, silently. So a claim first looks for
unexpired claims written in another format (an index makes that one probe), and if it
finds one it raises :class:`~rselection.errors.ConfigError` instead of claiming: stop
the nodes of the other release, or wait one ttl after the last of them stopped.

**Holder and term.** Each claim records who made it (``holder``: a random process
identity by default) and, when given, the fencing ``term`` under which it was made, for
audits and debugging.

Connections
-----------

``conninfo_or_pool`` is one of:

* a connection string: the claimer opens one autocommit connection of its own (on first
  use; reopened after a failure), and calls take turns on it;
* a pool, anything with a ``connection()`` context manager (``psycopg_pool.
  ConnectionPool``): each call borrows a connection and runs in its own transaction;
* a ``psycopg.Connection``: calls take turns on it under a lock. If it is inside an open
  transaction, the claim joins it (as a savepoint) and binds others only once that
  transaction commits, so the claim and the fire's own writes commit or roll back
  together; other claimers of the same key wait for it meanwhile.

Every instance is thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import select
import socket
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from ..errors import BackendUnavailable, ConfigError
from ._conn import IoWatchdog, check_conninfo, describe_conninfo, unavailable
from .schema import CLAIMS_TABLE, create_tables, table_identifier

__all__ = ["FIRE_KEY_FORMAT", "PostgresClaimer", "random_identity"]

logger = logging.getLogger(__name__)

FIRE_KEY_FORMAT = 1
"""Format of the fire keys this release writes: ``"<task>@<UTC RFC 3339, 9 digits>Z"``."""

MIN_TTL = 0.001
"""The shortest ttl accepted, seconds (1 ms)."""

_MAX_KEY_BYTES = 2000  # a btree entry must fit in a third of a page
_MAX_TERM = 2**63 - 1


def random_identity() -> str:
    """A random identity for this process: ``"<host>:<pid>:<8 hex digits>"``.

    Unique per call, so two claimers or electors of one process differ too.
    """
    host = socket.gethostname() or "host"
    return f"{host[:200]}:{os.getpid()}:{secrets.token_hex(4)}"


def check_ttl(ttl: object, label: str = "ttl") -> float:
    """Return ``ttl`` as a float, or raise :class:`ConfigError` if it is not >= 1 ms.

    Args:
        ttl: seconds, an int or a float (not a bool); at least :data:`MIN_TTL`, finite.
        label: the parameter's name, for the message.
    """
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise ConfigError(f"{label} must be a number of seconds, got {ttl!r}")
    if not math.isfinite(ttl) or ttl < MIN_TTL:
        raise ConfigError(
            f"{label} must be finite and at least {MIN_TTL} s (1 ms), got {ttl!r}: claims "
            "and elections are measured in server time with microsecond precision"
        )
    return float(ttl)


def check_name(value: object, label: str) -> str:
    """Return ``value`` if it is a usable name, else raise :class:`ConfigError`.

    Args:
        value: a non-empty string, not only whitespace, without NUL characters.
        label: the parameter's name, for the message.
    """
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{label} must be a non-empty string, got {value!r:.80}")
    if "\x00" in value:
        raise ConfigError(f"{label} must not contain NUL characters, got {value!r:.80}")
    if len(value.encode(errors="replace")) > _MAX_KEY_BYTES:
        raise ConfigError(f"{label} is longer than {_MAX_KEY_BYTES} bytes: {value[:40]!r}...")
    return value


class Connections:
    """Where a claimer or an elector gets its connection: a conninfo, a pool or a connection.

    Not public API; see the module docstring for the three modes.

    Args:
        source: a connection string, a pool with ``connection()``, or a
            ``psycopg.Connection``.
        owner: the class using it, for messages (``"PostgresClaimer"``).
        application_name: ``application_name`` of connections it opens itself.
        connect_timeout: seconds to wait for a connection it opens itself.
        statement_timeout: bound of one statement on connections it opens itself.
    """

    def __init__(
        self,
        source: object,
        *,
        owner: str,
        application_name: str,
        connect_timeout: float = 5.0,
        statement_timeout: float = 10.0,
    ) -> None:
        """Check ``source`` (raises :class:`ConfigError`); opens nothing yet."""
        if source is None or (isinstance(source, str) and not source.strip()):
            raise ConfigError(
                f"{owner} needs a connection string (postgresql://...), a connection pool "
                f"or a psycopg Connection, got {source!r}"
            )
        self._conninfo: str | None = None
        self._pool: Any = None
        self._shared: psycopg.Connection[Any] | None = None
        if isinstance(source, str):
            check_conninfo(source)
            self._conninfo = source
            self.where = describe_conninfo(source)
        elif isinstance(source, psycopg.Connection):
            if source.closed:
                raise ConfigError(f"{owner} was given a closed psycopg Connection")
            self._shared = source
            self.where = describe_conninfo(source.info.dsn)
        elif isinstance(source, psycopg.AsyncConnection):
            raise ConfigError(
                f"{owner} needs a synchronous psycopg Connection, got an AsyncConnection"
            )
        elif callable(getattr(source, "connection", None)):
            self._pool = source
            conninfo = getattr(source, "conninfo", None)
            self.where = (
                describe_conninfo(conninfo)
                if isinstance(conninfo, str)
                else f"pool {type(source).__name__}"
            )
        else:
            raise ConfigError(
                f"{owner} needs a connection string, a pool with a connection() context "
                "manager (psycopg_pool.ConnectionPool) or a psycopg Connection, got "
                f"{type(source).__name__}"
            )
        self.owner = owner
        self._app = application_name
        self._connect_timeout = connect_timeout
        self._statement_timeout = statement_timeout
        self._lock = threading.Lock()
        self._own: psycopg.Connection[Any] | None = None
        # Keepalives and tcp_user_timeout cannot see a peer that accepts bytes and never
        # answers (a stuck proxy or pooler): bound each call on our own connection.
        self._io = IoWatchdog(application_name)

    def _open(self) -> psycopg.Connection[Any]:
        assert self._conninfo is not None
        try:
            conn = psycopg.Connection.connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=max(2, math.ceil(self._connect_timeout)),
                application_name=self._app,
                # A silent network ends a call within about statement_timeout too.
                keepalives=1,
                keepalives_idle=max(1, math.ceil(self._statement_timeout / 2)),
                keepalives_interval=1,
                keepalives_count=3,
                tcp_user_timeout=math.ceil(self._statement_timeout * 1000) + 1000,
            )
        except psycopg.Error as exc:
            raise unavailable("connect to Postgres", self._conninfo, exc) from exc
        try:
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false)",
                (f"{math.ceil(self._statement_timeout * 1000)}ms",),
            )
        except psycopg.Error as exc:
            conn.close()
            raise unavailable("prepare the session", self._conninfo, exc) from exc
        return conn

    @staticmethod
    def _usable(conn: psycopg.Connection[Any]) -> bool:
        """False when ``conn`` is known dead: closed, broken, or the server hung up.

        An idle connection that nobody LISTENs on has nothing to read unless the server
        ended the session (an error message, then EOF): then it is replaced before use.
        """
        if conn.closed or conn.broken:
            return False
        if conn.info.transaction_status != TransactionStatus.IDLE:
            return False
        try:
            readable, _, _ = select.select([conn.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """Lend a connection for one call; the body runs ``with conn.transaction()``.

        Driver errors are left to the caller (see :meth:`wrap`); a connection of its own
        that failed is closed and reopened by the next call.
        """
        if self._pool is not None:
            with self._pool.connection() as conn:
                yield conn
            return
        with self._lock:
            if self._shared is not None:
                yield self._shared
                return
            if self._own is not None and not self._usable(self._own):
                logger.debug("%s: replacing a dead connection (%s)", self.owner, self.where)
                with contextlib.suppress(Exception):
                    self._own.close()
                self._own = None
            if self._own is None:
                self._own = self._open()
            conn = self._own
            ok = False
            try:
                with self._io.guard(conn, self._statement_timeout + self._connect_timeout):
                    yield conn
                ok = True
            finally:
                if not ok and (conn.broken or conn.closed):
                    with contextlib.suppress(Exception):
                        conn.close()
                    self._own = None

    def wrap(self, what: str, exc: psycopg.Error) -> BackendUnavailable:
        """The :class:`BackendUnavailable` for a failed ``what`` (never shows a password).

        Args:
            what: what was attempted, e.g. ``"claim 'purge@...'"``.
            exc: the driver error; chain it with ``raise ... from exc``.
        """
        if self._conninfo is not None:
            return unavailable(what, self._conninfo, exc)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return BackendUnavailable(f"cannot {what} ({self.where}): {detail}")

    def close(self) -> None:
        """Close the connection it opened itself (idempotent); pools and connections stay open.

        Never waits for a call in flight (it may be stuck on a silent link until its
        bound): then the connection is closed in the background once that call ends.
        """
        if not self._lock.acquire(blocking=False):
            threading.Thread(target=self._close_when_free, daemon=True).start()
            return
        try:
            self._close_own()
        finally:
            self._lock.release()

    def _close_when_free(self) -> None:
        with self._lock:
            self._close_own()

    def _close_own(self) -> None:
        """Close our connection and its watchdog; the caller holds the lock, so no call
        arms a guard meanwhile."""
        conn, self._own = self._own, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        self._io.close()


def _check_term(term: object) -> None:
    if term is not None and (
        isinstance(term, bool) or not isinstance(term, int) or not 0 <= term <= _MAX_TERM
    ):
        raise ConfigError(f"term must be None or an int in [0, 2**63), got {term!r}")


class PostgresClaimer:
    """Claims fires in Postgres so that each one runs at most once across a fleet.

    See the module docstring for the semantics (kept until ttl, expired claims replaced
    atomically, server time, fail closed, fire-key format version) and the three kinds
    of ``conninfo_or_pool``. Thread-safe.

    Args:
        conninfo_or_pool: a libpq connection string or URI, a pool with a
            ``connection()`` context manager (``psycopg_pool.ConnectionPool``), or a
            ``psycopg.Connection``.
        ttl: seconds a claim binds, in server time (at least 1 ms; default 600). Longer
            than the latest any node may start a fire.
        table: claims table, optionally schema-qualified (``"ops.claims"``).
        holder: identity recorded with each claim; a random process identity
            (:func:`random_identity`) by default.
        create_tables: create the table on first use. Off by default: run
            :func:`~rselection.postgres.migrate` (or ``rselection migrate``) once.
        connect_timeout: seconds to wait for a connection (connection string only).
        statement_timeout: bound of one claim on the server, seconds (connection string
            only); a claim that overruns raises ``BackendUnavailable``.

    Raises:
        ConfigError: no connection, a ttl below 1 ms, an unsafe table name, an empty
            holder, bad timeouts.
    """

    def __init__(
        self,
        conninfo_or_pool: str | Any,
        *,
        ttl: float = 600.0,
        table: str = CLAIMS_TABLE,
        holder: str | None = None,
        create_tables: bool = False,
        connect_timeout: float = 5.0,
        statement_timeout: float = 10.0,
    ) -> None:
        self.ttl = check_ttl(ttl)
        self._ident = table_identifier(table)  # validates
        self.table = table
        self.holder = random_identity() if holder is None else check_name(holder, "holder")
        self.create_tables = bool(create_tables)
        self._conns = Connections(
            conninfo_or_pool,
            owner="PostgresClaimer",
            application_name="rselection:claims",
            connect_timeout=check_ttl(connect_timeout, "connect_timeout"),
            statement_timeout=check_ttl(statement_timeout, "statement_timeout"),
        )
        self._ready = not self.create_tables
        self._claim_sql = sql.SQL(
            "WITH foreign_format AS ("
            " SELECT f.format_version FROM {t} f"
            " WHERE (f.format_version < %(fv)s OR f.format_version > %(fv)s)"
            " AND f.expires_at > clock_timestamp() LIMIT 1"
            "), claimed AS ("
            " INSERT INTO {t} AS c"
            " (fire_key, format_version, holder, term, claimed_at, expires_at)"
            " SELECT %(key)s::text, %(fv)s::int, %(holder)s::text, %(term)s::bigint,"
            " clock_timestamp(), clock_timestamp() + make_interval(secs => %(ttl)s::float8)"
            " WHERE NOT EXISTS (SELECT 1 FROM foreign_format)"
            " ON CONFLICT (fire_key) DO UPDATE SET"
            " format_version = EXCLUDED.format_version, holder = EXCLUDED.holder,"
            " term = EXCLUDED.term, claimed_at = clock_timestamp(),"
            " expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8)"
            " WHERE c.expires_at <= clock_timestamp()"
            " RETURNING 1"
            ") SELECT (SELECT count(*) FROM claimed), (SELECT format_version FROM foreign_format)"
        ).format(t=self._ident)
        # Missed fires: keys (oldest first) newer than the newest one already claimed.
        self._claim_missed_sql = sql.SQL(
            "WITH foreign_format AS ("
            " SELECT f.format_version FROM {t} f"
            " WHERE (f.format_version < %(fv)s OR f.format_version > %(fv)s)"
            " AND f.expires_at > clock_timestamp() LIMIT 1"
            "), keys AS ("
            " SELECT k.key, k.ord FROM unnest(%(keys)s::text[]) WITH ORDINALITY AS k(key, ord)"
            "), held AS ("
            " SELECT coalesce(max(keys.ord), 0) AS ord FROM keys JOIN {t} h"
            " ON h.fire_key = keys.key AND h.expires_at > clock_timestamp()"
            "), claimed AS ("
            " INSERT INTO {t} AS c"
            " (fire_key, format_version, holder, term, claimed_at, expires_at)"
            " SELECT keys.key, %(fv)s::int, %(holder)s::text, %(term)s::bigint,"
            " clock_timestamp(), clock_timestamp() + make_interval(secs => %(ttl)s::float8)"
            " FROM keys, held WHERE keys.ord > held.ord"
            " AND NOT EXISTS (SELECT 1 FROM foreign_format)"
            " ON CONFLICT (fire_key) DO UPDATE SET"
            " format_version = EXCLUDED.format_version, holder = EXCLUDED.holder,"
            " term = EXCLUDED.term, claimed_at = clock_timestamp(),"
            " expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8)"
            " WHERE c.expires_at <= clock_timestamp()"
            " RETURNING c.fire_key"
            ") SELECT array(SELECT fire_key FROM claimed),"
            " (SELECT format_version FROM foreign_format)"
        ).format(t=self._ident)
        self._cleanup_sql = sql.SQL(
            "DELETE FROM {} WHERE expires_at < clock_timestamp() - interval '1 minute'"
        ).format(self._ident)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(table={self.table!r}, ttl={self.ttl}, "
            f"holder={self.holder!r}, {self._conns.where})"
        )

    def __enter__(self) -> PostgresClaimer:
        """Return the claimer; the ``with`` block closes its own connection on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the claimer's own connection (see :meth:`close`)."""
        self.close()

    def close(self) -> None:
        """Close the connection the claimer opened (idempotent; a later call reopens it).

        A pool or connection passed in is left open: it belongs to the caller. Claims are
        kept: they bind until their ttl.
        """
        self._conns.close()

    def _run(
        self, what: str, conn: psycopg.Connection[Any], query: sql.Composed, params: Any
    ) -> Any:
        try:
            if not self._ready:
                create_tables(conn, claims=self.table)
                self._ready = True
            with conn.transaction():
                cur = conn.execute(query, params)
                return cur.fetchone() if cur.description is not None else cur.rowcount
        except psycopg.errors.UndefinedTable as exc:
            raise ConfigError(
                f"cannot {what}: the claims table {self.table!r} does not exist in this "
                "connection's database or search_path: run rselection.postgres.migrate(conn) "
                "(or `rselection migrate`) once, or pass create_tables=True"
            ) from exc
        except (psycopg.errors.UndefinedColumn, psycopg.errors.NotNullViolation) as exc:
            raise ConfigError(
                f"cannot {what}: {self.table!r} is not a claims table made by migrate() "
                f"({str(exc).strip().splitlines()[0]})"
            ) from exc
        except psycopg.Error as exc:
            raise self._conns.wrap(what, exc) from exc

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim the missed fires among ``fire_keys`` in one statement; return those won.

        ``fire_keys`` are one task's fires, oldest first. Every key newer than the newest
        one that an unexpired claim already holds is claimed (that claim marks how far
        the fleet got); the keys won come back oldest first. A leader that starts calls
        this once per task, instead of one :meth:`claim` per missed fire.

        Raises:
            ConfigError, BackendUnavailable: as :meth:`claim`.
        """
        for key in fire_keys:
            check_name(key, "fire_key")
        _check_term(term)
        if not fire_keys:
            return []
        params = {
            "keys": list(fire_keys),
            "fv": FIRE_KEY_FORMAT,
            "holder": self.holder,
            "term": term,
            "ttl": self.ttl,
        }
        what = f"claim {len(fire_keys)} missed fires from {fire_keys[0][:80]!r}"
        with self._conns.connection() as conn:
            won, foreign = self._run(what, conn, self._claim_missed_sql, params)
        self._refuse_foreign_format(what, foreign)
        order = {key: i for i, key in enumerate(fire_keys)}
        return sorted(won, key=order.__getitem__)

    def _refuse_foreign_format(self, what: str, foreign: int | None) -> None:
        if foreign is not None:
            raise ConfigError(
                f"cannot {what}: the claims table {self.table!r} holds unexpired claims "
                f"written with fire-key format {foreign}, and this release writes format "
                f"{FIRE_KEY_FORMAT}; the same fire would get two keys and run twice. Run "
                "one release of rselection across the fleet, or wait one claim ttl after "
                "the last node of the other release stopped"
            )

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """Claim one fire: ``True`` if this call won it, ``False`` if a claim holds it.

        One statement. Wins when the key was never claimed or its last claim expired
        (then it is replaced). The claim binds until ``ttl`` seconds from now, server
        time, and is not released when the run ends.

        Args:
            fire_key: the fire's key, normally
                :func:`~rselection.format_fire_key` of the task and the *scheduled*
                instant (never the time the job happens to run).
            term: a fencing term to record with the claim (for example the leader's).

        Raises:
            ConfigError: an empty or oversized key, a bad term, a missing claims table,
                or unexpired claims written in another fire-key format (see the module
                docstring).
            BackendUnavailable: the claim could not be made or its outcome is unknown;
                do not run the fire.
        """
        check_name(fire_key, "fire_key")
        _check_term(term)
        params = {
            "key": fire_key,
            "fv": FIRE_KEY_FORMAT,
            "holder": self.holder,
            "term": term,
            "ttl": self.ttl,
        }
        what = f"claim {fire_key[:80]!r}"
        with self._conns.connection() as conn:
            row = self._run(what, conn, self._claim_sql, params)
        won, foreign = row
        self._refuse_foreign_format(what, foreign)
        logger.debug("%s: %s", what, "won" if won else "held by another claim")
        return bool(won)

    def cleanup(self) -> int:
        """Delete claims that expired more than a minute ago; return how many.

        Safe from any node at any time: a claim that still binds is never deleted.

        Raises:
            ConfigError: the claims table does not exist.
            BackendUnavailable: the database cannot be reached.
        """
        with self._conns.connection() as conn:
            count = self._run("clean up claims", conn, self._cleanup_sql, None)
        logger.debug("claims table %s: deleted %s expired claims", self.table, count)
        return int(count)
