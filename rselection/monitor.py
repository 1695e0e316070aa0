"""``HeartbeatMonitor``: a ready-made persistent task that reports nodes joining and lost."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from . import signals
from .errors import BackendUnavailable, ConfigError
from .tasks import TaskType

if TYPE_CHECKING:
    from .context import TaskContext
    from .members import NodeInfo
    from .schedules import Schedule

__all__ = ["HeartbeatMonitor"]

logger = logging.getLogger(__name__)


class HeartbeatMonitor:
    """Watches the lease's nodes on the leader; sends ``node_joined`` and ``node_lost``.

    Register it like any persistent task::

        tasks.register("heartbeat-monitor", HeartbeatMonitor())

    Works on every backend with membership (Postgres and Redis leaders). While this
    node leads, it reads ``ctx.nodes()`` every ``poll_interval`` seconds. At
    the start of a term every live node is announced once on ``signals.node_joined``
    (so a receiver can build its view from scratch), then each change: a node that came
    alive (``node_joined``), a node whose heartbeats stopped for ``node_timeout`` or that
    left gracefully (``node_lost``, with its last known info). A node is lost at most
    ``node_timeout + heartbeat_interval + poll_interval`` after its last heartbeat.

    Args:
        poll_interval: seconds between reads of the membership (default 1): the nodes
            table on Postgres, the nodes sorted set and its info hash on Redis (one
            script); any leader whose ``ctx.nodes()`` lists its nodes will do.
    """

    type = TaskType.PERSISTENT
    schedule: Schedule | None = None

    def __init__(self, *, poll_interval: float = 1.0, name: str = "heartbeat-monitor") -> None:
        if (
            isinstance(poll_interval, bool)
            or not isinstance(poll_interval, int | float)
            or not math.isfinite(poll_interval)
            or poll_interval <= 0
        ):
            raise ConfigError(
                f"poll_interval must be a positive number of seconds, got {poll_interval!r}"
            )
        self.poll_interval = float(poll_interval)
        self.name = name

    def run(self, ctx: TaskContext) -> None:
        """Poll the nodes until the term ends, sending a signal for each change."""
        known: dict[str, NodeInfo] = {}
        while not ctx.cancelled.is_set():
            try:
                nodes = ctx.nodes()
            except BackendUnavailable as exc:
                logger.warning("heartbeat monitor cannot read the nodes: %s", exc)
            else:
                known = self._compare(known, nodes)
            if not ctx.sleep(self.poll_interval):
                return

    def _compare(self, known: dict[str, NodeInfo], nodes: list[NodeInfo]) -> dict[str, NodeInfo]:
        alive = {node.node_id: node for node in nodes if node.alive}
        rows = {node.node_id: node for node in nodes}
        for node_id, node in alive.items():
            if node_id not in known:
                logger.info("node %s joined lease %r", node_id, node.name)
                signals.node_joined.send(self, name=node.name, node=node)
        for node_id, node in known.items():
            if node_id not in alive:
                last = rows.get(node_id, node)  # gone entirely when it left gracefully
                logger.warning("node %s of lease %r is lost", node_id, last.name)
                signals.node_lost.send(self, name=last.name, node=last)
        return alive

    def __repr__(self) -> str:
        return f"HeartbeatMonitor(poll_interval={self.poll_interval})"
