"""The adapter of blocking leases (:mod:`rselection.blocking_lease`) never holds up the
driver, and never lets two threads use a lease at once."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import rselection as rs
from rselection.blocking_lease import ArmedAttempt
from rselection.memory import MemoryLease
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.2, "renew_deadline": 1.0, "retry_interval": 0.2}


class HungWait(MemoryLease):
    """A lease whose wait ignores its timeout and interrupt() until the test lets go."""

    def __init__(self, name: str, let_go: threading.Event) -> None:
        super().__init__(name=name, ttl=3.0)
        self.let_go = let_go

    def interrupt(self) -> None:
        """Does nothing (allowed: a call then waits for the wait's end)."""

    def wait_for_change(self, timeout: float) -> None:
        self.let_go.wait(30)


class HangingRenewals(MemoryLease):
    """A memory lease whose renewals hang once ``hang`` is set; ``sent`` is when the last
    successful renewal was sent (the deadline counts from it)."""

    def __init__(self, name: str, let_go: threading.Event) -> None:
        super().__init__(name=name, ttl=3.0)
        self.hang = threading.Event()
        self.let_go = let_go
        self.sent = 0.0

    def renew(self, node_id: str, term: int) -> bool:
        if self.hang.is_set():
            self.let_go.wait(30)
            return False
        sent = time.monotonic()
        renewed = super().renew(node_id, term)
        if renewed:
            self.sent = sent
        return renewed


def test_stopping_leaders_whose_waits_hang_never_delays_another_leaders_deadline() -> None:
    # Before, the driver's thread joined each stopped leader's waiting thread (up to 2 s
    # each) and no deadline of the process was checked meanwhile: a leader whose
    # renewals hung ran its tasks seconds past its deadline.
    let_go = threading.Event()
    prefix = uuid.uuid4().hex[:6]
    cancelled: list[float] = []
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.cancelled.wait(30)
        cancelled.append(time.monotonic())

    lease = HangingRenewals(f"b-{prefix}", let_go)
    b = rs.LeaseLeader(lease, handler, node_id="b", **FAST)  # type: ignore[arg-type]
    hung: list[Any] = [HungWait(f"a{i}-{prefix}", let_go) for i in range(4)]
    others = [
        rs.LeaseLeader(x, rs.TaskHandler(), node_id=f"a{i}", **FAST) for i, x in enumerate(hung)
    ]  # type: ignore[arg-type]
    stoppers: list[threading.Thread] = []
    try:
        b.start()
        for leader in others:
            leader.start()
        assert b.wait_until_leader(5)
        assert all(x.wait_until_leader(5) for x in others)
        wait_until(lambda: lease.sent > 0, 5, "a renewal of b")
        # Stopped together, while their waits still hang.
        stoppers += [threading.Thread(target=x.stop, kwargs={"timeout": 20}) for x in others]
        for stopper in stoppers:
            stopper.start()
        wait_until(lambda: any(not x.is_alive() for x in stoppers), 20, "a stop to return")
        lease.hang.set()
        wait_until(lambda: bool(cancelled), 10, "b's task to be cancelled")
        deadline = lease.sent + FAST["renew_deadline"]  # the last renewal that went through
        late = cancelled[0] - deadline
        assert late < 0.5, f"b's task was cancelled {late:.2f} s after its deadline"
    finally:
        let_go.set()
        for stopper in stoppers:
            stopper.join(20)
        b.stop(timeout=10)


def test_an_armed_attempt_is_taken_or_cancelled_once() -> None:
    taken = ArmedAttempt(lambda: True)
    assert taken.take()
    assert not taken.cancel()  # too late: its outcome is on its way
    assert not taken.take()  # and nobody runs it twice

    cancelled = ArmedAttempt(lambda: True)
    assert cancelled.cancel()
    assert cancelled.cancel()  # asked again, the same answer
    assert not cancelled.take()


def test_of_workers_and_the_keeper_racing_for_an_armed_attempt_one_wins() -> None:
    for _ in range(200):
        armed = ArmedAttempt(lambda: True)
        start = threading.Barrier(5)
        wins: list[str] = []

        def take(armed: ArmedAttempt, start: threading.Barrier, wins: list[str]) -> None:
            start.wait()
            if armed.take():
                wins.append("worker")

        workers = [threading.Thread(target=take, args=(armed, start, wins)) for _ in range(4)]
        for worker in workers:
            worker.start()
        start.wait()
        if armed.cancel():
            wins.append("keeper")
        for worker in workers:
            worker.join(5)
        assert len(wins) == 1, wins
