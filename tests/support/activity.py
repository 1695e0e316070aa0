"""The activity ledger: when each task of each term ran, and whether two terms overlapped.

Node programs (``python -m rselection.commands.demo_fleet``) report every task run as two JSON
events stamped with this machine's wall clock, ``{"ev": "activity", "node", "term",
"task", "run", "start", "end": null}`` when it starts and the same with ``end`` when it
ends. Fenced writes cannot see a task of an old term that still runs after the lease
passed on (its stale writes are refused, but it ran); this ledger can.

The check: no run of one term overlaps a run of another term (on any node). What the
harness knows goes in as well:

* ``ended_at``: when a node's process died (``kill -9``) or was seen to exit; a run
  that reported its start but never its end ends there.
* ``paused``: the windows in which a node's process was frozen (SIGSTOP to SIGCONT).
  A frozen process runs nothing, so those windows are cut out of its runs. A run that
  was frozen while the lease passed on must still run, after SIGCONT, the few
  instructions that tell it its term is over; that tail, up to ``resume_grace``
  seconds after SIGCONT, is reported apart (``resume_tail``), not as an overlap. When
  the next term started only after SIGCONT, nothing is excused.
* ``allowance``: overlaps up to this long are reported but do not count as violations.
  Use it only for the one documented exception: a live leader's session killed from
  outside (``pg_terminate_backend``, ``CLIENT KILL``), where the old node's tasks may
  run for their cancel time while the successor starts (fencing still protects writes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Overlap", "Report", "Run", "assert_no_overlap", "check", "check_fleet", "runs"]

Window = tuple[float, float]


@dataclass(frozen=True)
class Run:
    """One run of one task in one term on one node, in wall-clock seconds.

    Attributes:
        node: the node that ran it.
        term: its term.
        task: the task's name.
        run: the node's number for this run.
        start: when it started.
        end: when it ended (or, if it never reported its end, when its process died).
        finished: ``False`` when the end is the process's death, not the task's report.
    """

    node: str
    term: int
    task: str
    run: int
    start: float
    end: float
    finished: bool = True

    def label(self) -> str:
        """``node/term/task#run`` for messages."""
        return f"{self.node}/term {self.term}/{self.task}#{self.run}"


@dataclass(frozen=True)
class Overlap:
    """Two runs of different terms (or of one term on two nodes) that ran at once.

    Attributes:
        older: the run of the older term (or the first of two nodes with one term).
        newer: the run of the newer term.
        seconds: how long both ran, frozen windows and excused resume tails cut out.
        resume_tail: seconds excused because ``older``'s process had to resume first.
    """

    older: Run
    newer: Run
    seconds: float
    resume_tail: float = 0.0

    def __str__(self) -> str:
        tail = f" (+{self.resume_tail * 1000:.0f} ms after resume)" if self.resume_tail else ""
        return (
            f"{self.older.label()} ran {self.seconds * 1000:.1f} ms{tail} "
            f"alongside {self.newer.label()}"
        )


@dataclass
class Report:
    """The outcome of :func:`check`.

    Attributes:
        runs: every run, in start order.
        overlaps: every overlapping pair longer than 0 (allowed or not), longest first.
        allowance: the allowance the check used.
        resume_tails: pairs whose only overlap was an excused resume tail.
    """

    runs: list[Run]
    overlaps: list[Overlap]
    allowance: float = 0.0
    resume_tails: list[Overlap] = field(default_factory=list)

    @property
    def violations(self) -> list[Overlap]:
        """Overlaps longer than the allowance."""
        return [o for o in self.overlaps if o.seconds > self.allowance]

    @property
    def max_overlap(self) -> float:
        """The longest overlap in seconds (0 when none)."""
        return max((o.seconds for o in self.overlaps), default=0.0)

    @property
    def max_resume_tail(self) -> float:
        """The longest excused resume tail in seconds (0 when none)."""
        tails = [o.resume_tail for o in [*self.overlaps, *self.resume_tails]]
        return max(tails, default=0.0)

    @property
    def terms(self) -> set[int]:
        """Terms that ran at least one task."""
        return {r.term for r in self.runs}

    def summary(self, limit: int = 5) -> str:
        """A few lines for an assertion message."""
        head = (
            f"{len(self.runs)} task runs in {len(self.terms)} terms; "
            f"{len(self.violations)} overlaps over {self.allowance * 1000:.0f} ms, "
            f"max {self.max_overlap * 1000:.1f} ms"
        )
        return "\n".join([head, *(f"  {o}" for o in self.overlaps[:limit])])


def runs(
    events: Iterable[Mapping[str, Any]],
    ended_at: Mapping[str, float] | None = None,
    now: float | None = None,
) -> list[Run]:
    """The task runs in a stream of node events (other events are ignored).

    Args:
        events: the events of every node, in any order.
        ended_at: when each node's process died or exited; ends its unfinished runs.
        now: the end of unfinished runs of nodes not in ``ended_at`` (still running);
            default: now.
    """
    ended_at = ended_at or {}
    started: dict[tuple[str, int], Mapping[str, Any]] = {}
    finished: dict[tuple[str, int], float] = {}
    for event in events:
        if event.get("ev") != "activity":
            continue
        key = (str(event["node"]), int(event["run"]))
        if event.get("end") is None:
            started[key] = event
        else:
            started.setdefault(key, event)
            finished[key] = float(event["end"])
    out = []
    stop = time.time() if now is None else now
    for key, event in started.items():
        node = key[0]
        end = finished.get(key)
        out.append(
            Run(
                node=node,
                term=int(event["term"]),
                task=str(event["task"]),
                run=key[1],
                start=float(event["start"]),
                end=end if end is not None else ended_at.get(node, stop),
                finished=end is not None,
            )
        )
    out.sort(key=lambda r: (r.start, r.node, r.run))
    return out


def _minus(span: Window, holes: Sequence[Window]) -> list[Window]:
    """``span`` with the ``holes`` cut out."""
    pieces = [span]
    for lo, hi in holes:
        cut: list[Window] = []
        for a, b in pieces:
            if hi <= a or lo >= b:
                cut.append((a, b))
                continue
            if a < lo:
                cut.append((a, lo))
            if hi < b:
                cut.append((hi, b))
        pieces = cut
    return pieces


def _common(xs: Sequence[Window], ys: Sequence[Window]) -> list[Window]:
    out = []
    for a, b in xs:
        for c, d in ys:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    return out


def _length(windows: Sequence[Window]) -> float:
    return sum(hi - lo for lo, hi in windows)


def check(
    events: Iterable[Mapping[str, Any]],
    *,
    ended_at: Mapping[str, float] | None = None,
    paused: Mapping[str, Sequence[Window]] | None = None,
    allowance: float = 0.0,
    resume_grace: float = 0.0,
    now: float | None = None,
) -> Report:
    """Find every pair of task runs of different terms that ran at the same time.

    Two runs of one term on two different nodes count too (two holders of one term).

    Args:
        events: the events of every node.
        ended_at: when each node's process died or exited (see :func:`runs`).
        paused: per node, the (SIGSTOP, SIGCONT) windows in which it was frozen.
        allowance: overlaps up to this long are not violations (the documented
            exception only, see the module docstring).
        resume_grace: how long after SIGCONT a run frozen while a newer term started
            may still run before that counts as an overlap.
        now: the end of runs still going (default: now).
    """
    paused = paused or {}
    found = runs(events, ended_at, now)
    overlaps: list[Overlap] = []
    tails: list[Overlap] = []
    began: dict[int, float] = {}
    for r in found:
        began.setdefault(r.term, r.start)  # found is in start order
    for i, a in enumerate(found):
        for b in found[i + 1 :]:
            if b.start >= a.end:
                break  # in start order: every later run starts after a ended too
            if a.term == b.term and a.node == b.node:
                continue
            older, newer = (a, b) if (a.term, a.start) <= (b.term, b.start) else (b, a)
            pair = _overlap(older, newer, began[newer.term], paused, resume_grace)
            if pair is None:
                continue
            (overlaps if pair.seconds > 0 else tails).append(pair)
    overlaps.sort(key=lambda o: o.seconds, reverse=True)
    return Report(found, overlaps, allowance, tails)


def _overlap(
    older: Run,
    newer: Run,
    newer_began: float,
    paused: Mapping[str, Sequence[Window]],
    resume_grace: float,
) -> Overlap | None:
    old_frozen = paused.get(older.node, ())
    new_frozen = paused.get(newer.node, ())
    common = _common(
        _minus((older.start, older.end), old_frozen), _minus((newer.start, newer.end), new_frozen)
    )
    if not common:
        return None
    # Excuse the tail a resumed process needs to learn that its term is over, but only
    # when the newer term began (its first task run) while it was frozen.
    excused: list[Window] = [
        (cont, cont + resume_grace)
        for stop, cont in old_frozen
        if stop < older.end and cont > older.start and stop <= newer_began < cont
    ]
    counted = _minus_all(common, excused)
    tail = _length(common) - _length(counted)
    return Overlap(older, newer, _length(counted), tail)


def _minus_all(windows: Sequence[Window], holes: Sequence[Window]) -> list[Window]:
    out: list[Window] = []
    for w in windows:
        out.extend(_minus(w, holes))
    return out


def check_fleet(fleet: Any, **options: Any) -> Report:
    """:func:`check` over a stopped :class:`rselection.commands.demo_fleet.Fleet`: its
    events, the times its nodes were killed or exited, and the windows they were frozen.

    Args:
        fleet: the fleet, after :meth:`~rselection.commands.demo_fleet.Fleet.stop_all` (or
            its ``with`` block) so that every event has been read.
        options: ``allowance``, ``resume_grace`` (see :func:`check`).
    """
    return check(fleet.history, ended_at=fleet.ended_at, paused=fleet.paused, **options)


KILLED_SESSION_ALLOWANCE = 1.0
"""Overlap allowed when a live leader's session ended from outside (``pg_terminate_backend``,
a connection reset on a working network): the documented exception, in which the server
frees the lease at once while the old node's tasks take their cancel time to stop; fenced
writes keep that window safe (the tests check their ledgers too)."""


def assert_no_overlap(fleet: Any, **options: Any) -> Report:
    """Fail unless the stopped ``fleet``'s tasks ran and no two terms' runs overlapped.

    Args:
        fleet: a stopped :class:`rselection.commands.demo_fleet.Fleet`.
        options: ``allowance``, ``resume_grace`` (see :func:`check`).
    """
    report = check_fleet(fleet, **options)
    assert report.runs, "the nodes reported no task activity"
    assert not report.violations, report.summary()
    return report
