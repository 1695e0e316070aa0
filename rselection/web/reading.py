"""What the console's pages show and what its actions do, through a backend's admin API.

:class:`Console` reads the overview (every lease, with alerts), a lease's page (its
timeline, nodes, tasks and recent terms), a sharded lease's grid and a task's run
history, and carries out the operator's actions. Every method blocks on the server:
the web app runs them in worker threads. Nothing here writes a page; nothing here
knows HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ..admin import LeaseAdmin, Refused
from ..history import TermRecord
from ..resigning import Resignation, check_handover, hand_over, live_nodes_of
from ..status_report import shard_of_name, status_document
from ..task_runs import RUN_HISTORY_LIMIT, RunRecord, TaskInfo
from ..text import printable
from ..validation import check_name
from .timeline import WINDOW, Timeline, layout

__all__ = [
    "HANDOVER_TIMEOUT",
    "SILENT_FOR",
    "STUCK_AFTER",
    "Action",
    "Alert",
    "Console",
    "LeasePage",
    "Overview",
    "ShardsPage",
    "TaskPage",
]

HANDOVER_TIMEOUT = 10.0
"""Seconds an action that hands a lease over waits for the new term."""

SILENT_FOR = timedelta(hours=1)
"""A node that stopped heartbeating is an alert for this long (then it is only listed)."""

STUCK_AFTER = timedelta(minutes=10)
"""A scheduled task's run still going after this long is an alert."""

TERMS_READ = 1000  # the history read for the timeline (the leaders keep 1,000 by default)
TERMS_LISTED = 20  # the recent terms listed under the timeline
RUNS_PICTURED = 100  # the runs of each task read for the timeline
TASKS_PICTURED = 12  # tasks whose runs the timeline shows
LEASES_WITH_TASKS = 50  # leases whose tasks the overview reads for its alerts


@dataclass(frozen=True)
class Alert:
    """Something an operator should look at.

    Attributes:
        level: ``"danger"`` (no leader, a failing task) or ``"warning"``.
        lease: the lease it is about (``None``: the whole fleet).
        text: what is wrong, for people.
        task: the task it is about, else ``None``.
    """

    level: str
    lease: str | None
    text: str
    task: str | None = None


@dataclass(frozen=True)
class Overview:
    """The overview page.

    Attributes:
        status: the status document (see :func:`rselection.status_report.status_document`).
        leases: the leases to list (shards folded into their sharded name), each a dict
            of the status document's lease with ``version``, ``alive``, ``nodes`` and
            ``shards`` (the sharded name's entry, else ``None``) added.
        alerts: what is wrong.
        tasks_note: why tasks are not shown, else ``None``.
    """

    status: dict[str, Any]
    leases: list[dict[str, Any]]
    alerts: list[Alert]
    tasks_note: str | None = None


@dataclass(frozen=True)
class LeasePage:
    """A lease's page.

    Attributes:
        name: the lease name.
        checked_at: when it was read (the server's clock).
        lease: the status document's entry of the lease, ``None`` when it has none.
        nodes: the status document's nodes of the lease.
        handover: the pending handover request of the lease, else ``None``.
        shards: the sharded name's entry when the lease has shards, else ``None``.
        timeline: the last hour's picture.
        terms: the most recent terms, newest first.
        tasks: the lease's tasks, ``None`` when they cannot be read.
        tasks_note: why they cannot be read, else ``None``.
        alerts: what is wrong with this lease.
    """

    name: str
    checked_at: datetime
    lease: dict[str, Any] | None
    nodes: list[dict[str, Any]]
    handover: dict[str, Any] | None
    shards: dict[str, Any] | None
    timeline: Timeline
    terms: list[TermRecord]
    tasks: list[TaskInfo] | None
    tasks_note: str | None
    alerts: list[Alert] = field(default_factory=list)

    @property
    def candidates(self) -> list[str]:
        """The live nodes a lease may be handed to: eligible, not drained, not leading."""
        return [
            n["node_id"]
            for n in self.nodes
            if n["alive"] and n["eligible"] and not n["drained"] and not n["is_leader"]
        ]


@dataclass(frozen=True)
class ShardsPage:
    """A sharded lease's grid.

    Attributes:
        name: the sharded name.
        checked_at: when it was read.
        count: how many shards it has.
        owners: each shard's holder (``None``: unled), by shard number.
        nodes: the nodes that hold shards, in the order of their colours.
    """

    name: str
    checked_at: datetime
    count: int
    owners: list[str | None]
    nodes: list[str]


@dataclass(frozen=True)
class TaskPage:
    """A task's run history.

    Attributes:
        name: the lease name.
        task: the task's name.
        info: the task as its leader published it, ``None`` when not published.
        runs: its runs, newest first.
        note: why the runs cannot be read, else ``None``.
    """

    name: str
    task: str
    info: TaskInfo | None
    runs: list[RunRecord]
    note: str | None = None


@dataclass(frozen=True)
class Action:
    """What an action did.

    Attributes:
        ok: it did what was asked (a handover: another node leads now).
        message: what happened, for people.
        document: what happened, as JSON-ready values.
    """

    ok: bool
    message: str
    document: dict[str, Any]


def _lease_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The status document's leases to list: a sharded name's shards are folded into it."""
    sharded = {entry["name"]: entry for entry in status["shards"] or ()}
    nodes = status["nodes"] or []
    rows = []
    for lease in status["leases"]:
        shard = shard_of_name(lease["name"])
        if shard is not None and shard[0] in sharded:
            continue
        mine = [n for n in nodes if n["lease"] == lease["name"]]
        leader = next((n for n in mine if n["is_leader"]), None)
        rows.append(
            {
                **lease,
                "version": None if leader is None else leader["version"],
                "alive": sum(1 for n in mine if n["alive"]),
                "nodes": len(mine),
                "shards": sharded.get(lease["name"]),
            }
        )
    return rows


def _node_alerts(status: dict[str, Any]) -> list[Alert]:
    alerts = []
    for node in status["nodes"] or ():
        if node["alive"] or node["seen_ago"] > SILENT_FOR.total_seconds():
            continue
        alerts.append(
            Alert(
                "warning",
                node["lease"],
                f"node {printable(node['node_id'])} of lease {node['lease']!r} went silent "
                f"{node['seen_ago']:.0f}s ago",
            )
        )
    return alerts


def _task_alerts(name: str, tasks: Iterable[TaskInfo], now: datetime) -> list[Alert]:
    alerts = []
    for task in tasks:
        run = task.last_run
        if run is None or task.paused:
            continue
        which = f"task {task.task!r} of lease {name!r}"
        if run.outcome == "failed":
            alerts.append(
                Alert("danger", name, f"{which} failed: {run.error or 'no message'}", task.task)
            )
        elif run.outcome == "missed" or run.reason == "misfire":
            alerts.append(Alert("warning", name, f"{which} missed a fire", task.task))
        elif (
            task.kind != "persistent"
            and run.started_at is not None
            and run.ended_at is None
            and now - run.started_at > STUCK_AFTER
        ):
            minutes = (now - run.started_at).total_seconds() / 60
            alerts.append(
                Alert("warning", name, f"{which} has run for {minutes:.0f} min", task.task)
            )
    return alerts


class Console:
    """The console's reads and actions over one backend's admin API.

    Args:
        admin: the leases' admin API (a :class:`~rselection.postgres.PostgresAdmin` or
            :class:`~rselection.redis.RedisAdmin`); the console never closes it.
    """

    def __init__(self, admin: LeaseAdmin) -> None:
        self.admin = admin
        self.where = admin.where

    # -- reads ---------------------------------------------------------------------

    def _document(self, names: list[str] | None = None) -> dict[str, Any]:
        snapshot = self.admin.status(names)
        drained = self.admin.drained_of(node.name for node in snapshot.nodes or ())
        document = status_document(snapshot, self.where, names=names or (), drained=drained)
        document["checked_at_time"] = snapshot.checked_at
        return document

    def _tasks(self, name: str) -> tuple[list[TaskInfo] | None, str | None]:
        try:
            return self.admin.tasks(name), None
        except Refused as exc:
            return None, str(exc)

    def overview(self) -> Overview:
        """Every lease but the retired ones, and what is wrong."""
        status = self._document()
        now: datetime = status.pop("checked_at_time")
        alerts = [
            Alert("danger", name, f"lease {name!r} has no leader")
            for name in status["headless"]
            if shard_of_name(name) is None
        ]
        for sharded in status["shards"] or ():
            if sharded["unled"]:
                count = len(sharded["unled"])
                alerts.append(
                    Alert(
                        "danger",
                        sharded["name"],
                        f"{count} of {sharded['shards']} shards of {sharded['name']!r} "
                        "have no leader",
                    )
                )
        alerts += _node_alerts(status)
        rows = _lease_rows(status)
        note = None
        for row in rows[:LEASES_WITH_TASKS]:
            tasks, why = self._tasks(row["name"])
            if tasks is None:
                note = why
                continue
            row["tasks"] = len(tasks)
            row["paused"] = sum(1 for t in tasks if t.paused)
            alerts += _task_alerts(row["name"], tasks, now)
        status["alerts"] = [
            {"level": a.level, "lease": a.lease, "task": a.task, "text": a.text} for a in alerts
        ]
        return Overview(status, rows, alerts, note)

    def lease(self, name: str, *, window: timedelta = WINDOW) -> LeasePage | None:
        """Lease ``name``'s page, its timeline ``window`` long; ``None`` when there is no
        such lease."""
        name = check_name(name, "lease name")
        status = self._document([name])
        now: datetime = status.pop("checked_at_time")
        entry = next((x for x in status["leases"] if x["name"] == name), None)
        nodes = [n for n in status["nodes"] or () if n["lease"] == name]
        if entry is None and not nodes and not self.admin.exists(name):
            return None
        handover = next((h for h in status["handovers"] or () if h["lease"] == name), None)
        shards = next((s for s in status["shards"] or () if s["name"] == name), None)
        try:
            terms = self.admin.history(name, limit=TERMS_READ)
        except Refused:
            terms = []
        tasks, note = self._tasks(name)
        runs: dict[str, list[RunRecord]] = {}
        for task in (tasks or [])[:TASKS_PICTURED]:
            try:
                runs[task.task] = self.admin.task_runs(name, task.task, limit=RUNS_PICTURED)
            except Refused:
                break
        timeline = layout(terms, now, nodes=[n["node_id"] for n in nodes], runs=runs, window=window)
        alerts = []
        if entry is not None and not entry["live"] and not entry["retired"]:
            alerts.append(Alert("danger", name, f"lease {name!r} has no leader"))
        alerts += _node_alerts({"nodes": nodes})
        alerts += _task_alerts(name, tasks or (), now)
        return LeasePage(
            name=name,
            checked_at=now,
            lease=entry,
            nodes=nodes,
            handover=handover,
            shards=shards,
            timeline=timeline,
            terms=terms[:TERMS_LISTED],
            tasks=tasks,
            tasks_note=note,
            alerts=alerts,
        )

    def shards(self, name: str) -> ShardsPage | None:
        """The grid of sharded lease ``name``; ``None`` when it has no shards."""
        name = check_name(name, "lease name")
        status = self._document([name])
        now: datetime = status.pop("checked_at_time")
        entry = next((s for s in status["shards"] or () if s["name"] == name), None)
        if entry is None:
            return None
        owners: list[str | None] = [None] * entry["shards"]
        for node, mine in entry["nodes"].items():
            for shard in mine:
                if 0 <= shard < len(owners):
                    owners[shard] = node
        return ShardsPage(name, now, entry["shards"], owners, list(entry["nodes"]))

    def task(self, name: str, task: str, *, limit: int = RUN_HISTORY_LIMIT) -> TaskPage | None:
        """Task ``task`` of lease ``name``: as published, and its last ``limit`` runs;
        ``None`` when there is no such lease.

        Raises:
            Refused: no such task.
        """
        name = check_name(name, "lease name")
        if not self.admin.exists(name):
            return None
        tasks, note = self._tasks(name)
        info = next((t for t in tasks or () if t.task == task), None)
        try:
            runs = self.admin.task_runs(name, task, limit=limit)
        except Refused as exc:
            if tasks is not None:
                raise
            return TaskPage(name, task, info, [], note or str(exc))
        return TaskPage(name, task, info, runs, note)

    # -- actions -------------------------------------------------------------------

    def hand_over(self, name: str, to: str | None = None) -> Action:
        """Ask the leader of lease ``name`` to hand over (to node ``to``, else to any
        other node: a step-down) and wait for the new term.

        Raises:
            Refused: no such lease, no leader, or a node that may not take over.
        """
        name = check_name(name, "lease name")
        checked = check_handover(
            self.admin,
            name,
            to,
            missing=f"no lease {name!r} in {self.where}",
            alive=live_nodes_of(self.admin, name),
            unchecked=None,
            not_live="not seen alive",
        )
        if checked.already:
            holder = checked.holder
            message = f"{printable(holder.node_id)} already leads {name!r} (term {holder.term})"
            return Action(True, message, {"name": name, "to": to, "term": holder.term})
        done = hand_over(self.admin, name, to=to, timeout=HANDOVER_TIMEOUT)
        return Action(done.done, _handover_message(done), _handover_document(done))

    def drain(self, name: str, node: str, *, drained: bool = True) -> Action:
        """Drain (or, ``drained=False``, undrain) node ``node`` of lease ``name``.

        Raises:
            Refused: no such lease, or no such node of it.
        """
        change = self.admin.drain(name, node) if drained else self.admin.undrain(name, node)
        shown = printable(change.node_id)
        if change.changed:
            message = f"{'drained' if drained else 'undrained'} node {shown} of {name!r}"
        else:
            message = f"node {shown} of {name!r} was {'already' if drained else 'not'} drained"
        return Action(True, message, asdict(change))

    def control(self, name: str, task: str, what: str) -> Action:
        """``what``: pause, resume or trigger task ``task`` of lease ``name``.

        Raises:
            Refused: no such lease or task, or (trigger) a persistent task.
        """
        if what == "trigger":
            fire = self.admin.trigger_task(name, task)
            return Action(
                True, f"triggered task {task!r} of {name!r} ({fire.fire_key})", fire.as_json()
            )
        admin = self.admin
        change = (admin.pause_task if what == "pause" else admin.resume_task)(name, task)
        state = "paused" if change.paused else "running"
        message = f"task {task!r} of {name!r} {'is' if change.changed else 'was already'} {state}"
        return Action(True, message, change.as_json())


def _handover_message(done: Resignation) -> str:
    name, asked, new, said = done.name, done.asked, done.new, done.new_term_line()
    if new is None or said is None:
        return (
            f"no new term within {HANDOVER_TIMEOUT:g}s: {printable(asked.node_id)} did not "
            f"hand {name!r} over; the request was withdrawn"
        )
    if done.to is not None and new.node_id != done.to:
        said += f"; {printable(done.to)} did not take over"
    elif new.node_id == asked.node_id:
        said += "; no other node took over"
    return said


def _handover_document(done: Resignation) -> dict[str, Any]:
    new = done.new
    return {
        "name": done.name,
        "asked": {"node_id": done.asked.node_id, "term": done.asked.term},
        "to": done.to,
        "new": None if new is None else {"node_id": new.node_id, "term": new.term},
        "took_ms": round(done.took * 1000, 1),
        "done": done.done,
    }
