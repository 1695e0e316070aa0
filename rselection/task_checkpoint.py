"""``ctx.checkpoint``: one task's snapshot, fenced to the term that runs it."""

from __future__ import annotations

import asyncio
from typing import Any

from .abc import CheckpointStore
from .checkpoints import Key, Snapshot
from .keys import lease_scoped
from .validation import check_name, check_term

__all__ = ["TaskCheckpoint"]


class TaskCheckpoint:
    """``ctx.checkpoint``: the snapshot of one task, fenced to the term that runs it.

    The key is the task's name scoped to the leader's lease,
    :func:`~rselection.keys.lease_scoped` ``(name, task)`` (``"billing/cursor"`` for the
    task ``cursor`` of the lease ``billing``), so tasks of the same name under two
    leases keep two snapshots. Every save and delete commits only while the term still
    holds the lease called ``name``, so a deposed leader can never overwrite what its
    successor saved. The async variants run the call in a worker thread, so an
    ``async def`` task does not block its event loop.

    Args:
        store: the leader's checkpoint store.
        task: the task's name.
        term: the fencing term of the task's run.
        name: the name of the lease whose term fences the writes (the leader's ``name``).

    Raises:
        ConfigError: a bad task name, term or lease name.
    """

    def __init__(self, store: CheckpointStore, task: str, term: int, name: str) -> None:
        self.store = store
        self._name = check_name(name, "lease name")
        self._key: Key = lease_scoped(self._name, check_name(task, "task name"))
        self._term = check_term(term)

    @property
    def key(self) -> Key:
        """The key the task's snapshot is stored under (``lease_scoped(name, task)``)."""
        return self._key

    @property
    def term(self) -> int:
        """The term saves are fenced to."""
        return self._term

    @property
    def name(self) -> str:
        """The name of the lease whose term fences the saves."""
        return self._name

    def load(self) -> Snapshot | None:
        """The task's last snapshot (from any term), or ``None``."""
        return self.store.load(self._key)

    def save(self, state: Any) -> Snapshot:
        """Save ``state``; :class:`~rselection.errors.StaleLeaderError` once the term is over.

        Args:
            state: a JSON-encodable value.
        """
        return self.store.save(self._key, state, term=self._term, name=self._name)

    def delete(self) -> bool:
        """Delete the task's snapshot (fenced like :meth:`save`); ``True`` if one existed."""
        return self.store.delete(self._key, term=self._term, name=self._name)

    async def aload(self) -> Snapshot | None:
        """:meth:`load` for ``async def`` tasks (runs in a worker thread)."""
        return await asyncio.to_thread(self.load)

    async def asave(self, state: Any) -> Snapshot:
        """:meth:`save` for ``async def`` tasks (runs in a worker thread).

        Args:
            state: a JSON-encodable value.
        """
        return await asyncio.to_thread(self.save, state)

    async def adelete(self) -> bool:
        """:meth:`delete` for ``async def`` tasks (runs in a worker thread)."""
        return await asyncio.to_thread(self.delete)

    def __repr__(self) -> str:
        return f"TaskCheckpoint({self._key!r}, term={self._term}, name={self._name!r})"
