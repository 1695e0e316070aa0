"""``rselection task pause|resume|trigger NAME TASK`` and ``task history NAME TASK``:
operate a lease's tasks, and read a task's run history.

Pause and resume are durable (they last across the leader's failover and restarts
until undone); trigger asks for one extra fire, claimed like any other, which runs even
while the task is paused. The backend's admin API does it (``pause_task``,
``resume_task``, ``trigger_task``, ``task_runs``); this module says what happened, or
prints the runs as a table for people or, with ``--json``, as ``{"runs": [...]}``,
newest first, with the record's field names (see :class:`rselection.task_runs.RunRecord`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..task_runs import RUN_HISTORY_LIMIT, RunRecord
from .connections import act_on_lease
from .options import add_lease_options, lease_name, limit_type, subcommand
from .output import EXIT_OK, grid, iso, printable, say

if TYPE_CHECKING:
    from ..admin import LeaseAdmin

__all__ = ["DEFAULT_ROWS", "add_parser", "describe_outcome", "run"]

DEFAULT_ROWS = 20
"""Runs shown unless ``--limit`` says otherwise."""


def _task_name(value: str) -> str:
    from ..validation import check_name

    try:
        return check_name(value, "task name")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _common(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int]) -> None:
    parser.add_argument("name", type=lease_name, help="the lease name")
    parser.add_argument("task", type=_task_name, help="the task's name")
    add_lease_options(parser)
    parser.set_defaults(run=run)


@subcommand("task", help="pause, resume or trigger a lease's task; read its run history")
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Operate the tasks of a lease: `pause` skips a scheduled task's fires (each recorded,
    reason paused) and stops a persistent one, until `resume`, durably and across failover;
    `trigger` asks the leader for one extra fire of a scheduled task now (claimed like any
    other, run even while paused); `history` prints the task's last runs, newest first. The
    leader sees a change within about a second. Refused (exit 1) for an unknown lease or
    task, or a trigger of a persistent task."""
    actions = parser.add_subparsers(
        dest="action", required=True, metavar="ACTION", help="pause, resume, trigger or history"
    )
    for action, text in (
        ("pause", "skip the task's fires (stop a persistent task) until resumed"),
        ("resume", "run the task again"),
        ("trigger", "one extra fire of a scheduled task now, even while paused"),
    ):
        sub = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        _common(sub, run)
        sub.add_argument("--json", action="store_true", help="one JSON document")
    history = actions.add_parser(
        "history",
        help="the task's last runs, newest first",
        description="The task's last runs, newest first: when each was due, started and "
        "ended, its outcome (ok, failed, cancelled, skipped, missed) and why, the node and "
        f"term that ran it, and who asked (operator). At most {RUN_HISTORY_LIMIT} are "
        "kept per task by default.",
    )
    _common(history, run)
    history.add_argument(
        "--limit",
        type=limit_type(10_000),
        default=DEFAULT_ROWS,
        metavar="N",
        help=f"the newest N runs (default {DEFAULT_ROWS})",
    )
    history.add_argument("--json", action="store_true", help='one JSON document, {"runs": [...]}')


def describe_outcome(run: RunRecord) -> str:
    """A run's outcome for people: ``ok``, ``skipped (paused, by operator)``,
    ``failed: ValueError: bad input``."""
    text = run.outcome
    details = [part for part in (run.reason, f"by {run.by}" if run.by else None) if part]
    if details:
        text += f" ({', '.join(details)})"
    if run.error:
        text += f": {run.error}"
    return text


def _took(run: RunRecord) -> str:
    if run.started_at is None or run.ended_at is None:
        return "-"
    seconds = (run.ended_at - run.started_at).total_seconds()
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.1f}s"


def _history(admin: LeaseAdmin, args: argparse.Namespace) -> int:
    runs = admin.task_runs(args.name, args.task, limit=args.limit)
    if args.json:
        print(json.dumps({"runs": [run.as_json() for run in runs]}, indent=2), flush=True)
        return EXIT_OK
    task = repr(args.task)
    if not runs:
        say(f"task {task} of lease {args.name!r}: no runs recorded yet")
        return EXIT_OK
    say(f"task {task} of lease {args.name!r}: the last {len(runs)} runs, newest first")
    rows = [
        [
            iso(run.scheduled_at) or "-",
            iso(run.started_at) or "-",
            _took(run),
            run.node_id,
            str(run.term),
            describe_outcome(run),
        ]
        for run in runs
    ]
    for line in grid(["SCHEDULED", "STARTED", "TOOK", "NODE", "TERM", "OUTCOME"], rows):
        say(line)
    return EXIT_OK


def _act(admin: LeaseAdmin, args: argparse.Namespace) -> int:
    name, task = args.name, args.task
    shown = repr(task)
    if args.action == "trigger":
        trigger = admin.trigger_task(name, task)
        if args.json:
            print(json.dumps(trigger.as_json()), flush=True)
            return EXIT_OK
        say(
            f"triggered task {shown} of lease {name!r}: its leader runs one extra fire "
            f"({printable(trigger.fire_key)}) within about a second"
        )
        return EXIT_OK
    paused = args.action == "pause"
    done = admin.pause_task(name, task) if paused else admin.resume_task(name, task)
    if args.json:
        print(json.dumps(done.as_json()), flush=True)
        return EXIT_OK
    if not done.changed:
        say(f"task {shown} of lease {name!r} was {'already' if paused else 'not'} paused")
    elif paused:
        say(
            f"paused task {shown} of lease {name!r}: its fires are skipped (a persistent "
            f"task stops) until `rselection task resume {name} {printable(task)}`"
        )
    else:
        say(f"resumed task {shown} of lease {name!r}: it runs again")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Run ``rselection task ACTION NAME TASK``; return the exit code."""

    def act(admin: LeaseAdmin) -> int:
        if args.action == "history":
            return _history(admin, args)
        return _act(admin, args)

    return act_on_lease(
        args,
        f"task {args.action}",
        hint="run `rselection migrate`, or pass the right --table",
        postgres=lambda admin, _dsn: act(admin),
        redis=act,
    )
