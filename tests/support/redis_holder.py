"""A Redis lease holder in a process of its own, for tests that pause or kill it.

``python -m tests.support.redis_holder URL NAME TTL RENEW_DEADLINE LIVENESS_INTERVAL
single|cluster`` acquires lease ``NAME`` (and ``NAME-companion``) as node ``"holder"``,
prints ``{"event": "held", "term": ..., "client": ...}`` and keeps it as a leader's
keeper does: it waits for changes and renews every third of the ttl, while its process
beats for it (see :mod:`rselection.redis.liveness`). When its keeper connection fails it
prints ``lost`` and lives on. On SIGUSR1 it closes the lease without releasing it and
keeps the companion (its process beats on). It runs until it is killed, or its stdin closes.

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


def _hold(url: str, name: str, timings: dict[str, float], cluster: bool) -> tuple[RedisLease, int]:
    lease = RedisLease(RedisCluster.from_url(url) if cluster else url, name=name, **timings)
    deadline = time.monotonic() + 10
    while not (held := lease.try_acquire("holder")).acquired:
        assert time.monotonic() < deadline, "the lease stayed taken"
        lease.wait_for_change(0.2)
    assert held.holder is not None
    return lease, held.holder.term


def main(
    url: str, name: str, ttl: str, renew_deadline: str, liveness_interval: str, cluster: str
) -> None:
    timings = {
        "ttl": float(ttl),
        "renew_deadline": float(renew_deadline),
        "liveness_interval": float(liveness_interval),
    }
    lease, term = _hold(url, name, timings, cluster == "cluster")
    # A second lease of the process, so that it beats on once the first is abandoned.
    companion, companion_term = _hold(url, f"{name}-companion", timings, cluster == "cluster")
    stopped, abandon, neglect = threading.Event(), threading.Event(), threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stopped.set()), daemon=True).start()
    signal.signal(signal.SIGUSR1, lambda *_: abandon.set())
    signal.signal(signal.SIGUSR2, lambda *_: neglect.set())
    emit("held", term=term, client=lease.client_id, fast=lease.fast_failover)
    renew_every = float(ttl) / 3
    kept = True
    last_renewal = time.time()
    neglected = False
    try:
        while not stopped.is_set():
            renew_at = time.monotonic() + renew_every
            while (left := renew_at - time.monotonic()) > 0 and not stopped.is_set():
                if kept and abandon.is_set():
                    lease.close()  # its connection closes, its key stays: no release
                    kept = False
                    emit("abandoned")
                if kept:
                    lease.wait_for_change(min(left, 0.1))
                else:
                    stopped.wait(min(left, 0.1))
            if kept and neglect.is_set():
                if not neglected:
                    emit("neglected", renewed=last_renewal)
                    neglected = True
            elif kept and not lease.renew("holder", term):
                emit("lost", why="renewal refused")
                break
            else:
                last_renewal = time.time()
            if not companion.renew("holder", companion_term):
                emit("lost", why="the companion's renewal refused")
                break
    except BackendUnavailable as exc:
        # The keeper connection failed: the process lives on (and beats) until stopped.
        emit("lost", why=str(exc))
    stopped.wait()
    lease.close()
    companion.close()


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

    def abandon(self) -> None:
        """SIGUSR1: the holder closes the lease's connection without releasing it, and
        its process beats on for a second lease (``<name>-companion``)."""
        os.kill(self.node.proc.pid, signal.SIGUSR1)
        self.node.wait_for("the lease abandoned", count("abandoned", 1), 10)

    def neglect(self) -> float:
        """SIGUSR2: the holder stops renewing the lease, keeping its connection and its
        process's beats; returns the wall-clock time of its last renewal (the lease
        expires a ttl later)."""
        os.kill(self.node.proc.pid, signal.SIGUSR2)
        self.node.wait_for("the lease neglected", count("neglected", 1), 10)
        return float(self.node.of("neglected")[0]["renewed"])

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
