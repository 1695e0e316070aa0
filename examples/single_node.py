"""Single-node rselection: a heartbeat publisher and a monitor that flags missed beats.

Two leader-scoped tasks share a broadcaster channel:

- ``heartbeat`` (an interval task, plain ``def``, runs in a worker thread) publishes a
  numbered heartbeat every ``--interval`` seconds, on epoch-aligned instants;
- ``heartbeat-monitor`` (a persistent ``async def`` task) reads the channel and logs a
  warning whenever no heartbeat arrived within three intervals.

Run it until Ctrl-C (or SIGTERM)::

    python examples/single_node.py

or for a fixed time, and with the publisher going quiet after 3 beats to see the
monitor complain::

    python examples/single_node.py --seconds 5 --silent-after 3

``--name`` (default ``$RSELECTION_NAME``, else ``single-node``) names the lease in the
logs and signals. A second replica is the same command in another terminal, but it has
no lease to share: a ``SingleNodeLeader`` always leads, so both lead, each in its own
process. For replicas that compete, run ``examples/worker.py`` with ``--dsn``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import threading
import time
from typing import Any

import rselection as rs

CHANNEL = "heartbeats"
MISSED_AFTER = 3  # intervals without a heartbeat before the monitor complains

log = logging.getLogger("single_node")


def build_tasks(interval: float, silent_after: int | None) -> rs.TaskHandler:
    """The two tasks: publish heartbeats, and watch for missing ones."""
    tasks = rs.TaskHandler(stop_grace=2.0)
    numbers = itertools.count(1)

    @tasks.interval(interval, name="heartbeat")
    def heartbeat(ctx: rs.TaskContext) -> None:
        number = next(numbers)
        if silent_after is not None and number > silent_after:
            return  # simulate a publisher that went quiet
        assert ctx.broadcaster is not None
        print(f"sending heartbeat {number} (fire {ctx.fire_key}, term {ctx.term})", flush=True)
        ctx.broadcaster.publish(CHANNEL, {"number": number, "at": ctx.scheduled_at})

    @tasks.persistent("heartbeat-monitor")
    async def monitor(ctx: rs.TaskContext) -> None:
        assert ctx.broadcaster is not None
        limit = MISSED_AFTER * interval
        with ctx.broadcaster.subscribe(CHANNEL) as beats:
            last = time.monotonic()
            while True:  # ends with CancelledError when leadership ends
                try:
                    beat: Any = await beats.aget(timeout=limit)
                except TimeoutError:
                    log.warning(
                        "missed heartbeats: none for %.1f s (%d intervals)",
                        time.monotonic() - last,
                        MISSED_AFTER,
                    )
                    continue
                last = time.monotonic()
                late = time.time() - beat["at"].timestamp()
                print(
                    f"monitor got heartbeat {beat['number']} ({late * 1000:.1f} ms after its fire)",
                    flush=True,
                )

    return tasks


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=None, help="stop after this long (default: Ctrl-C)"
    )
    parser.add_argument("--interval", type=float, default=0.5, help="heartbeat period (s)")
    parser.add_argument(
        "--silent-after",
        type=int,
        default=None,
        metavar="N",
        help="stop publishing after N heartbeats, so the monitor flags them as missed",
    )
    parser.add_argument(
        "--name",
        default=os.environ.get("RSELECTION_NAME") or "single-node",
        help="the lease name, for logs and signals (default $RSELECTION_NAME, else single-node)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    broadcaster = rs.Broadcaster()
    tasks = build_tasks(args.interval, args.silent_after)
    leader = rs.SingleNodeLeader(tasks, broadcaster=broadcaster, name=args.name)

    def elected(sender: object, **kw: Any) -> None:
        print(f"elected: node {kw['node_id']} leads with term {kw['term']}", flush=True)

    def demoted(sender: object, **kw: Any) -> None:
        print(f"demoted: term {kw['term']} ended ({kw['reason']})", flush=True)

    def failed(sender: object, **kw: Any) -> None:
        print(f"task {kw['task']} failed: {kw['error']!r}", flush=True)

    rs.signals.elected.connect(elected, sender=leader)
    rs.signals.demoted.connect(demoted, sender=leader)
    rs.signals.task_failed.connect(failed, sender=tasks)

    if args.seconds is not None:
        timer = threading.Timer(args.seconds, leader.stop)
        timer.daemon = True
        timer.start()
    print("leading; press Ctrl-C to stop", flush=True)
    leader.lead()  # returns after stop(), Ctrl-C or SIGTERM, every task cancelled and joined
    broadcaster.close()

    for name, report in tasks.health().items():
        print(
            f"{name}: runs={report['runs']} failures={report['failures']} "
            f"skipped={report['skipped']} state={report['state']}",
            flush=True,
        )
    print("stopped cleanly", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
