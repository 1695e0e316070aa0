"""``rs.LeaseLeader``: what it accepts, what it refuses, and what it hands to tasks.

The state machine itself is tested in ``test_leader_safety.py`` and, over every
backend, by the conformance suite (``rselection.testing.LeaderConformance``).
"""

from __future__ import annotations

import contextvars
import decimal
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

import rselection as rs
import rselection.leader
import rselection.leadership
from rselection.memory import MemoryLease
from rselection.timing import Timings
from tests.support.lease_view import LeaseView
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.2, "renew_deadline": 1.0, "retry_interval": 0.2}


@pytest.fixture
def lease_leaders() -> Iterator[Callable[..., rs.LeaseLeader]]:
    made: list[rs.LeaseLeader] = []

    def make(lease: Any, handler: rs.TaskHandler | None = None, **kw: Any) -> rs.LeaseLeader:
        leader = rs.LeaseLeader(lease, handler or rs.TaskHandler(), **kw)
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


def test_the_name_comes_from_the_lease_and_the_ttl_too(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    lease = MemoryLease(name="billing", ttl=3.0)
    leader = lease_leaders(lease, renew_interval=0.2, renew_deadline=1.0, node_id="n1")
    assert leader.name == "billing" and leader.lease is lease and leader.node_id == "n1"
    assert leader.timings == Timings(3.0, 0.2, 1.0, 2.0)
    assert isinstance(leader, rs.Leader)
    assert rs.LeaseLeader(MemoryLease(name="x"), rs.TaskHandler()).node_id  # a fresh id


def test_a_lease_that_expires_sooner_than_the_leaders_ttl_is_refused_with_the_math() -> None:
    with pytest.raises(rs.ConfigError) as err:
        rs.LeaseLeader(MemoryLease(name="x", ttl=3.0), rs.TaskHandler(), ttl=15.0)
    message = str(err.value)
    assert "expires 3s after a renewal, sooner than the leader's ttl of 15s" in message
    assert "pass ttl=3" in message
    rs.LeaseLeader(MemoryLease(name="x", ttl=30.0), rs.TaskHandler(), ttl=15.0)  # longer: fine


class OtherTtl:
    """A lease of one's own around a memory lease, saying its ttl as it likes (or not)."""

    def __init__(self, inner: MemoryLease, ttl: object = None) -> None:
        self.inner, self.name = inner, inner.name
        if ttl is not None:
            self.ttl = ttl

    def connect(self) -> None:
        self.inner.connect()

    def try_acquire(self, node_id: str) -> rs.Acquisition:
        return self.inner.try_acquire(node_id)

    def renew(self, node_id: str, term: int) -> bool:
        return self.inner.renew(node_id, term)

    def release(self, node_id: str, term: int) -> None:
        self.inner.release(node_id, term)

    def current(self) -> rs.LeaderInfo | None:
        return self.inner.current()

    def wait_for_change(self, timeout: float) -> None:
        self.inner.wait_for_change(timeout)

    def interrupt(self) -> None:
        self.inner.interrupt()

    def term_ended(self, term: int) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("ttl", "match"),
    [
        (None, "which has no ttl"),  # no ttl: the leader cannot know when it expires
        (timedelta(seconds=1.5), "ttl - renew_deadline = 1.5 - 10"),
        (math.nan, "must be a finite number"),
        ("15", "must be a finite number"),
        (True, "must be a finite number"),
        (0, "must be positive"),
    ],
)
def test_a_lease_whose_ttl_is_missing_or_too_short_in_any_form_is_refused(
    ttl: object, match: str
) -> None:
    lease = OtherTtl(MemoryLease(name="short", ttl=1.5), ttl)
    with pytest.raises(rs.ConfigError, match=match):
        rs.LeaseLeader(lease, rs.TaskHandler(), retry_interval=0.1)
    with pytest.raises(rs.ConfigError, match="ttl"):  # the leader's own ttl changes nothing
        rs.LeaseLeader(lease, rs.TaskHandler(), ttl=15.0)


def test_a_lease_ttl_given_as_a_timedelta_is_read_in_seconds() -> None:
    lease = OtherTtl(MemoryLease(name="long", ttl=30.0), timedelta(seconds=30))
    assert rs.LeaseLeader(lease, rs.TaskHandler()).timings.ttl == 30.0
    with pytest.raises(rs.ConfigError, match="expires 30s after a renewal"):
        rs.LeaseLeader(lease, rs.TaskHandler(), ttl=60.0, renew_deadline=40.0)


def test_timings_come_either_as_one_object_or_as_four_values() -> None:
    with pytest.raises(rs.ConfigError, match="not both"):
        rs.LeaseLeader(MemoryLease(name="x"), rs.TaskHandler(), timings=Timings(), ttl=15.0)
    with pytest.raises(rs.ConfigError, match="timings must be a Timings"):
        rs.LeaseLeader(MemoryLease(name="x"), rs.TaskHandler(), timings={"ttl": 15})  # type: ignore[arg-type]
    with pytest.raises(rs.ConfigError, match="ttl - renew_deadline"):
        rs.LeaseLeader(MemoryLease(name="x", ttl=3.0), rs.TaskHandler())  # deadline 10 > ttl 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"claimer": object()}, "claimer must have claim"),
        ({"checkpoint_store": object()}, "checkpoint_store must have load"),
        ({"fence": object()}, "fence must have fence"),
        ({"node_id": ""}, "node_id"),
    ],
)
def test_parts_of_the_wrong_kind_are_refused_at_construction(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(rs.ConfigError, match=match):
        rs.LeaseLeader(MemoryLease(name="x"), rs.TaskHandler(), **kwargs)


def blank_named_lease() -> MemoryLease:
    lease = MemoryLease(name="x")
    lease.name = " "  # a backend of one's own may not check its name: the leader does
    return lease


@pytest.mark.parametrize("make", [object, lambda: "billing", blank_named_lease])
def test_a_lease_that_is_no_lease_backend_or_has_a_blank_name_is_refused(
    make: Callable[[], Any],
) -> None:
    with pytest.raises(rs.ConfigError, match=r"LeaseBackend|lease name"):
        rs.LeaseLeader(make(), rs.TaskHandler())


def test_a_memory_checkpoint_store_is_given_the_lease(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    lease = MemoryLease(name="fenced", ttl=3.0)
    store = rs.MemoryCheckpointStore()
    saved: list[rs.Snapshot] = []
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.persistent("job", restart="never")
    def job(ctx: rs.TaskContext) -> None:
        saved.append(ctx.checkpoint.save({"term": ctx.term}))

    leader = lease_leaders(lease, handler, checkpoint_store=store, **FAST)
    assert leader.checkpoint_store is store
    leader.start()
    wait_until(lambda: bool(saved), 5, "the save")
    assert saved[0].term == 1
    leader.stop(timeout=10)
    with pytest.raises(rs.StaleLeaderError):  # fenced against the leader's lease
        store.save("fenced/job", {}, term=1, name="fenced")


def test_cleanup_runs_once_after_the_release_and_survives_errors(
    lease_leaders: Callable[..., rs.LeaseLeader], caplog: pytest.LogCaptureFixture
) -> None:
    lease = MemoryLease(name="tidy", ttl=3.0)
    calls: list[object] = []

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("a cleanup that fails")

    def tidy() -> None:
        calls.append(lease.current())  # the lease is already released

    leader = lease_leaders(lease, cleanup=[broken, tidy], **FAST)
    leader.start()
    assert leader.wait_until_leader(5)
    leader.stop(timeout=10)
    assert calls == ["broken", None]
    assert leader.leader() is None
    leader.stop(timeout=10)
    assert calls == ["broken", None]  # never twice
    assert any("clean-up" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_a_hanging_cleanup_holds_stop_at_most_the_cleanup_timeout(
    lease_leaders: Callable[..., rs.LeaseLeader], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rselection.leadership, "CLEANUP_TIMEOUT", 0.5)
    lease = MemoryLease(name="hang", ttl=3.0)
    release = threading.Event()
    calls: list[str] = []

    def hang() -> None:
        calls.append("hang")
        release.wait(30)

    leader = lease_leaders(lease, cleanup=[hang, lambda: calls.append("next")], **FAST)
    leader.start()
    assert leader.wait_until_leader(5)
    stopping = threading.Thread(target=leader.stop, daemon=True)  # no timeout
    try:
        stopping.start()
        stopping.join(5)
        assert not stopping.is_alive(), "stop() waits for a hanging clean-up"
        assert calls == ["hang", "next"] and lease.current() is None
    finally:
        release.set()


def test_cleanups_share_one_thread_until_one_outlasts_its_timeout(
    lease_leaders: Callable[..., rs.LeaseLeader], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One thread for every clean-up (each thread started as a stop releases takes time
    # from the next leader's start); after one that hangs, the rest go on on another, and
    # the thread left behind takes none of them once its clean-up returns.
    monkeypatch.setattr(rselection.leadership, "CLEANUP_TIMEOUT", 0.5)
    lease = MemoryLease(name="one-thread", ttl=3.0)
    release = threading.Event()
    ran: list[tuple[str, threading.Thread]] = []

    def record(label: str) -> Callable[[], None]:
        return lambda: ran.append((label, threading.current_thread()))

    def hang() -> None:
        record("hang")()
        release.wait(30)

    cleanup = [record("a"), record("b"), hang, record("c"), record("d")]
    leader = lease_leaders(lease, cleanup=cleanup, **FAST)
    leader.start()
    assert leader.wait_until_leader(5)
    leader.stop(timeout=10)
    release.set()
    first = ran[0][1]
    first.join(5)
    assert not first.is_alive()
    assert [label for label, _ in ran] == ["a", "b", "hang", "c", "d"]
    assert {thread for _, thread in ran[:3]} == {first}
    assert {thread for _, thread in ran[3:]} == {ran[3][1]} and ran[3][1] is not first


def test_each_cleanup_runs_in_a_context_of_its_own(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    # They share a thread, but not what one sets in its context (as on threads of their
    # own): a context variable, the decimal context.
    var: contextvars.ContextVar[str] = contextvars.ContextVar("cleanup_var", default="unset")
    seen: list[tuple[str, int]] = []

    def first() -> None:
        var.set("first")
        decimal.getcontext().prec = 3

    def second() -> None:
        seen.append((var.get(), decimal.getcontext().prec))

    lease = MemoryLease(name="contexts", ttl=3.0)
    leader = lease_leaders(lease, cleanup=[first, second], **FAST)
    leader.start()
    assert leader.wait_until_leader(5)
    leader.stop(timeout=10)
    assert seen == [("unset", decimal.DefaultContext.prec)]


def test_a_cleanup_that_exits_skips_nothing_and_frees_the_handler(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    calls: list[str] = []

    def exits() -> None:
        calls.append("exits")
        raise SystemExit(3)

    handler = rs.TaskHandler()
    leader = lease_leaders(
        MemoryLease(name="exits", ttl=3.0),
        handler,
        cleanup=[exits, lambda: calls.append("next")],
        **FAST,
    )
    leader.start()
    assert leader.wait_until_leader(5)
    leader.stop(timeout=10)
    assert calls == ["exits", "next"]
    assert leader._driven.done.is_set()  # the keeper is done
    wait_until(
        lambda: not any(t.name == "rselection-wait-exits" for t in threading.enumerate()),
        5,
        "the lease's waiting thread to end",
    )
    again = lease_leaders(MemoryLease(name="exits-again", ttl=3.0), handler, **FAST)
    again.start()  # the handler was detached
    assert again.wait_until_leader(5)


def test_a_start_cut_short_by_ctrl_c_still_runs_the_cleanups(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    # A Ctrl-C that lands in start() (here: raised by a receiver of `started`) ends it
    # before the engine has the leader: nothing will ever stop it, so what it opened
    # is closed on the way out (the clean-ups, the backend, the handler).
    calls: list[str] = []
    handler = rs.TaskHandler()
    leader = lease_leaders(
        MemoryLease(name="cut-short", ttl=3.0),
        handler,
        cleanup=[lambda: calls.append("cleanup")],
        **FAST,
    )

    def interrupt(sender: Any, **kw: Any) -> None:
        if sender is leader:
            raise KeyboardInterrupt

    rs.signals.started.connect(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            leader.start()
    finally:
        rs.signals.started.disconnect(interrupt)
    assert calls == ["cleanup"]
    leader.stop(timeout=10)  # nothing more to do, and the clean-ups do not run again
    assert calls == ["cleanup"]
    again = lease_leaders(MemoryLease(name="cut-short-again", ttl=3.0), handler, **FAST)
    again.start()  # the handler was detached
    assert again.wait_until_leader(5)


def test_claims_go_through_the_lease_name(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    claimer = rs.MemoryClaimer()
    keys: list[str] = []
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.interval(0.05, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        assert ctx.fire_key is not None
        keys.append(ctx.fire_key)

    leader = lease_leaders(MemoryLease(name="claims", ttl=3.0), handler, claimer=claimer, **FAST)
    assert leader.claimer is claimer
    leader.start()
    wait_until(lambda: len(keys) >= 2, 5, "two fires")
    leader.stop(timeout=10)
    assert {f"claims/{key}" for key in keys} <= set(claimer.claims())


def test_a_cleanup_that_calls_stop_does_not_wait_for_itself(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    # A shared "shut everything down" hook may be one of the clean-ups; its stop() only
    # asks, as from a task or a receiver, instead of waiting for the clean-up it runs in.
    leaders: list[rs.LeaseLeader] = []
    stopped_in: list[float] = []

    def shut_down() -> None:
        start = time.monotonic()
        leaders[0].stop()
        stopped_in.append(time.monotonic() - start)

    leader = lease_leaders(
        MemoryLease(name="stop-in-cleanup", ttl=3.0), cleanup=[shut_down], **FAST
    )
    leaders.append(leader)
    leader.start()
    assert leader.wait_until_leader(5)
    start = time.monotonic()
    leader.stop(timeout=30)
    took = time.monotonic() - start
    assert stopped_in and stopped_in[0] < 1.0, f"stop() inside the clean-up took {stopped_in}"
    assert took < rselection.leader.CLEANUP_TIMEOUT, f"stop() took {took:.2f}s"


def test_a_follower_over_a_shared_memory_lease_stops_at_once(
    lease_leaders: Callable[..., rs.LeaseLeader],
) -> None:
    # Its waiting thread sits in the shared lease's wait, which a call does not
    # interrupt (concurrent_calls): before, stop() waited for that wait to time out (1 s).
    # Views of the memory lease, which do not call back on changes: its leaders wait in
    # it (a memory lease itself calls back, and its leaders wait in no thread).
    lease = MemoryLease(name="shared-stop", ttl=3.0)
    chief = lease_leaders(LeaseView(lease), rs.TaskHandler(), node_id="chief", **FAST)
    follower = lease_leaders(LeaseView(lease), rs.TaskHandler(), node_id="follower", **FAST)
    chief.start()
    assert chief.wait_until_leader(5)
    follower.start()
    wait_until(lambda: follower.leader() is not None, 5, "the follower to see the leader")
    waiting = follower._backend
    wait_until(lambda: waiting._waiting, 5, "the follower's thread to wait in the lease")  # type: ignore[attr-defined]
    began = time.monotonic()
    follower.stop(timeout=10)
    took = time.monotonic() - began
    assert took < 0.5, f"a follower's stop() took {took:.2f} s"
    assert chief.is_leader
