"""The newest version leads: a holder hands over once to a settled node of a newer release.

:class:`Look` decides, from a lease's nodes as their heartbeats show them, which
node the holder should hand over to: the live, eligible node whose version is newest
and newer than the holder's, settled (heartbeating) for ``settle`` seconds; ties go to
the longest settled. Nodes without a version never cause a move, and neither does an
older one: a rollback simply leads once no newer node is alive.

:class:`SuccessionWatch` is the one thread of a process that has each leader this
process runs with a version set look at its lease's nodes when due (:meth:`Look.next_look`:
when a newer node settles, else every few seconds), and ask for the handover through
the leader's backend (the same request as ``rselection resign --to``). See
``docs/explanation/how-it-works.md`` ("Versions and eligibility").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from packaging.version import InvalidVersion, Version

from .members import NodeInfo
from .process_thread import ProcessThread

__all__ = [
    "ASK_AGAIN_AFTER",
    "CHECK_INTERVAL",
    "LOOK_AT_MOST",
    "Look",
    "SuccessionWatch",
    "Successor",
]

logger = logging.getLogger("rselection.leader")

CHECK_INTERVAL = 0.5
"""Seconds between two rounds of the watching thread: a newer node is handed the lease
within about this long (plus a handover) of being settled."""

LOOK_AT_MOST = 5.0
"""Most seconds between two looks of a holder at its lease's nodes (one read each); it
looks sooner when a newer node is about to settle (see :meth:`Look.next_look`)."""

ASK_AGAIN_AFTER = 30.0
"""Seconds before the same node is asked for again, when a handover to it did not
happen (it stopped, or could not take the lease): no lease hops back and forth."""


@dataclass(frozen=True)
class Look:
    """What a holder sees when it looks at its lease's nodes.

    Attributes:
        nodes: the lease's nodes.
        node_id: the holder.
        version: the holder's version; ``None``: it never hands over for a version.
        settle: seconds a node must have heartbeated before it counts.
        now: the time to measure settling against (server time, as ``started_at``).
        since: when the holder's term began (server time): a node that has not
            heartbeated since then does not count. It is still listed as alive for a
            node timeout after it died (the holder before this one, killed, say), and
            a lease handed to it would stay reserved for a node that never takes it.
    """

    nodes: Sequence[NodeInfo]
    node_id: str
    version: str | None
    settle: float
    now: datetime
    since: datetime | None = None

    def successor(self) -> NodeInfo | None:
        """The node that should lead instead of the holder, or ``None``: the newest
        settled candidate (ties: the longest settled)."""
        best: tuple[Version, timedelta, NodeInfo] | None = None
        for node, theirs in self._newer():
            if self._silent(node):
                continue
            settled_for = self.now - node.started_at
            if settled_for >= timedelta(seconds=self.settle) and (
                best is None or (theirs, settled_for) > best[:2]
            ):
                best = (theirs, settled_for, node)
        return None if best is None else best[2]

    def next_look(self) -> float:
        """Seconds until the holder should look again: when the first newer node not
        settled yet settles, else half of ``settle`` (a node that appears meanwhile
        cannot settle before that), between :data:`CHECK_INTERVAL` and
        :data:`LOOK_AT_MOST`; :data:`CHECK_INTERVAL` while a newer node has not
        heartbeated since the term began (it is handed the lease right after its next
        heartbeat, if it is alive)."""
        wait = self.settle / 2
        for node, _ in self._newer():
            if self._silent(node):
                return CHECK_INTERVAL
            settled_at = node.started_at + timedelta(seconds=self.settle)
            left = (settled_at - self.now).total_seconds()
            if left > 0:
                wait = min(wait, left)
        return min(LOOK_AT_MOST, max(CHECK_INTERVAL, wait))

    def _silent(self, node: NodeInfo) -> bool:
        return self.since is not None and node.last_seen < self.since

    def _newer(self) -> Iterator[tuple[NodeInfo, Version]]:
        """The live, eligible nodes other than the holder of a version newer than its
        own, with their versions (none when it has no version)."""
        if self.version is None:
            return
        mine = Version(self.version)
        for node in self.nodes:
            if (
                node.node_id == self.node_id
                or not node.alive
                or not node.eligible
                or node.version is None
            ):
                continue
            try:
                theirs = Version(node.version)
            except InvalidVersion:  # written by hand, or by another program: not a release
                continue
            if theirs > mine:
                yield node, theirs


class Successor(Protocol):
    """A leader whose terms may pass to a newer node (see :class:`SuccessionWatch`)."""

    def hand_over_to_newer(self) -> None:
        """Look at the nodes once; ask for a handover when a newer node is settled."""
        ...


class SuccessionWatch(ProcessThread):
    """The process's one thread that runs each watched leader's
    :meth:`Successor.hand_over_to_newer` every :data:`CHECK_INTERVAL`; get it with
    :meth:`shared`. The thread ends once no leader is watched."""

    THREAD_NAME = "rselection-succession"

    def __init__(self) -> None:
        super().__init__()
        self._leaders: dict[Successor, None] = {}

    def add(self, leader: Successor) -> None:
        """Watch ``leader`` until :meth:`discard`."""
        with self._cond:
            self._leaders[leader] = None
            self._start_thread()

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
