"""A Redis lease holder in a process of its own, for tests that pause or kill it.

``python -m tests.support.redis_holder URL NAME TTL RENEW_DEADLINE LIVENESS_INTERVAL
single|cluster``
acquires lease ``NAME`` as node ``"holder"``, prints ``{"event": "held", "term": ...,
"client": ...}`` and keeps it as a leader's keeper does: it waits for changes and renews
every third of the ttl, while its process beats for it (see
:mod:`rselection.redis.liveness`). When its keeper connection fails it prints ``lost``
and lives on. It runs until it is killed, or its stdin closes.

A follower in the test's process then sees a holder that lives, pauses (SIGSTOP) or dies
(SIGKILL) as a whole process does: its beats and its keeper connection together.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from redis.cluster import RedisCluster

from rselection.errors import BackendUnavailable
from rselection.redis import RedisLease
from tests.support.node_process import NodeProcess, count, emit


def main(
    url: str, name: str, ttl: str, renew_deadline: str, liveness_interval: str, cluster: str
) -> None:
    lease = RedisLease(
        RedisCluster.from_url(url) if cluster == "cluster" else url,
        name=name,
        ttl=float(ttl),
        renew_deadline=float(renew_deadline),
        liveness_interval=float(liveness_interval),
    )
    stopped = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stopped.set()), daemon=True).start()
    deadline = time.monotonic() + 10
    while not (held := lease.try_acquire("holder")).acquired:
        assert time.monotonic() < deadline, "the lease stayed taken"
        lease.wait_for_change(0.2)
    assert held.holder is not None
    emit("held", term=held.holder.term, client=lease.client_id, fast=lease.fast_failover)
    renew_every = float(ttl) / 3
    try:
        while not stopped.is_set():
            renew_at = time.monotonic() + renew_every
            while (left := renew_at - time.monotonic()) > 0 and not stopped.is_set():
                lease.wait_for_change(min(left, 0.5))
            if not lease.renew("holder", held.holder.term):
                emit("lost", why="renewal refused")
                break
    except BackendUnavailable as exc:
        # The keeper connection failed: the process lives on (and beats) until stopped.
        emit("lost", why=str(exc))
    stopped.wait()
    lease.close()


class HolderProcess:
    """The holder program in a process of its own (see the module docstring).

    Args:
        url: the Redis URL.
        name: the lease name.
        ttl, renew_deadline, liveness_interval: the lease's timings, seconds.
        cluster: ``url`` is a Redis Cluster's.
    """

    def __init__(
        self,
        url: str,
        name: str,
        *,
        ttl: float,
        renew_deadline: float,
        liveness_interval: float,
        cluster: bool = False,
    ) -> None:
        self.node = NodeProcess(
            "tests.support.redis_holder",
            url,
            name,
            str(ttl),
            str(renew_deadline),
            str(liveness_interval),
            "cluster" if cluster else "single",
        )
        self.node.wait_for("the lease held", count("held", 1), 30)
        held = self.node.of("held")[0]
        self.term: int = held["term"]
        self.client: int = held["client"]
        self.fast: bool = held["fast"]

    def pause(self) -> None:
        """SIGSTOP: the process, its beats and its renewals stop; its connections stay."""
        os.kill(self.node.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL (also of a paused process): its kernel closes its connections."""
        self.node.kill()

    def close(self) -> None:
        """Kill it unless it is gone already."""
        if self.node.proc.poll() is None:
            self.kill()


if __name__ == "__main__":
    main(*sys.argv[1:])
