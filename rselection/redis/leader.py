"""``RedisLeader``: leadership over a lease key in Redis."""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio
from redis.cluster import RedisCluster

from ..claiming import FireClaimer
from ..errors import ConfigError
from ..leader import LeaderBase, default_node_id
from ..timing import Timings
from ..validation import check_name, check_node_id
from ._conn import check_client
from .claims import RedisClaimer
from .fencing import RedisFence, afenced_call
from .lease import RedisLease

if TYPE_CHECKING:
    from ..broadcast import Broadcaster
    from ..tasks import TaskHandler

__all__ = ["DEFAULT_CLAIMER", "RedisLeader"]

logger = logging.getLogger(__name__)


class _Default(enum.Enum):
    CLAIMER = "a RedisClaimer on the lease's Redis"


DEFAULT_CLAIMER = _Default.CLAIMER
"""The default of ``RedisLeader(claimer=...)``: claims in the lease's Redis."""


class _LeaseClaims:
    """A claimer seen through one lease: claim keys are ``"<lease>/<fire key>"``.

    Leases that share a claim prefix may have tasks of the same name; the lease name
    keeps their fires apart.
    """

    def __init__(self, claimer: FireClaimer, lease: str) -> None:
        self.claimer = claimer
        self.ttl = claimer.ttl
        self.prefix = f"{lease}/"

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        return self.claimer.claim(self.prefix + fire_key, term=term)


class _LeaseFence:
    """``ctx.fence(client)`` / ``ctx.afence(client)`` of a Redis leader: checks the term
    against the lease key."""

    def __init__(self, fence: RedisFence, name: str, key_prefix: str) -> None:
        self.fence = fence
        self.name = name
        self.key_prefix = key_prefix

    def __call__(self, conn: Any, term: int) -> None:
        if isinstance(conn, redis.Redis | RedisCluster):
            RedisFence(conn, self.name, key_prefix=self.key_prefix).check(term)
            return
        raise ConfigError(
            "ctx.fence() of a RedisLeader takes a Redis client and only checks the term at "
            f"that moment (got {type(conn).__name__}). For a fenced Redis write use "
            "leader.fence.call(ctx.term, ...); writes to other stores need a fence of "
            "their own (store ctx.term with the data and refuse lower terms)"
        )

    async def afence(self, conn: Any, term: int) -> None:
        if isinstance(conn, redis.asyncio.Redis | redis.asyncio.RedisCluster):
            await afenced_call(conn, self.name, term, key_prefix=self.key_prefix)
            return
        raise ConfigError(
            "ctx.afence() of a RedisLeader takes a redis.asyncio client and only checks "
            f"the term at that moment (got {type(conn).__name__}); with a blocking client "
            "call ctx.fence(client). For a fenced Redis write use "
            "rselection.redis.afenced_call(client, name, ctx.term, ...)"
        )


class RedisLeader(LeaderBase):
    """Competes for a lease key in Redis; the holder runs the handler's tasks.

    Behaves like :class:`~rselection.PostgresLeader`: Redis's own expiry (``PX``), a
    fencing term from an ``INCR`` counter taken atomically with acquisition, renewal and
    release by scripts that check the holder, a ``PUBLISH`` on release so followers take
    over at once, and fast crash failover by the holder's connection id where the server
    allows it (see :mod:`rselection.redis.lease`). ``ctx.term`` is the fencing token;
    :attr:`fence` runs Redis writes only while a term holds.

    Args:
        client_or_url: a ``redis://`` URL, a ``redis.Redis`` or a
            ``redis.cluster.RedisCluster`` (the lease's keys share one hash slot). The
            leader's keeper opens connections of its own with the same settings; the
            client serves :meth:`leader`, the default claimer and :attr:`fence`.
        handler: the tasks to run while leading.
        name: the lease name; nodes with the same name and prefix compete.
        node_id: this node's id (default: host, pid and a random suffix).
        key_prefix: prefix of the lease's keys (``<prefix>{<name>}:lease``, ``:term``).
        ttl: lease length on the server, seconds.
        renew_interval: seconds between renewals.
        renew_deadline: step down when no renewal succeeded for this long.
        retry_interval: a follower's polling period (jittered).
        liveness_interval: how often a follower checks that the holder's connection
            exists (``CLIENT LIST ID``), seconds; ``None`` turns fast crash failover
            off, so takeover after a crash waits for the ttl.
        connect_timeout: bound of opening a connection, seconds.
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        claimer: claims each scheduled fire before it runs, so a fire runs once across
            the fleet. By default a :class:`~rselection.redis.RedisClaimer` on the same
            Redis (ttl 600 s, prefix ``<key_prefix>claim:``, holder = node id); pass
            your own (any :class:`~rselection.claiming.FireClaimer`) or ``None`` to run
            fires unclaimed. Claim keys are ``"<lease name>/<fire key>"``.

    Raises:
        ConfigError: bad arguments (the message says which and why).
    """

    def __init__(
        self,
        client_or_url: Any,
        handler: TaskHandler,
        *,
        name: str = "default",
        node_id: str | None = None,
        key_prefix: str = "rselection:",
        ttl: float = 15.0,
        renew_interval: float = 2.0,
        renew_deadline: float = 10.0,
        retry_interval: float = 2.0,
        liveness_interval: float | None = 0.5,
        connect_timeout: float = 5.0,
        broadcaster: Broadcaster | None = None,
        claimer: FireClaimer | _Default | None = DEFAULT_CLAIMER,
    ) -> None:
        check_name(name, "lease name")
        node_id = check_node_id(node_id) if node_id is not None else default_node_id()
        timings = Timings(ttl, renew_interval, renew_deadline, retry_interval)
        client, self._owns_client = check_client(client_or_url, "RedisLeader")
        self._client = client
        backend = RedisLease(
            client,
            name=name,
            key_prefix=key_prefix,
            ttl=timings.ttl,
            renew_deadline=timings.renew_deadline,
            liveness_interval=liveness_interval,
            connect_timeout=connect_timeout,
        )
        self._fence = RedisFence(client, name, key_prefix=key_prefix)
        self._owned_claimer: RedisClaimer | None = None
        if claimer is DEFAULT_CLAIMER:
            claimer = self._owned_claimer = RedisClaimer(
                client, key_prefix=f"{key_prefix}claim:", node_id=node_id
            )
        elif claimer is not None and not isinstance(claimer, FireClaimer):
            raise ConfigError(
                "claimer must have claim(fire_key, *, term) and ttl (a RedisClaimer), "
                f"or be None, got {type(claimer).__name__}"
            )
        super().__init__(
            backend,
            handler,
            name=name,
            node_id=node_id,
            timings=timings,
            broadcaster=broadcaster,
            fencer=_LeaseFence(self._fence, name, key_prefix),
            claimer=None if claimer is None else _LeaseClaims(claimer, name),
        )
        self._lease = backend

    @property
    def lease(self) -> RedisLease:
        """The lease backend (its keys, its keeper's client id)."""
        return self._lease

    @property
    def fence(self) -> RedisFence:
        """Runs Redis commands only while a term holds this lease: ``fence.call(ctx.term, ...)``."""
        return self._fence

    def _close_backend(self) -> None:
        super()._close_backend()
        if self._owns_client and self._keeper_done():
            try:
                self._client.connection_pool.disconnect()
            except Exception:  # best effort; the pool reconnects on next use
                logger.debug("lease %r: error closing the client", self.name, exc_info=True)

    def _keeper_done(self) -> bool:
        return self._stopping.is_set()
