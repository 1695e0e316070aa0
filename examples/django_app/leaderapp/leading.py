"""The leader of this process, built from the settings; shared by the server and ``runleader``."""

from __future__ import annotations

from django.conf import settings

import rselection as rs

from .tasks import handler

_running: rs.LeaseLeader | None = None


def build_leader(*, name: str | None = None, node_id: str | None = None) -> rs.LeaseLeader:
    """A leader of the project's tasks: on ``settings.RSELECTION_DSN``, else alone.

    Args:
        name: the lease (default ``settings.RSELECTION_LEASE``).
        node_id: this node's id (default: the library's, unique per process; ``local``
            when leading alone).
    """
    dsn = getattr(settings, "RSELECTION_DSN", None)
    lease = name or getattr(settings, "RSELECTION_LEASE", "django-app")
    if dsn:
        return rs.PostgresLeader(dsn, handler, name=lease, node_id=node_id)
    return rs.SingleNodeLeader(handler, name=lease, node_id=node_id or "local")


def running_leader() -> rs.LeaseLeader | None:
    """The leader this server worker started, or ``None`` (no lifespan ran here)."""
    return _running


def set_running_leader(leader: rs.LeaseLeader | None) -> None:
    """Record (or forget, with ``None``) the leader this worker runs, for the views."""
    global _running
    _running = leader
