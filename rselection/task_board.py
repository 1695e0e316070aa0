"""One leader's task controls and run history: :class:`TaskBoard`.

A leader with a task store (:class:`~rselection.abc.TaskStore`) has a board. It reads
the lease's controls whenever a notification on the lease's channel wakes it
(:meth:`TaskBoard.wake`): a notification is anyone's, so it is only a wake-up, and the
board reads the controls from the store itself, on the process's task desk
(:mod:`rselection.task_desk`). What it holds is current (:attr:`TaskBoard.fresh`) from
its first read until the leader (re)connects (notifications may be missed meanwhile):
a term then starts its persistent tasks as it says at once, else reads the controls
first; a term with scheduled tasks reads them once more before its scheduler begins.
While a term runs, what the board reads is handed to it
(:meth:`ControlsListener.apply_controls`). The term's runs go through the board to the
desk, which writes them in batches. See ``docs/explanation/how-it-works.md`` ("Task
controls and run history").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from .task_desk import ControlsDesk, Noted, RunQueue, TaskDesk
from .task_runs import TaskControls, TaskEntry, Trigger

if TYPE_CHECKING:
    from .abc import TaskStore

__all__ = ["READ_GAP", "RETRY_AFTER", "RETRY_MAX", "ControlsListener", "TaskBoard", "TaskNotices"]

logger = logging.getLogger(__name__)

RETRY_AFTER = 1.0
"""Seconds before a read of the controls that failed is tried again (while the term
that wanted it runs)."""

READ_GAP = 0.1
"""Least seconds between two reads of the controls that notifications ask for."""

RETRY_MAX = 10.0
"""Most seconds between two reads of the controls a term waits for (see
:meth:`TaskBoard.read_for_term`)."""

STOP_FLUSH = 2.0
"""Seconds a stopping leader waits at most for its last runs to be written."""


class TaskNotices:
    """The task-controls notifications a lease receives, passed on to the callback its
    leader set (the lease's ``on_tasks``), as :class:`~rselection.drains.DrainNotices`
    does for drains: whatever the callback raises is logged and never reaches the
    lease's reader of notifications, which serves every lease of the process.

    Args:
        name: the lease's name, for the log.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self.callback: Callable[[], None] | None = None
        """Called for each notification; ``None``: notifications are dropped."""

    def tell(self) -> None:
        """Pass a notification that the task controls changed to the callback, if any."""
        callback = self.callback
        if callback is None:
            return
        try:
            callback()
        except Exception:  # the reader goes on
            logger.exception("lease %r: error reading a tasks notification", self._name)


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
        self._last_read = -READ_GAP  # when the last read on a wake-up began (monotonic)
        self._open = False  # the leader runs (see open, close)
        self._fresh = False  # see fresh
        # Bumped by each notification and reconnect: a read that began before the last
        # one may hold controls older than a change, and makes the board fresh no more.
        self._changes = 0
        self._known = False  # see known
        self.notified = False
        """Whether changes of the controls wake the board (:meth:`wake`): its lease's
        notifications, or its store's callbacks. Without, each term reads them."""
        self._queue: RunQueue | None = None  # this leader's runs waiting for the desk

    def paused(self, task: str) -> bool:
        """Whether ``task`` was paused when the controls were last read."""
        return task in self.controls.paused

    def open(self) -> None:
        """The leader starts: notifications make the board read the controls."""
        with self._lock:
            self._open = True

    @property
    def fresh(self) -> bool:
        """Whether the controls held are current: read since the leader last
        (re)connected, and kept so by the notifications since (never, when nothing
        notifies the board: see :attr:`notified`)."""
        return self._fresh and self.notified

    def stale(self) -> None:
        """The leader (re)connected: notifications may have been missed meanwhile, so
        the next term reads the controls before it starts its tasks."""
        with self._lock:
            self._changes += 1
            self._fresh = False

    def read_for_term(
        self, begin: Callable[[TaskControls], None], live: Callable[[], bool]
    ) -> None:
        """Read the controls on the task desk (never on the caller's thread: a term
        starts on the engine's worker, which renews leases), then ``begin(controls)``
        there, while ``live()``.

        A read that fails falls back on the controls held when this board read them
        before (:attr:`known`); else the term begins nothing (no paused task may run):
        the read is tried again, :data:`RETRY_AFTER` seconds later, then twice as long
        each time up to :data:`RETRY_MAX`, said once, until it works or the term ends.
        """
        said = [False]

        def attempt(delay: float) -> None:
            if not live():
                return
            try:
                controls = self.read()
            except Exception as exc:
                if self._known:
                    logger.warning(
                        "lease %r: could not read the task controls (%s); the tasks run "
                        "as they were last read (%d paused)",
                        self.name,
                        exc,
                        len(self.controls.paused),
                    )
                    begin(self.controls)
                    return
                if not said[0]:
                    said[0] = True
                    logger.warning(
                        "lease %r: could not read the task controls (%s); the term starts "
                        "no task until they are read (trying again, every %gs at most)",
                        self.name,
                        exc,
                        RETRY_MAX,
                    )
                ControlsDesk.shared().submit(
                    lambda: attempt(min(2 * delay, RETRY_MAX)), delay=delay
                )
                return
            if said[0]:
                logger.info("lease %r: task controls read: the term starts its tasks", self.name)
            begin(controls)

        ControlsDesk.shared().submit(lambda: attempt(RETRY_AFTER))

    @property
    def known(self) -> bool:
        """Whether this board read the controls successfully at least once."""
        return self._known

    def read(self) -> TaskControls:
        """Read the lease's controls from the store (and keep them); once the leader
        stopped, the controls last read (nothing of a stopped leader opens a session).

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        if not self._open:
            return self.controls
        with self._lock:
            changes = self._changes
        controls = self.store.read_controls(self.name)
        self.controls = controls
        with self._lock:
            self._known = True
            self._fresh = self._changes == changes  # no notification came meanwhile
        return controls

    def attach(self, listener: ControlsListener) -> None:
        """Hand the controls read from now on to ``listener`` (a term that runs)."""
        TaskDesk.shared().use(self.store)
        ControlsDesk.shared().use(self.store)
        with self._lock:
            self._listener = listener

    def detach(self, listener: ControlsListener) -> None:
        """Hand ``listener`` nothing more (its term ended)."""
        with self._lock:
            if self._listener is not listener:
                return
            self._listener = None
        TaskDesk.shared().release(self.store)
        ControlsDesk.shared().release(self.store)

    def wake(self) -> None:
        """A notification says the controls may have changed: read them soon on the task
        desk (never on the caller's thread, which must not block), and hand them to the
        running term, if any; a follower keeps them for its next term. Until that read,
        they are not current: a term that begins meanwhile reads them before it starts
        its tasks."""
        with self._lock:
            self._changes += 1
            self._fresh = False

        self._read_soon(0.0)

    def _read_soon(self, delay: float) -> None:
        """Read the controls ``delay`` seconds from now, and not sooner than
        :data:`READ_GAP` after the last read: wake-ups coalesce into one pending read,
        so that a flood of notifications (anyone may send them) costs a read each
        :data:`READ_GAP` seconds at most."""
        with self._lock:
            if not self._open or self._reading:
                return
            self._reading = True
            delay = max(delay, self._last_read + READ_GAP - time.monotonic())
        ControlsDesk.shared().submit(self._refresh, delay=delay)

    def _refresh(self) -> None:
        """On the desk: read the controls and hand them to the running term."""
        with self._lock:
            self._reading = False
            self._last_read = time.monotonic()
            if not self._open:
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

    def note(self, noted: Noted) -> None:
        """Queue a run for the run history (from the hot path: no lock, no wait)."""
        queue = self._queue
        if queue is None:
            queue = self._queue = TaskDesk.shared().queue(self.store, self.limit)
        queue.add(noted)

    def publish(self, node_id: str, term: int, entries: Sequence[TaskEntry]) -> None:
        """Publish the list of tasks of ``term`` (led by ``node_id``), on the desk (best
        effort: logged)."""

        def publish() -> None:
            if not self._open:  # the leader stopped meanwhile
                return
            try:
                self.store.publish_tasks(self.name, node_id, term, list(entries))
            except Exception as exc:
                logger.warning(
                    "lease %r: could not publish the list of tasks of term %d: %s",
                    self.name,
                    term,
                    exc,
                )

        TaskDesk.shared().submit(publish)

    def drop_triggers(self, fire_keys: Sequence[str]) -> None:
        """Forget the triggers ``fire_keys`` in the store, on the desk (best effort: a
        trigger left behind is found claimed by the next leader, which drops it)."""
        keys = list(fire_keys)

        def drop() -> None:
            if not self._open:  # the leader stopped meanwhile: the next one drops them
                return
            try:
                self.store.drop_triggers(self.name, keys)
            except Exception as exc:
                logger.warning(
                    "lease %r: could not drop %d triggers: %s", self.name, len(keys), exc
                )

        TaskDesk.shared().submit(drop)

    def reissue_trigger(self, trigger: Trigger) -> None:
        """Ask ``trigger``'s fire again under a fresh key, and drop it, on the desk: it
        was claimed by a term that ended before the fire started (a later leader finds
        its key claimed and would drop it unrun). Best effort: logged."""

        def reissue() -> None:
            if not self._open:  # the leader stopped meanwhile: its store may be closed
                logger.warning(
                    "lease %r: trigger %.120s not run: its leader stopped", self.name,
                    trigger.fire_key,
                )  # fmt: skip
                return
            try:
                self.store.add_trigger(self.name, trigger.task)
                self.store.drop_triggers(self.name, [trigger.fire_key])
            except Exception as exc:
                logger.warning(
                    "lease %r: could not ask trigger %.120s again: %s",
                    self.name,
                    trigger.fire_key,
                    exc,
                )

        TaskDesk.shared().submit(reissue)

    def close(self) -> None:
        """The leader stops: write its last runs now (waiting at most
        :data:`STOP_FLUSH` seconds), and read the controls no more."""
        with self._lock:
            self._open = False
        ControlsDesk.shared().release(self.store)
        TaskDesk.shared().drain(self.store, STOP_FLUSH)
        self._queue = None
