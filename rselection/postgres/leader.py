"""``PostgresLeader``: leadership over a lease row in Postgres."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..claiming import FireClaimer
from ..errors import ConfigError
from ..history import HISTORY_LIMIT
from ..member_leader import DEFAULT_CLAIMER, DefaultClaimer, MemberLeader
from ..members import node_timeout_or_default
from ..task_runs import RUN_HISTORY_LIMIT
from ..timing import Timings
from ..validation import check_name
from ._conn import per_call_source, session_conninfo
from .checkpoint import PostgresCheckpointStore
from .claims import PostgresClaimer
from .connections import Connections
from .fencing import afenced, fenced
from .handover import request_handovers
from .lease import PostgresLease
from .membership import PostgresMembership
from .schema import NODES_TABLE
from .task_runs import TASK_STATEMENT_TIMEOUT, PostgresTaskStore, store_turn

if TYPE_CHECKING:
    from ..broadcast import Broadcaster
    from ..tasks import TaskHandler

__all__ = ["DEFAULT_CLAIMER", "PostgresLeader"]


class _LeaseFence:
    """``ctx.fence`` / ``ctx.afence`` of a Postgres leader: the transaction locks the lease
    row, so a takeover waits until it ends."""

    def __init__(self, name: str, table: str, idle_timeout: float) -> None:
        self.name = name
        self.table = table
        self.idle_timeout = idle_timeout

    def fence(self, conn: Any, term: int) -> None:
        # A paused stale leader must not hold a takeover up for longer than the
        # margin between its own deadline and the lease's expiry.
        fenced(conn, self.name, term, table=self.table, idle_timeout=self.idle_timeout)

    async def afence(self, conn: Any, term: int) -> None:
        await afenced(conn, self.name, term, table=self.table, idle_timeout=self.idle_timeout)


class PostgresLeader(MemberLeader):
    """Competes for a lease row in Postgres; the holder runs the handler's tasks.

    The lease lives on the server, with server time (``now()``) for every expiry and a
    fencing term that grows on every change of holder. The holder's keeper session holds
    an advisory lock, so when its process dies the server frees the lock and a follower
    blocked on it takes over at once; a paused or partitioned leader is replaced only
    after the lease expires, by which time its own deadline has already stopped it.

    A :class:`~rselection.LeaseLeader` over a
    :class:`~rselection.postgres.PostgresLease`, with a claimer, a checkpoint store and
    node heartbeats (:meth:`nodes`) in the same database; ``ctx.fence(conn)`` fences a
    task's transaction to its term (:func:`~rselection.postgres.fenced`).

    Args:
        conninfo: the lease's database: a libpq connection string or URI, a
            ``psycopg.Connection`` or a pool (``psycopg_pool.ConnectionPool``). The
            lease's keeper and watcher sessions are the process's own, opened with the
            parameters a connection connected with (the connection itself is never
            used) or with a pool's ``conninfo`` and libpq ``kwargs``. With a pool, the
            default claimer and checkpoint store and the reads of :meth:`nodes` borrow
            its connections instead of the process's pooled sessions.
        handler: the tasks to run while leading.
        name: the lease name; nodes with the same name compete with each other.
        node_id: this node's id (default: host, pid and a random suffix).
        ttl: lease length on the server, seconds.
        renew_interval: seconds between renewals.
        renew_deadline: step down when no renewal succeeded for this long.
        retry_interval: a follower's polling period (jittered).
        table: lease table, optionally schema-qualified (``"ops.leases"``).
        create_tables: create the tables on first connect (else run ``rselection migrate``).
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        checkpoint_store: where ``ctx.checkpoint`` keeps task state. By default a
            :class:`~rselection.postgres.PostgresCheckpointStore` on the same
            ``conninfo`` (default table prefix, tables created on first use when
            ``create_tables``), which connects only when a task uses it and is closed
            with the leader. A store you pass must use the lease's database and table
            (its ``lease_table``); it is not closed by the leader. Either way, a fenced
            save of ``ctx.checkpoint`` may stay idle no longer than the margin
            ``ttl - renew_deadline`` (the store's ``idle_timeout`` if shorter), as a
            transaction fenced by ``ctx.fence``.
        claimer: claims each scheduled fire before it runs, so that a fire runs once
            across the fleet, also across a handover, and a new leader catches up the
            fires missed while no node led (see the tasks' ``misfire`` policy). By
            default a :class:`~rselection.postgres.PostgresClaimer` on the same
            ``conninfo`` (ttl 600 s, table ``rselection_claims``, holder = node id),
            closed with the leader; pass your own (any
            :class:`~rselection.FireClaimer`, not closed by the leader), or ``None`` to
            run fires unclaimed. Claim keys are ``"<lease name>/<fire key>"`` (``%`` and
            ``/`` in the lease name written ``%25`` and ``%2F``).
        heartbeat_interval: seconds between this node's heartbeats in the nodes table
            (see :meth:`nodes`), from a thread and connection of its own.
        node_timeout: a node not seen for this long is lost (default three heartbeats).
        nodes_table: the nodes table, optionally schema-qualified.
        version: the release this node runs (PEP 440, such as ``"2.4.1"``), recorded
            with its heartbeats and shown in :meth:`nodes` and ``rselection status``.
        eligible: ``False``: a member that never leads (a canary, an admin process): it
            heartbeats and is listed, never takes the lease, and ``rselection resign
            --to`` it is refused.
        settle: seconds a node of a newer ``version`` must have heartbeated before this
            node, leading, hands the lease over to it (once; see ``version``).
        history_limit: terms of the lease's leadership history to keep in the table
            ``<table>_history`` (see ``rselection history``); each acquisition trims
            the older ones.
        run_history_limit: runs kept per task in the table ``<table>_task_runs`` (see
            ``rselection task history``); the task controls (``rselection task pause``,
            ``resume``, ``trigger``) are in ``<table>_tasks`` and
            ``<table>_task_triggers``.
    """

    def __init__(
        self,
        conninfo: str | Any,
        handler: TaskHandler,
        *,
        name: str = "default",
        node_id: str | None = None,
        ttl: float = 15.0,
        renew_interval: float = 2.0,
        renew_deadline: float = 10.0,
        retry_interval: float = 2.0,
        table: str = "rselection_leases",
        create_tables: bool = True,
        broadcaster: Broadcaster | None = None,
        checkpoint_store: PostgresCheckpointStore | None = None,
        claimer: FireClaimer | DefaultClaimer | None = DEFAULT_CLAIMER,
        heartbeat_interval: float = 5.0,
        node_timeout: float | None = None,
        nodes_table: str = NODES_TABLE,
        version: str | None = None,
        eligible: bool = True,
        settle: float = 10.0,
        history_limit: int = HISTORY_LIMIT,
        run_history_limit: int = RUN_HISTORY_LIMIT,
    ) -> None:
        check_name(name, "lease name")
        sessions = session_conninfo(conninfo, type(self).__name__)  # validates
        source = per_call_source(conninfo, sessions)
        first_node_id = self._first_node_id(node_id)
        timings = Timings(ttl, renew_interval, renew_deadline, retry_interval)
        lease = PostgresLease(
            source,
            name=name,
            ttl=timings.ttl,
            renew_deadline=timings.renew_deadline,
            stop_grace=timings.stop_grace(handler.stop_grace),
            table=table,
            create_tables=create_tables,
            version=version,
            history_limit=history_limit,
        )
        cleanup: list[Any] = []

        if checkpoint_store is None:
            checkpoint_store = PostgresCheckpointStore(
                source, lease_table=table, create_tables=create_tables
            )
            cleanup.append(checkpoint_store.close)
        elif not isinstance(checkpoint_store, PostgresCheckpointStore):
            raise ConfigError(
                "checkpoint_store must be a PostgresCheckpointStore, got "
                f"{type(checkpoint_store).__name__}"
            )
        elif checkpoint_store.lease_table != table:
            raise ConfigError(
                f"checkpoint_store fences saves against lease table "
                f"{checkpoint_store.lease_table!r}, but this leader's lease is in {table!r}: "
                f"build the store with lease_table={table!r}"
            )
        self._postgres_store = checkpoint_store

        claimer = self._own_claimer(
            claimer,
            lambda: PostgresClaimer(source, node_id=first_node_id, create_tables=create_tables),
            cleanup,
        )

        # On the process's pooled sessions, as the claimer's calls; closed with the
        # leader, after its last runs are written.
        task_store = PostgresTaskStore(
            Connections(
                source,
                owner=type(self).__name__,
                application_name="rselection:tasks",
                connect_timeout=5.0,
                statement_timeout=TASK_STATEMENT_TIMEOUT,
                pooled=True,
            ),
            table=table,
            create_tables=create_tables,
            keeper=lambda: lease.keeper,
            # One call at a time of the process's task stores: its fire claims always
            # find the pool's other session.
            turn=None
            if not isinstance(source, str)
            else store_turn(source, 5.0 + TASK_STATEMENT_TIMEOUT),
            # The reads of the controls take a turn of their own: never behind a write.
            controls_turn=None
            if not isinstance(source, str)
            else store_turn(source, 5.0 + TASK_STATEMENT_TIMEOUT, "controls"),
        )
        cleanup.append(task_store.close)

        membership = PostgresMembership(
            source,
            name=name,
            node_id=first_node_id,
            table=nodes_table,
            lease_table=table,
            heartbeat_interval=heartbeat_interval,
            node_timeout=node_timeout_or_default(heartbeat_interval, node_timeout),
            create_tables=create_tables,
            version=version,
            eligible=eligible,
        )
        super().__init__(
            lease,
            handler,
            membership=membership,
            node_id=node_id,
            timings=timings,
            claimer=claimer,
            # A leader paused inside a save holds a takeover back no longer than one
            # paused inside ctx.fence: the leader's margin.
            checkpoint_store=checkpoint_store.with_idle_timeout(timings.margin),
            broadcaster=broadcaster,
            fence=_LeaseFence(name, table, timings.margin),
            cleanup=cleanup,
            version=version,
            eligible=eligible,
            settle=settle,
            task_store=task_store,
            run_history_limit=run_history_limit,
        )
        self._source, self._table, self._nodes_table = source, table, nodes_table
        self._postgres_membership = membership
        lease.on_drain(self._drain_woken)
        self._wake_on_task_notices(lease.on_tasks)

    @property
    def checkpoint_store(self) -> PostgresCheckpointStore:
        """The store behind ``ctx.checkpoint`` (to inspect or seed task state)."""
        return self._postgres_store

    def _request_successor(self, node_id: str, term: int) -> None:
        # Fenced by the term and only to a node with a row in the nodes table, as a
        # sharded leader's moves are.
        request_handovers(
            self._source,
            {self.name: node_id},
            table=self._table,
            valid_for=self.stop_grace + 1.0,
            members_of=self.name,
            nodes_table=self._nodes_table,
            fence=(self.name, term),
        )

    def _read_drained(self) -> bool:
        return self._postgres_membership.drained()

    def _read_drained_nodes(self) -> frozenset[str]:
        return frozenset(self._postgres_membership.drained_nodes())

    def _before_driven(self) -> None:
        # Before the engine connects it: a lease that joined the process's keeper session
        # is listened for by whichever lease connects first, so leaders started one
        # after another listen in a few round trips, not one each.
        lease = self.lease
        assert isinstance(lease, PostgresLease)
        lease.join_keeper()
