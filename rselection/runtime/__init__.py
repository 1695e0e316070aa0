"""Runs one term's tasks: supervision, schedules, claims, cancellation and join.

Plain ``def`` tasks run in their own threads, so a CPU-bound task or an ``async def``
task that blocks the event loop never holds up the others. ``async def`` tasks run on
one event loop: the caller's under ``async with leader``, else the loop that the
process's terms share (:mod:`rselection.event_loops`), on which nothing of a term runs
once it has ended. The machinery's threads are shared by every term of the process
(:mod:`rselection.runtime.pools`), so that they do not grow with the number of leases.

Modules: :mod:`~rselection.runtime.runner` (a term's lifecycle: start, cancel, join),
:mod:`~rselection.runtime.units` (what the end of a term waits for),
:mod:`~rselection.runtime.runs` (one run of a task, a persistent task's restarts),
:mod:`~rselection.runtime.timetable` (a term's scheduled fires),
:mod:`~rselection.runtime.claims` (claims of fires, clean-ups of expired ones),
:mod:`~rselection.runtime.catch_up` (fires missed while no node led),
:mod:`~rselection.runtime.reports` (skips and stuck tasks, sent off the caller's thread).
"""

from __future__ import annotations

from .claims import cleanup_period
from .reports import STUCK_EXIT_CODE
from .runner import TermRunner
from .runs import restart_delay

__all__ = ["STUCK_EXIT_CODE", "TermRunner", "cleanup_period", "restart_delay"]
