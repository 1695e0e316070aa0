"""The sharded leader over any backend: a fixed set of shards, each led by one node.

Each shard ``k`` of a sharded name is an ordinary lease, ``"<name>/<k>"``, with a leader
of its own on every node. The holder of the coordinator lease ``"<name>"`` runs
:class:`Rebalancer`, which moves surplus shards by handovers reserved for their targets.
:class:`ShardedLeader` is all of that, whatever the backend; a backend's sharded leader
supplies the methods marked *backend*. The package holds it in two parts: the leader,
its shards' leaders and the hand-off on stop (:mod:`.leader`), and the coordinator's
task (:mod:`.rebalancer`). See ``docs/explanation/sharding.md``.
"""

from __future__ import annotations

from .leader import HAND_OFF_WAIT, SHARDS_RECORD, TAKEOVER_WAIT, ShardedLeader, ShardLeader
from .rebalancer import PENDING_POLL, Balanced, Rebalancer, ShardState

__all__ = [
    "HAND_OFF_WAIT",
    "PENDING_POLL",
    "SHARDS_RECORD",
    "TAKEOVER_WAIT",
    "Balanced",
    "Rebalancer",
    "ShardLeader",
    "ShardState",
    "ShardedLeader",
]
