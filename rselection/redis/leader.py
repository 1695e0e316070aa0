"""``RedisLeader``: leadership over a lease key in Redis."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..claiming import FireClaimer
from ..context import NoTransactionFence
from ..history import HISTORY_LIMIT
from ..member_leader import DEFAULT_CLAIMER, DefaultClaimer, MemberLeader
from ..members import node_timeout_or_default
from ..task_runs import RUN_HISTORY_LIMIT
from ..timing import Timings
from ..validation import check_name
from ._conn import check_client
from .claims import RedisClaimer
from .drains import drained_nodes, is_drained
from .fencing import RedisFence
from .handover import request_handover
from .keys import DEFAULT_KEY_PREFIX, claims_prefix
from .lease import RedisLease
from .membership import RedisMembership
from .task_runs import RedisTaskStore

if TYPE_CHECKING:
    from ..broadcast import Broadcaster
    from ..members import NodeInfo
    from ..tasks import TaskHandler

__all__ = ["DEFAULT_CLAIMER", "RedisLeader"]

logger = logging.getLogger(__name__)


def no_transaction_fence(name: str, key_prefix: str) -> NoTransactionFence:
    """``ctx.fence`` / ``ctx.afence`` of a Redis leader: refused, naming the fenced call.

    Redis has no transaction a takeover would wait for, so a check of the term at one
    moment protects nothing written after it; the fenced call checks and writes in one
    script.
    """
    prefix = "" if key_prefix == DEFAULT_KEY_PREFIX else f", key_prefix={key_prefix!r}"
    return NoTransactionFence(
        "a RedisLeader cannot fence a transaction: Redis has none that would hold a "
        "takeover back. For a fenced Redis write call leader.fence.call(ctx.term, "
        "<command>, ...) (async: await rselection.redis.afenced_call(<redis.asyncio "
        f"client>, {name!r}, ctx.term, <command>, ...{prefix})); for writes to another "
        "store, keep ctx.term with the data and refuse lower terms"
    )


class RedisLeader(MemberLeader):
    """Competes for a lease key in Redis; the holder runs the handler's tasks.

    Behaves like :class:`~rselection.PostgresLeader`: Redis's own expiry (``PX``), a
    fencing term from an ``INCR`` counter taken atomically with acquisition, renewal and
    release by scripts that check the holder, a ``PUBLISH`` on release so followers take
    over at once, and fast crash failover by the holder's connection id where the server
    allows it (see :mod:`rselection.redis.lease`). ``ctx.term`` is the fencing token;
    :attr:`fence` runs Redis writes only while a term holds. Redis has no transaction to
    fence, so ``ctx.fence(conn)`` and ``await ctx.afence(conn)`` are refused, whatever
    ``conn`` is, with a :class:`~rselection.ConfigError` that names
    ``leader.fence.call(ctx.term, ...)`` and ``rselection.redis.afenced_call``.

    A :class:`~rselection.LeaseLeader` over a :class:`~rselection.redis.RedisLease`
    with a :class:`~rselection.redis.RedisClaimer` and node heartbeats (:meth:`nodes`,
    :mod:`rselection.redis.membership`) on the same Redis.

    Args:
        client: a ``redis://`` URL, a ``redis.Redis`` or a
            ``redis.cluster.RedisCluster`` (the lease's keys share one hash slot). The
            leader's keeper opens connections of its own with the same settings; the
            client serves :meth:`leader`, the default claimer and :attr:`fence`. From a
            URL the leader makes its clients itself and closes them on :meth:`stop`
            (and again after a :meth:`leader` call made after it); a client you pass
            stays open.
        handler: the tasks to run while leading.
        name: the lease name; nodes with the same name and prefix compete.
        node_id: this node's id (default: host, pid and a random suffix).
        key_prefix: prefix of the lease's keys (``<prefix>{<name>}:lease``, ``:term``).
        ttl: lease length on the server, seconds.
        renew_interval: seconds between renewals.
        renew_deadline: step down when no renewal succeeded for this long.
        retry_interval: a follower's polling period (jittered).
        liveness_interval: how soon a follower notices that the holder's connection is
            gone, seconds. The holder's process publishes one liveness beat for all
            the leases it holds every ``liveness_interval / 2`` (see
            :mod:`rselection.redis.liveness`); a follower that heard nothing from the
            holder's process for ``liveness_interval`` checks its connection once
            (``CLIENT LIST ID``). ``None`` turns fast crash failover off, so takeover
            after a crash waits for the ttl.
        connect_timeout: bound of opening a connection, seconds.
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        claimer: claims each scheduled fire before it runs, so a fire runs once across
            the fleet. By default a :class:`~rselection.redis.RedisClaimer` on the same
            Redis (ttl 600 s, prefix ``<key_prefix>claim:``, holder = node id); pass
            your own (any :class:`~rselection.FireClaimer`) or ``None`` to run
            fires unclaimed. Claim keys are ``"<lease name>/<fire key>"`` (``%`` and
            ``/`` in the lease name written ``%25`` and ``%2F``).
        heartbeat_interval: seconds between this node's heartbeats (see :meth:`nodes`),
            sent by one thread per Redis server with ``client``'s settings, each
            bounded by ``min(heartbeat_interval, node_timeout / 3)``. Each heartbeat is
            three commands as Redis counts them (the script, ``TIME``, ``ZADD``); the default,
            10 s, keeps an idle follower's heartbeats and lease checks together at about
            0.6 commands per second.
        node_timeout: a node not seen for this long is lost (default three heartbeats).
        version, eligible, settle: the node's release, whether it may lead, and how
            long a newer node heartbeats before it is handed the lease, as for
            :class:`~rselection.PostgresLeader`.
        history_limit: terms of the lease's leadership history to keep in its stream
            (``<prefix>{<name>}:history``; see ``rselection history``).
        run_history_limit: runs kept per task in ``<prefix>{<name>}:runs:<task>`` (see
            ``rselection task history``); the task controls (``rselection task pause``,
            ``resume``, ``trigger``) are hashes beside the lease's keys.

    Raises:
        ConfigError: bad arguments (the message says which and why).
    """

    _membership: RedisMembership

    def __init__(
        self,
        client: Any,
        handler: TaskHandler,
        *,
        name: str = "default",
        node_id: str | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl: float = 15.0,
        renew_interval: float = 2.0,
        renew_deadline: float = 10.0,
        retry_interval: float = 2.0,
        liveness_interval: float | None = 0.5,
        connect_timeout: float = 5.0,
        broadcaster: Broadcaster | None = None,
        claimer: FireClaimer | DefaultClaimer | None = DEFAULT_CLAIMER,
        heartbeat_interval: float = 10.0,
        node_timeout: float | None = None,
        version: str | None = None,
        eligible: bool = True,
        settle: float = 10.0,
        history_limit: int = HISTORY_LIMIT,
        run_history_limit: int = RUN_HISTORY_LIMIT,
    ) -> None:
        check_name(name, "lease name")
        first_node_id = self._first_node_id(node_id)
        timings = Timings(ttl, renew_interval, renew_deadline, retry_interval)
        redis_client, owns_client = check_client(client, "RedisLeader")
        lease = RedisLease(
            # From a URL the lease makes a client of its own, which it closes whenever
            # the leader closes it (also after a leader() call made after stop).
            client if owns_client else redis_client,
            name=name,
            key_prefix=key_prefix,
            ttl=timings.ttl,
            renew_deadline=timings.renew_deadline,
            liveness_interval=liveness_interval,
            connect_timeout=connect_timeout,
            version=version,
            history_limit=history_limit,
        )
        self._redis_lease = lease
        self._fence_writes = RedisFence(redis_client, name=name, key_prefix=key_prefix)
        membership = RedisMembership(
            redis_client,
            name=name,
            node_id=first_node_id,
            key_prefix=key_prefix,
            lease_key=lease.key,
            heartbeat_interval=heartbeat_interval,
            node_timeout=node_timeout_or_default(heartbeat_interval, node_timeout),
            version=version,
            eligible=eligible,
        )
        cleanup: list[Any] = []
        claimer = self._own_claimer(
            claimer,
            lambda: RedisClaimer(
                redis_client, key_prefix=claims_prefix(key_prefix), node_id=first_node_id
            ),
            cleanup,
        )
        self._owns_client, self._membership_client = owns_client, redis_client
        if owns_client:

            def disconnect() -> None:
                redis_client.connection_pool.disconnect()

            cleanup.append(disconnect)
        super().__init__(
            lease,
            handler,
            membership=membership,
            node_id=node_id,
            timings=timings,
            claimer=claimer,
            broadcaster=broadcaster,
            fence=no_transaction_fence(name, key_prefix),
            cleanup=cleanup,
            version=version,
            eligible=eligible,
            settle=settle,
            task_store=RedisTaskStore(redis_client, key_prefix=key_prefix),
            run_history_limit=run_history_limit,
        )
        self._key_prefix = key_prefix
        lease.on_drain(self._drain_woken)
        self._wake_on_task_notices(lease.on_tasks)

    def _read_drained(self) -> bool:
        return is_drained(self._membership_client, self.name, self.node_id, self._key_prefix)

    def _read_drained_nodes(self) -> frozenset[str]:
        client, prefix = self._membership_client, self._key_prefix
        return frozenset(drained_nodes(client, self.name, prefix, node=True))

    def _request_successor(self, node_id: str, term: int) -> None:
        # Of this term only: once it ended, the request would move the next holder.
        request_handover(
            self._membership_client,
            self.name,
            to=node_id,
            valid_for=self.stop_grace + 1.0,
            key_prefix=self._key_prefix,
            term=term,
        )

    @property
    def lease(self) -> RedisLease:
        """The lease backend (its keys, its keeper's client id)."""
        return self._redis_lease

    @property
    def fence(self) -> RedisFence:
        """Runs Redis commands only while a term holds this lease: ``fence.call(ctx.term, ...)``."""
        return self._fence_writes

    def nodes(self) -> list[NodeInfo]:
        """Every node of this lease from its heartbeats, oldest first.

        Each :class:`~rselection.NodeInfo` has the node's id, host, pid, address (as
        the server saw it, when ``CLIENT INFO`` is allowed), first and last heartbeat
        (server time), ``alive`` (seen within ``node_timeout``) and ``is_leader``. Works
        on any node, leader or follower; ``ctx.nodes()`` is the same list.

        Raises:
            BackendUnavailable: Redis could not be reached.
        """
        try:
            return self._membership.nodes()
        finally:
            if self._owns_client and self._membership.stopped:
                # After stop() a read leaves no connection open (as leader() does).
                self._membership_client.connection_pool.disconnect()
