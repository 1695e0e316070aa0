"""Postgres backend: lease, tables, fenced writes, leader, checkpoints, claims, elections
and the admin API (:class:`PostgresAdmin`).

Needs psycopg 3.

Importing :mod:`rselection` does not import this package (nor psycopg); importing this
package does. :class:`PostgresLeader` and :class:`PostgresShardedLeader` are loaded on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names
from ..task_checkpoint import TaskCheckpoint
from .admin import PostgresAdmin
from .broadcast import PostgresBroadcaster
from .checkpoint import PostgresCheckpointStore, Snapshot
from .claims import PostgresClaimer
from .elector import PostgresElector
from .fencing import afenced, fenced
from .handover import cancel_handover, current_holder, request_handover
from .lease import PostgresLease
from .schema import migrate

if TYPE_CHECKING:
    from ..monitor import HeartbeatMonitor
    from .leader import PostgresLeader
    from .sharded import PostgresShardedLeader

__all__ = [
    "HeartbeatMonitor",
    "PostgresAdmin",
    "PostgresBroadcaster",
    "PostgresCheckpointStore",
    "PostgresClaimer",
    "PostgresElector",
    "PostgresLeader",
    "PostgresLease",
    "PostgresShardedLeader",
    "Snapshot",
    "TaskCheckpoint",
    "afenced",
    "cancel_handover",
    "current_holder",
    "fenced",
    "migrate",
    "request_handover",
]


__getattr__ = lazy_names(
    __name__,
    {
        "PostgresLeader": ".leader",
        "PostgresShardedLeader": ".sharded",
        "HeartbeatMonitor": "..monitor",
    },
)
