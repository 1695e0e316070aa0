"""Node membership: every node of a lease heartbeats into a table; anyone can list them.

Each :class:`~rselection.PostgresLeader` (leader and followers alike) upserts its row
``(lease name, node id)`` every ``heartbeat_interval`` seconds with the server's clock.
The heartbeats of every node of a process ride on its shared keeper session
(:mod:`rselection.postgres.keeper`), sent by the keeper's own thread while the session
is idle, one statement for all nodes due: no session or thread of their own. Heartbeats
go on through outages (a failed one is retried within a second, and on the new session
once the keeper has reconnected) until the leader stops. A node is *alive* while its
last heartbeat is younger than ``node_timeout`` by the server's clock; no client clock
is ever compared. A node that stops gracefully deletes its row at once; rows of nodes
lost for more than a day are purged by the heartbeats of the others.

The node id, not the client address, identifies a node: many nodes behind one NAT or
connection pooler share an address (``client_addr`` is kept for operators only).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any, Unpack

import psycopg
from psycopg import sql

from .. import forks
from ..errors import BackendUnavailable
from ..members import MembershipArgs, MembershipBase, NodeInfo
from ._conn import per_call_source, session_conninfo
from ._lease_sql import array_literal
from .connections import Connections
from .drains import drained_nodes, drained_sql
from .keeper import Heartbeat, SharedKeeper
from .schema import create_tables, table_identifier

__all__ = ["PostgresMembership", "node_infos", "nodes_sql"]

logger = logging.getLogger(__name__)

_PURGE_AFTER = 86_400.0  # seconds a lost node's row is kept for operators to see

# What a heartbeat of a listed node writes. A node restarted under its id (a crash, a
# container restarted in place) is another run: its first heartbeat starts it anew, so
# that it settles again before a newer version is handed the lease.
_ON_BEAT = (
    "last_seen = clock_timestamp(), client_addr = EXCLUDED.client_addr,"
    " hostname = EXCLUDED.hostname, pid = EXCLUDED.pid,"
    " version = EXCLUDED.version, eligible = EXCLUDED.eligible,"
    " started_at = CASE WHEN t.incarnation IS DISTINCT FROM EXCLUDED.incarnation"
    " THEN clock_timestamp() ELSE t.started_at END, incarnation = EXCLUDED.incarnation"
)


def nodes_sql(
    table: str, lease_table: str, node_timeout: float, name: str | None = None
) -> sql.Composed:
    """The statement listing the nodes of lease ``name`` (of every lease: ``None``), by
    lease, oldest first; its rows make :class:`NodeInfo` (:func:`node_infos`).

    Args:
        table: the nodes table.
        lease_table: the lease table, to flag each lease's leader.
        node_timeout: a node not seen for this long is lost, seconds.
        name: the lease name, or ``None`` for every lease.
    """
    where = sql.SQL("") if name is None else sql.SQL(" WHERE n.name = {}").format(sql.Literal(name))
    return sql.SQL(
        "SELECT n.name, n.node_id, n.hostname, n.pid, host(n.client_addr), n.started_at,"
        " n.last_seen,"
        " n.last_seen >= clock_timestamp() - make_interval(secs => {timeout}),"
        " coalesce(l.holder = n.node_id AND l.expires_at > clock_timestamp(), false),"
        " n.version, coalesce(n.eligible, true)"
        " FROM {n} n LEFT JOIN {l} l ON l.name = n.name"
        "{where} ORDER BY n.name, n.started_at, n.node_id"
    ).format(
        n=table_identifier(table),
        l=table_identifier(lease_table),
        timeout=sql.Literal(float(node_timeout)),
        where=where,
    )


def node_infos(rows: Sequence[Sequence[Any]]) -> list[NodeInfo]:
    """The nodes of the rows of :func:`nodes_sql`.

    Args:
        rows: its rows.
    """
    return [
        NodeInfo(
            node_id=row[1],
            name=row[0],
            hostname=row[2],
            pid=row[3],
            client_addr=row[4],
            started_at=row[5],
            last_seen=row[6],
            alive=bool(row[7]),
            is_leader=bool(row[8]),
            version=row[9],
            eligible=bool(row[10]),
        )
        for row in rows
    ]


class PostgresMembership(MembershipBase):
    """Heartbeats of one node, and the list of a lease's nodes.

    Args:
        conninfo: where the nodes table lives (the lease's database): a connection
            string, a ``psycopg.Connection`` or a pool. The heartbeats ride on the
            keeper session of its connection string (that of a connection's parameters
            or a pool's, see :func:`~._conn.session_conninfo`); reads and the leave
            borrow from a pool given, else from the process's pooled sessions.
        table: the nodes table, optionally schema-qualified.
        lease_table: the lease table, to flag the leader in :meth:`nodes`.
        create_tables: create the nodes table on first use.
        node: the node's lease name, id, heartbeats, version and eligibility (see
            :class:`~rselection.members.MembershipArgs`).
    """

    def __init__(
        self,
        conninfo: str | Any,
        *,
        table: str,
        lease_table: str,
        create_tables: bool,
        **node: Unpack[MembershipArgs],
    ) -> None:
        super().__init__(**node)
        self.table = table
        self._create = create_tables
        # A heartbeat stuck longer than its interval is late anyway: give up and retry.
        self._statement_timeout = max(1.0, min(10.0, self.heartbeat_interval))
        sessions = session_conninfo(conninfo, "PostgresLeader membership")  # validates
        self._conns = Connections(
            per_call_source(conninfo, sessions),
            owner="PostgresLeader membership",
            application_name="rselection:nodes",
            statement_timeout=self._statement_timeout,
            pooled=True,
        )
        nodes = table_identifier(table)
        self._beat_sql = sql.SQL(
            "WITH purge AS ("
            " DELETE FROM {n} WHERE name = %(lease)s AND node_id <> %(node)s"
            " AND last_seen < clock_timestamp() - make_interval(secs => %(purge)s))"
            " INSERT INTO {n} AS t (name, node_id, hostname, pid, client_addr, started_at,"
            " last_seen, version, eligible, incarnation) VALUES (%(lease)s, %(node)s,"
            " %(host)s, %(pid)s, inet_client_addr(), clock_timestamp(), clock_timestamp(),"
            " %(version)s, %(eligible)s, %(incarnation)s)"
            " ON CONFLICT (name, node_id) DO UPDATE SET " + _ON_BEAT
        ).format(n=nodes)
        self._leave_sql = sql.SQL("DELETE FROM {} WHERE name = %s AND node_id = %s").format(nodes)
        self._nodes_sql = nodes_sql(table, lease_table, self.node_timeout, self.name)
        self._conninfo = sessions
        self._lease_table = lease_table
        self._lock = threading.Lock()  # start() and stop() may race at shutdown
        self._keeper: SharedKeeper | None = None
        self._stopped = False
        self._drains_refused = False  # the drains table was refused once (logged)
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): the keeper session its
        heartbeats ride on is the parent's; forget it (:meth:`nodes` reads on this
        process's sessions). Heartbeats started in the parent are the parent's node's:
        here it neither sends them nor deletes its row."""
        forks.keep_inherited(self._keeper)
        if self._keeper is not None:
            self._stopped = True
        self._keeper = None
        self._lock = threading.Lock()

    @property
    def create_tables(self) -> bool:
        """Create the nodes table before the first heartbeat."""
        return self._create

    def start(self) -> None:
        """Heartbeat now and then every ``heartbeat_interval``, on the process's shared
        keeper session, until :meth:`stop`. Does nothing once stopped."""
        with self._lock:
            if self._stopped or self._keeper is not None:
                return
            self._keeper = SharedKeeper.beat_through(self._conninfo, self._lease_table, self)

    def stop(self) -> None:
        """Stop heartbeating and delete this node's row (best effort), then disconnect."""
        with self._lock:
            self._stopped = True
            keeper, self._keeper = self._keeper, None
        if keeper is None:  # never started: no row to delete
            self._conns.close()
            return
        keeper.stop_beating(self)
        try:
            # Heartbeats created the table (a leave from a table that never was raises,
            # and is logged): a process stopping a thousand leaders checks no schema
            # a thousand times.
            self._execute(
                "leave the membership table",
                self._leave_sql,
                (self.name, self.node_id),
                create=False,
            )
        except BackendUnavailable as exc:
            logger.info("node %s left without deleting its heartbeat row: %s", self.node_id, exc)
        self._conns.close()

    def heartbeat_sql(self, batch: Sequence[Heartbeat]) -> sql.Composed:
        """One statement recording a heartbeat of every node of ``batch`` (memberships on
        this table), and purging rows of their leases' nodes lost for a day."""
        # One row per (lease, node): two leaders of one lease and node id in a process
        # would make the upsert affect a row twice, and fail for every node.
        members = {
            (m.name, m.node_id): m for m in batch if isinstance(m, PostgresMembership)
        }.values()
        # Array literals, not literals a node: a process of a thousand leases composes
        # this every heartbeat.
        names = array_literal([m.name for m in members], "text")
        nodes = array_literal([m.node_id for m in members], "text")
        versions = array_literal([m.version for m in members], "text")
        eligible = array_literal(["t" if m.eligible else "f" for m in members], "boolean")
        runs = array_literal([m.incarnation for m in members], "text")
        return sql.SQL(
            "WITH beat(name, node, version, eligible, incarnation) AS"
            " (SELECT * FROM unnest({names}, {nodes}, {versions}, {eligible}, {runs})),"
            " purge AS ("
            " DELETE FROM {n} AS d USING (SELECT DISTINCT name FROM beat) AS b"
            " WHERE d.name = b.name"
            " AND (d.name, d.node_id) NOT IN (SELECT name, node FROM beat)"
            " AND d.last_seen < clock_timestamp() - make_interval(secs => {purge}))"
            " INSERT INTO {n} AS t (name, node_id, hostname, pid, client_addr, started_at,"
            " last_seen, version, eligible, incarnation) SELECT beat.name, beat.node, {host},"
            " {pid}, inet_client_addr(), clock_timestamp(), clock_timestamp(), beat.version,"
            " beat.eligible, beat.incarnation FROM beat"
            " ON CONFLICT (name, node_id) DO UPDATE SET " + _ON_BEAT
        ).format(
            names=names,
            nodes=nodes,
            versions=versions,
            eligible=eligible,
            runs=runs,
            n=table_identifier(self.table),
            purge=sql.Literal(_PURGE_AFTER),
            host=sql.Literal(socket.gethostname()),
            pid=sql.Literal(os.getpid()),
        )

    def beat(self) -> None:
        """Record one heartbeat of this node (server time)."""
        params = {
            "lease": self.name,
            "node": self.node_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "purge": _PURGE_AFTER,
            "version": self.version,
            "eligible": self.eligible,
            "incarnation": self.incarnation,
        }
        self._execute("record a heartbeat", self._beat_sql, params)

    def nodes(self) -> list[NodeInfo]:
        """Every node with a row for this lease, oldest first; lost ones have ``alive=False``.

        Raises:
            BackendUnavailable: the database could not be reached.
        """
        keeper = self._keeper
        try:
            rows = None if keeper is None else keeper.read(self._nodes_sql, "list the nodes")
        except psycopg.errors.UndefinedTable:
            rows = None  # not created yet: the pooled read creates it
        except psycopg.Error as exc:
            raise self._conns.wrap("list the nodes", exc) from exc
        if rows is None:  # this process leads (or its keeper is not up): pooled
            rows = self._execute("list the nodes", self._nodes_sql, None, fetch=True)
        return node_infos(rows)

    def drained(self) -> bool:
        """Whether an operator drained this node (``rselection drain``; see
        :mod:`rselection.postgres.drains`): one short read, on the keeper session while
        the process only follows, else pooled. ``False`` without a drains table.

        Raises:
            BackendUnavailable: the database could not be reached.
        """
        query = drained_sql(self.table, self.name, self.node_id)
        keeper = self._keeper
        try:
            # Every lease of a follower process reads this as it connects: one after
            # another on the keeper session, not on pooled sessions it would keep.
            rows = None if keeper is None else keeper.read(query, "read the drains")
            if rows is None:
                with self._conns.connection() as conn:
                    rows = conn.execute(query).fetchall()
        except psycopg.errors.UndefinedTable:
            return False  # migrated by an older release: nobody is drained
        except psycopg.errors.InsufficientPrivilege as exc:
            # Created by `rselection migrate`, not granted yet: the node must still lead.
            if not self._drains_refused:
                self._drains_refused = True
                logger.warning(
                    "node %s cannot read the drains table (%s): it cannot be drained until "
                    "its role may SELECT from it",
                    self.node_id,
                    exc,
                )
            return False
        except psycopg.Error as exc:
            raise self._conns.wrap("read the drains", exc) from exc
        return bool(rows)

    def drained_nodes(self) -> set[str]:
        """The drained nodes of this lease (empty without a drains table this node may
        read; see :meth:`drained`).

        Raises:
            BackendUnavailable: the database could not be reached.
        """
        try:
            with self._conns.connection() as conn:
                return drained_nodes(conn, self.table, self.name)
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            return set()
        except psycopg.Error as exc:
            raise self._conns.wrap("read the drains", exc) from exc

    def _execute(
        self,
        what: str,
        statement: sql.Composed,
        params: Any,
        *,
        fetch: bool = False,
        create: bool = True,
    ) -> list[tuple[Any, ...]]:
        try:
            with self._conns.connection() as conn:
                if self._create and create:
                    create_tables(conn, nodes=self.table, timeout=self._statement_timeout)
                    self._create = False
                cur = conn.execute(statement, params)
                return cur.fetchall() if fetch else []
        except psycopg.Error as exc:
            raise self._conns.wrap(what, exc) from exc
