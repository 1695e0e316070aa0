"""``PostgresShardedLeader``: the sharded leader (:mod:`rselection.sharded`) on Postgres.

Each shard ``k`` is an ordinary Postgres lease, ``"<name>/<k>"``, with a
:class:`~rselection.PostgresLeader` of its own on every node (all with the node's one
``node_id``; they share the process's keeper session and driver thread, so S shards cost
no more sessions than one lease). A dead node's shards are taken over at once by
dead-session takeover. The coordinator (the holder of the lease ``"<name>"``) reads the
shards' holders and the nodes' heartbeats in one statement, and moves shards with
handovers recorded in one statement too (:func:`~.handover.request_handovers`).

See ``docs/explanation/sharding.md`` for the design and its failure cases.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from ..history import HISTORY_LIMIT
from ..lease import LeaderInfo
from ..sharded import SHARDS_RECORD, ShardedLeader, ShardLeader, ShardState
from ..sharding import shard_lease_name
from ..tasks import TaskHandler
from ..timing import Timings
from ._conn import per_call_source, session_conninfo
from ._lease_sql import utc
from .checkpoint import PostgresCheckpointStore
from .claims import PostgresClaimer
from .connections import Connections
from .handover import current_holder, reopen_handovers, request_handovers
from .leader import DEFAULT_CLAIMER, PostgresLeader
from .lease import PostgresLease
from .schema import DEFAULT_TABLE, NODES_TABLE, table_identifier

if TYPE_CHECKING:
    from ..broadcast import Broadcaster

__all__ = ["PostgresShardedLeader"]


class _ShardLeader(ShardLeader, PostgresLeader):
    """The leader of one shard (see :class:`ShardLeader`) on a ``PostgresLeader``."""

    def holder_died(self) -> bool:
        """Whether a keeper session died since the last wake (the holder's, maybe)."""
        lease = self.lease
        return isinstance(lease, PostgresLease) and lease.death_announced


class PostgresShardedLeader(ShardedLeader):
    """Leads a fixed set of shards across a fleet: each shard run by one live node.

    The handler's tasks run once per shard this node owns, with ``ctx.shard`` and
    ``ctx.shards`` set. Each shard is a Postgres lease of its own (``"<name>/<shard>"``)
    with its own term, fencing (``ctx.fence`` fences to the shard's term), claims, and
    checkpoints (keyed by task and shard), and losing a shard cancels and joins only
    that shard's tasks. A coordinator (the holder of the lease ``"<name>"``) moves shards
    by graceful handovers so that every live node owns ``floor(S/N)`` or ``ceil(S/N)``,
    moving only the shards that must move; every node competes for every shard, so a
    dead node's shards are taken over within a second without waiting for it.

    Example::

        leader = rs.PostgresShardedLeader(dsn, tasks, name="pollers", shards=64)
        leader.lead()

    Args:
        conninfo: the leases' database: a libpq connection string or URI, a
            ``psycopg.Connection`` or a pool (``psycopg_pool.ConnectionPool``), as for
            :class:`~rselection.postgres.PostgresLeader`: every shard's lease shares the
            process's keeper session, opened with a connection's parameters (the
            connection itself is never used) or a pool's; with a pool, the claims,
            checkpoints, handovers and reads borrow its connections.
        handler: the tasks to run for each owned shard (copied per shard at
            :meth:`start`: register every task before).
        name: the sharded name (no ``/``); the shards' leases are ``"<name>/<shard>"``
            and the coordinator's lease is ``"<name>"``.
        shards: the number of shards (1 to 4,096); every node must use the same.
        node_id: this node's id (default: host, pid and a random suffix).
        ttl: lease length on the server, seconds (every shard and the coordinator).
        renew_interval: seconds between renewals.
        renew_deadline: a shard's leader steps down when no renewal succeeded for this long.
        retry_interval: a follower's polling period (jittered).
        table: lease table, optionally schema-qualified.
        create_tables: create the tables on first connect (else run ``rselection migrate``).
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        checkpoint_store: where ``ctx.checkpoint`` keeps task state (one store for every
            shard; keys include the shard's lease name). By default a
            :class:`~rselection.postgres.PostgresCheckpointStore` on ``conninfo``,
            closed with the leader.
        claimer: claims each scheduled fire (claim keys include the shard's lease name);
            by default one :class:`~rselection.postgres.PostgresClaimer` on ``conninfo``
            for every shard, closed with the leader; ``None`` runs fires unclaimed.
        heartbeat_interval: seconds between this node's heartbeats (as a member of the
            lease ``"<name>"``); the coordinator tells live nodes by them.
        node_timeout: a node not seen for this long is lost (default three heartbeats).
        nodes_table: the nodes table, optionally schema-qualified.
        rebalance_interval: seconds between the coordinator's rounds.
        settle: seconds a node must have been heartbeating before it is given shards
            (default: ``heartbeat_interval``), so that a node that comes and goes does
            not make shards bounce.
        max_moves: most handovers in flight at once from any one node (each old owner
            cancels, joins and releases the shards it gives).
        handover_valid_for: seconds a moved shard stays reserved for its target (default:
            ``stop_grace + 1``); a target that has not taken it by then gets no more
            shards until it heartbeats again.
        eligible: ``False``: a member that never leads a shard (nor the coordinator's
            lease): it heartbeats and is listed, and the coordinator gives it no shards.
        version: this node's release (PEP 440), recorded with its heartbeats and with each
            term it takes; shards never move for versions.
        history_limit: terms kept in the leadership history of each shard's lease.

    Raises:
        ConfigError: bad arguments or inconsistent timings (the message shows the math).
    """

    _shard_leader = _ShardLeader

    def __init__(
        self,
        conninfo: str | Any,
        handler: TaskHandler,
        *,
        name: str,
        shards: int,
        node_id: str | None = None,
        ttl: float = 15.0,
        renew_interval: float = 2.0,
        renew_deadline: float = 10.0,
        retry_interval: float = 2.0,
        table: str = DEFAULT_TABLE,
        create_tables: bool = True,
        broadcaster: Broadcaster | None = None,
        checkpoint_store: PostgresCheckpointStore | None = None,
        claimer: object = DEFAULT_CLAIMER,
        heartbeat_interval: float = 2.0,
        node_timeout: float | None = None,
        nodes_table: str = NODES_TABLE,
        rebalance_interval: float = 0.5,
        settle: float | None = None,
        max_moves: int = 32,
        handover_valid_for: float | None = None,
        eligible: bool = True,
        version: str | None = None,
        history_limit: int = HISTORY_LIMIT,
    ) -> None:
        # Every shard's lease on one keeper session: one connection string for them all.
        source = per_call_source(conninfo, session_conninfo(conninfo, type(self).__name__))
        super().__init__(
            handler,
            name=name,
            shards=shards,
            node_id=node_id,
            timings=Timings(ttl, renew_interval, renew_deadline, retry_interval),
            heartbeat_interval=heartbeat_interval,
            node_timeout=node_timeout,
            rebalance_interval=rebalance_interval,
            settle=settle,
            max_moves=max_moves,
            handover_valid_for=handover_valid_for,
            eligible=eligible,
            version=version,
            history_limit=history_limit,
        )
        table_identifier(table)  # validates
        table_identifier(nodes_table)
        self.conninfo = source
        self.table = table
        self.nodes_table = nodes_table
        if checkpoint_store is None:
            checkpoint_store = PostgresCheckpointStore(
                source, lease_table=table, create_tables=create_tables
            )
            self._cleanup.append(checkpoint_store.close)
        self._store = checkpoint_store
        self._build_coordinator(
            PostgresLeader,
            source,
            node_id=node_id,
            claimer=claimer,
            make_claimer=lambda: PostgresClaimer(
                source, node_id=self._node_id, create_tables=create_tables
            ),
            table=table,
            create_tables=create_tables,
            broadcaster=broadcaster,
            checkpoint_store=checkpoint_store,
            nodes_table=nodes_table,
        )
        self._reads = Connections(
            source,
            owner="PostgresShardedLeader",
            application_name="rselection:shards",
            statement_timeout=10.0,
            pooled=True,
        )
        # One statement per read: the holders, the nodes and the server's clock (a row
        # of its own, so that it comes back even when both tables are empty).
        holders_sql = sql.SQL(
            "SELECT 'h', name, holder, term, acquired_at, expires_at, NULL::boolean,"
            " clock_timestamp() FROM {leases} WHERE name = ANY(%(names)s)"
            " AND holder IS NOT NULL AND expires_at > clock_timestamp()"
        ).format(leases=table_identifier(table))
        # A node that may not lead (drained, or eligible=False) comes back as 'i'.
        nodes_sql = sql.SQL(
            " UNION ALL SELECT CASE WHEN coalesce(eligible, true) THEN 'n' ELSE 'i' END,"
            " node_id, NULL, NULL, started_at, last_seen,"
            " last_seen >= clock_timestamp() - make_interval(secs => %(node_timeout)s),"
            " clock_timestamp() FROM {nodes} WHERE name = %(name)s"
        ).format(nodes=table_identifier(nodes_table))
        clock_sql = sql.SQL(
            " UNION ALL SELECT 't', NULL, NULL, NULL, NULL, NULL, NULL, clock_timestamp()"
        )
        self._state_sql = holders_sql + nodes_sql + clock_sql
        # The shards' leases may be held before the first heartbeat created the nodes
        # table: the holders are read without the nodes then.
        self._holders_sql = holders_sql + clock_sql

    def state(self) -> ShardState:
        """The shards' holders and the nodes' heartbeats, read in one go (server time).

        Raises:
            BackendUnavailable: the database could not be reached.
        """
        names = [shard_lease_name(self._name, shard) for shard in range(self._shards)]
        prefix = len(self._name) + 1
        params = {"names": names, "node_timeout": self._node_timeout, "name": self._name}
        try:
            found = self._read_state(self._state_sql, params)
            if found is None:
                found = self._read_state(self._holders_sql, params)
            if found is None:
                # Not created yet (a leader's first connect creates them): nothing to read.
                return ShardState({}, {}, datetime.now(UTC))
        except psycopg.Error as exc:
            raise self._reads.wrap(f"read the shards of {self._name!r}", exc) from exc
        finally:
            if self._stopped.is_set():
                self._reads.close()  # after stop(), a read leaves no session behind
        holders: dict[int, LeaderInfo] = {}
        nodes: dict[str, tuple[datetime, datetime, bool]] = {}
        ineligible: set[str] = set()
        now = datetime.now(UTC)
        for kind, key, holder, term, first, last, alive, clock in found:
            now = utc(clock)
            if kind == "h":
                holders[int(key[prefix:])] = LeaderInfo(holder, term, utc(first), utc(last))
            elif kind == "n":
                nodes[key] = (utc(first), utc(last), bool(alive))
            elif kind == "i" and alive:
                ineligible.add(key)
        return ShardState(holders, nodes, now, frozenset(ineligible))

    def _read_state(self, query: sql.Composed, params: dict[str, Any]) -> list[Any] | None:
        """The rows of ``query``; ``None`` when a table it reads does not exist yet."""
        try:
            with self._reads.connection() as conn:
                return conn.execute(query, params).fetchall()
        except psycopg.errors.UndefinedTable:
            return None

    # -- the backend's part of the sharded leader ---------------------------------------

    def _request_handovers(
        self, targets: dict[str, str], *, fence: tuple[str, int] | None = None
    ) -> dict[str, LeaderInfo]:
        # Every move in one statement (each old owner is woken at once), only to nodes
        # with a row in the nodes table of "<name>".
        return request_handovers(
            self.conninfo,
            targets,
            table=self.table,
            valid_for=self.handover_valid_for,
            members_of=self._name,
            nodes_table=self.nodes_table,
            fence=fence,
        )

    def _reopen_handovers(self, names: list[str]) -> list[str]:
        return reopen_handovers(self.conninfo, names, self._node_id, table=self.table)

    def _current_holder(self, name: str) -> LeaderInfo | None:
        return current_holder(self.conninfo, name, table=self.table)

    def _load_shards_record(self) -> object:
        snapshot = self._store.load((SHARDS_RECORD, self._name))
        return snapshot.state if snapshot is not None else None

    def _save_shards_record(self, record: dict[str, Any], term: int) -> None:
        # In the checkpoint table, fenced by the coordinator's term.
        self._store.save((SHARDS_RECORD, self._name), record, term=term, name=self._name)

    def _before_shards_start(self) -> None:
        for leader in self._leaders:
            # Before any connects: the first connect listens for every shard at once.
            assert isinstance(leader.lease, PostgresLease)
            leader.lease.join_keeper()

    def _after_stop(self) -> None:
        self._reads.close()
