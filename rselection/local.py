"""A leader that is always leader: local development and tests, no database."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .leader import LeaderBase
from .lease import MemoryLease
from .timing import Timings

if TYPE_CHECKING:
    from .broadcast import Broadcaster
    from .claiming import FireClaimer
    from .tasks import TaskHandler

__all__ = ["SingleNodeLeader"]


class SingleNodeLeader(LeaderBase):
    """Leads at once with term 1, over an in-memory lease; no database needed.

    It runs the same state machine as the Postgres leader, so cancellation, joins and
    signals behave as in production. :meth:`step_down` ends the term (tasks are
    cancelled and joined) and the next term starts with the next number.

    Args:
        handler: the tasks to run.
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        name: the lease name, for logs and signals.
        node_id: this node's id (default ``"local"``).
        claimer: claims each scheduled fire first (default ``None``: every fire runs).
            A :class:`~rselection.MemoryClaimer` shared across terms lets a test see the
            misfire policies at work when a term starts after a gap.
    """

    def __init__(
        self,
        handler: TaskHandler,
        *,
        broadcaster: Broadcaster | None = None,
        name: str = "single-node",
        node_id: str = "local",
        claimer: FireClaimer | None = None,
    ) -> None:
        timings = Timings()
        super().__init__(
            MemoryLease(name, ttl=timings.ttl),
            handler,
            name=name,
            node_id=node_id,
            timings=timings,
            broadcaster=broadcaster,
            claimer=claimer,
        )
