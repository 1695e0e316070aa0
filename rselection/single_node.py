"""A leader that is always leader: local development and tests, no database."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .abc import CheckpointStore, TaskStore, store_ability
from .errors import ConfigError
from .leader import LeaseLeader
from .memory import MemoryCheckpointStore, MemoryLease, MemoryTaskStore
from .timing import Timings

if TYPE_CHECKING:
    from .broadcast import Broadcaster
    from .claiming import FireClaimer
    from .tasks import TaskHandler

__all__ = ["SingleNodeLeader"]


FIRST_TERM_WAIT = 5.0
"""Seconds :meth:`SingleNodeLeader.start` waits at most for its first term."""


class SingleNodeLeader(LeaseLeader):
    """Leads at once with term 1, over an in-memory lease; no database needed.

    It is a :class:`~rselection.LeaseLeader` over a
    :class:`~rselection.MemoryLease`: the same state machine as the Postgres
    leader, so cancellation, joins and signals behave as in production.
    :meth:`step_down` ends the term (tasks are cancelled and joined) and the next term
    starts with the next number. ``ctx.checkpoint`` keeps task state in memory, fenced
    by term as in Postgres; ``ctx.fence(conn)`` is refused with a
    :class:`~rselection.ConfigError` (there is no lease table to fence a transaction
    against).

    Args:
        handler: the tasks to run.
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        claimer: claims each scheduled fire first (default ``None``: every fire runs).
            A :class:`~rselection.MemoryClaimer` shared across terms lets a test see the
            misfire policies at work when a term starts after a gap.
        checkpoint_store: keeps ``ctx.checkpoint`` (default: a new
            :class:`~rselection.MemoryCheckpointStore`). One you pass must fence against
            this leader's in-memory lease, which it is given (a
            :class:`~rselection.abc.LeaseFencedStore` such as a
            ``MemoryCheckpointStore``); a ``PostgresCheckpointStore`` is refused.
        name: the lease name, for logs and signals.
        node_id: this node's id (default ``"local"``).
        task_store: keeps the task controls and run history (:meth:`pause_task`,
            :meth:`task_runs`, ...; default: a new :class:`~rselection.MemoryTaskStore`).

    Raises:
        ConfigError: bad arguments, or a checkpoint store that cannot fence against
            this leader's lease.
    """

    def __init__(
        self,
        handler: TaskHandler,
        *,
        broadcaster: Broadcaster | None = None,
        claimer: FireClaimer | None = None,
        checkpoint_store: CheckpointStore | None = None,
        name: str = "single-node",
        node_id: str = "local",
        task_store: TaskStore | None = None,
    ) -> None:
        if checkpoint_store is not None and store_ability(checkpoint_store, "add_lease") is None:
            raise ConfigError(
                f"a SingleNodeLeader's checkpoint_store must fence against its own in-memory "
                f"lease (a store with add_lease(lease), such as MemoryCheckpointStore), got "
                f"{type(checkpoint_store).__name__}, which cannot: every fenced save would be "
                "refused. Leave checkpoint_store out (a new MemoryCheckpointStore), pass a "
                "MemoryCheckpointStore, or run a PostgresLeader to keep the state in Postgres"
            )
        timings = Timings()
        store = checkpoint_store if checkpoint_store is not None else MemoryCheckpointStore()
        self._store = store
        super().__init__(
            MemoryLease(name=name, ttl=timings.ttl),
            handler,
            node_id=node_id,
            timings=timings,
            broadcaster=broadcaster,
            claimer=claimer,
            checkpoint_store=store,
            task_store=task_store if task_store is not None else MemoryTaskStore(),
        )

    @property
    def checkpoint_store(self) -> CheckpointStore:
        """The store behind ``ctx.checkpoint`` (to inspect or seed task state)."""
        return self._store

    def start(self) -> None:
        """Start, and return once the first term has begun (it leads at once; within
        :data:`FIRST_TERM_WAIT` seconds at most). Under ``async with`` it returns at once:
        the term begins on the loop the block runs."""
        super().start()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: nothing it waits for runs here
            self.wait_until_leader(FIRST_TERM_WAIT)
