"""``PostgresClaimer``: at most one run per fire across a fleet, for any scheduler.

Every process of a fleet runs the same schedule (APScheduler, celery beat, a cron loop).
Before it runs a fire, it *claims* the fire's key::

    claimer = PostgresClaimer("postgresql://...")
    key = format_fire_key("purge", scheduled_at)  # "purge@2026-11-30T02:40:00.000000000Z"
    if claimer.claim(key):
        purge()

See ``docs/explanation/how-it-works.md``, "Claims: one run per fire", for how a claim
works (kept until its ttl, server time, fail closed, the fire-key format) and the three
kinds of ``conninfo``.
"""

from __future__ import annotations

import logging
from typing import Any

from psycopg import sql

from ..claiming import CLEANUP_BATCH, check_fire_key, check_fire_keys
from ..errors import ConfigError
from ..node_identity import NodeIdentity
from ..validation import check_optional_term, check_seconds
from .schema import CLAIMS_TABLE
from .table_client import TableClient

__all__ = [
    "FIRE_KEY_FORMAT",
    "MIN_TTL",
    "PostgresClaimer",
]

logger = logging.getLogger(__name__)

FIRE_KEY_FORMAT = 1
"""Format of the fire keys this release writes: ``"<task>@<UTC RFC 3339, 9 digits>Z"``."""

MIN_TTL = 0.001
"""The shortest ttl accepted, seconds (1 ms): claims are measured in server time with
microsecond precision."""


# What rselection.format_fire_key ends a key with, as a Postgres regular expression.
_INSTANT_SQL = r"@[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{9}Z$"


def _claim_statement(
    ident: sql.Composable,
    *,
    key: str,
    source: str = "",
    keys: str = "",
    where: str = "",
    order: str = "",
) -> sql.Composed:
    """One claim statement: insert a claim for each key that ``source`` yields (and
    ``where`` keeps), in ``order``; a key already claimed is taken only once its claim
    expired. A live claim written in another key format (another release) makes the
    statement claim nothing: the row it returns is the keys won and that format.

    ``keys`` adds common table expressions before the claims (they may read ``{t}``).
    """
    conditions = " AND ".join(filter(None, (where, "NOT EXISTS (SELECT 1 FROM foreign_format)")))
    return sql.SQL(
        "WITH foreign_format AS ("
        " SELECT f.format_version FROM {t} f"
        " WHERE (f.format_version < %(fv)s OR f.format_version > %(fv)s)"
        " AND f.expires_at > clock_timestamp() LIMIT 1)"
        f"{keys}, claimed AS ("
        " INSERT INTO {t} AS c (fire_key, format_version, holder, term, claimed_at, expires_at)"
        f" SELECT {key}, %(fv)s::int, %(holder)s::text, %(term)s::bigint,"
        " clock_timestamp(), clock_timestamp() + make_interval(secs => %(ttl)s::float8)"
        f" {source} WHERE {conditions} {order}"
        " ON CONFLICT (fire_key) DO UPDATE SET"
        " format_version = EXCLUDED.format_version, holder = EXCLUDED.holder,"
        " term = EXCLUDED.term, claimed_at = clock_timestamp(),"
        " expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8)"
        " WHERE c.expires_at <= clock_timestamp()"
        " RETURNING c.fire_key"
        ") SELECT array(SELECT fire_key FROM claimed),"
        " (SELECT format_version FROM foreign_format)"
    ).format(t=ident)


class PostgresClaimer(TableClient, NodeIdentity):
    """Claims fires in Postgres so that each one runs at most once across a fleet.

    See ``docs/explanation/how-it-works.md``, "Claims: one run per fire", for the
    semantics (kept until ttl, expired claims replaced atomically, server time, fail
    closed, fire-key format version) and the three kinds of ``conninfo``. Thread-safe.
    :meth:`close` leaves the claims made: they bind until their ttl.

    Args:
        conninfo: a libpq connection string or URI, a ``psycopg.Connection``, or a pool
            with a ``connection()`` context manager (``psycopg_pool.ConnectionPool``).
        ttl: seconds a claim binds, in server time (at least 1 ms; default 600). Longer
            than the latest any node may start a fire.
        table: claims table, optionally schema-qualified (``"ops.claims"``).
        node_id: who claims, recorded with each claim; a new node id
            (:func:`~rselection.validation.new_node_id`) by default, taken anew in a
            process forked from this one.
        create_tables: create the table on first use. Pass ``False`` where the
            application role may not run DDL, and run :func:`~rselection.postgres.migrate`
            (or ``rselection migrate``) once with one that may.
        connect_timeout: seconds to wait for a connection (connection string only).
        statement_timeout: bound of one claim on the server, seconds (connection string
            only); a claim that overruns raises ``BackendUnavailable``.

    Raises:
        ConfigError: a bad ``conninfo``, a ttl below 1 ms, an unsafe table name, a blank
            node_id, bad timeouts.
    """

    _kind = "claims"
    _role = "claimer"

    node_id: str
    """Who claims: recorded with each claim (in the ``holder`` column)."""

    def __init__(
        self,
        conninfo: str | Any,
        *,
        ttl: float = 600.0,
        table: str = CLAIMS_TABLE,
        node_id: str | None = None,
        create_tables: bool = True,
        connect_timeout: float = 5.0,
        statement_timeout: float = 10.0,
    ) -> None:
        self.ttl = check_seconds(ttl, "ttl", minimum=MIN_TTL)
        super().__init__(
            conninfo,
            owner="PostgresClaimer",
            application_name="rselection:claims",
            table=table,
            create_tables=create_tables,
            connect_timeout=connect_timeout,
            statement_timeout=statement_timeout,
        )
        self._take_node_id(node_id)
        self._claim_sql = _claim_statement(self._ident, key="%(key)s::text")
        # Missed fires: keys (oldest first) newer than the newest one already claimed.
        self._claim_missed_sql = _claim_statement(
            self._ident,
            keys=", keys AS ("
            " SELECT k.key, k.ord FROM unnest(%(keys)s::text[]) WITH ORDINALITY AS k(key, ord)"
            "), held AS ("
            " SELECT coalesce(max(keys.ord), 0) AS ord FROM keys JOIN {t} h"
            " ON h.fire_key = keys.key AND h.expires_at > clock_timestamp())",
            key="keys.key",
            source="FROM keys, held",
            where="keys.ord > held.ord",
        )
        # Many fires at once (those due at one instant): each key as in a claim. The
        # keys go in one order on every node (sorted), so two nodes claiming the same
        # batch wait for each other's rows in that order and never deadlock.
        self._claim_many_sql = _claim_statement(
            self._ident,
            key="k.key",
            source="FROM unnest(%(keys)s::text[]) WITH ORDINALITY AS k(key, ord)",
            order="ORDER BY k.ord",
        )
        # Missed fires of many tasks: keys numbered by task (grp) and age (ord); each
        # task's keys newer than its newest one already claimed.
        self._claim_missed_many_sql = _claim_statement(
            self._ident,
            keys=", keys AS ("
            " SELECT k.key, k.grp, k.ord"
            " FROM unnest(%(keys)s::text[], %(grps)s::int[], %(ords)s::int[]) AS k(key, grp, ord)"
            "), held AS ("
            " SELECT keys.grp, max(keys.ord) AS ord FROM keys JOIN {t} h"
            " ON h.fire_key = keys.key AND h.expires_at > clock_timestamp() GROUP BY keys.grp)",
            key="keys.key",
            source="FROM keys LEFT JOIN held ON held.grp = keys.grp",
            where="keys.ord > coalesce(held.ord, 0)",
            order="ORDER BY keys.key",
        )
        # Many series at once: the series (of those given) that have a claim.
        self._ran_before_many_sql = sql.SQL(
            "SELECT array(SELECT s.series FROM unnest(%(series)s::text[]) AS s(series)"
            " WHERE EXISTS (SELECT 1 FROM {t}"
            ' WHERE (fire_key COLLATE "C") > (s.series COLLATE "C")'
            ' AND (fire_key COLLATE "C") < ((s.series || \'[\') COLLATE "C")'
            " AND length(fire_key) = length(s.series) + 30))"
        ).format(t=self._ident)
        # Expired claims, oldest first (the expiry index), a batch at a time; the newest
        # claim of each task stays (ran_before() reads it), found by one probe of the
        # key index: a newer key of the same task, same length, in the same key range.
        self._cleanup_sql = sql.SQL(
            "DELETE FROM {t} d USING ("
            " SELECT c.fire_key FROM {t} c"
            " WHERE c.expires_at < clock_timestamp() - interval '1 minute'"
            " AND (c.fire_key !~ %(instant)s OR EXISTS (SELECT 1 FROM {t} n"
            '  WHERE (n.fire_key COLLATE "C") > (c.fire_key COLLATE "C")'
            '  AND (n.fire_key COLLATE "C") < ((left(c.fire_key, -30) || \'[\') COLLATE "C")'
            "  AND length(n.fire_key) = length(c.fire_key)))"
            " ORDER BY c.expires_at LIMIT %(batch)s FOR UPDATE OF c SKIP LOCKED"
            ") old WHERE d.fire_key = old.fire_key"
        ).format(t=self._ident)
        # Any claim of a task's series, expired or not: the key index's range of it.
        self._ran_before_sql = sql.SQL(
            "SELECT EXISTS (SELECT 1 FROM {t}"
            ' WHERE (fire_key COLLATE "C") > (%(series)s::text COLLATE "C")'
            ' AND (fire_key COLLATE "C") < ((%(series)s::text || \'[\') COLLATE "C")'
            " AND length(fire_key) = length(%(series)s::text) + 30)"
        ).format(t=self._ident)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(table={self.table!r}, ttl={self.ttl}, "
            f"node_id={self.node_id!r}, {self._conns.where})"
        )

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim the missed fires among ``fire_keys`` in one statement; return those won.

        ``fire_keys`` are one task's fires, oldest first. Every key newer than the newest
        one that an unexpired claim already holds is claimed (that claim marks how far
        the fleet got); the keys won come back oldest first. A leader that starts calls
        this once per task, instead of one :meth:`claim` per missed fire.

        Raises:
            ConfigError, BackendUnavailable: as :meth:`claim`.
        """
        fire_keys = check_fire_keys(fire_keys)
        check_optional_term(term)
        if not fire_keys:
            return []
        what = f"claim {len(fire_keys)} missed fires from {fire_keys[0][:80]!r}"
        won = self._claim(what, self._claim_missed_sql, term, keys=list(fire_keys))
        order = {key: i for i, key in enumerate(fire_keys)}
        return sorted(won, key=order.__getitem__)

    def claim_missed_many(
        self, fire_keys: list[list[str]], *, term: int | None = None
    ) -> list[list[str]]:
        """:meth:`claim_missed` of each list (one task's fires each, oldest first), all in
        one statement; return the keys won of each list, oldest first. A leader that
        starts calls this once for all its tasks.

        Raises:
            ConfigError: as :meth:`claim`, or a key given twice (in one list or two).
            BackendUnavailable: as :meth:`claim`.
        """
        flat = check_fire_keys([key for keys in fire_keys for key in keys])
        check_optional_term(term)
        if not flat:
            return [[] for _ in fire_keys]
        what = f"claim the missed fires of {len(fire_keys)} tasks from {flat[0][:80]!r}"
        won = self._claim(
            what,
            self._claim_missed_many_sql,
            term,
            keys=flat,
            grps=[grp for grp, keys in enumerate(fire_keys) for _ in keys],
            ords=[ord_ + 1 for keys in fire_keys for ord_ in range(len(keys))],
        )
        got = set(won)
        return [[key for key in keys if key in got] for keys in fire_keys]

    def _claim(self, what: str, query: sql.Composed, term: int | None, **keys: Any) -> list[str]:
        """Run one claim statement with ``keys`` (its key parameters); return the keys
        won, refusing a table that holds live claims of another key format."""
        params = {"fv": FIRE_KEY_FORMAT, "holder": self.node_id, "term": term, "ttl": self.ttl}
        won, foreign = self._run(what, query, params | keys)
        if foreign is not None:
            raise ConfigError(
                f"cannot {what}: the claims table {self.table!r} holds unexpired claims "
                f"written with fire-key format {foreign}, and this release writes format "
                f"{FIRE_KEY_FORMAT}; the same fire would get two keys and run twice. Run "
                "one release of rselection across the fleet, or wait one claim ttl after "
                "the last node of the other release stopped"
            )
        return list(won)

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
        check_fire_key(fire_key)
        check_optional_term(term)
        what = f"claim {fire_key[:80]!r}"
        won = self._claim(what, self._claim_sql, term, key=fire_key)
        logger.debug("%s: %s", what, "won" if won else "held by another claim")
        return bool(won)

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        """Claim many fires in one statement; return the keys this call won.

        Each key is claimed as by :meth:`claim` (won when never claimed or its claim
        expired), all in one transaction: a leader claims every fire due at one instant
        this way, one round trip per instant instead of one per fire. The keys are
        independent fires (of any tasks), each given once.

        Raises:
            ConfigError: as :meth:`claim`, or a key given twice.
            BackendUnavailable: the claims could not be made or their outcome is
                unknown; run none of the fires.
        """
        fire_keys = check_fire_keys(fire_keys)
        check_optional_term(term)
        if not fire_keys:
            return set()
        what = f"claim {len(fire_keys)} fires from {fire_keys[0][:80]!r}"
        won = self._claim(what, self._claim_many_sql, term, keys=sorted(fire_keys))
        logger.debug("%s: won %d", what, len(won))
        return set(won)

    def cleanup(self, *, batch: int | None = None) -> int:
        """Delete claims that expired more than a minute ago; return how many.

        Safe from any node at any time: a claim that still binds is never deleted, nor
        the newest claim of each task (a key :func:`~rselection.format_fire_key` wrote):
        it tells a starting leader that the task ran before (:meth:`ran_before`). Each
        statement deletes at most ``batch`` claims (:data:`~rselection.claiming.
        CLEANUP_BATCH` when ``None``), oldest expiry first, skipping rows locked by a
        claim in progress; with ``batch=None`` statements follow until none is left.
        A leader calls this itself, at least once per claim ttl.

        Args:
            batch: at most this many claims (one statement); ``None``: all of them.

        Raises:
            ConfigError: the claims table does not exist, or a bad ``batch``.
            BackendUnavailable: the database cannot be reached.
        """
        if batch is not None and (
            isinstance(batch, bool) or not isinstance(batch, int) or batch < 1
        ):
            raise ConfigError(f"batch must be None or a positive int, got {batch!r:.40}")
        size = CLEANUP_BATCH if batch is None else batch
        params = {"batch": size, "instant": _INSTANT_SQL}
        total = 0
        while True:
            count = int(self._run("clean up claims", self._cleanup_sql, params))
            total += count
            if batch is not None or count < size:
                break
        logger.debug("claims table %s: deleted %s expired claims", self.table, total)
        return total

    def ran_before_many(self, series: list[str]) -> set[str]:
        """Those of ``series`` that :meth:`ran_before` says ran before, in one statement
        (one probe of the key index each).

        Raises:
            ConfigError: a bad series or a missing claims table.
            BackendUnavailable: the database cannot be reached.
        """
        series = check_fire_keys(series)
        if not series:
            return set()
        what = f"look up the claims of {len(series)} tasks from {series[0][:80]!r}"
        return set(self._run(what, self._ran_before_many_sql, {"series": series})[0])

    def ran_before(self, series: str) -> bool:
        """Whether a fire of ``series`` (a task's fire keys without the instant, such as
        ``"billing/purge@"``) was ever claimed in this table, expired claims included
        (:meth:`cleanup` keeps the newest of each task). One probe of the key index.

        Raises:
            ConfigError: a bad ``series`` or a missing claims table.
            BackendUnavailable: the database cannot be reached.
        """
        check_fire_key(series)
        what = f"look up the claims of {series[:80]!r}"
        return bool(self._run(what, self._ran_before_sql, {"series": series})[0])
