"""The backends' admin APIs, whichever the backend: what they do and what they answer.

:class:`LeaseAdmin` is what :class:`~rselection.postgres.PostgresAdmin` and
:class:`~rselection.redis.RedisAdmin` do: read and operate a fleet's leases from outside
it (what ``rselection status``, ``resign``, ``forget``, ``drain``, ``undrain`` and
``task`` do); both answer in the shapes below (those of task controls and run
histories are in :mod:`rselection.task_runs`, re-exported here). Times are the
server's, but for the times of a run, which are its node's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Self

from .closeable import Closeable
from .drains import DrainChange
from .errors import RSelectionError
from .history import TermRecord
from .members import NodeInfo
from .task_runs import (
    OUTCOMES,
    RUN_HISTORY_LIMIT,
    RunRecord,
    TaskControlChange,
    TaskInfo,
    Trigger,
    check_run_limit,
)
from .text import printable
from .validation import check_name, check_node_id

if TYPE_CHECKING:
    from .abc import TaskStore
    from .lease import LeaderInfo

__all__ = [
    "DEFAULT_HISTORY_ROWS",
    "DrainChange",
    "LastFire",
    "LeaseAdmin",
    "LeaseStatus",
    "OUTCOMES",
    "PendingHandover",
    "RUN_HISTORY_LIMIT",
    "Refused",
    "Retirement",
    "RunRecord",
    "StatusSnapshot",
    "TaskControlChange",
    "TaskInfo",
    "TermWatch",
    "Trigger",
]


DEFAULT_HISTORY_ROWS = 100
"""Terms :meth:`LeaseAdmin.history` returns unless told otherwise."""


class Refused(RSelectionError):
    """An admin operation was refused and changed nothing; the message says why and
    what to do."""

    @classmethod
    def held(cls, name: str, holder: str, term: object, expires_in: float) -> Refused:
        """The refusal to retire lease ``name``, held by ``holder`` in ``term``.

        Args:
            name: the lease name.
            holder: its holder's node id.
            term: the holder's term.
            expires_in: seconds until the lease expires unless renewed.
        """
        return cls(
            f"lease {name!r} has a live holder: {printable(holder)} leads term {term} (lease "
            f"expires in {expires_in:.1f}s unless renewed); stop the service's nodes first: "
            "forget only retires a lease no service uses any more"
        )

    @classmethod
    def busy(cls, name: str, nodes: list[str], how: str) -> Refused:
        """The refusal to retire lease ``name``, whose ``nodes`` still run.

        Args:
            name: the lease name.
            nodes: the live nodes' ids.
            how: how they were found alive.
        """
        return cls(
            f"lease {name!r} still has live nodes ({how}): {', '.join(map(printable, nodes))}; "
            "stop them first: forget only retires a lease no service uses any more"
        )


@dataclass(frozen=True)
class LeaseStatus:
    """One lease as stored.

    Attributes:
        name: the lease name.
        holder: the node id of its live holder, ``None`` when nobody holds it.
        term: its latest term (``None``: a Redis lease with members that never led).
        acquired_at: when the live holder's term began, else ``None``.
        expires_at: when the live holder's lease expires unless renewed, else ``None``.
        expires_in: seconds until then, else ``None``.
        retired: retired at its latest term (see ``retire``); the next term revives it.
        last_change: the newest term that ended (when and why the holder last changed;
            see :meth:`LeaseAdmin.history`), ``None`` when none is recorded.
    """

    name: str
    holder: str | None
    term: int | None
    acquired_at: datetime | None
    expires_at: datetime | None
    expires_in: float | None
    retired: bool
    last_change: TermRecord | None = None

    @property
    def live(self) -> bool:
        """Whether a node holds the lease now."""
        return self.holder is not None


@dataclass(frozen=True)
class PendingHandover:
    """A handover request that still holds (see ``request_handover``).

    Attributes:
        lease: the lease name.
        term: the term asked to hand over (``None`` when the request does not say).
        node_id: the node asked to hand over (its holder then).
        to: the node the lease is reserved for, ``None`` for any other node.
        until: when the request lapses unless a new term began before.
        expires_in: seconds until then.
    """

    lease: str
    term: int | None
    node_id: str | None
    to: str | None
    until: datetime
    expires_in: float


@dataclass(frozen=True)
class LastFire:
    """The newest claimed fire of one scheduled task of a lease.

    Attributes:
        lease: the lease name.
        task: the task's name.
        fire: the fire's instant as in its fire key (RFC 3339, nanoseconds).
        node: the node that claimed (and ran) it.
        term: the term it was claimed in.
        claimed_at: when it was claimed.
    """

    lease: str
    task: str
    fire: str
    node: str
    term: int
    claimed_at: datetime


@dataclass(frozen=True)
class StatusSnapshot:
    """The leases asked for, read at one moment; each sequence sorted by lease name.

    Attributes:
        checked_at: when it was read.
        leases: the leases that exist among those asked for, and the shards
            (``NAME/<k>``) of each lease ``NAME`` asked for.
        handovers: the pending handover requests of those leases; ``None`` when the
            lease table predates handover requests.
        nodes: the nodes of those leases, oldest first within each lease; ``None``
            when there is no nodes table.
        fires: the last claimed fire of each task of those leases; ``None`` when not
            recorded (no claims table; Redis has no index to read them from).
    """

    checked_at: datetime
    leases: tuple[LeaseStatus, ...]
    handovers: tuple[PendingHandover, ...] | None
    nodes: tuple[NodeInfo, ...] | None
    fires: tuple[LastFire, ...] | None


@dataclass(frozen=True)
class Retirement:
    """What ``retire`` did.

    Attributes:
        name: the lease name.
        term: the term it is retired at (kept: a new leader gets a higher one).
        already: it was retired at that term before the call.
        marker: what records it, for people: a column of the lease row, or a key.
    """

    name: str
    term: int
    already: bool
    marker: str


class TermWatch(Closeable, ABC):
    """Waits for a new term of one lease (see :meth:`LeaseAdmin.watch_terms`): woken by
    the lease's own announcement, and reading the holder again every half second in
    case one was missed. ``with`` starts listening and stops on exit."""

    @abstractmethod
    def __enter__(self) -> Self:
        """Start listening for the lease's announcements."""

    @abstractmethod
    def wait(self, after_term: int, timeout: float) -> LeaderInfo | None:
        """The holder of the first term after ``after_term``, or ``None`` when none began
        within ``timeout`` seconds.

        Args:
            after_term: the term that should end (the holder asked to hand over).
            timeout: seconds to wait.
        """


class LeaseAdmin(Closeable, ABC):
    """A backend's leases, read and operated from outside the fleet.

    Every method raises :class:`~rselection.errors.BackendUnavailable` when the server
    cannot be reached or fails, :class:`~rselection.errors.ConfigError` on bad
    arguments. Each ``name`` is a lease name.
    """

    where: str
    """Where the leases are, for messages (never with a password)."""

    @abstractmethod
    def leases(self) -> list[str]:
        """The names of the leases, sorted."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether lease ``name`` exists (it ever had a term)."""

    @abstractmethod
    def status(self, names: Iterable[str] | None = None) -> StatusSnapshot:
        """A snapshot of leases ``names`` and their shards (default: every lease), their
        pending handover requests, their nodes and their tasks' last claimed fires.

        Args:
            names: the leases asked for; ``None`` for all.
        """

    @abstractmethod
    def nodes(self, name: str) -> list[NodeInfo] | None:
        """The nodes of lease ``name`` as their heartbeats show them, oldest first
        (``None``: they cannot be read)."""

    @abstractmethod
    def live_nodes(self, name: str) -> list[str] | None:
        """The ids of the live nodes of lease ``name`` (``None``: they cannot be told)."""

    @abstractmethod
    def current_holder(self, name: str) -> LeaderInfo | None:
        """The live holder of lease ``name``, or ``None``."""

    @abstractmethod
    def request_handover(
        self, name: str, *, to: str | None = None, valid_for: float = 10.0
    ) -> LeaderInfo | None:
        """Ask the leader of lease ``name`` to hand over; return the holder asked, or
        ``None`` when nobody holds it.

        Args:
            name: the lease name.
            to: the node that should take over, or ``None`` for any other node.
            valid_for: seconds the request (and the reservation for ``to``) holds.

        Raises:
            Refused: ``to`` is a node that may not lead (``eligible=False``); or, without
                ``to``, the heartbeats list nodes but none that may lead besides the
                holder.
        """

    def ineligible(self, name: str) -> set[str]:
        """The ids of the nodes of lease ``name`` that may not lead: ``eligible=False``
        as their heartbeats show them (empty when the nodes cannot be read), and the
        drained ones (:meth:`drained`)."""
        found = {node.node_id for node in self.nodes(name) or () if not node.eligible}
        return found | self.drained(name)

    def drained(self, name: str) -> set[str]:
        """The ids of the nodes of lease ``name`` an operator drained (:meth:`drain`)."""
        return set()

    def drained_of(self, names: Iterable[str]) -> set[tuple[str, str]]:
        """The (lease name, node id) pairs drained among leases ``names``."""
        return {(name, node) for name in set(names) for node in self.drained(name)}

    def drain(self, name: str, node_id: str) -> DrainChange:
        """Drain node ``node_id`` of lease ``name`` (``rselection drain``): from now on,
        and across its restarts until :meth:`undrain`, it never leads, never gets a
        handover or a shard; if it leads, it ends its term at once and the lease passes
        to another eligible node. Its node sees the drain within about a second (it is
        woken by a notification, and reads the drain itself). Draining a drained node
        changes nothing (``changed`` is ``False``).

        Args:
            name: the lease name.
            node_id: the node's id (as ``status`` lists it).

        Raises:
            Refused: no such lease, or no such node of it.
        """
        name, node_id = check_name(name, "lease name"), check_node_id(node_id)
        self._known_node(name, node_id, self.drained(name))
        return DrainChange(name, node_id, True, self._set_drained(name, node_id, True))

    def undrain(self, name: str, node_id: str) -> DrainChange:
        """Undrain node ``node_id`` of lease ``name`` (``rselection undrain``): it may lead
        again (if started with ``eligible=True``), competing as any other node; it does
        not take the lease back by itself unless versions say so. Undraining a node that
        is not drained changes nothing (``changed`` is ``False``).

        Args:
            name: the lease name.
            node_id: the node's id.

        Raises:
            Refused: no such lease, or no such node of it (neither drained nor listed).
        """
        name, node_id = check_name(name, "lease name"), check_node_id(node_id)
        self._known_node(name, node_id, self.drained(name))
        return DrainChange(name, node_id, False, self._set_drained(name, node_id, False))

    def _known_node(self, name: str, node_id: str, drained: set[str]) -> None:
        """Refuse an unknown lease, or a node that is neither drained nor listed."""
        nodes = self.nodes(name)
        if not self.exists(name) and not nodes and not drained:
            raise Refused(
                f"no lease {name!r} in {self.where}: check the name (`rselection status` "
                "lists the leases)"
            )
        if node_id in drained or any(node.node_id == node_id for node in nodes or ()):
            return
        listed = ", ".join(printable(node.node_id) for node in nodes or ()) or "none"
        raise Refused(
            f"no node {printable(node_id)} of lease {name!r} (its nodes: {listed}); start "
            "it first, or check the node id (`rselection status` lists the nodes)"
        )

    def _set_drained(self, name: str, node_id: str, drained: bool) -> bool:
        """*Backend*: record ``node_id`` drained (or not) and wake the lease's nodes;
        whether that changed anything."""
        raise Refused(f"{type(self).__name__} cannot drain nodes")

    def refuse_handover(self, name: str, to: str | None) -> None:
        """Raise :class:`Refused` when a handover of lease ``name`` to ``to`` (any other
        node: ``None``) could only leave the lease reserved for a node that never takes
        it: ``to`` may not lead, or no live node but the holder may."""
        nodes = self.nodes(name) or []
        drained = self.drained(name)
        if to is not None:
            if to in drained:
                raise Refused(
                    f"{printable(to)} may not lead {name!r}: it is drained (`rselection "
                    "undrain` makes it eligible again); hand over to another node"
                )
            if to in {node.node_id for node in nodes if not node.eligible}:
                raise Refused(
                    f"{printable(to)} may not lead {name!r}: it was started with "
                    "eligible=False (a canary or an admin process, say); hand over to "
                    "another node"
                )
        elif any(not node.eligible or node.node_id in drained for node in nodes) and not any(
            node.alive and node.eligible and node.node_id not in drained and not node.is_leader
            for node in nodes
        ):
            raise Refused(
                f"no other live node of lease {name!r} may lead (the others were started "
                "with eligible=False, or are drained); start another node first"
            )

    @abstractmethod
    def cancel_handover(self, name: str, term: int) -> bool:
        """Withdraw the handover request for ``term`` of lease ``name``; ``True`` if one was.

        Args:
            name: the lease name.
            term: the term asked to hand over (that of :meth:`request_handover`'s answer).
        """

    @abstractmethod
    def history(self, name: str, *, limit: int = DEFAULT_HISTORY_ROWS) -> list[TermRecord]:
        """The last ``limit`` terms of lease ``name``, newest first (its leadership
        history; see :mod:`rselection.history`): empty when none is recorded.

        Raises:
            ConfigError: ``limit`` is not an int from 1.
            Refused: the lease table has no history yet (Postgres: run ``rselection
                migrate``).
        """

    @abstractmethod
    def retire(self, name: str, *, check_nodes: bool = True) -> Retirement:
        """Retire lease ``name``, which no service uses any more (``rselection forget``):
        its term stays, marked retired; :meth:`status` snapshots still show it, and the
        next acquisition brings it back.

        Args:
            name: the lease name.
            check_nodes: also refuse while a node of the lease is alive.

        Raises:
            Refused: no such lease, a live holder, live nodes, or as the backend says.
        """

    @abstractmethod
    def watch_terms(self, name: str) -> TermWatch:
        """A watch for the next term of lease ``name``: enter it before asking for a
        handover, then :meth:`~TermWatch.wait`."""

    # -- task controls and run history ------------------------------------------------

    def _task_store(self) -> TaskStore:
        """*Backend*: the store of the task controls and run histories of its leases."""
        raise Refused(f"{type(self).__name__} keeps no task controls nor run history")

    def _known_lease(self, name: str) -> None:
        """Refuse lease ``name`` unless it exists or has nodes."""
        if not self.exists(name) and not self.nodes(name):
            raise Refused(
                f"no lease {name!r} in {self.where}: check the name (`rselection status` "
                "lists the leases)"
            )

    def _known_task(self, store: TaskStore, name: str, task: str, *, scheduled: bool) -> None:
        """Refuse an unknown lease, or a task its leader's list does not have (when it
        published one), or (``scheduled``) a persistent task. Reads the list without
        the newest runs: a pause never waits on the run history."""
        listed = store.read_tasks(name, last_run=False)
        if not listed:
            self._known_lease(name)
            return
        found = next((info for info in listed if info.task == task), None)
        if found is None:
            names = ", ".join(printable(info.task) for info in listed)
            raise Refused(
                f"no task {task!r} of lease {name!r} (its tasks: {names}); check "
                "the name (`rselection task history` needs the exact task name)"
            )
        if scheduled and found.kind == "persistent":
            raise Refused(
                f"task {task!r} of lease {name!r} is persistent: only scheduled "
                "tasks can be triggered (pause and resume it instead)"
            )

    def tasks(self, name: str) -> list[TaskInfo]:
        """The tasks of lease ``name`` as its leader last published them (when a term
        began), sorted by task name, each with its controls and its newest run: empty
        when no leader of the lease ever published its tasks.

        Raises:
            Refused: no such lease.
        """
        name = check_name(name, "lease name")
        found = self._task_store().read_tasks(name)
        if not found:
            self._known_lease(name)
        return found

    def task_runs(self, name: str, task: str, *, limit: int = RUN_HISTORY_LIMIT) -> list[RunRecord]:
        """The last ``limit`` runs of task ``task`` of lease ``name``, newest first (its
        run history; see :mod:`rselection.task_runs`): empty when none is recorded.

        Raises:
            ConfigError: ``limit`` is not an int from 1 to 10,000.
            Refused: no such lease, or (when its tasks are known) no such task.
        """
        name, task = check_name(name, "lease name"), check_name(task, "task name")
        limit = check_run_limit(limit)
        store = self._task_store()
        runs = store.read_runs(name, task, limit)
        if not runs:
            self._known_task(store, name, task, scheduled=False)
        return runs

    def pause_task(self, name: str, task: str) -> TaskControlChange:
        """Pause task ``task`` of lease ``name`` (``rselection task pause``), durably
        until :meth:`resume_task`: a scheduled task's fires are skipped (reason
        ``paused``), a persistent task is stopped and not restarted. The leader sees it
        within about a second, and a new leader before its first fire. Pausing a paused
        task changes nothing (``changed`` is ``False``).

        Raises:
            Refused: no such lease, or (when its tasks are known) no such task.
        """
        return self._set_paused(name, task, True)

    def resume_task(self, name: str, task: str) -> TaskControlChange:
        """Resume task ``task`` of lease ``name`` (``rselection task resume``): its fires
        run again, a persistent task starts again within about a second. Resuming a task
        that is not paused changes nothing (``changed`` is ``False``).

        Raises:
            Refused: no such lease, or (when its tasks are known) no such task.
        """
        return self._set_paused(name, task, False)

    def _set_paused(self, name: str, task: str, paused: bool) -> TaskControlChange:
        # Pause and resume differ only in the flag they write.
        name, task = check_name(name, "lease name"), check_name(task, "task name")
        store = self._task_store()
        self._known_task(store, name, task, scheduled=False)
        return store.set_paused(name, task, paused)

    def trigger_task(self, name: str, task: str) -> Trigger:
        """Ask the leader of lease ``name`` for one extra fire of scheduled task ``task``
        now (``rselection task trigger``), even while the task is paused: it has its own
        fire key and is claimed like any other fire, so it runs once across the fleet
        (a leader that takes over runs it if the old one did not). Its run record says
        ``by: "operator"``.

        Raises:
            Refused: no such lease, no such task (when its tasks are known), or a
                persistent task (only scheduled tasks can be triggered).
        """
        name, task = check_name(name, "lease name"), check_name(task, "task name")
        store = self._task_store()
        self._known_task(store, name, task, scheduled=True)
        return store.add_trigger(name, task)
