"""Redis backend: lease, leader, fenced writes, elections, fire claims, handover
requests, node membership and the admin API (:class:`RedisAdmin`).

Needs redis-py (extra ``redis``: ``pip install 'rselection[redis]'``) and Redis 6.2 or
later.

Importing :mod:`rselection` does not import this package (nor redis-py); importing this
package does. :class:`RedisLeader` is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

try:
    from .admin import RedisAdmin
    from .claims import RedisClaimer
    from .elector import RedisElector
    from .fencing import RedisFence, afenced_call, fenced_call
    from .handover import (
        cancel_handover,
        current_holder,
        live_nodes,
        reopen_handovers,
        request_handover,
        request_handovers,
    )
    from .keys import DEFAULT_KEY_PREFIX
    from .lease import RedisLease
except ImportError as exc:
    if exc.name != "redis" and not (exc.name or "").startswith("redis."):
        raise
    raise ImportError(
        f"rselection.redis needs redis-py, which cannot be imported ({exc}): "
        "pip install 'rselection[redis]'",
        name=exc.name,
    ) from exc

if TYPE_CHECKING:
    from .leader import RedisLeader
    from .sharded import RedisShardedLeader

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "RedisAdmin",
    "RedisClaimer",
    "RedisElector",
    "RedisFence",
    "RedisLeader",
    "RedisLease",
    "RedisShardedLeader",
    "afenced_call",
    "cancel_handover",
    "current_holder",
    "fenced_call",
    "live_nodes",
    "reopen_handovers",
    "request_handover",
    "request_handovers",
]


__getattr__ = lazy_names(__name__, {"RedisLeader": ".leader", "RedisShardedLeader": ".sharded"})


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
