"""``RedisShardedLeader``: the sharded leader (:mod:`rselection.sharded`) on Redis.

Each shard is an ordinary Redis lease with a :class:`~rselection.RedisLeader` of its own
on every node; the coordinator moves shards with handover requests reserved for their
targets, and withdraws (or reopens) those whose target left. See
``docs/explanation/sharding.md`` for the design and its failure cases.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import redis

from ..claiming import FireClaimer
from ..errors import ConfigError
from ..history import HISTORY_LIMIT
from ..lease import LeaderInfo
from ..sharded import SHARDS_RECORD, ShardedLeader, ShardLeader, ShardState
from ..sharding import shard_lease_name
from ..tasks import TaskHandler
from ..timing import Timings
from ._conn import check_client, describe, unavailable
from ._scripts import READ
from .claims import RedisClaimer
from .fencing import RedisFence
from .handover import cancel_handover, current_holder, reopen_handovers, request_handovers
from .holder import parse_holder
from .keys import (
    DEFAULT_KEY_PREFIX,
    check_key_prefix,
    claims_prefix,
    lease_keys,
    shards_record_key,
)
from .leader import DEFAULT_CLAIMER, RedisLeader

if TYPE_CHECKING:
    from ..broadcast import Broadcaster

__all__ = ["RedisShardedLeader"]


class _ShardLeader(ShardLeader, RedisLeader):
    """The leader of one shard (see :class:`ShardLeader`) on a ``RedisLeader``."""

    def holder_died(self) -> bool:
        """Whether this node found the holder's connection gone since its last attempt."""
        return self.lease.holder_gone


class RedisShardedLeader(ShardedLeader):
    """Leads a fixed set of shards across a fleet over Redis: each shard run by one
    live node.

    The same sharded leader as :class:`~rselection.PostgresShardedLeader` (see
    :mod:`rselection.sharded`): the handler's tasks run once per shard this node owns,
    with ``ctx.shard`` and ``ctx.shards`` set; each shard is a Redis lease of its own
    (``"<name>/<shard>"``) with its own term, claims and fenced writes
    (``leader.fence`` of a shard's leader is not offered: fence a shard's Redis writes
    with :class:`~rselection.redis.RedisFence` on its lease name and ``ctx.term``); a
    coordinator (the holder of the lease ``"<name>"``) moves shards by graceful
    handovers so that every live node owns ``floor(S/N)`` or ``ceil(S/N)``.

    Example::

        leader = rs.RedisShardedLeader("redis://localhost:6379/0", tasks, name="pollers",
                                       shards=64)
        leader.lead()

    Args:
        client: a ``redis://`` URL, a ``redis.Redis`` or a ``redis.cluster.RedisCluster``
            (each shard's keys share one hash slot). From a URL the sharded leader makes
            its client itself and closes it on :meth:`stop`.
        handler: the tasks to run for each owned shard (copied per shard at
            :meth:`start`: register every task before).
        name: the sharded name (no ``/``).
        shards: the number of shards (1 to 4,096); every node must use the same.
        node_id: this node's id (default: host, pid and a random suffix).
        key_prefix: prefix of every key.
        ttl: lease length on the server, seconds (every shard and the coordinator).
        renew_interval: seconds between renewals.
        renew_deadline: a shard's leader steps down when no renewal succeeded for this long.
        retry_interval: a follower's polling period (jittered).
        liveness_interval: how soon a follower notices that a holder's connection is
            gone (see :class:`~rselection.RedisLeader`); ``None`` waits for the ttl.
        connect_timeout: bound of opening a connection, seconds.
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        claimer: claims each scheduled fire (claim keys include the shard's lease name);
            by default one :class:`~rselection.redis.RedisClaimer` on the same Redis for
            every shard; ``None`` runs fires unclaimed.
        heartbeat_interval: the coordinator's balancing (with ``node_timeout``,
            ``rebalance_interval``, ``settle``, ``max_moves`` and
            ``handover_valid_for``), as for :class:`~rselection.PostgresShardedLeader`.
        eligible: ``False``: a member that never leads a shard (see
            :class:`~rselection.PostgresShardedLeader`).
        version, history_limit: this node's release and the terms kept per shard's
            lease, as for :class:`~rselection.PostgresShardedLeader`.

    Raises:
        ConfigError: bad arguments or inconsistent timings (the message shows the math).
    """

    _shard_leader = _ShardLeader

    def __init__(
        self,
        client: Any,
        handler: TaskHandler,
        *,
        name: str,
        shards: int,
        node_id: str | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl: float = 15.0,
        renew_interval: float = 2.0,
        renew_deadline: float = 10.0,
        retry_interval: float = 2.0,
        liveness_interval: float | None = 0.5,
        connect_timeout: float = 5.0,
        broadcaster: Broadcaster | None = None,
        claimer: object = DEFAULT_CLAIMER,
        heartbeat_interval: float = 2.0,
        node_timeout: float | None = None,
        rebalance_interval: float = 0.5,
        settle: float | None = None,
        max_moves: int = 32,
        handover_valid_for: float | None = None,
        eligible: bool = True,
        version: str | None = None,
        history_limit: int = HISTORY_LIMIT,
    ) -> None:
        if not (claimer is DEFAULT_CLAIMER or claimer is None or isinstance(claimer, FireClaimer)):
            raise ConfigError(
                "claimer must be a FireClaimer (a RedisClaimer, say) or None, got "
                f"{type(claimer).__name__}"
            )
        redis_client, owns_client = check_client(client, "RedisShardedLeader")
        try:
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
            self.key_prefix = check_key_prefix(key_prefix)
        except BaseException:
            if owns_client:
                redis_client.close()
            raise
        self._client = redis_client
        if owns_client:
            self._cleanup.append(redis_client.connection_pool.disconnect)
        self._build_coordinator(
            RedisLeader,
            redis_client,
            node_id=node_id,
            claimer=claimer,
            make_claimer=lambda: RedisClaimer(
                redis_client, key_prefix=claims_prefix(key_prefix), node_id=self._node_id
            ),
            key_prefix=key_prefix,
            liveness_interval=liveness_interval,
            connect_timeout=connect_timeout,
            broadcaster=broadcaster,
        )
        # The record of the number of shards shares the coordinator lease's hash slot,
        # so that its write is fenced by the coordinator's term in one script.
        self._record_key = shards_record_key(self._name, SHARDS_RECORD, key_prefix)
        self._record_fence = RedisFence(redis_client, name=self._name, key_prefix=key_prefix)

    # -- reads ---------------------------------------------------------------------------

    def state(self) -> ShardState:
        """The shards' holders and the nodes' heartbeats (server time), read in two round
        trips: the holders in one pipeline, then the nodes.

        Raises:
            BackendUnavailable: Redis could not be reached.
        """
        names = [shard_lease_name(self._name, shard) for shard in range(self._shards)]
        try:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.eval(READ, 1, lease_keys(name, self.key_prefix)[0])
            replies = pipe.execute()
        except redis.RedisError as exc:
            raise unavailable(
                f"read the shards of {self._name!r}", describe(self._client), exc
            ) from exc
        holders: dict[int, LeaderInfo] = {}
        now_ms = 0
        for shard, (raw, pttl, now) in enumerate(replies):
            now_ms = max(now_ms, int(now))
            info, _ = parse_holder(raw, pttl, now)
            if info is not None:
                holders[shard] = info
        members = self.nodes()
        nodes = {n.node_id: (n.started_at, n.last_seen, n.alive) for n in members if n.eligible}
        ineligible = frozenset(n.node_id for n in members if n.alive and not n.eligible)
        now = datetime.fromtimestamp(now_ms / 1000, UTC) if now_ms else datetime.now(UTC)
        return ShardState(holders, nodes, now, ineligible)

    # -- the backend's part of the sharded leader ---------------------------------------

    def _request_handovers(
        self, targets: dict[str, str], *, fence: tuple[str, int] | None = None
    ) -> dict[str, LeaderInfo]:
        # Checked just before the requests (see the module docstring): the fence, then
        # that each target is still listed as a node of "<name>".
        if fence is not None:
            holder = current_holder(self._client, fence[0], key_prefix=self.key_prefix)
            if holder is None or holder.term != fence[1]:
                return {}
        members = self._members()
        asked = {name: to for name, to in targets.items() if to in members}
        answers = request_handovers(
            self._client, asked, valid_for=self.handover_valid_for, key_prefix=self.key_prefix
        )
        # A target that left between the read and the requests opened what was reserved
        # for it before ours landed: withdraw ours now, or its shards would stay unled
        # until the reservations lapse (a node that leaves after this read opens them
        # itself). The holder asked keeps its shard, or takes it back.
        members = self._members()
        for name in [name for name in answers if asked[name] not in members]:
            cancel_handover(self._client, name, answers.pop(name).term, key_prefix=self.key_prefix)
        return answers

    def _members(self) -> set[str]:
        """The nodes listed for ``"<name>"`` now (alive or not: they have not left)."""
        return {node.node_id for node in self.nodes()}

    def _reopen_handovers(self, names: list[str]) -> list[str]:
        return reopen_handovers(self._client, names, self._node_id, key_prefix=self.key_prefix)

    def _current_holder(self, name: str) -> LeaderInfo | None:
        return current_holder(self._client, name, key_prefix=self.key_prefix)

    def _load_shards_record(self) -> object:
        try:
            raw = self._client.get(self._record_key)
        except redis.RedisError as exc:
            raise unavailable("read the number of shards", describe(self._client), exc) from exc
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None  # not ours: the coordinator writes it again

    def _save_shards_record(self, record: dict[str, Any], term: int) -> None:
        self._record_fence.call(term, "SET", self._record_key, json.dumps(record))
