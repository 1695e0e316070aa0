"""The lease page's picture: the last hour of a lease's terms as bars, one row per node.

:func:`layout` places each term of the leadership history that overlaps the window as a
bar on its node's row, from when it began to when it ended (the current term runs to
now), and each recorded task run on its task's row beneath; the template draws them as
inline SVG. Bars never overlap on one lease: the picture shows "never twice at once".
Times are the server's; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from ..history import END_REASONS, TermRecord
from ..task_runs import OUTCOMES, RunRecord

__all__ = [
    "LABEL_WIDTH",
    "PLOT_WIDTH",
    "WINDOW",
    "Bar",
    "Mark",
    "Row",
    "Tick",
    "Timeline",
    "layout",
]

WINDOW = timedelta(hours=1)
"""How far back the picture goes."""

LABEL_WIDTH = 200
"""Width of the names' column, in the picture's units."""

PLOT_WIDTH = 800
"""Width of the time axis, in the picture's units."""

ROW_HEIGHT = 22
AXIS_HEIGHT = 20
LABEL_CHARS = 26  # a longer name is cut in its label (its tooltip has it whole)


@dataclass(frozen=True)
class Bar:
    """One term on its node's row.

    Attributes:
        term: the term's number.
        node_id: its holder.
        began_at: when it began.
        ended_at: when it ended, ``None`` while it runs.
        end: its ``end_reason``, or ``"leading"`` while it runs.
        handed_to: the node it was handed to, else ``None``.
        by: ``"operator"`` when an operator ended it, else ``None``.
        x: where the bar starts, in the picture's units.
        width: how wide it is (at least 2, so a short term stays visible).
    """

    term: int
    node_id: str
    began_at: datetime
    ended_at: datetime | None
    end: str
    handed_to: str | None
    by: str | None
    x: float
    width: float

    @property
    def title(self) -> str:
        """Its tooltip."""
        until = "now" if self.ended_at is None else _clock(self.ended_at)
        how = self.end
        if self.handed_to:
            how += f" to {self.handed_to}"
        if self.by:
            how += f" (by {self.by})"
        return f"term {self.term} · {self.node_id} · {_clock(self.began_at)} to {until} · {how}"


@dataclass(frozen=True)
class Mark:
    """One task run on its task's row.

    Attributes:
        run: the run's record.
        x: where it starts, in the picture's units.
        width: how wide it is (at least 2).
    """

    run: RunRecord
    x: float
    width: float

    @property
    def title(self) -> str:
        """Its tooltip."""
        run = self.run
        when = run.started_at or run.scheduled_at
        text = f"{run.task} · {run.outcome}"
        if run.reason:
            text += f" ({run.reason})"
        if when is not None:
            text += f" · {_clock(when)}"
        if run.started_at is not None and run.ended_at is not None:
            text += f" · {(run.ended_at - run.started_at).total_seconds() * 1000:.0f} ms"
        text += f" · {run.node_id}, term {run.term}"
        if run.by:
            text += f" · by {run.by}"
        if run.error:
            text += f" · {run.error}"
        return text


@dataclass(frozen=True)
class Row:
    """A row of the picture: a node's terms, or a task's runs.

    Attributes:
        label: the node id or task name, cut to fit.
        name: the node id or task name, whole.
        y: the row's top, in the picture's units.
        bars: the node's terms.
        marks: the task's runs.
    """

    label: str
    name: str
    y: float
    bars: tuple[Bar, ...] = ()
    marks: tuple[Mark, ...] = ()


@dataclass(frozen=True)
class Tick:
    """A time on the axis: ``x`` in the picture's units, ``label`` as ``HH:MM`` UTC."""

    x: float
    label: str


@dataclass(frozen=True)
class Timeline:
    """The picture, laid out.

    Attributes:
        start: the window's start.
        end: the window's end (now, on the server's clock).
        nodes: one row per node.
        tasks: one row per task, beneath.
        ticks: the axis's times.
        width: the picture's width.
        height: the picture's height.
        ends: the ends of terms the picture shows, for its legend (``leading`` first).
        outcomes: the outcomes of the runs it shows, for its legend.
    """

    start: datetime
    end: datetime
    nodes: tuple[Row, ...]
    tasks: tuple[Row, ...]
    ticks: tuple[Tick, ...]
    width: int
    height: int
    ends: tuple[str, ...]
    outcomes: tuple[str, ...]

    @property
    def bars(self) -> list[Bar]:
        """Every bar, newest term first."""
        return sorted((b for row in self.nodes for b in row.bars), key=lambda b: -b.term)


def _clock(value: datetime) -> str:
    return value.strftime("%H:%M:%S")


def _label(name: str) -> str:
    return name if len(name) <= LABEL_CHARS else name[: LABEL_CHARS - 1] + "…"


def layout(
    terms: Iterable[TermRecord],
    now: datetime,
    *,
    nodes: Sequence[str] = (),
    runs: Mapping[str, Sequence[RunRecord]] | None = None,
    window: timedelta = WINDOW,
) -> Timeline:
    """Lay out the terms (and task runs) that overlap the window ending at ``now``.

    Args:
        terms: the lease's terms (its leadership history, any order).
        now: the window's end, on the server's clock.
        nodes: node ids to give a row even without a term in the window (the lease's
            current nodes), after those with one.
        runs: each task's runs (any order), for the rows beneath.
        window: how far back the picture goes.
    """
    start = now - window
    span = window.total_seconds()

    def x_of(at: datetime) -> float:
        seconds = min(max((at - start).total_seconds(), 0.0), span)
        return LABEL_WIDTH + PLOT_WIDTH * seconds / span

    by_node: dict[str, list[Bar]] = {}
    for record in sorted(terms, key=lambda r: r.term):
        ended = record.ended_at
        if (ended is not None and ended < start) or record.began_at > now:
            continue
        x = x_of(record.began_at)
        width = max(2.0, x_of(ended if ended is not None else now) - x)
        by_node.setdefault(record.node_id, []).append(
            Bar(
                record.term,
                record.node_id,
                record.began_at,
                ended,
                record.end_reason or "leading",
                record.handed_to,
                record.by,
                round(x, 2),
                round(width, 2),
            )
        )
    for node in nodes:
        by_node.setdefault(node, [])
    y = float(AXIS_HEIGHT)
    node_rows = []
    for node, bars in by_node.items():
        node_rows.append(Row(_label(node), node, y, bars=tuple(bars)))
        y += ROW_HEIGHT
    task_rows = []
    if runs:
        y += ROW_HEIGHT / 2  # a gap between the terms and the tasks
        for task in sorted(runs):
            marks = []
            for run in runs[task]:
                began = run.started_at or run.scheduled_at
                if began is None or began > now:
                    continue
                ended = run.ended_at or began
                if ended < start:
                    continue
                x = x_of(began)
                marks.append(Mark(run, round(x, 2), round(max(2.0, x_of(ended) - x), 2)))
            task_rows.append(Row(_label(task), task, y, marks=tuple(marks)))
            y += ROW_HEIGHT
    ticks = []
    # a tick every 1, 2, 5, 10, 15, 30 or 60 minutes: at most about eight of them
    step = next((m for m in (1, 2, 5, 10, 15, 30) if m * 60 * 8 >= span), 60)
    at = start.replace(second=0, microsecond=0) + timedelta(minutes=step - start.minute % step)
    while at <= now:
        ticks.append(Tick(round(x_of(at), 2), at.strftime("%H:%M")))
        at += timedelta(minutes=step)
    shown_ends = {bar.end for row in node_rows for bar in row.bars}
    shown_outcomes = {mark.run.outcome for row in task_rows for mark in row.marks}
    return Timeline(
        start=start,
        end=now,
        nodes=tuple(node_rows),
        tasks=tuple(task_rows),
        ticks=tuple(ticks),
        width=LABEL_WIDTH + PLOT_WIDTH + 10,
        height=int(y) + 4,
        ends=tuple(e for e in ("leading", *END_REASONS) if e in shown_ends),
        outcomes=tuple(o for o in OUTCOMES if o in shown_outcomes),
    )
