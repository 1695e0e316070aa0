"""The newest version leads: a holder hands over once to a settled node of a newer release.

:func:`successor` decides, from a lease's nodes as their heartbeats show them, which
node the holder should hand over to: the live, eligible node whose version is newest
and newer than the holder's, settled (heartbeating) for ``settle`` seconds; ties go to
the longest settled. Nodes without a version never cause a move, and neither does an
older one: a rollback simply leads once no newer node is alive.

:class:`SuccessionWatch` is the one thread of a process that looks, every
:data:`CHECK_INTERVAL`, at the nodes of each lease this process leads with a version
set, and asks for the handover through the leader's backend (the same request as
``rselection resign --to``). See ``docs/explanation/how-it-works.md`` ("Versions and
eligibility").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Protocol

from packaging.version import Version

from . import forks
from .members import NodeInfo

__all__ = ["ASK_AGAIN_AFTER", "CHECK_INTERVAL", "SuccessionWatch", "Successor", "successor"]

logger = logging.getLogger("rselection.leader")

CHECK_INTERVAL = 0.5
"""Seconds between two looks at the nodes of a lease this process leads: a newer node
is handed the lease within about this long (plus a handover) of being settled."""

ASK_AGAIN_AFTER = 30.0
"""Seconds before the same node is asked for again, when a handover to it did not
happen (it stopped, or could not take the lease): no lease hops back and forth."""


def successor(
    nodes: Sequence[NodeInfo], node_id: str, version: str | None, settle: float, now: datetime
) -> NodeInfo | None:
    """The node that should lead instead of ``node_id`` (of ``version``), or ``None``.

    Args:
        nodes: the lease's nodes.
        node_id: the holder.
        version: the holder's version; ``None``: it never hands over for a version.
        settle: seconds a node must have heartbeated before it counts.
        now: the time to measure settling against (server time, as ``started_at``).
    """
    if version is None:
        return None
    mine = Version(version)
    best: tuple[Version, timedelta, NodeInfo] | None = None
    for node in nodes:
        if node.node_id == node_id or not node.alive or not node.eligible or node.version is None:
            continue
        theirs = Version(node.version)
        settled_for = now - node.started_at
        if theirs <= mine or settled_for < timedelta(seconds=settle):
            continue
        if best is None or (theirs, settled_for) > best[:2]:
            best = (theirs, settled_for, node)
    return None if best is None else best[2]


class Successor(Protocol):
    """A leader whose terms may pass to a newer node (see :class:`SuccessionWatch`)."""

    def hand_over_to_newer(self) -> None:
        """Look at the nodes once; ask for a handover when a newer node is settled."""
        ...


class SuccessionWatch(forks.PerProcess):
    """The process's one thread that runs each watched leader's
    :meth:`Successor.hand_over_to_newer` every :data:`CHECK_INTERVAL`; get it with
    :meth:`shared`. The thread ends once no leader is watched."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._leaders: dict[Successor, None] = {}
        self._thread: threading.Thread | None = None

    def add(self, leader: Successor) -> None:
        """Watch ``leader`` until :meth:`discard`."""
        with self._cond:
            self._leaders[leader] = None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="rselection-succession", daemon=True
                )
                self._thread.start()

    def discard(self, leader: Successor) -> None:
        """Watch ``leader`` no more (a look under way may end)."""
        with self._cond:
            self._leaders.pop(leader, None)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._leaders:
                    self._thread = None
                    return
                leaders = list(self._leaders)
            began = time.monotonic()
            for leader in leaders:
                try:
                    leader.hand_over_to_newer()
                except Exception:  # a backend error: the next look tries again
                    logger.warning("succession: a look at the nodes failed", exc_info=True)
            with self._cond:
                self._cond.wait(max(0.0, began + CHECK_INTERVAL - time.monotonic()))
