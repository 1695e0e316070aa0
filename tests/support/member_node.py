"""A node for the membership tests: a PostgresLeader (or, with ``--backend redis``, a
RedisLeader) with a HeartbeatMonitor.

Prints one JSON line per event on stdout: ``started``, ``elected``, ``joined`` and
``lost`` (from the HeartbeatMonitor while it leads, with the node id), ``view`` (its own
``nodes()``, every 0.2 s) and ``stopped``. Stops gracefully when stdin closes.

    python -m tests.support.member_node DSN --lease NAME --node ID [--backend redis]
    [--key-prefix PREFIX]
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

import rselection as rs
from rselection.postgres import PostgresLeader
from tests.support.node_process import emit

HEARTBEAT = 0.3
NODE_TIMEOUT = 1.0
POLL = 0.1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dsn")
    parser.add_argument("--lease", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--backend", choices=["postgres", "redis"], default="postgres")
    parser.add_argument("--key-prefix", default="rselection:")
    args = parser.parse_args(argv)

    handler = rs.TaskHandler()
    handler.register("monitor", rs.HeartbeatMonitor(poll_interval=POLL))

    def joined(sender: object, **kw: Any) -> None:
        emit("joined", node=kw["node"].node_id)

    def lost(sender: object, **kw: Any) -> None:
        emit("lost", node=kw["node"].node_id, alive=kw["node"].alive)

    rs.signals.node_joined.connect(joined)
    rs.signals.node_lost.connect(lost)
    options: dict[str, Any] = {
        "name": args.lease,
        "node_id": args.node,
        "ttl": 3,
        "renew_interval": 0.5,
        "renew_deadline": 2,
        "retry_interval": 0.5,
        "heartbeat_interval": HEARTBEAT,
        "node_timeout": NODE_TIMEOUT,
    }
    leader: Any
    if args.backend == "redis":
        from rselection.redis import RedisLeader

        leader = RedisLeader(args.dsn, handler, key_prefix=args.key_prefix, **options)
    else:
        leader = PostgresLeader(args.dsn, handler, **options)
    rs.signals.elected.connect(lambda sender, **kw: emit("elected", term=kw["term"]), weak=False)
    stopping = threading.Event()

    def report_views() -> None:
        while not stopping.wait(0.2):
            try:
                nodes = leader.nodes()
            except rs.BackendUnavailable as exc:
                emit("view-error", error=str(exc))
                continue
            emit(
                "view",
                nodes=[[n.node_id, n.alive, n.is_leader, n.client_addr] for n in nodes],
            )

    leader.start()
    emit("started")
    threading.Thread(target=report_views, daemon=True).start()
    sys.stdin.read()  # until the test closes our stdin
    stopping.set()
    leader.stop(timeout=10)
    emit("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
