"""The wait pump (:mod:`rselection.wait_pump`) with leases of our own that offer their
wait in steps: a step that hangs holds up no other lease, a lease never sees two callers
at once, a change wakes the keeper, and the pump's thread ends with the last lease."""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import rselection as rs
from rselection import blocking_lease
from rselection.abc import Watchable
from rselection.blocking_lease import BlockingLease
from rselection.memory import MemoryLease
from rselection.wait_pump import WaitPump
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.2, "renew_deadline": 1.0, "retry_interval": 0.2}
TICK = 0.05  # seconds between two steps of a lease's wait (a beat, say)


class SteppedLease(MemoryLease):
    """A memory lease whose wait is taken in steps: one step every :data:`TICK`, which
    hangs while ``hang`` is set; ``poke()`` makes its socket readable (a change). It
    records a second caller that came while one was inside it."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, ttl=3.0)
        self.hang = threading.Event()
        self.let_go = threading.Event()
        self.hanging = threading.Event()
        self.steps: list[float] = []
        self.overlaps = 0
        self._inside = threading.Lock()
        self._pair = socket.socketpair()
        for end in self._pair:
            end.setblocking(False)

    def _enter(self) -> None:
        if not self._inside.acquire(blocking=False):
            self.overlaps += 1
            self._inside.acquire()

    def poke(self) -> None:
        self._pair[1].send(b"x")

    def watch_for_change(self) -> _Watch:
        self._enter()
        try:
            return _Watch(self)
        finally:
            self._inside.release()

    def connect(self) -> None:
        self._enter()
        try:
            super().connect()
        finally:
            self._inside.release()

    def try_acquire(self, node_id: str) -> rs.Acquisition:
        self._enter()
        try:
            return super().try_acquire(node_id)
        finally:
            self._inside.release()

    def renew(self, node_id: str, term: int) -> bool:
        self._enter()
        try:
            return super().renew(node_id, term)
        finally:
            self._inside.release()

    def release(self, node_id: str, term: int) -> None:
        self._enter()
        try:
            super().release(node_id, term)
        finally:
            self._inside.release()

    def close(self) -> None:
        self._enter()
        try:
            super().close()
        finally:
            self._inside.release()


class _Watch:
    def __init__(self, lease: SteppedLease) -> None:
        self.lease = lease
        self.sockets = (lease._pair[0],)
        self.next = time.monotonic() + TICK

    def due(self) -> float:
        return self.next

    def step(self, readable: frozenset[Any]) -> bool:
        lease = self.lease
        lease._enter()
        try:
            if lease.hang.is_set():
                lease.hanging.set()
                lease.let_go.wait(30)
            lease.steps.append(time.monotonic())
            self.next = time.monotonic() + TICK
            if readable:
                lease._pair[0].recv(64)
                return True
            return False
        finally:
            lease._inside.release()


def pump_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rselection-wait-pump"]


def wait_workers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rselection-driver-wait")]


def longest_gap(times: list[float], since: float) -> float:
    """The longest time without a step from ``since`` until now."""
    seen = [since, *(t for t in times if t >= since), time.monotonic()]
    return max(b - a for a, b in itertools.pairwise(seen))


def test_a_lease_offering_steps_is_watched_by_the_pump_without_a_thread_of_its_own() -> None:
    prefix = uuid.uuid4().hex[:6]
    leases = [SteppedLease(f"s{i}-{prefix}") for i in range(3)]
    assert all(isinstance(x, Watchable) for x in leases)
    leaders = [
        rs.LeaseLeader(x, rs.TaskHandler(), node_id="a", **FAST)  # type: ignore[arg-type]
        for x in leases
    ]
    try:
        for leader in leaders:
            leader.start()
        assert all(x.wait_until_leader(5) for x in leaders)
        assert not [t for t in threading.enumerate() if t.name.startswith("rselection-wait-s")]
        assert len(pump_threads()) == 1
        wait_until(lambda: all(len(x.steps) > 5 for x in leases), 5, "steps of every lease")
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
    assert all(x.overlaps == 0 for x in leases), [x.overlaps for x in leases]
    wait_until(lambda: not pump_threads(), 5, "the pump's thread to end")
    # These leases also call back on changes. Before, a call of the keeper watched one
    # (its lane of wait workers opened) while its stop only undid the callbacks: the
    # lane stayed open, and its idle workers stayed for 10 s.
    wait_until(lambda: not wait_workers(), 2, f"the wait workers to end: {wait_workers()}")


def test_a_step_that_hangs_holds_up_no_other_lease_and_a_change_wakes_the_keeper() -> None:
    prefix = uuid.uuid4().hex[:6]
    # More leases that hang than the wait workers: each holds one, the others go on.
    hung = [SteppedLease(f"h{i}-{prefix}") for i in range(6)]
    healthy = SteppedLease(f"ok-{prefix}")
    leaders = [
        rs.LeaseLeader(x, rs.TaskHandler(), node_id="a", **FAST)  # type: ignore[arg-type]
        for x in [*hung, healthy]
    ]
    try:
        for leader in leaders:
            leader.start()
        assert all(x.wait_until_leader(5) for x in leaders)
        for lease in hung:
            lease.hang.set()
        began = time.monotonic()
        wait_until(lambda: time.monotonic() - began > 1.5, 5, "a while with hung steps")
        gap = longest_gap(healthy.steps, began)
        # Steps come every 0.05 s; a hung step stops counting against the workers after
        # 0.25 s (WAIT_STUCK_AFTER), and another worker takes the healthy lease's.
        assert gap < 0.8, f"the healthy lease's steps stalled {gap:.2f} s"
        assert leaders[-1].is_leader
    finally:
        for lease in hung:
            lease.let_go.set()
        for leader in leaders:
            leader.stop(timeout=10)
    assert all(x.overlaps == 0 for x in [*hung, healthy])
    wait_until(lambda: not pump_threads(), 5, "the pump's thread to end")
    assert WaitPump.shared().watching() == 0


def test_a_change_wakes_the_keeper_and_a_call_waits_for_its_own_leases_step_only() -> None:
    prefix = uuid.uuid4().hex[:6]
    mine, other = SteppedLease(f"m-{prefix}"), SteppedLease(f"o-{prefix}")
    woken = threading.Event()
    adapters = [BlockingLease(mine), BlockingLease(other)]
    adapters[0].on_wake(woken.set)
    adapters[1].on_wake(lambda: None)
    calls: list[threading.Thread] = []
    try:
        for adapter in adapters:
            adapter.connect()
        wait_until(lambda: mine.steps and other.steps, 5, "steps of both leases")
        assert not woken.is_set()
        mine.poke()
        assert woken.wait(2), "a change did not wake the keeper"
        other.hang.set()
        assert other.hanging.wait(2)
        began = time.monotonic()
        assert adapters[0].try_acquire("n").acquired
        assert time.monotonic() - began < 0.5, "a call waited for another lease's step"
        # A call on the hung lease waits for its step: never two callers at once.
        calls.append(threading.Thread(target=adapters[1].try_acquire, args=("n",)))
        calls[0].start()
        calls[0].join(0.3)
        assert calls[0].is_alive()
        other.let_go.set()
        calls[0].join(5)
        assert not calls[0].is_alive()
    finally:
        other.let_go.set()
        for call in calls:
            call.join(5)
        for adapter in adapters:
            adapter.on_wake(None)
            adapter.close()
    assert mine.overlaps == 0 and other.overlaps == 0
    wait_until(lambda: not pump_threads(), 5, "the pump's thread to end")


def test_the_pump_says_whether_a_watch_ended_by_a_change_or_by_its_slice() -> None:
    lease = SteppedLease(f"slice-{uuid.uuid4().hex[:6]}")
    lane = ThreadPoolExecutor(1)
    ends: list[tuple[BaseException | None, bool, bool]] = []
    ended = threading.Event()

    def on_end(outcome: BaseException | None, sliced: bool, stepped: bool) -> None:
        ends.append((outcome, sliced, stepped))
        ended.set()

    pump = WaitPump.shared()
    try:
        pump.add(lease, lane, lease.watch_for_change, on_end, 0.2)
        assert ended.wait(5)
        assert ends == [(None, True, True)]  # only its slice ran out
        ended.clear()
        pump.add(lease, lane, lease.watch_for_change, on_end, 30.0)
        wait_until(lambda: len(lease.steps) > 3, 5, "steps of the second watch")
        lease.poke()
        assert ended.wait(5)
        assert ends[1] == (None, False, True)  # a change, seen by a step
    finally:
        pump.discard(lease)
        lane.shutdown(wait=True)


def test_a_watch_whose_slice_ran_out_does_not_wake_the_keeper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each slice's end woke the keeper of every watched follower into an attempt: 200
    attempts a second at 1,000 leases, each lease's every 5 s."""
    slice_seconds = 0.5
    monkeypatch.setattr(blocking_lease, "WATCH_SLICE", slice_seconds)
    lease = SteppedLease(f"quiet-{uuid.uuid4().hex[:6]}")
    adapter = BlockingLease(lease)
    wakes: list[float] = []
    adapter.on_wake(lambda: wakes.append(time.monotonic()))
    try:
        adapter.connect()
        began = time.monotonic()
        wait_until(lambda: time.monotonic() - began > 3 * slice_seconds, 5, "three slices")
        steps = [t for t in lease.steps if t > began + 2 * slice_seconds]
        assert steps, "the lease was not watched again after its slice"
        assert wakes == [], "a slice's end woke the keeper"
        lease.poke()
        wait_until(lambda: wakes, 5, "a change to wake the keeper")
    finally:
        adapter.on_wake(None)
        adapter.close()
    assert lease.overlaps == 0


class _QuietWatch:
    """A watch with nothing due: it steps only when its socket is readable."""

    def __init__(self, sock: socket.socket, seen: list[float]) -> None:
        self.sockets = (sock,)
        self._seen = seen

    def due(self) -> float:
        return math.inf

    def step(self, readable: frozenset[Any]) -> bool:
        if readable:
            self.sockets[0].recv(64)
            self._seen.append(time.monotonic())
            return True
        return False


def test_a_watch_added_while_the_pump_sleeps_is_watched_at_once() -> None:
    """A lease watched again after a call (a renewal, an attempt) had its socket out of
    the selector until the pump's thread next woke by itself, up to a second later when
    the other leases had nothing due: a release in that time was seen that late."""
    pump = WaitPump()
    lane = ThreadPoolExecutor(2)
    pairs = [socket.socketpair() for _ in range(2)]
    seen: list[float] = []
    try:
        pump.add("quiet", lane, lambda: _QuietWatch(pairs[0][0], []), lambda *_: None, 60.0)
        time.sleep(0.3)  # the pump's thread sleeps now, with nothing due for a while
        started = threading.Event()

        def start() -> _QuietWatch:
            started.set()
            return _QuietWatch(pairs[1][0], seen)

        pump.add("added", lane, start, lambda *_: None, 60.0)
        assert started.wait(5)
        time.sleep(0.05)  # the watch has begun
        poked = time.monotonic()
        pairs[1][1].send(b"x")
        wait_until(lambda: seen, 5, "the added watch to see its socket")
        assert seen[0] - poked < 0.3, f"seen after {seen[0] - poked:.3f} s"
    finally:
        pump.discard("quiet")
        pump.discard("added")
        lane.shutdown(wait=True)
        for pair in pairs:
            for end in pair:
                end.close()


def test_the_pumps_thread_stays_across_a_call_and_ends_when_the_lease_leaves() -> None:
    """A lease out for a call comes back: the thread (and its socket pair and selector)
    is not ended and made anew for each renewal. A lease that leaves ends it at once."""
    pump = WaitPump()
    lane = ThreadPoolExecutor(1)
    pair = socket.socketpair()

    def threads() -> list[threading.Thread]:
        thread = pump._thread  # this pump's thread, not the process's pump's
        return [thread] if thread is not None and thread.is_alive() else []

    try:
        pump.add("lease", lane, lambda: _QuietWatch(pair[0], []), lambda *_: None, 60.0)
        wait_until(threads, 5, "the pump's thread")
        (first,) = threads()
        pump.remove("lease")  # a call takes the lease out
        time.sleep(0.3)
        assert threads() == [first], "the thread ended while the lease was out for a call"
        pump.add("lease", lane, lambda: _QuietWatch(pair[0], []), lambda *_: None, 60.0)
        assert threads() == [first]
        pump.remove("lease")
        pump.discard("lease")  # the lease leaves for good (its leader stops)
        wait_until(lambda: not threads(), 2, "the pump's thread to end")
    finally:
        pump.discard("lease")
        lane.shutdown(wait=True)
        for end in pair:
            end.close()
