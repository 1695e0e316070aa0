"""rselection: leader-scoped tasks.

A fleet of processes competes for a lease (Postgres, Redis, or memory for a single
node); the holder runs the registered tasks, and every task is cancelled the moment
leadership is lost or in doubt.

The core never imports psycopg or redis; the backend classes named here
(``PostgresLeader``, ``RedisLeader``, their sharded leaders and their admin APIs) load
their backend on first use (so they are not in ``__all__``: ``from rselection import *``
needs neither driver), and ``rs.RedisLeader`` without redis-py raises an
``ImportError`` that says what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import signals
from .abc import CheckpointStore, LeaseBackend, Membership, TaskStore
from .broadcast import Broadcaster, BroadcasterClosed, Subscription, SubscriptionClosed
from .checkpoints import Snapshot
from .claiming import FireClaimer
from .context import TaskContext, TransactionFence
from .errors import (
    BackendUnavailable,
    ConfigError,
    LeadershipLost,
    RSelectionError,
    StaleLeaderError,
)
from .leader import Leader, LeaseLeader
from .lease import Acquisition, LeaderInfo
from .members import NodeInfo
from .memory import (
    MemoryCheckpointStore,
    MemoryClaimer,
    MemoryLease,
    MemoryMembership,
    MemoryTaskStore,
)
from .monitor import HeartbeatMonitor
from .schedules import CronSchedule, IntervalSchedule, Schedule, format_fire_key
from .sharding import shard_of
from .single_node import SingleNodeLeader
from .task_runs import RunRecord, TaskInfo
from .tasks import GenericTask, Task, TaskHandler, TaskType

if TYPE_CHECKING:
    from .postgres.admin import PostgresAdmin as PostgresAdmin
    from .postgres.leader import PostgresLeader as PostgresLeader
    from .postgres.sharded import PostgresShardedLeader as PostgresShardedLeader
    from .redis.admin import RedisAdmin as RedisAdmin
    from .redis.leader import RedisLeader as RedisLeader
    from .redis.sharded import RedisShardedLeader as RedisShardedLeader

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
    "MemoryLease",
    "MemoryMembership",
    "MemoryTaskStore",
    "Membership",
    "NodeInfo",
    "RSelectionError",
    "RunRecord",
    "Schedule",
    "SingleNodeLeader",
    "Snapshot",
    "StaleLeaderError",
    "Subscription",
    "SubscriptionClosed",
    "Task",
    "TaskContext",
    "TaskHandler",
    "TaskInfo",
    "TaskStore",
    "TaskType",
    "TransactionFence",
    "format_fire_key",
    "shard_of",
    "signals",
]

__version__ = "0.1.0.dev0"


#: Names loaded on first use, with their module, the driver it needs and how to install
#: it. They are not in ``__all__``, so ``from rselection import *`` needs no driver;
#: ``dir(rselection)`` lists them.
_LAZY = {
    "PostgresAdmin": (".postgres.admin", "psycopg", "pip install 'rselection[binary]'"),
    "PostgresLeader": (".postgres.leader", "psycopg", "pip install 'rselection[binary]'"),
    "PostgresShardedLeader": (
        ".postgres.sharded",
        "psycopg",
        "pip install 'rselection[binary]'",
    ),
    "RedisAdmin": (".redis.admin", "redis", "pip install 'rselection[redis]'"),
    "RedisLeader": (".redis.leader", "redis", "pip install 'rselection[redis]'"),
    "RedisShardedLeader": (".redis.sharded", "redis", "pip install 'rselection[redis]'"),
}


def __getattr__(name: str) -> Any:
    # Backends load their driver only when asked for.
    if name not in _LAZY:
        raise AttributeError(f"module 'rselection' has no attribute {name!r}")
    where, driver, install = _LAZY[name]
    try:
        module = importlib.import_module(where, __name__)
    except ImportError as exc:
        missing = exc.name or ""
        if missing != driver and not missing.startswith(driver + "."):
            raise
        raise ImportError(
            f"rselection.{name} needs the {driver!r} package, which is not installed: {install}",
            name=missing,
        ) from exc
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY))
