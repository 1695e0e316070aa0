"""``PostgresAdmin``: read and operate a fleet's Postgres leases from outside it.

What ``rselection status``, ``resign``, ``forget``, ``drain``, ``undrain`` and ``task``
do, for programs: a status snapshot (:mod:`.snapshot`), handover requests
(:mod:`.handover`), retiring a lease (:mod:`.retire`), drained nodes (:mod:`.drains`),
task controls and run histories (:mod:`.task_runs`) and waiting for a new term.
Answers are the shapes of :mod:`rselection.admin`, the same as
:class:`~rselection.redis.RedisAdmin`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
from psycopg import sql

from ..admin import DEFAULT_HISTORY_ROWS, LeaseAdmin, Refused, Retirement, StatusSnapshot, TermWatch
from ..errors import ConfigError
from ..history import TermRecord, check_history_limit
from ..lease import LeaderInfo
from ..members import NodeInfo
from ..validation import check_name, check_seconds
from . import drains, handover
from ._conn import describe_conninfo, open_session, session_conninfo
from .connections import Connections
from .history import read_history
from .lease import lease_channel, resolve_lease_table
from .membership import node_infos, nodes_sql
from .notices import parse_lease_notice
from .retire import retire_lease
from .schema import (
    CLAIMS_TABLE,
    DEFAULT_TABLE,
    NODES_TABLE,
    drains_table_name,
    table_exists,
    table_identifier,
)
from .snapshot import read_snapshot
from .task_runs import PostgresTaskStore

__all__ = ["PostgresAdmin", "PostgresTermWatch", "describe_conninfo"]

_OWNER = "PostgresAdmin"


class PostgresAdmin(LeaseAdmin):
    """The leases of one lease table, read and operated from outside the fleet.

    Every method takes a connection for the call (``conninfo`` as the other Postgres
    objects take it) and raises :class:`~rselection.errors.BackendUnavailable` when the
    database fails, :class:`~rselection.errors.ConfigError` when the lease table does
    not exist (see :meth:`lease_table_exists`) or on bad arguments.

    Args:
        conninfo: the leases' database: a connection string, a ``psycopg.Connection``
            (used as it is, never closed here) or a pool.
        table: the lease table, optionally schema-qualified.
        nodes_table: the node heartbeats table.
        claims_table: the fire claims table (the last fires of :meth:`status`).
        node_timeout: a node is alive when seen within this many seconds (the leaders'
            default: 15).
    """

    def __init__(
        self,
        conninfo: Any,
        *,
        table: str = DEFAULT_TABLE,
        nodes_table: str = NODES_TABLE,
        claims_table: str = CLAIMS_TABLE,
        node_timeout: float = 15.0,
    ) -> None:
        for each in (table, nodes_table, claims_table):
            table_identifier(each)  # validates
        self.table, self.nodes_table, self.claims_table = table, nodes_table, claims_table
        self.node_timeout = check_seconds(node_timeout, "node_timeout")
        self._source = conninfo
        self._conns = Connections(conninfo, owner=_OWNER, application_name="rselection:admin")
        self._tasks = PostgresTaskStore(self._conns, table=table)
        self.where = self._conns.where
        """Where the leases are, for messages (never with a password)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(table={self.table!r}, {self.where})"

    def close(self) -> None:
        """Close the connections it opened itself (a connection or pool passed in stays)."""
        self._conns.close()

    @contextlib.contextmanager
    def _call(self, what: str, *, table: bool = True) -> Iterator[psycopg.Connection[Any]]:
        """A connection for one call; driver errors become ``BackendUnavailable``; with
        ``table``, a missing lease table a ``ConfigError``."""
        try:
            with self._conns.connection() as conn:
                if table and not table_exists(conn, self.table):
                    raise ConfigError(
                        f"lease table {self.table!r} does not exist: run `rselection migrate`"
                    )
                yield conn
        except psycopg.Error as exc:
            raise self._conns.wrap(what, exc) from exc

    def lease_table_exists(self) -> bool:
        """Whether the lease table exists (``rselection migrate`` creates it)."""
        with self._call("find the lease table", table=False) as conn:
            return table_exists(conn, self.table)

    def leases(self) -> list[str]:
        """The names of every lease in the table (held, free or retired), sorted."""
        with self._call("list the leases") as conn:
            rows = conn.execute(
                sql.SQL("SELECT name FROM {} ORDER BY name").format(table_identifier(self.table))
            ).fetchall()
        return [row[0] for row in rows]

    def exists(self, name: str) -> bool:
        """Whether lease ``name`` has a row (held, free or retired)."""
        name = check_name(name, "lease name")
        with self._call("find the lease") as conn:
            row = conn.execute(
                sql.SQL("SELECT 1 FROM {} WHERE name = %s").format(table_identifier(self.table)),
                (name,),
            ).fetchone()
        return row is not None

    def status(self, names: Iterable[str] | None = None) -> StatusSnapshot:
        """See :meth:`~rselection.admin.LeaseAdmin.status`."""
        asked = None if names is None else [check_name(n, "lease name") for n in names]
        with self._call("read the leases") as conn:
            return read_snapshot(
                conn,
                table=self.table,
                nodes_table=self.nodes_table,
                claims_table=self.claims_table,
                node_timeout=self.node_timeout,
                names=asked,
            )

    def nodes(self, name: str) -> list[NodeInfo] | None:
        """See :meth:`~rselection.admin.LeaseAdmin.nodes`; ``None`` when there is no nodes table."""
        name = check_name(name, "lease name")
        with self._call("list the nodes") as conn:
            if not table_exists(conn, self.nodes_table):
                return None
            statement = nodes_sql(self.nodes_table, self.table, self.node_timeout, name)
            return node_infos(conn.execute(statement).fetchall())

    def live_nodes(self, name: str) -> list[str] | None:
        """The ids of the nodes of lease ``name`` seen within the node timeout; ``None``
        when there is no nodes table."""
        nodes = self.nodes(name)
        return None if nodes is None else [node.node_id for node in nodes if node.alive]

    def current_holder(self, name: str) -> LeaderInfo | None:
        """See :meth:`~rselection.admin.LeaseAdmin.current_holder`."""
        with self._call("read the lease holder", table=False) as conn:
            return handover.current_holder(conn, name, table=self.table)

    def request_handover(
        self, name: str, *, to: str | None = None, valid_for: float = 10.0
    ) -> LeaderInfo | None:
        """See :meth:`~rselection.admin.LeaseAdmin.request_handover` and
        :func:`rselection.postgres.request_handover`."""
        self.refuse_handover(name, to)
        with self._call("record the handover request", table=False) as conn:
            return handover.request_handover(
                conn, name, table=self.table, to=to, valid_for=valid_for
            )

    def drained(self, name: str) -> set[str]:
        """See :meth:`~rselection.admin.LeaseAdmin.drained`: the rows of the drains table
        beside the nodes table (none when it does not exist)."""
        name = check_name(name, "lease name")
        with self._call("read the drained nodes") as conn:
            return drains.drained_nodes(conn, self.nodes_table, name)

    def drained_of(self, names: Iterable[str]) -> set[tuple[str, str]]:
        """See :meth:`~rselection.admin.LeaseAdmin.drained_of`: one read."""
        wanted = set(names)
        if not wanted:
            return set()
        with self._call("read the drained nodes") as conn:
            pairs = drains.drained_pairs(conn, self.nodes_table)
        return {pair for pair in pairs if pair[0] in wanted}

    def _set_drained(self, name: str, node_id: str, drained: bool) -> bool:
        change = drains.drain if drained else drains.undrain
        with self._call("drain the node" if drained else "undrain the node") as conn:
            return change(
                conn,
                lease_table=self.table,
                nodes_table=self.nodes_table,
                name=name,
                node_id=node_id,
            )

    def _task_store(self) -> PostgresTaskStore:
        # The task tables beside the lease table (see rselection.postgres.task_runs).
        return self._tasks

    def cancel_handover(self, name: str, term: int) -> bool:
        """See :meth:`~rselection.admin.LeaseAdmin.cancel_handover`."""
        with self._call("withdraw the handover request", table=False) as conn:
            return handover.cancel_handover(conn, name, term, table=self.table)

    def history(self, name: str, *, limit: int = DEFAULT_HISTORY_ROWS) -> list[TermRecord]:
        """See :meth:`~rselection.admin.LeaseAdmin.history` (read from the table
        ``<table>_history``)."""
        name = check_name(name, "lease name")
        limit = check_history_limit(limit, "limit", least=1)
        with self._call("read the leadership history") as conn:
            records = read_history(conn, name, table=self.table, limit=limit)
        if records is None:
            raise Refused(
                f"lease table {self.table!r} has no leadership history table beside it yet: "
                "run `rselection migrate` to create it (nothing else changes)"
            )
        return records

    def retire(self, name: str, *, check_nodes: bool = True) -> Retirement:
        """Retire lease ``name``, which no service uses any more (``rselection forget``).

        Its row and term stay, marked retired at that term: :meth:`status` snapshots
        still show it; the next acquisition brings it back.

        Args:
            name: the lease name.
            check_nodes: also refuse while a node of the lease heartbeats.

        Raises:
            Refused: no such lease, a live holder, live nodes, a lease table that
                predates retiring (``rselection migrate``), or a row locked too long.
        """
        name = check_name(name, "lease name")
        with self._call("retire the lease") as conn:
            return retire_lease(
                conn,
                name,
                table=self.table,
                nodes_table=self.nodes_table if check_nodes else None,
                node_timeout=self.node_timeout,
                drains_table=drains_table_name(self.nodes_table),
            )

    def watch_terms(self, name: str) -> PostgresTermWatch:
        """See :meth:`~rselection.admin.LeaseAdmin.watch_terms`."""
        return PostgresTermWatch(self, check_name(name, "lease name"))


class PostgresTermWatch(TermWatch):
    """Waits for a new term of one lease: woken by the acquisition's ``NOTIFY``, and
    re-reading the holder every half second in case a notification was missed.

    It listens on the admin's connection when it was given one, else on a session of
    its own (a pool's connections are lent per call: none would keep listening).

    Args:
        admin: the admin of the lease's table.
        name: the lease name.
    """

    def __init__(self, admin: PostgresAdmin, name: str) -> None:
        self._admin, self._name = admin, name
        self._own: psycopg.Connection[Any] | None = None
        self._channel: str | None = None

    @contextlib.contextmanager
    def _session(self) -> Iterator[psycopg.Connection[Any]]:
        if self._own is not None:
            yield self._own
        else:
            with self._admin._conns.connection() as conn:
                yield conn

    def __enter__(self) -> PostgresTermWatch:
        """Listen on the lease's channel."""
        admin = self._admin
        if admin._conns.kind != "connection":
            conninfo = session_conninfo(admin._source, _OWNER)
            self._own = open_session(
                conninfo,
                application_name="rselection:admin",
                connect_timeout=5.0,
                keepalive_idle=5.0,
                user_timeout=10.0,
            )
        try:
            with self._session() as conn:
                found = resolve_lease_table(conn, admin.table)
                if found is None:
                    raise ConfigError(
                        f"lease table {admin.table!r} does not exist: run `rselection migrate`"
                    )
                self._channel = lease_channel(found[1], self._name)
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except psycopg.Error as exc:
            self.close()
            raise admin._conns.wrap("listen for a new term", exc) from exc
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop listening (close the session of its own)."""
        if self._own is not None:
            self._own.close()
            self._own = None
        elif self._channel is not None:
            with contextlib.suppress(psycopg.Error), self._session() as conn:
                conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(self._channel)))
        self._channel = None

    def wait(self, after_term: int, timeout: float) -> LeaderInfo | None:
        """See :meth:`~rselection.admin.TermWatch.wait`."""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                with self._session() as conn:
                    for notify in conn.notifies(timeout=min(left, 0.5)):
                        notice = parse_lease_notice(notify.payload)
                        if (
                            notice is not None
                            and notice.event == "acquired"
                            and notice.term is not None
                            and notice.term > after_term
                        ):
                            if notice.holder is not None:
                                return notice.holder
                            break  # a notice that does not say enough: read the holder
                current = self._admin.current_holder(self._name)
                if current is not None and current.term > after_term:
                    return current
        except psycopg.Error as exc:
            raise self._admin._conns.wrap("wait for a new term", exc) from exc
        return None
