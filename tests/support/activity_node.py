"""A PostgresLeader node whose persistent task reports when it runs, for activity ledgers.

Prints one JSON line per event on stdout: ``started``; ``elected`` and ``demoted`` (with
the term); ``task-start`` and ``task-end`` from the task itself (node, term and the wall
clock ``time.time()`` of this machine, so the test can compare nodes); ``lead-error``
when leading failed; ``stopped``. Stops gracefully when stdin closes.

    python -m tests.support.activity_node DSN --lease NAME --node ID
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import rselection as rs
from rselection.postgres import PostgresLeader
from tests.support.node_process import emit

TIMINGS = {"ttl": 4.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}
STOP_GRACE = 1.0  # renew_deadline + stop_grace + 0.5 s <= ttl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dsn")
    parser.add_argument("--lease", required=True)
    parser.add_argument("--node", required=True)
    args = parser.parse_args(argv)

    handler = rs.TaskHandler(stop_grace=STOP_GRACE)

    @handler.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        emit("task-start", node=args.node, term=ctx.term, t=time.time())
        try:
            while not ctx.cancelled.wait(0.02):
                pass
        finally:
            emit("task-end", node=args.node, term=ctx.term, t=time.time())

    def elected(sender: Any, **kw: Any) -> None:
        emit("elected", node=args.node, term=kw["term"])

    def demoted(sender: Any, **kw: Any) -> None:
        emit("demoted", node=args.node, term=kw.get("term"))

    rs.signals.elected.connect(elected)
    rs.signals.demoted.connect(demoted)
    leader = PostgresLeader(
        args.dsn, handler, name=args.lease, node_id=args.node, claimer=None, **TIMINGS
    )

    def lead() -> None:
        try:
            leader.lead()
        except Exception as exc:
            emit("lead-error", node=args.node, error=f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=lead, daemon=True)
    thread.start()
    emit("started", node=args.node)
    sys.stdin.read()  # until the test closes our stdin
    leader.stop(timeout=10)
    thread.join(10)
    emit("stopped", node=args.node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
