"""The activity ledger checker: task runs of different terms must never overlap."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import activity


def run(node: str, term: int, task: str, n: int, start: float, end: float | None) -> list[Any]:
    """The two events a node reports for one run (only the start when ``end`` is None)."""
    fields = {"ev": "activity", "node": node, "term": term, "task": task, "run": n}
    events = [{**fields, "start": start, "end": None}]
    if end is not None:
        events.append({**fields, "start": start, "end": end})
    return events


def test_terms_one_after_another_do_not_overlap() -> None:
    events = [
        *run("a", 1, "work", 1, 10.0, 12.0),
        *run("a", 1, "tick", 2, 10.5, 10.6),
        *run("b", 2, "work", 1, 12.0, 15.0),
        {"ev": "elected", "node": "b", "term": 2},
    ]
    report = activity.check(events)
    assert report.overlaps == [] and report.violations == []
    assert report.terms == {1, 2}
    assert len(report.runs) == 3


def test_an_old_term_still_running_when_the_next_starts_is_reported() -> None:
    events = [
        *run("a", 1, "work", 1, 10.0, 12.5),
        *run("a", 1, "ledger", 2, 10.0, 12.1),
        *run("b", 2, "work", 1, 12.0, 15.0),
    ]
    report = activity.check(events)
    assert [(o.older.task, o.newer.node) for o in report.overlaps] == [
        ("work", "b"),
        ("ledger", "b"),
    ]
    assert report.max_overlap == pytest.approx(0.5)
    assert len(report.violations) == 2
    assert "a/term 1/work#1 ran 500.0 ms alongside b/term 2/work#1" in report.summary()


def test_an_allowance_excuses_short_overlaps_only() -> None:
    events = [*run("a", 1, "work", 1, 10.0, 12.05), *run("b", 2, "work", 1, 12.0, 15.0)]
    assert activity.check(events, allowance=0.1).violations == []
    assert len(activity.check(events, allowance=0.01).violations) == 1


def test_an_unfinished_run_ends_when_its_process_died() -> None:
    events = [*run("a", 1, "work", 1, 10.0, None), *run("b", 2, "work", 1, 12.0, 15.0)]
    assert activity.check(events, ended_at={"a": 11.9}).overlaps == []
    late = activity.check(events, ended_at={"a": 12.2})
    assert late.max_overlap == pytest.approx(0.2)
    assert not late.runs[0].finished
    # a node the harness knows nothing of is still running: its run lasts until now
    assert activity.check(events, now=13.0).max_overlap == pytest.approx(1.0)


def test_one_term_on_two_nodes_is_an_overlap() -> None:
    events = [*run("a", 3, "work", 1, 10.0, 11.0), *run("b", 3, "work", 1, 10.5, 11.5)]
    assert activity.check(events).max_overlap == pytest.approx(0.5)


def test_a_node_leading_again_must_have_ended_its_old_term() -> None:
    events = [*run("a", 1, "work", 1, 10.0, 12.3), *run("a", 3, "work", 2, 12.0, 13.0)]
    assert activity.check(events).max_overlap == pytest.approx(0.3)


def test_frozen_time_is_cut_out_and_the_resume_tail_is_excused() -> None:
    # a is frozen 11-15; b takes over at 14 (by expiry); a resumes at 15 and its task
    # ends 10 ms later.
    events = [*run("a", 1, "work", 1, 10.0, 15.01), *run("b", 2, "work", 1, 14.0, 20.0)]
    strict = activity.check(events)
    assert strict.max_overlap == pytest.approx(1.01)
    frozen = activity.check(events, paused={"a": [(11.0, 15.0)]})
    assert frozen.max_overlap == pytest.approx(0.01)
    excused = activity.check(events, paused={"a": [(11.0, 15.0)]}, resume_grace=0.05)
    assert excused.overlaps == [] and excused.violations == []
    assert excused.max_resume_tail == pytest.approx(0.01)
    # also against runs of the newer term that start after the resume (a scheduled fire)
    ticks = [*events, *run("b", 2, "tick", 2, 15.005, 15.006)]
    assert activity.check(ticks, paused={"a": [(11.0, 15.0)]}, resume_grace=0.05).overlaps == []
    # a tail longer than the grace counts beyond it
    slow = [*run("a", 1, "work", 1, 10.0, 15.3), *run("b", 2, "work", 1, 14.0, 20.0)]
    report = activity.check(slow, paused={"a": [(11.0, 15.0)]}, resume_grace=0.05)
    assert report.max_overlap == pytest.approx(0.25)


def test_no_resume_grace_when_the_next_term_began_after_the_resume() -> None:
    # a was frozen 11-12.5 (shorter than the ttl); b starts at 12.6, after a resumed and
    # had the chance to stop first: a's tasks running on until 12.8 are an overlap.
    events = [*run("a", 1, "work", 1, 10.0, 12.8), *run("b", 2, "work", 1, 12.6, 20.0)]
    report = activity.check(events, paused={"a": [(11.0, 12.5)]}, resume_grace=0.5)
    assert report.max_overlap == pytest.approx(0.2)
    assert report.max_resume_tail == 0
