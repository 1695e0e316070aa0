"""Draining: an operator makes a running node ineligible, durably, until undrained.

``rselection drain NAME NODE`` (or an admin API's ``drain``) records the node as drained
beside the lease (a table on Postgres, a set on Redis) and wakes the lease's nodes
(``NOTIFY`` / ``PUBLISH``). A notification is only a wake-up: a node reads whether it is
drained from the server itself, so that a forged one can neither drain nor undrain
anything. A node also reads it each time its leader (re)connects, before it attempts to
lead, so a drain survives the node's restart and a notification missed while it was cut
off. A drained node behaves as one started with ``eligible=False``; a drained holder
ends its term at once (reason :data:`DRAINED`), reserving the lease for the newest
eligible live node when versions tell one (:func:`heir`). See
``docs/explanation/how-it-works.md`` ("Versions and eligibility").

:class:`DrainWatch` is the one thread of a process that reads the drain state of the
leaders woken by a notification.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from packaging.version import InvalidVersion, Version

from .members import NodeInfo
from .process_thread import ProcessThread

__all__ = [
    "DRAINED",
    "RETRY_AFTER",
    "Drainable",
    "DrainChange",
    "DrainNotices",
    "DrainWatch",
    "heir",
]

logger = logging.getLogger("rselection.leader")

DRAINED = "drained"
"""The reason a drained holder's term ends with (``demoted`` signal, history)."""

RETRY_AFTER = 1.0
"""Seconds before a read of the drain state that failed is tried again."""

READ_EVERY = 0.05
"""Fewest seconds between two reads of one leader's drain state: notifications are
anyone's (a flood of them costs one read per leader every 50 ms at most)."""


class DrainNotices:
    """The drain notifications a lease receives, passed on to the callback its leader
    set (the lease's ``on_drain``).

    The lease's reader of notifications (the Postgres keeper's thread, the Redis
    channel's reader) calls :meth:`tell`; whatever the callback raises is logged and
    never reaches that reader, which serves every lease of the process.

    Args:
        name: the lease's name, for the log.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self.callback: Callable[[str | None], None] | None = None
        """Called with the node a notification names (``None``: any node); ``None``:
        notifications are dropped."""

    def tell(self, node_id: str | None) -> None:
        """Pass a notification that the drains of node ``node_id`` (``None``: of any
        node) changed to the callback, if any."""
        callback = self.callback
        if callback is None:
            return
        try:
            callback(node_id)
        except Exception:  # the reader goes on
            logger.exception("lease %r: error reading a drain notification", self._name)


@dataclass(frozen=True)
class DrainChange:
    """What an admin API's ``drain`` or ``undrain`` did.

    Attributes:
        name: the lease name.
        node_id: the node.
        drained: whether the node is drained now.
        changed: ``False`` when it already was (drained, or not) before the call.
    """

    name: str
    node_id: str
    drained: bool
    changed: bool


class Drainable(Protocol):
    """A leader whose node may be drained (see :class:`DrainWatch`)."""

    def check_drained(self) -> None:
        """Read whether this node is drained and act on it.

        Raises:
            BackendUnavailable: the server could not be reached.
        """
        ...


class DrainWatch(ProcessThread):
    """The process's one thread that reads the drain state of the leaders a
    notification woke (:meth:`wake`); a read that fails is tried again after
    :data:`RETRY_AFTER`. Get it with :meth:`shared`; the thread ends when idle."""

    THREAD_NAME = "rselection-drains"

    def __init__(self) -> None:
        super().__init__()
        self._due: dict[Drainable, float] = {}  # leader -> when to read (monotonic)
        self._read_at: dict[Drainable, float] = {}  # leader -> when last read

    def wake(self, leader: Drainable) -> None:
        """Read ``leader``'s drain state soon: at once, or :data:`READ_EVERY` after the
        last read (safe from any thread; never blocks long)."""
        with self._cond:
            at = self._read_at.get(leader, -READ_EVERY) + READ_EVERY
            self._due[leader] = min(self._due.get(leader, at), at)
            self._cond.notify_all()
            self._start_thread()

    def discard(self, leader: Drainable) -> None:
        """Read ``leader``'s drain state no more (it stopped)."""
        with self._cond:
            self._due.pop(leader, None)
            self._read_at.pop(leader, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._due:
                        self._thread = None
                        return
                    now = time.monotonic()
                    ready = [leader for leader, at in self._due.items() if at <= now]
                    if ready:
                        for leader in ready:
                            del self._due[leader]
                            self._read_at[leader] = now
                        break
                    self._cond.wait(min(self._due.values()) - now)
            for leader in ready:
                try:
                    leader.check_drained()
                except Exception:  # a backend error: try again soon
                    logger.warning("drains: could not read the drain state", exc_info=True)
                    with self._cond:
                        self._due.setdefault(leader, time.monotonic() + RETRY_AFTER)


def heir(
    nodes: Sequence[NodeInfo],
    node_id: str,
    since: datetime | None,
    drained: frozenset[str] = frozenset(),
) -> NodeInfo | None:
    """The node a drained holder ``node_id`` reserves its lease for: the live, eligible
    node of the newest version that heartbeated since the term began (``since``), ties
    to the longest running; ``None`` when no candidate has a version (then any eligible
    node may take the lease: the holder simply releases it).

    Args:
        nodes: the lease's nodes, as their heartbeats show them.
        node_id: the drained holder.
        since: when its term began (server time): a node silent since then may be dead.
        drained: nodes known drained whose heartbeats may not say so yet.
    """
    best: tuple[Version, datetime, NodeInfo] | None = None
    for node in nodes:
        if (
            node.node_id == node_id
            or node.node_id in drained
            or not node.alive
            or not node.eligible
            or node.version is None
            or (since is not None and node.last_seen < since)
        ):
            continue
        try:
            version = Version(node.version)
        except InvalidVersion:
            continue
        if best is None or version > best[0] or (version == best[0] and node.started_at < best[1]):
            best = (version, node.started_at, node)
    return None if best is None else best[2]
