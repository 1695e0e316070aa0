"""Keep APScheduler 3, run each fire once across many processes: PostgresClaimer/Elector.

Start the same script in several terminals (or on several hosts); a second replica is
the same command in another terminal:

    python examples/claims_with_apscheduler.py --dsn postgresql://localhost/test --node a
    python examples/claims_with_apscheduler.py --dsn postgresql://localhost/test --node b

Without ``--dsn`` (or ``RSELECTION_DSN``) one process runs alone: claims in memory
(``rs.MemoryClaimer``) and a ``SingleNodeLeader`` as the elector, so every fire runs.
``--name`` (default ``$RSELECTION_NAME``, else ``apscheduler-example``) is the elector's
lease; the claims and elections live in rselection's own tables (``rselection
migrate``).

Every process runs an APScheduler ``BackgroundScheduler`` with the same job every
second, the usual "each worker runs the scheduler" deployment. Before doing its work a
fire asks Postgres whether this process should run it:

* ``--mode claim`` (default): ``claimer.claim(fire_key)``. The key names the fire's
  *scheduled* instant (``format_fire_key("tick", scheduled_at)``), so every process
  computes the same key and exactly one claim wins, even when one process fires late.
* ``--mode elector``: ``elector.is_leader()``. Only the leader runs fires; simpler, but
  around a handover a fire can run twice or not at all.
* ``--mode both``: the elector picks the process, the claim makes each fire run at
  most once. A fire due while the process that stops is between its last fire and its
  resignation runs nowhere: the others still see it lead.

Each process prints ``ran <fire key>`` or ``skipped <fire key>`` for every fire it sees;
``--seconds N`` stops it after N seconds (otherwise Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
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

import rselection as rs
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


class AloneElector:
    """The elector of a process that runs alone: a ``SingleNodeLeader``, which always leads."""

    def __init__(self, name: str, node_id: str) -> None:
        self._leader = rs.SingleNodeLeader(rs.TaskHandler(), name=name, node_id=node_id)
        self._leader.start()
        self._leader.wait_until_leader(5)

    @property
    def term(self) -> int | None:
        return self._leader.term

    def is_leader(self) -> bool:
        return self._leader.is_leader

    def resign(self) -> None:
        self._leader.stop()

    def close(self) -> None:
        self._leader.stop()


def main() -> None:
    """Parse the arguments, start the scheduler, run until ``--seconds`` or a signal."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("RSELECTION_DSN"), help="Postgres (default: run alone)"
    )
    parser.add_argument("--mode", choices=["claim", "elector", "both"], default="claim")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--node", default=f"node-{os.getpid()}", help="name in the output")
    parser.add_argument(
        "--name",
        default=os.environ.get("RSELECTION_NAME") or "apscheduler-example",
        help="the elector's lease (default $RSELECTION_NAME, else apscheduler-example)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    # Claims must outlive the latest a fire may start anywhere (misfire_grace_time).
    claimer: Any
    elector: Any
    if args.dsn:
        from rselection.postgres import PostgresClaimer, PostgresElector, migrate

        migrate(args.dsn)  # idempotent and safe from many processes at once
        claimer = PostgresClaimer(args.dsn, ttl=60, node_id=args.node)
        elector = PostgresElector(args.dsn, name=args.name, ttl=5, node_id=args.node)
    else:
        print(f"[{args.node}] no --dsn (or RSELECTION_DSN): running alone", flush=True)
        claimer = rs.MemoryClaimer(ttl=60)
        elector = AloneElector(args.name, args.node)

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
    if args.dsn:  # any node may delete long-expired claims now and then
        scheduler.add_job(claimer.cleanup, IntervalTrigger(minutes=5, start_date=ANCHOR), id="gc")

    # SIGTERM stops the node as Ctrl-C does: by raising KeyboardInterrupt in the main
    # thread. (A handler that sets a threading.Event can deadlock: it runs in the main
    # thread, which may be inside that Event's own wait(), holding its lock.)
    signal.signal(signal.SIGTERM, _interrupt)
    scheduler.start()
    print(f"[{args.node}] scheduler started (mode {args.mode})", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait(args.seconds)  # None: until a signal
    scheduler.shutdown(wait=True)
    if elector.term is not None:
        elector.resign()  # the next process takes over at once
    elector.close()
    if args.dsn:
        claimer.close()
    print(f"[{args.node}] stopped", flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
