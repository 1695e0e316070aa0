"""A node whose last line is ``leader.lead()``, for the stop-signal tests.

``python -m tests.support.signal_node KIND TARGET NAME`` builds one leader of ``KIND``
(``postgres``, ``redis``, ``lease`` (a :class:`~rselection.LeaseLeader` over a file
lease), ``single`` or ``sharded``) and leads until a signal stops it. Its persistent task
reports when it runs and when its ``finally`` runs, and the program reports when
``lead()`` returned: a graceful stop shows all three, in order, and exit code 0.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import rselection as rs
from tests.support.file_lease import FileLease
from tests.support.node_process import emit

TTL = {"ttl": 6.0, "renew_interval": 0.5, "renew_deadline": 3.0, "retry_interval": 0.5}


def build(kind: str, target: str, name: str, tasks: rs.TaskHandler) -> rs.Leader:
    """One leader of ``kind`` over ``target`` (a DSN, a Redis URL or a file path)."""
    if kind == "postgres":
        return rs.PostgresLeader(target, tasks, name=name, **TTL)
    if kind == "redis":
        return rs.RedisLeader(target, tasks, name=name, **TTL)
    if kind == "lease":
        return rs.LeaseLeader(FileLease(Path(target), name=name, ttl=TTL["ttl"]), tasks, **TTL)
    if kind == "single":
        return rs.SingleNodeLeader(tasks)
    if kind == "sharded":
        return rs.PostgresShardedLeader(target, tasks, name=name, shards=4, **TTL)
    raise SystemExit(f"unknown kind {kind!r}")


def main(kind: str, target: str, name: str) -> None:
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        emit("running", term=ctx.term, shard=ctx.shard)
        try:
            while ctx.sleep(0.05):
                pass
        finally:
            emit("joined", term=ctx.term, shard=ctx.shard)

    leader = build(kind, target, name, tasks)
    # What lead() must put back on return.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    emit("ready", node=leader.node_id, pid=os.getpid())
    leader.lead()
    restored = all(signal.getsignal(sig) is handler for sig, handler in previous.items())
    emit("returned", restored=restored)


if __name__ == "__main__":
    main(*sys.argv[1:4])
