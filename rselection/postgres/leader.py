"""``PostgresLeader``: leadership over a lease row in Postgres."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from ..claiming import FireClaimer, claim_missed
from ..errors import ConfigError
from ..leader import LeaderBase, default_node_id
from ..timing import Timings
from ..validation import check_name, check_node_id
from .checkpoint import PostgresCheckpointStore, TaskCheckpoint
from .claims import PostgresClaimer
from .fencing import afenced, fenced
from .lease import PostgresLease
from .membership import Membership
from .schema import NODES_TABLE

if TYPE_CHECKING:
    from ..broadcast import Broadcaster
    from ..members import NodeInfo
    from ..tasks import TaskHandler

__all__ = ["PostgresLeader"]


class _Default(enum.Enum):
    CLAIMER = "a PostgresClaimer on the lease's database"


DEFAULT_CLAIMER = _Default.CLAIMER
"""The default of ``PostgresLeader(claimer=...)``: claims in the lease's database."""


class _LeaseClaims:
    """A claimer seen through one lease: claim keys are ``"<lease>/<fire key>"``.

    Leases that share a claims table may have tasks of the same name; the prefix keeps
    their fires apart.
    """

    def __init__(self, claimer: FireClaimer, lease: str) -> None:
        self.claimer = claimer
        self.ttl = claimer.ttl
        self.prefix = f"{lease}/"

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        return self.claimer.claim(self.prefix + fire_key, term=term)

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        keys = [self.prefix + key for key in fire_keys]
        won = claim_missed(self.claimer, keys, term=term)
        return [key[len(self.prefix) :] for key in won]


class _LeaseFence:
    """``ctx.fence`` / ``ctx.afence`` of a Postgres leader, and the source of
    ``ctx.checkpoint``."""

    def __init__(
        self, name: str, table: str, idle_timeout: float, store: PostgresCheckpointStore
    ) -> None:
        self.name = name
        self.table = table
        self.idle_timeout = idle_timeout
        self.store = store

    def __call__(self, conn: Any, term: int) -> None:
        # A paused stale leader must not hold a takeover up for longer than the
        # margin between its own deadline and the lease's expiry.
        fenced(conn, self.name, term, table=self.table, idle_timeout=self.idle_timeout)

    async def afence(self, conn: Any, term: int) -> None:
        await afenced(conn, self.name, term, table=self.table, idle_timeout=self.idle_timeout)

    def bind_checkpoint(self, task: str, term: int) -> TaskCheckpoint:
        return TaskCheckpoint(self.store, task, term, self)


class PostgresLeader(LeaderBase):
    """Competes for a lease row in Postgres; the holder runs the handler's tasks.

    The lease lives on the server, with server time (``now()``) for every expiry and a
    fencing term that grows on every change of holder. The holder's keeper session holds
    an advisory lock, so when its process dies the server frees the lock and a follower
    blocked on it takes over at once; a paused or partitioned leader is replaced only
    after the lease expires, by which time its own deadline has already stopped it.

    Args:
        conninfo: a libpq connection string or URI.
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
            with the leader. A store you pass must use the lease's database; it is not
            closed by the leader.
        claimer: claims each scheduled fire before it runs, so that a fire runs once
            across the fleet, also across a handover, and a new leader catches up the
            fires missed while no node led (see the tasks' ``misfire`` policy). By
            default a :class:`~rselection.postgres.PostgresClaimer` on the same
            ``conninfo`` (ttl 600 s, table ``rselection_claims``, holder = node id),
            closed with the leader; pass your own (any
            :class:`~rselection.claiming.FireClaimer`, not closed by the leader), or
            ``None`` to run fires unclaimed. Claim keys are ``"<lease name>/<fire key>"``.
        heartbeat_interval: seconds between this node's heartbeats in the nodes table
            (see :meth:`nodes`), from a thread and connection of its own.
        node_timeout: a node not seen for this long is lost (default three heartbeats).
        nodes_table: the nodes table, optionally schema-qualified.
    """

    def __init__(
        self,
        conninfo: str,
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
        claimer: FireClaimer | _Default | None = DEFAULT_CLAIMER,
        heartbeat_interval: float = 5.0,
        node_timeout: float | None = None,
        nodes_table: str = NODES_TABLE,
    ) -> None:
        check_name(name, "lease name")
        node_id = check_node_id(node_id) if node_id is not None else default_node_id()
        timings = Timings(ttl, renew_interval, renew_deadline, retry_interval)
        backend = PostgresLease(
            conninfo,
            name=name,
            ttl=timings.ttl,
            renew_deadline=timings.renew_deadline,
            stop_grace=timings.stop_grace(handler.stop_grace),
            table=table,
            create_tables=create_tables,
        )

        if checkpoint_store is not None and not isinstance(
            checkpoint_store, PostgresCheckpointStore
        ):
            raise ConfigError(
                "checkpoint_store must be a PostgresCheckpointStore, got "
                f"{type(checkpoint_store).__name__}"
            )
        self._owns_store = checkpoint_store is None
        if checkpoint_store is None:
            checkpoint_store = PostgresCheckpointStore(
                conninfo, lease_table=table, create_tables=create_tables
            )
        self._checkpoint_store = checkpoint_store
        fence = _LeaseFence(name, table, timings.margin, checkpoint_store)

        self._owned_claimer: PostgresClaimer | None = None
        if claimer is DEFAULT_CLAIMER:
            claimer = self._owned_claimer = PostgresClaimer(
                conninfo, holder=node_id, create_tables=create_tables
            )
        elif claimer is not None and not isinstance(claimer, FireClaimer):
            raise ConfigError(
                "claimer must have claim(fire_key, *, term) and ttl (a PostgresClaimer), "
                f"or be None, got {type(claimer).__name__}"
            )

        for label, value in (
            ("heartbeat_interval", heartbeat_interval),
            ("node_timeout", node_timeout),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            ):
                raise ConfigError(f"{label} must be a positive number of seconds, got {value!r}")
        self._membership = Membership(
            conninfo,
            lease=name,
            node_id=node_id,
            table=nodes_table,
            lease_table=table,
            heartbeat_interval=float(heartbeat_interval),
            node_timeout=float(3 * heartbeat_interval if node_timeout is None else node_timeout),
            create_tables=create_tables,
        )

        super().__init__(
            backend,
            handler,
            name=name,
            node_id=node_id,
            timings=timings,
            broadcaster=broadcaster,
            fencer=fence,
            claimer=None if claimer is None else _LeaseClaims(claimer, name),
        )

    @property
    def checkpoint_store(self) -> PostgresCheckpointStore:
        """The store behind ``ctx.checkpoint`` (to inspect or seed task state)."""
        return self._checkpoint_store

    def start(self) -> None:
        """Start heartbeating and competing for the lease in background threads."""
        super().start()
        self._membership.start()

    def nodes(self) -> list[NodeInfo]:
        """Every node of this lease from the nodes table, oldest first.

        Each :class:`~rselection.NodeInfo` has the node's id, host, pid, client address,
        first and last heartbeat (server time), ``alive`` (seen within ``node_timeout``)
        and ``is_leader``. Works on any node, leader or follower.

        Raises:
            BackendUnavailable: the database could not be reached.
        """
        return self._membership.nodes()

    def _close_backend(self) -> None:
        # Also runs after every outage, before the keeper reconnects: close only what
        # reopens on demand. Membership heartbeats go on from their own thread and
        # connection (reconnecting by themselves) until the leader shuts down.
        super()._close_backend()
        if self._owns_store:
            self._checkpoint_store.close()  # idle connections only; reopened on demand
        if self._owned_claimer is not None:
            self._owned_claimer.close()

    def _shutdown(self) -> None:
        # Whatever ends the keeper (stop(), or an error it cannot go on after), the node
        # leaves the membership with it: no heartbeats from a node that no longer competes.
        try:
            super()._shutdown()
        finally:
            self._membership.stop()  # deletes this node's row at once
