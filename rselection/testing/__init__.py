"""Helpers for testing your own tasks (run them, step down, compute and fire schedules:
:mod:`rselection.testing.tasks`) and your own lease backend (:class:`LeaderConformance`:
:mod:`rselection.testing.conformance`); both are imported from here.

The task helpers need no database. :func:`run_tasks` runs a handler under a real
:class:`~rselection.SingleNodeLeader` (the production state machine over an in-memory
lease), so cancellation, joins and signals behave as in production. :func:`fire_once`
calls one task now with a real :class:`~rselection.TaskContext`. :func:`fires` and
:class:`FakeClock` tell which fires come due between two instants, without waiting (a
running leader's scheduler uses real time): test *what a task does at a given fire* with
them and :func:`fire_once`, and *that it runs and stops* with :func:`run_tasks`.

A lease backend of your own (etcd, ZooKeeper, a cloud lock service) is checked by the
same scenarios every built-in backend passes: subclass :class:`LeaderConformance` in a
test module and say how to make a lease::

    from rselection.testing import LeaderConformance

    class TestEtcdLease(LeaderConformance):
        def make_lease(self, name: str) -> rs.LeaseBackend:
            return EtcdLease(ETCD_URL, name=name, ttl=self.timings.ttl)

Example::

    from datetime import UTC, datetime, timedelta
    import rselection as rs
    from rselection.testing import FakeClock, fire_once, run_tasks

    tasks = rs.TaskHandler()

    @tasks.cron("0 * * * *", name="hourly")
    def hourly(ctx: rs.TaskContext) -> str:
        return ctx.fire_key

    clock = FakeClock(datetime(2030, 1, 1, tzinfo=UTC), tasks)
    due = clock.advance(timedelta(hours=3))
    assert [fire.at.hour for fire in due] == [1, 2, 3]
    assert fire_once(tasks, "hourly", at=due[0].at) == "hourly@2030-01-01T01:00:00.000000000Z"
"""

from __future__ import annotations

# The task helpers are named once, in .tasks (as asyncio assembles its namespace).
from . import tasks
from .conformance import LeaderConformance
from .tasks import *  # noqa: F403

__all__ = ["LeaderConformance", *tasks.__all__]
