"""Leaders driven by the process's one driver thread (leases that never block).

A ``LeaseLeader`` over a :class:`~rselection.abc.NonBlockingLease` has no keeper or
watchdog thread of its own (``PostgresLeader`` is one). These tests run such leaders over
an in-memory lease that answers on another thread, so what is checked is the driven
state machine itself: the deadline ends a term whose renewal hangs and the lease passes
on only after that term's tasks are joined, a slow receiver of one leader never delays
another's renewals, failures recover with backoff, and the threads stay few.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import rselection as rs
from rselection import signals
from rselection.errors import BackendUnavailable
from rselection.leader import LeaseLeader
from rselection.timing import Timings
from tests.support.nonblocking_lease import (
    AnnouncingMemoryLease,
    Answerer,
    NonBlockingMemoryLease,
    WakingMemoryLease,
)
from tests.support.waiting import wait_until

# ttl 3 s, deadline 1 s: a renewal may be late by up to 2 s before the lease expires.
FAST = Timings(ttl=3.0, renew_interval=0.2, renew_deadline=1.0, retry_interval=0.2)


@pytest.fixture
def answerer() -> Answerer:
    return Answerer()


@pytest.fixture
def made() -> Iterator[list[LeaseLeader]]:
    leaders: list[LeaseLeader] = []
    yield leaders
    for leader in leaders:
        leader.stop(10)


def make(
    made: list[LeaseLeader],
    lease: NonBlockingMemoryLease,
    handler: rs.TaskHandler | None = None,
    node_id: str = "n",
) -> LeaseLeader:
    leader = LeaseLeader(lease, handler or rs.TaskHandler(), node_id=node_id, timings=FAST)
    made.append(leader)
    return leader


def machinery_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rselection-")]


def test_three_hundred_leaders_run_on_a_few_threads_and_leave_none_behind(
    answerer: Answerer, made: list[LeaseLeader]
) -> None:
    # Counted from a quiet process: threads of an earlier test may still be ending.
    wait_until(lambda: not machinery_threads(), 15, f"earlier threads: {machinery_threads()}")
    leaders = [
        make(made, NonBlockingMemoryLease(WakingMemoryLease(f"l{i}", ttl=3.0), answerer))
        for i in range(300)
    ]
    for leader in leaders:
        leader.start()
    wait_until(lambda: all(x.is_leader for x in leaders), 20, "every lease to be led")
    time.sleep(3 * FAST.renew_interval)  # several rounds of renewals
    assert all(x.is_leader for x in leaders)
    threads = machinery_threads()
    assert not [n for n in threads if n.startswith(("rselection-keeper", "rselection-watchdog"))]
    # The driver, at most 8 workers, and the signal thread: never one per leader.
    assert len(threads) <= 10, threads
    for leader in leaders:
        leader.stop(0)  # only asks
    for leader in leaders:
        leader.stop(10)
    assert not any(x.is_leader for x in leaders)
    wait_until(lambda: not machinery_threads(), 5, f"no thread left: {machinery_threads()}")


def test_a_hung_renewal_ends_the_term_at_its_deadline_and_the_lease_passes_on_after_its_tasks(
    answerer: Answerer, made: list[LeaseLeader]
) -> None:
    shared = WakingMemoryLease("hang", ttl=FAST.ttl)
    first, second = (
        NonBlockingMemoryLease(shared, answerer),
        NonBlockingMemoryLease(shared, answerer),
    )
    finished: dict[str, float] = {}
    started: dict[str, float] = {}

    def handler(node: str) -> rs.TaskHandler:
        tasks = rs.TaskHandler(stop_grace=1.0)

        @tasks.persistent("work")
        def work(ctx: rs.TaskContext) -> None:
            started[node] = time.monotonic()
            ctx.cancelled.wait()
            time.sleep(0.4)  # winds down for a while after the cancel
            finished[node] = time.monotonic()

        return tasks

    a = make(made, first, handler("a"), node_id="a")
    a.start()
    assert a.wait_until_leader(5)
    b = make(made, second, handler("b"), node_id="b")
    b.start()
    time.sleep(0.5)
    first.held.set()  # a's renewals hang from now on
    held_at = time.monotonic()
    wait_until(lambda: not a.is_leader, 3, "a to stop leading")
    assert time.monotonic() - held_at <= FAST.renew_deadline + FAST.renew_interval + 0.5
    wait_until(lambda: "b" in started, 10, "b to lead")
    assert "a" in finished
    assert finished["a"] < started["b"], "b ran while a's task still wound down"
    # b took over only once a's lease expired on the server: a never released it.
    assert started["b"] - held_at >= FAST.ttl - FAST.renew_interval - 0.1
    first.release_answers()


def test_a_slow_elected_receiver_of_one_leader_never_delays_another_leaders_renewals(
    answerer: Answerer, made: list[LeaseLeader]
) -> None:
    slow = make(made, NonBlockingMemoryLease(WakingMemoryLease("slow", ttl=3.0), answerer))
    quick = make(made, NonBlockingMemoryLease(WakingMemoryLease("quick", ttl=3.0), answerer))
    renewed: list[float] = []
    letting_go = threading.Event()

    def on_elected(sender: Any, **kw: Any) -> None:
        if sender is slow:
            letting_go.wait(5)

    def on_renewed(sender: Any, **kw: Any) -> None:
        if sender is quick:
            renewed.append(time.monotonic())

    signals.elected.connect(on_elected)
    signals.lease_renewed.connect(on_renewed)
    try:
        slow.start()
        wait_until(lambda: slow.term is not None, 5, "the slow leader's term")
        quick.start()
        assert quick.wait_until_leader(5)
        watched = time.monotonic()
        time.sleep(2.0)
        gaps = [b - a for a, b in zip([watched, *renewed], renewed, strict=False) if b > watched]
        assert len([t for t in renewed if t > watched]) >= 5, renewed
        assert max(gaps) < 0.8, f"renewals of the quick leader were held up: {gaps}"
    finally:
        letting_go.set()
        signals.elected.disconnect(on_elected)
        signals.lease_renewed.disconnect(on_renewed)


def test_a_renewal_that_fails_ends_the_term_and_the_leader_leads_again_after_backoff(
    answerer: Answerer, made: list[LeaseLeader]
) -> None:
    lease = NonBlockingMemoryLease(WakingMemoryLease("flaky", ttl=FAST.ttl), answerer)
    demoted: list[str] = []

    def on_demoted(sender: Any, **kw: Any) -> None:
        demoted.append(kw["reason"])

    signals.demoted.connect(on_demoted)
    try:
        leader = make(made, lease)
        leader.start()
        assert leader.wait_until_leader(5)
        first = leader.term
        lease.renew_error = BackendUnavailable("the server went away")
        wait_until(lambda: demoted == ["connection"], 5, "the term to end on the failure")
        wait_until(lambda: leader.term is not None and leader.term != first, 5, "a new term")
    finally:
        signals.demoted.disconnect(on_demoted)


def test_step_down_with_a_hold_lets_the_other_node_lead(
    answerer: Answerer, made: list[LeaseLeader]
) -> None:
    shared = WakingMemoryLease("hand", ttl=FAST.ttl)
    a = make(made, NonBlockingMemoryLease(shared, answerer), node_id="a")
    b = make(made, NonBlockingMemoryLease(shared, answerer), node_id="b")
    a.start()
    assert a.wait_until_leader(5)
    b.start()
    asked = time.monotonic()
    a.step_down(hold=5.0)
    assert not a.is_leader
    assert b.wait_until_leader(2), "b did not take the released lease over"
    assert time.monotonic() - asked < 1.0


def test_stop_from_a_task_and_from_a_receiver_only_asks(
    answerer: Answerer, made: list[LeaseLeader]
) -> None:
    tasks = rs.TaskHandler()
    leader = make(made, NonBlockingMemoryLease(WakingMemoryLease("self", ttl=3.0), answerer), tasks)
    returned = threading.Event()

    @tasks.persistent("stopper")
    def stopper(ctx: rs.TaskContext) -> None:
        leader.stop()  # waiting here would wait for this very task
        returned.set()

    stopped_in_receiver = threading.Event()

    def on_demoted(sender: Any, **kw: Any) -> None:
        if sender is leader:
            sender.stop()
            stopped_in_receiver.set()

    signals.demoted.connect(on_demoted)
    try:
        leader.start()
        assert returned.wait(5), "stop() from a task did not return"
        assert stopped_in_receiver.wait(5), "stop() from a demoted receiver did not return"
        leader.stop(5)
        assert leader._wait_stopped(0)
    finally:
        signals.demoted.disconnect(on_demoted)


def test_receivers_that_block_in_many_leaders_never_hold_up_another_leader(
    answerer: Answerer, made: list[LeaseLeader]
) -> None:
    # More leaders whose leader_changed receivers block than the driver has workers: each
    # blocked step stops counting against them, so the next leader still leads and stops.
    blocked = [
        make(made, NonBlockingMemoryLease(WakingMemoryLease(f"b{i}", ttl=3.0), answerer))
        for i in range(12)
    ]
    letting_go = threading.Event()
    waiting: list[object] = []

    def on_changed(sender: Any, **kw: Any) -> None:
        if sender in blocked:
            waiting.append(sender)
            letting_go.wait(20)

    signals.leader_changed.connect(on_changed)
    try:
        for leader in blocked:
            leader.start()
        wait_until(lambda: len(waiting) == len(blocked), 10, "every blocked receiver")
        other = make(made, NonBlockingMemoryLease(WakingMemoryLease("other", ttl=3.0), answerer))
        began = time.monotonic()
        other.start()
        assert other.wait_until_leader(3), "a leader waited behind others' receivers"
        other.stop(3)
        assert other._wait_stopped(0), "stop() waited behind others' receivers"
        assert time.monotonic() - began < 4.0
    finally:
        letting_go.set()
        signals.leader_changed.disconnect(on_changed)


class Following(LeaseLeader):
    """A leader that follows announced holders (as a sharded leader's shards do)."""

    _follows_announcements = True


def test_a_follower_follows_an_announced_holder_and_never_an_older_term(
    answerer: Answerer, made: list[LeaseLeader]
) -> None:
    # An announcement (a Postgres acquisition's notification) that arrives after an
    # attempt already saw a newer term must not make leader_changed go back in time.
    shared = WakingMemoryLease("ann", ttl=FAST.ttl)
    view = AnnouncingMemoryLease(shared, answerer)
    seen: list[tuple[str, int]] = []

    def on_changed(sender: Any, **kw: Any) -> None:
        if sender is follower and kw["leader"] is not None:
            seen.append((kw["leader"].node_id, kw["leader"].term))

    signals.leader_changed.connect(on_changed)
    try:
        holder = make(made, NonBlockingMemoryLease(shared, answerer), node_id="a")
        holder.start()
        assert holder.wait_until_leader(5)
        follower = Following(view, rs.TaskHandler(), node_id="b", timings=FAST)
        made.append(follower)
        follower.start()
        wait_until(lambda: seen[-1:] == [("a", 1)], 5, "b to see a")
        now = shared.current()
        assert now is not None
        view.announce(rs.LeaderInfo("c", 7, now.acquired_at, now.expires_at))
        wait_until(lambda: seen[-1:] == [("c", 7)], 5, "b to follow the announced holder")
        view.announce(rs.LeaderInfo("d", 5, now.acquired_at, now.expires_at))
        wait_until(lambda: view._announced is None, 5, "b to take the stale announcement")
        view.announce(rs.LeaderInfo("e", 9, now.acquired_at, now.expires_at))
        wait_until(lambda: seen[-1:] == [("e", 9)], 5, "b to follow the next holder")
        assert ("d", 5) not in seen, seen
    finally:
        signals.leader_changed.disconnect(on_changed)
