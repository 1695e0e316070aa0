"""One leader's task controls and run history: :class:`TaskBoard`.

A leader with a task store (:class:`~rselection.abc.TaskStore`) has a board. Each term
reads the lease's controls through it before its first fire (:meth:`TaskBoard.read`),
and while the term runs a notification on the lease's channel wakes the board
(:meth:`TaskBoard.wake`): a notification is anyone's, so it is only a wake-up, and the
board reads the controls from the store itself, on the process's task desk
(:mod:`rselection.task_desk`), then hands them to the running term
(:meth:`ControlsListener.apply_controls`). The term's runs go through the board to the
desk, which writes them in batches. See ``docs/explanation/how-it-works.md`` ("Task
controls and run history").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from .task_desk import TaskDesk
from .task_runs import RunRecord, TaskControls, entry_of

if TYPE_CHECKING:
    from .abc import TaskStore
    from .context import Term
    from .specs import TaskSpec

__all__ = ["RETRY_AFTER", "ControlsListener", "TaskBoard"]

logger = logging.getLogger(__name__)

RETRY_AFTER = 1.0
"""Seconds before a read of the controls that failed is tried again (while the term
that wanted it runs)."""

STOP_FLUSH = 2.0
"""Seconds a stopping leader waits at most for its last runs to be written."""


class ControlsListener(Protocol):
    """What a board hands the controls it reads to: the term running (its runner)."""

    def apply_controls(self, controls: TaskControls) -> None:
        """Act on ``controls``: pause or resume persistent tasks, run new triggers."""
        ...


class TaskBoard:
    """A leader's task controls, as last read, and where its runs go.

    Args:
        store: the task store of the leader's backend.
        name: the lease name.
        limit: runs kept per task.
    """

    def __init__(self, store: TaskStore, name: str, *, limit: int) -> None:
        self.store = store
        self.name = name
        self.limit = limit
        self.controls = TaskControls()
        """The controls as last read (replaced whole: read without a lock)."""
        self._lock = threading.Lock()
        self._listener: ControlsListener | None = None
        self._reading = False  # a read is queued on the desk

    def paused(self, task: str) -> bool:
        """Whether ``task`` was paused when the controls were last read."""
        return task in self.controls.paused

    def read(self) -> TaskControls:
        """Read the lease's controls from the store (and keep them).

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        controls = self.store.read_controls(self.name)
        self.controls = controls
        return controls

    def attach(self, listener: ControlsListener) -> None:
        """Hand the controls read from now on to ``listener`` (a term that runs)."""
        TaskDesk.shared().use(self.store)
        with self._lock:
            self._listener = listener

    def detach(self, listener: ControlsListener) -> None:
        """Hand ``listener`` nothing more (its term ended)."""
        with self._lock:
            if self._listener is listener:
                self._listener = None

    def wake(self) -> None:
        """A notification says the controls may have changed: while a term runs, read
        them soon on the task desk (never on the caller's thread, which must not block)."""
        self._read_soon(0.0)

    def _read_soon(self, delay: float) -> None:
        with self._lock:
            if self._listener is None or self._reading:
                return
            self._reading = True
        TaskDesk.shared().submit(self._refresh, delay=delay)

    def _refresh(self) -> None:
        """On the desk: read the controls and hand them to the running term."""
        with self._lock:
            self._reading = False
            if self._listener is None:
                return
        try:
            controls = self.read()
        except Exception as exc:
            logger.warning(
                "lease %r: could not read the task controls (%s); trying again in %gs",
                self.name,
                exc,
                RETRY_AFTER,
            )
            self._read_soon(RETRY_AFTER)
            return
        with self._lock:
            listener = self._listener
        if listener is not None:
            listener.apply_controls(controls)

    def retry_soon(self) -> None:
        """Read the controls again after :data:`RETRY_AFTER` (a trigger could not be
        claimed: it is taken on the next read)."""
        self._read_soon(RETRY_AFTER)

    def record(self, spec: TaskSpec, run: RunRecord) -> None:
        """Queue ``run`` of ``spec`` for the run history (never blocks)."""
        next_fire = spec.stats.next_fire if spec.schedule is not None else None
        TaskDesk.shared().record(self.store, run, next_fire=next_fire, limit=self.limit)

    def publish(self, term: Term, specs: Sequence[TaskSpec]) -> None:
        """Publish the term's list of tasks, on the desk (best effort: logged)."""
        entries = [entry_of(spec) for spec in specs]

        def publish() -> None:
            try:
                self.store.publish_tasks(self.name, term.node_id, term.number, entries)
            except Exception as exc:
                logger.warning(
                    "lease %r: could not publish the list of tasks of term %d: %s",
                    self.name,
                    term.number,
                    exc,
                )

        TaskDesk.shared().submit(publish)

    def drop_triggers(self, fire_keys: Sequence[str]) -> None:
        """Forget the triggers ``fire_keys`` in the store, on the desk (best effort: a
        trigger left behind is found claimed by the next leader, which drops it)."""
        keys = list(fire_keys)

        def drop() -> None:
            try:
                self.store.drop_triggers(self.name, keys)
            except Exception as exc:
                logger.warning(
                    "lease %r: could not drop %d triggers: %s", self.name, len(keys), exc
                )

        TaskDesk.shared().submit(drop)

    def close(self) -> None:
        """The leader stops: write its last runs now (waiting at most
        :data:`STOP_FLUSH` seconds)."""
        TaskDesk.shared().drain(self.store, STOP_FLUSH)
