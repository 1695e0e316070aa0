"""Who is in the fleet: :class:`NodeInfo`, one node competing for a lease."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

__all__ = ["NodeInfo"]


@dataclass(frozen=True)
class NodeInfo:
    """One node (leader or follower) of a lease, as its heartbeats show it.

    Attributes:
        node_id: the node's id (unique per leader object: host, pid and a random suffix
            by default, so nodes behind one NAT or pooler never collapse into one).
        name: the lease it competes for.
        hostname: the host it runs on.
        pid: its process id on that host.
        client_addr: its address as the server saw it (``None`` over a Unix socket).
        started_at: its first heartbeat (server time).
        last_seen: its latest heartbeat (server time).
        alive: seen within the node timeout.
        is_leader: it holds the lease now.
    """

    node_id: str
    name: str
    hostname: str
    pid: int
    client_addr: str | None
    started_at: datetime
    last_seen: datetime
    alive: bool
    is_leader: bool
