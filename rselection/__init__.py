"""rselection: leader-scoped tasks.

A fleet of processes competes for a lease (Postgres, Redis, or memory for a single
node); the holder runs the registered tasks, and every task is cancelled the moment
leadership is lost or in doubt.

The core never imports psycopg or redis; ``PostgresLeader`` and ``RedisLeader`` load
their backend on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import signals
from .broadcast import Broadcaster, BroadcasterClosed, Subscription, SubscriptionClosed
from .checkpoints import CheckpointStore, MemoryCheckpointStore, Snapshot
from .claiming import FireClaimer, MemoryClaimer
from .context import TaskContext, TransactionFence
from .errors import (
    BackendUnavailable,
    ConfigError,
    LeadershipLost,
    RSelectionError,
    StaleLeaderError,
)
from .leader import Leader, LeaseLeader
from .lease import Acquisition, LeaderInfo, LeaseBackend
from .members import NodeInfo
from .monitor import HeartbeatMonitor
from .schedules import CronSchedule, IntervalSchedule, Schedule, format_fire_key
from .single_node import SingleNodeLeader
from .tasks import GenericTask, Task, TaskHandler, TaskType

if TYPE_CHECKING:
    from .postgres.leader import PostgresLeader
    from .redis.leader import RedisLeader

__all__ = [
    "Acquisition",
    "BackendUnavailable",
    "Broadcaster",
    "BroadcasterClosed",
    "CheckpointStore",
    "ConfigError",
    "CronSchedule",
    "FireClaimer",
    "GenericTask",
    "HeartbeatMonitor",
    "IntervalSchedule",
    "Leader",
    "LeaderInfo",
    "LeadershipLost",
    "LeaseBackend",
    "LeaseLeader",
    "MemoryCheckpointStore",
    "MemoryClaimer",
    "NodeInfo",
    "PostgresLeader",
    "RSelectionError",
    "RedisLeader",
    "Schedule",
    "SingleNodeLeader",
    "Snapshot",
    "StaleLeaderError",
    "Subscription",
    "SubscriptionClosed",
    "Task",
    "TaskContext",
    "TaskHandler",
    "TaskType",
    "TransactionFence",
    "format_fire_key",
    "signals",
]

__version__ = "0.1.0.dev0"


def __getattr__(name: str) -> Any:
    # Backends load their driver only when asked for.
    if name == "PostgresLeader":
        from .postgres.leader import PostgresLeader

        return PostgresLeader
    if name == "RedisLeader":
        from .redis.leader import RedisLeader

        return RedisLeader
    raise AttributeError(f"module 'rselection' has no attribute {name!r}")
