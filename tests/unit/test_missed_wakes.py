"""A release that lands between a follower's attempt and its wait must wake that wait.

The follower attempts, learns the holder's lease runs for ``ttl`` more seconds, and waits
for a change up to then. When the holder releases in between, the wait must return at
once; before, ``MemoryLease`` and the example ``FileLease`` compared against what they saw
when the wait began, and the follower slept until the lease would have expired (the
conformance suite's step-down handover took 3.05 s against a bound of 1 s).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import rselection as rs
from rselection import blocking_lease
from rselection.timing import Timings
from tests.support.file_lease import FileLease
from tests.support.lease_view import LeaseView
from tests.support.waiting import wait_until

TTL = 5.0
PROMPT = 1.0  # a wait woken by the release returns within milliseconds


def memory_pair(tmp_path: Path) -> tuple[rs.LeaseBackend, rs.LeaseBackend]:
    lease = rs.MemoryLease(name="wakes", ttl=TTL)
    return lease, lease  # leaders of one process share the object


def file_pair(tmp_path: Path) -> tuple[rs.LeaseBackend, rs.LeaseBackend]:
    return FileLease(tmp_path, "wakes", ttl=TTL), FileLease(tmp_path, "wakes", ttl=TTL)


def timed_wait(lease: rs.LeaseBackend) -> float:
    began = time.monotonic()
    lease.wait_for_change(TTL)
    return time.monotonic() - began


@pytest.mark.parametrize("pair", [memory_pair, file_pair], ids=["memory", "file"])
def test_a_release_before_the_wait_wakes_it(
    pair: Callable[[Path], tuple[rs.LeaseBackend, rs.LeaseBackend]], tmp_path: Path
) -> None:
    holder_lease, follower_lease = pair(tmp_path)
    # Each node on a thread of its own, as each leader's keeper runs.
    with ThreadPoolExecutor(1) as holder, ThreadPoolExecutor(1) as follower:
        taken = holder.submit(holder_lease.try_acquire, "holder").result(10)
        assert taken.acquired and taken.holder is not None
        attempt = follower.submit(follower_lease.try_acquire, "follower").result(10)
        assert not attempt.acquired
        holder.submit(holder_lease.release, "holder", taken.holder.term).result(10)
        waited = follower.submit(timed_wait, follower_lease).result(2 * TTL)
    assert waited < PROMPT, f"the wait slept {waited:.2f} s through a release"


def test_a_wait_after_a_change_it_already_saw_still_sleeps() -> None:
    # The memory lease remembers what each thread saw: once a wait returned on a change,
    # the next wait does not return at once again (no busy loop of the keeper).
    lease = rs.MemoryLease(name="quiet", ttl=TTL)
    lease.try_acquire("a")
    with ThreadPoolExecutor(1) as other:
        other.submit(lease.revoke).result(10)  # a change this thread did not see
    assert timed_wait(lease) < PROMPT  # woken by the revoke that came after the attempt
    began = time.monotonic()
    lease.wait_for_change(0.3)
    assert time.monotonic() - began >= 0.25


class LateWake(LeaseView):
    """One node's view of a shared memory lease whose wait returns late in its timeout, as
    a wait ended by a change that came then would (a blocking lease of one's own)."""

    def __init__(self, shared: rs.MemoryLease) -> None:
        super().__init__(shared)
        self._interrupted = threading.Event()

    def wait_for_change(self, timeout: float) -> None:
        self._interrupted.wait(0.97 * timeout)
        self._interrupted.clear()

    def interrupt(self) -> None:
        self._interrupted.set()


def test_a_change_late_in_a_wait_still_wakes_the_follower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a wait that returned after 95 % of its timeout was taken for a timeout and
    # woke nobody: a release that ended it left the follower asleep until the lease would
    # have expired (the conformance suite's step-down handover took 3.01 s once).
    monkeypatch.setattr(blocking_lease, "WAIT_SLICE", 0.5)
    timings = Timings(ttl=3.0, renew_interval=0.5, renew_deadline=2.0, retry_interval=0.5)
    shared = rs.MemoryLease(name="late", ttl=3.0)
    chief = rs.LeaseLeader(shared, rs.TaskHandler(), node_id="chief", timings=timings)
    follower = rs.LeaseLeader(LateWake(shared), rs.TaskHandler(), node_id="f", timings=timings)
    try:
        chief.start()
        assert chief.wait_until_leader(5)
        follower.start()
        wait_until(lambda: follower.leader() is not None, 5, "the follower to see the leader")
        time.sleep(0.6)  # the follower's first attempt is behind it: it waits for a change
        chief.step_down(hold=10)
        began = time.monotonic()
        assert follower.wait_until_leader(5)
        took = time.monotonic() - began
        assert took < 1.5, f"the follower led {took:.2f} s after the release"
    finally:
        follower.stop(timeout=10)
        chief.stop(timeout=10)
