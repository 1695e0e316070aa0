"""Keep APScheduler 3, run each fire once across many processes: PostgresClaimer/Elector.

Start the same script in several terminals (or on several hosts):

    python examples/claims_with_apscheduler.py --dsn postgresql://postgres@127.0.0.1:5432/test

Every process runs an APScheduler ``BackgroundScheduler`` with the same job every
second, the usual "each worker runs the scheduler" deployment. Before doing its work a
fire asks Postgres whether this process should run it:

* ``--mode claim`` (default): ``claimer.claim(fire_key)``. The key names the fire's
  *scheduled* instant (``format_fire_key("tick", scheduled_at)``), so every process
  computes the same key and exactly one claim wins, even when one process fires late.
* ``--mode elector``: ``elector.is_leader()``. Only the leader runs fires; simpler, but
  around a handover a fire can run twice or not at all.
* ``--mode both``: the elector picks the process, the claim makes each fire run once.

Each process prints ``ran <fire key>`` or ``skipped <fire key>`` for every fire it sees;
``--seconds N`` stops it after N seconds (otherwise Ctrl-C).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from datetime import UTC, datetime
from typing import Any

from apscheduler.executors.base import run_job
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from rselection.postgres import PostgresClaimer, PostgresElector, migrate
from rselection.schedules import format_fire_key

# Every process must compute the same fire instants: anchor the interval on a fixed
# instant. (APScheduler's default start is "now", which differs per process.)
ANCHOR = datetime(2000, 1, 1, tzinfo=UTC)

_fire = threading.local()


def scheduled_at() -> datetime:
    """The scheduled instant of the fire the calling job runs (set by the executor)."""
    at: datetime = _fire.at
    return at


def _run_with_instant(job: Any, jobstore: str, run_times: list[datetime], logger: str) -> list:
    events: list = []
    for run_time in run_times:
        _fire.at = run_time
        events.extend(run_job(job, jobstore, [run_time], logger))
    return events


class FireAwareExecutor(ThreadPoolExecutor):  # type: ignore[misc]
    """APScheduler 3's thread pool executor, telling each run its scheduled instant.

    APScheduler 3 does not pass the scheduled time to the job; the fire key must be
    derived from it (not from the clock when the job happens to start), so this
    executor records it for :func:`scheduled_at`.
    """

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        def done(future: Any) -> None:
            exc = future.exception()
            if exc is not None:
                self._run_job_error(job.id, exc, exc.__traceback__)
            else:
                self._run_job_success(job.id, future.result())

        future = self._pool.submit(
            _run_with_instant, job, job._jobstore_alias, run_times, self._logger.name
        )
        future.add_done_callback(done)


def main() -> None:
    """Parse the arguments, start the scheduler, run until ``--seconds`` or a signal."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("RSELECTION_DSN"))
    parser.add_argument("--mode", choices=["claim", "elector", "both"], default="claim")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--node", default=f"node-{os.getpid()}", help="name in the output")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("pass --dsn postgresql://... or set RSELECTION_DSN")
    logging.basicConfig(level=logging.WARNING)

    migrate(args.dsn)  # idempotent and safe from many processes at once

    # Claims must outlive the latest a fire may start anywhere (misfire_grace_time).
    claimer = PostgresClaimer(args.dsn, ttl=60, node_id=args.node)
    elector = PostgresElector(args.dsn, name="apscheduler-example", ttl=5, node_id=args.node)

    def tick() -> None:
        key = format_fire_key("tick", scheduled_at())
        try:
            if args.mode == "claim":
                mine = claimer.claim(key)
            elif args.mode == "elector":
                mine = elector.is_leader()
            else:
                mine = elector.is_leader() and claimer.claim(key, term=elector.term)
        except Exception as exc:  # BackendUnavailable: fail closed, do not run the fire
            print(f"[{args.node}] skipped {key} (backend error: {exc})", flush=True)
            return
        if not mine:
            print(f"[{args.node}] skipped {key}", flush=True)
            return
        print(f"[{args.node}] ran {key}", flush=True)  # the real work goes here

    scheduler = BackgroundScheduler(
        timezone=UTC, executors={"default": FireAwareExecutor(max_workers=4)}
    )
    scheduler.add_job(
        tick,
        IntervalTrigger(seconds=1, start_date=ANCHOR, timezone=UTC),
        id="tick",
        coalesce=True,
        misfire_grace_time=30,
        max_instances=4,
    )
    # Any node may delete long-expired claims now and then.
    scheduler.add_job(claimer.cleanup, IntervalTrigger(minutes=5, start_date=ANCHOR), id="gc")

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    scheduler.start()
    print(f"[{args.node}] scheduler started (mode {args.mode})", flush=True)
    stop.wait(args.seconds)
    scheduler.shutdown(wait=True)
    if elector.term is not None:
        elector.resign()  # the next process takes over at once
    elector.close()
    claimer.close()
    print(f"[{args.node}] stopped", flush=True)


if __name__ == "__main__":
    main()
