"""``PostgresLeader``: leadership over a lease row in Postgres."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..leader import LeaderBase
from ..timing import Timings
from .fencing import fenced
from .lease import PostgresLease

if TYPE_CHECKING:
    from ..broadcast import Broadcaster
    from ..tasks import TaskHandler

__all__ = ["PostgresLeader"]


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
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"lease name must be a non-empty string, got {name!r}")
        timings = Timings(ttl, renew_interval, renew_deadline, retry_interval)
        backend = PostgresLease(
            conninfo,
            name=name,
            ttl=timings.ttl,
            renew_deadline=timings.renew_deadline,
            table=table,
            create_tables=create_tables,
        )

        def fence(conn: Any, term: int) -> None:
            # A paused stale leader must not hold a takeover up for longer than the
            # margin between its own deadline and the lease's expiry.
            fenced(conn, name, term, table=table, idle_timeout=timings.margin)

        super().__init__(
            backend,
            handler,
            name=name,
            node_id=node_id,
            timings=timings,
            broadcaster=broadcaster,
            fencer=fence,
        )
