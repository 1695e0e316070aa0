"""A Redis follower's next attempt runs on the worker that reads the release: the keeper
leaves it with the watched lease (:class:`rselection.blocking_lease.ArmedAttempt`), and
takes it back at every step of its own. What that must never change: a stop, a drain or
a stop from a receiver of the term it began."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from rselection.daemon_pool import Lane
from rselection.redis import RedisAdmin, RedisLeader
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


@pytest.fixture
def name() -> str:
    return f"armed-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_leader(redis_url: str, name: str) -> Iterator[Callable[..., RedisLeader]]:
    made: list[RedisLeader] = []

    def make(node_id: str, handler: rs.TaskHandler | None = None) -> RedisLeader:
        leader = RedisLeader(
            redis_url, handler or rs.TaskHandler(), name=name, node_id=node_id, **FAST
        )
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


def _elected_threads(name: str, node_id: str) -> tuple[list[str], Callable[..., None]]:
    """The names of the threads that sent ``node_id``'s ``elected`` for lease ``name``,
    and the receiver that records them (keep a reference: receivers are weak)."""
    threads: list[str] = []

    def receiver(sender: Any, **kw: Any) -> None:
        if kw["name"] == name and kw["node_id"] == node_id:
            threads.append(threading.current_thread().name)

    rs.signals.elected.connect(receiver)
    return threads, receiver


def _lead_and_follow(a: RedisLeader, b: RedisLeader) -> None:
    """Start ``a`` until it leads, then ``b`` until it follows with its next attempt left
    with its lease (every step of an idle follower leaves it there)."""
    a.start()
    assert a.wait_until_leader(10)
    b.start()
    wait_until(lambda: b._driven._armed is not None, 10, "an armed follower")


def test_the_worker_that_reads_a_release_sends_the_attempt_and_begins_the_term(
    make_leader: Callable[..., RedisLeader], name: str
) -> None:
    a, b = make_leader("a"), make_leader("b")
    threads, receiver = _elected_threads(name, "b")
    _lead_and_follow(a, b)
    a.stop()
    wait_until(lambda: threads, 5, "b's elected")  # sent once its tasks run
    # Before, the wait worker woke the driver's thread, which handed the attempt to a
    # worker of the leader's lane ("rselection-driver-work"): two more hand-offs.
    assert len(threads) == 1 and threads[0].startswith("rselection-driver-wait"), threads
    rs.signals.elected.disconnect(receiver)


def test_a_stop_from_a_receiver_of_a_term_the_wait_worker_began_returns_at_once(
    make_leader: Callable[..., RedisLeader], name: str
) -> None:
    # The receiver runs on the wait worker, which the keeper counts as its own: a stop()
    # there asks and returns (waiting would wait for itself: the keeper waits for the
    # attempt's outcome, which waits for the receiver).
    a, b = make_leader("a"), make_leader("b")
    returned = threading.Event()

    def stop_b(sender: Any, **kw: Any) -> None:
        if kw["name"] == name and kw["node_id"] == "b":
            b.stop()
            returned.set()

    rs.signals.elected.connect(stop_b)
    try:
        _lead_and_follow(a, b)
        a.stop()
        assert returned.wait(5), "stop() from the receiver did not return"
        wait_until(lambda: b.leader() is None, 10, "b to stop and release the lease")
    finally:
        rs.signals.elected.disconnect(stop_b)


def test_a_stopped_follower_never_attempts_again(
    make_leader: Callable[..., RedisLeader], name: str, redis_url: str
) -> None:
    a, b = make_leader("a"), make_leader("b")
    threads, receiver = _elected_threads(name, "b")
    _lead_and_follow(a, b)
    b.stop(timeout=5)
    a.stop(timeout=5)
    with RedisAdmin(redis_url) as admin:
        time.sleep(FAST["retry_interval"] * 2)  # what an attempt left behind would take
        assert admin.current_holder(name) is None
        assert [record.node_id for record in admin.history(name)] == ["a"]
    assert threads == []
    rs.signals.elected.disconnect(receiver)


def test_a_follower_drained_after_it_armed_its_attempt_never_takes_the_lease(
    make_leader: Callable[..., RedisLeader], name: str, redis_url: str
) -> None:
    # The keeper steps nothing when its node is drained (it has nothing to do): the
    # attempt it left with the lease must look at the drain itself. Before, it took the
    # lease and the new term was released at once as drained (a record of node b).
    a, b = make_leader("a"), make_leader("b")
    _lead_and_follow(a, b)
    with RedisAdmin(redis_url) as admin:
        admin.drain(name, "b")
        wait_until(lambda: not b.eligible, 10, "b to see its drain")
        a.stop()
        time.sleep(FAST["retry_interval"] * 2)  # b's attempt, had it made one
        assert admin.current_holder(name) is None
        assert [record.node_id for record in admin.history(name)] == ["a"]
    assert not b.is_leader


def test_a_term_begun_by_an_armed_attempt_ends_at_its_deadline_under_a_slow_receiver(
    make_leader: Callable[..., RedisLeader], name: str
) -> None:
    # Before, the keeper was not told of the attempt the worker ran: an idle follower's
    # next step was seconds away, so nothing looked at the new term's deadline while
    # its elected receiver ran (it was never renewed either): the term's tasks ran on
    # after the lease expired, beside the next leader's.
    started = threading.Event()
    cancelled_after: list[float] = []
    tasks = rs.TaskHandler(stop_grace=0.5)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        began = time.monotonic()
        started.set()
        ctx.cancelled.wait(10)
        cancelled_after.append(time.monotonic() - began)

    a, b = make_leader("a"), make_leader("b", tasks)

    def slow(sender: Any, **kw: Any) -> None:
        if kw["name"] == name and kw["node_id"] == "b":
            time.sleep(2 * FAST["renew_deadline"])

    rs.signals.elected.connect(slow)
    try:
        _lead_and_follow(a, b)
        a.stop()
        assert started.wait(5)
        wait_until(lambda: cancelled_after, 3 * FAST["renew_deadline"], "b's term to end")
        # Its deadline: renew_deadline after the attempt was sent, checked every second.
        assert cancelled_after[0] < FAST["renew_deadline"] + 1.5, cancelled_after
    finally:
        rs.signals.elected.disconnect(slow)


def test_a_step_the_pump_cannot_hand_out_never_runs_the_attempt_on_its_thread(
    make_leader: Callable[..., RedisLeader], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # When no worker can start, the pump ends the watch from its own thread. Before,
    # that ran the armed attempt there, and with it the elected receivers: every Redis
    # lease's watch in the process waited for them.
    a, b = make_leader("a"), make_leader("b")
    threads, receiver = _elected_threads(name, "b")
    _lead_and_follow(a, b)
    watched = b._backend
    submit = Lane.submit
    refused = threading.Event()

    def no_thread(lane: Lane, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if not refused.is_set() and args and getattr(args[0], "key", None) is watched:
            refused.set()
            raise RuntimeError("can't start new thread")
        return submit(lane, fn, *args, **kw)

    monkeypatch.setattr(Lane, "submit", no_thread)
    a.stop()
    wait_until(lambda: threads, 5, "b's elected")
    assert refused.is_set()
    assert threads[0] != "rselection-wait-pump", threads
    rs.signals.elected.disconnect(receiver)


def test_slow_receivers_of_terms_begun_on_wait_workers_never_hold_up_another_takeover(
    redis_url: str,
) -> None:
    # More leases with slow elected receivers than a server has wait workers (4): each
    # winner's worker steps aside before the term begins. Before, the steps of the
    # other leases of the server waited until a worker counted as stuck (0.25 s).
    prefix = uuid.uuid4().hex[:6]
    names = [f"armed-slow{i}-{prefix}" for i in range(6)] + [f"armed-fast-{prefix}"]
    holders = [RedisLeader(redis_url, rs.TaskHandler(), name=n, node_id="a", **FAST) for n in names]
    followers = [
        RedisLeader(redis_url, rs.TaskHandler(), name=n, node_id="b", **FAST) for n in names
    ]
    led_at: list[float] = []
    release = threading.Event()

    def receiver(sender: Any, **kw: Any) -> None:
        if kw["node_id"] != "b" or not kw["name"].endswith(prefix):
            return
        if kw["name"].startswith("armed-fast"):
            led_at.append(time.monotonic())
        else:
            release.wait(FAST["renew_deadline"])  # slow, but within the term's deadline

    rs.signals.elected.connect(receiver)
    try:
        for holder, follower in zip(holders, followers, strict=True):
            _lead_and_follow(holder, follower)
        for holder in holders[:-1]:
            holder.stop(0)  # only asks: the slow ones first
        wait_until(lambda: sum(f.is_leader for f in followers) >= 4, 5, "4 slow takeovers")
        stopped = time.monotonic()
        holders[-1].stop()
        wait_until(lambda: led_at, 5, "the fast lease's takeover")
        assert led_at[0] - stopped < 0.15, led_at[0] - stopped
    finally:
        release.set()
        rs.signals.elected.disconnect(receiver)
        for leader in (*holders, *followers):
            leader.stop(timeout=10)
