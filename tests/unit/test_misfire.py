"""Misfire policies and per-fire claims, under a real SingleNodeLeader and MemoryClaimer.

Two ways a fire is missed: no node led when it came due (a gap between terms, made here
with ``step_down(hold=...)``), or this node's scheduler fell behind by whole periods
(made here with a schedule whose ``next_fire`` stalls once). In both, the policy decides
what runs, and every fire that does not run is reported on ``signals.fire_skipped``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import rselection as rs
from rselection import signals
from rselection.testing import fires
from tests.support.recording import Recorder
from tests.support.waiting import wait_until

PERIOD = 0.1
STEP = timedelta(seconds=PERIOD)


class Runs:
    """Records each run of a task: (scheduled_at, term), in start order."""

    def __init__(self) -> None:
        self.items: list[tuple[datetime, int]] = []
        self._lock = threading.Lock()

    def __call__(self, ctx: rs.TaskContext) -> None:
        assert ctx.scheduled_at is not None
        with self._lock:
            self.items.append((ctx.scheduled_at, ctx.term))

    def of_term(self, term: int) -> list[datetime]:
        with self._lock:
            return [at for at, t in self.items if t == term]

    def instants(self) -> list[datetime]:
        with self._lock:
            return [at for at, _ in self.items]


def instants_between(first: datetime, last: datetime) -> list[datetime]:
    """Every PERIOD instant from ``first`` to ``last``, both included."""
    out = [first]
    while out[-1] < last:
        out.append(out[-1] + STEP)
    return out


# -- a gap between terms: fires found through the claims ------------------------------


def run_across_gap(
    leaders: Callable[..., rs.SingleNodeLeader], misfire: str, gap: float = 0.55
) -> tuple[Runs, Recorder, datetime]:
    """Lead, step down for ``gap`` seconds, lead again; return runs, skips, term 2 start."""
    handler = rs.TaskHandler(stop_grace=2.0)
    runs = Runs()
    # A short grace keeps the catch-up after the gap small.
    handler.interval(PERIOD, name="tick", misfire=misfire, misfire_grace=1.0)(runs)  # type: ignore[arg-type]
    leader = leaders(handler, claimer=rs.MemoryClaimer())
    skipped = Recorder()
    elected: list[datetime] = []

    def on_elected(sender: object, **kwargs: Any) -> None:
        elected.append(datetime.now(UTC))

    with (
        signals.fire_skipped.connected_to(skipped, sender=handler),
        signals.elected.connected_to(on_elected, sender=leader),
    ):
        leader.start()
        wait_until(lambda: len(runs.of_term(1)) >= 3, 10.0, "three runs in term 1")
        leader.step_down(hold=gap)
        wait_until(lambda: len(runs.of_term(2)) >= 3, 10.0 + gap, "three runs in term 2")
        leader.stop(timeout=10)
    assert len(elected) == 2
    return runs, skipped, elected[1]


def check_each_instant_once(runs: Runs, skipped: Recorder) -> None:
    """No instant ran twice; every instant between the first and last run either ran
    or was reported skipped."""
    ran = runs.instants()
    assert len(ran) == len(set(ran)), f"a fire ran twice: {sorted(ran)}"
    reported = {c["scheduled_at"] for c in skipped.of("tick")}
    missing = [at for at in instants_between(min(ran), max(ran)) if at not in set(ran)]
    unexplained = [at.isoformat() for at in missing if at not in reported]
    assert not unexplained, f"fires neither run nor reported skipped: {unexplained}"


def test_latest_runs_the_newest_missed_fire_once(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    runs, skipped, resumed = run_across_gap(leaders, "latest")
    check_each_instant_once(runs, skipped)
    caught_up = [at for at in runs.of_term(2) if at < resumed]
    misfires = [c["scheduled_at"] for c in skipped.of("tick", reason="misfire")]
    print(f"\nlatest: caught up {len(caught_up)}, reported misfire {len(misfires)}")
    assert len(caught_up) == 1
    # The newest: nothing missed came due after it.
    assert all(at < caught_up[0] for at in misfires)
    assert len(misfires) >= 2  # a 0.55 s gap misses four or five 0.1 s fires


def test_all_runs_every_missed_fire_oldest_first(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    runs, skipped, resumed = run_across_gap(leaders, "all")
    check_each_instant_once(runs, skipped)
    caught_up = [at for at in runs.of_term(2) if at < resumed]
    print(f"\nall: caught up {len(caught_up)}")
    assert len(caught_up) >= 3
    assert caught_up == sorted(caught_up)
    last_before = max(runs.of_term(1))
    # Everything from the old term's last run to the resumption ran, in one catch-up.
    assert caught_up == [at for at in instants_between(last_before, resumed)[1:] if at < resumed]
    assert [
        c for c in skipped.of("tick", reason="misfire") if c["scheduled_at"] > last_before
    ] == []


def test_skip_runs_no_missed_fire(leaders: Callable[..., rs.SingleNodeLeader]) -> None:
    runs, skipped, resumed = run_across_gap(leaders, "skip")
    check_each_instant_once(runs, skipped)
    assert [at for at in runs.of_term(2) if at < resumed] == []
    assert len(skipped.of("tick", reason="misfire")) >= 3


def test_a_new_term_does_not_repeat_a_fire_already_run(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    """A step-down with no gap: the new term finds the old term's claims and stops."""
    handler = rs.TaskHandler(stop_grace=2.0)
    runs = Runs()
    handler.interval(PERIOD, name="tick")(runs)  # type: ignore[arg-type]
    claimer = rs.MemoryClaimer()
    leader = leaders(handler, claimer=claimer)
    skipped = Recorder()
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        leader.start()
        for term in (1, 2, 3):
            wait_until(lambda t=term: len(runs.of_term(t)) >= 2, 10.0, f"runs in term {term}")
            if term < 3:
                leader.step_down()
        leader.stop(timeout=10)
    check_each_instant_once(runs, skipped)
    # Every run was claimed with its term, under the lease name; no claim without a run
    # or a skip report.
    claims = claimer.claims()
    for at, term in runs.items:
        assert claims[f"{leader.name}/" + rs.format_fire_key("tick", at)] == term


def test_two_leaders_sharing_claims_run_each_fire_once(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    """Two nodes that both lead (two single-node leaders) but share the claims."""
    claimer = rs.MemoryClaimer()
    runs = Runs()
    recorders = []
    for _ in range(2):
        handler = rs.TaskHandler(stop_grace=2.0)
        handler.interval(PERIOD, name="tick")(runs)  # type: ignore[arg-type]
        recorder = Recorder()
        signals.fire_skipped.connect(recorder, sender=handler)
        recorders.append((handler, recorder))
        leaders(handler, claimer=claimer).start()
    try:
        wait_until(lambda: len(runs.instants()) >= 10, 10.0, "ten runs")
    finally:
        for handler, recorder in recorders:
            signals.fire_skipped.disconnect(recorder, sender=handler)
    ran = runs.instants()
    assert len(ran) == len(set(ran)), "a fire ran on both nodes"
    lost = sum(len(r.of("tick", reason="already-claimed")) for _, r in recorders)
    # Both nodes competed: once the second one started, it lost each claim the first won
    # (or skipped that fire for another reported reason when the machine was busy).
    assert lost >= 5


# -- a scheduler that falls behind within a term --------------------------------------


class StallOnce:
    """An aligned interval schedule whose ``next_fire`` stalls once when armed."""

    aligned = True

    def __init__(self, every: float, stall: float) -> None:
        self.inner = rs.IntervalSchedule(every)
        self.stall = stall
        self.armed = threading.Event()
        self.stalled = threading.Event()
        self.after: datetime | None = None
        self.until: datetime | None = None

    def next_fire(self, after: datetime) -> datetime | None:
        if self.armed.is_set() and not self.stalled.is_set():
            self.after = after
            time.sleep(self.stall)
            self.until = datetime.now(UTC)
            self.stalled.set()
        return self.inner.next_fire(after)


def stall_scheduler(
    leaders: Callable[..., rs.SingleNodeLeader],
    misfire: str,
    *,
    grace: float = 60.0,
    stall: float = 0.55,
) -> tuple[Runs, Recorder, list[datetime]]:
    """Run a task, stall its scheduler once; return runs, skips and the instants that
    came due during the stall."""
    schedule = StallOnce(PERIOD, stall)
    runs = Runs()
    task = rs.GenericTask("tick", rs.TaskType.SCHEDULED, schedule)
    task.run = runs  # type: ignore[method-assign]
    handler = rs.TaskHandler(stop_grace=2.0)
    handler.register("tick", task, misfire=misfire, misfire_grace=grace)  # type: ignore[arg-type]
    leader = leaders(handler)
    skipped = Recorder()
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        leader.start()
        wait_until(lambda: len(runs.instants()) >= 2, 10.0, "two runs")
        schedule.armed.set()
        assert schedule.stalled.wait(10.0)
        count = len(runs.instants())
        wait_until(lambda: len(runs.instants()) >= count + 2, 10.0, "runs after the stall")
        leader.stop(timeout=10)
    assert schedule.after is not None and schedule.until is not None
    behind = [at for at in instants_between(schedule.after, schedule.until) if schedule.after < at]
    behind = [at for at in behind if at <= schedule.until]
    assert len(behind) >= 4
    return runs, skipped, behind


def test_within_a_term_latest_runs_only_the_newest(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    runs, skipped, behind = stall_scheduler(leaders, "latest")
    ran = set(runs.instants())
    assert sum(at in ran for at in behind) <= 1
    misfires = {c["scheduled_at"] for c in skipped.of("tick", reason="misfire")}
    assert len(misfires & set(behind)) >= len(behind) - 1


def test_within_a_term_all_runs_each_in_order(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    runs, skipped, behind = stall_scheduler(leaders, "all")
    ran = runs.instants()
    assert [at for at in ran if at in set(behind)] == behind
    assert skipped.of("tick", reason="misfire") == []


def test_within_a_term_skip_runs_only_the_on_time_fire(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    runs, skipped, behind = stall_scheduler(leaders, "skip")
    ran = set(runs.instants())
    # The newest fire due after the stall is on time (its successor is not due yet):
    # it runs; at most that one of the fires that came due during the stall.
    assert sum(at in ran for at in behind) <= 1
    assert set(ran) - set(behind[:-1]) == set(ran)
    misfires = {c["scheduled_at"] for c in skipped.of("tick", reason="misfire")}
    assert set(behind[:-1]) <= misfires


@pytest.mark.parametrize("misfire", ["latest", "skip"])
def test_a_fire_is_reported_missed_only_once_a_whole_period_behind(
    leaders: Callable[..., rs.SingleNodeLeader], misfire: str
) -> None:
    """Every fire skipped as a misfire was at least a period late when it was skipped;
    the on-time fire, found due along with missed ones, runs."""
    skipped_at: list[tuple[datetime, datetime]] = []

    def record(sender: object, **kwargs: Any) -> None:
        if kwargs["reason"] == "misfire":
            skipped_at.append((kwargs["scheduled_at"], datetime.now(UTC)))

    with signals.fire_skipped.connected_to(record):
        runs, _, behind = stall_scheduler(leaders, misfire)
    assert skipped_at, "the stall made no misfire"
    early = [(at.isoformat(), (when - at).total_seconds()) for at, when in skipped_at]
    assert all(when - at >= STEP for at, when in skipped_at), f"on-time fire skipped: {early}"
    # The first run after the stall is the newest fire then due, not its successor.
    after = min(at for at in runs.instants() if at > behind[0])
    assert after - STEP in {at for at, _ in skipped_at}
    assert after <= behind[-1] + STEP


class Slow:
    """A task that records each run's (scheduled_at, lateness at start) and then takes
    ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.items: list[tuple[datetime, float]] = []
        self._lock = threading.Lock()

    def started(self, ctx: rs.TaskContext) -> None:
        assert ctx.scheduled_at is not None
        with self._lock:
            self.items.append(
                (ctx.scheduled_at, (datetime.now(UTC) - ctx.scheduled_at).total_seconds())
            )

    def late(self) -> list[tuple[datetime, float]]:
        with self._lock:
            return list(self.items)


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_each_fire_of_a_catch_up_is_checked_against_the_grace_when_it_starts(
    leaders: Callable[..., rs.SingleNodeLeader], kind: str
) -> None:
    """misfire="all" runs missed fires one after another: a later one that ages past
    misfire_grace while the earlier ones run is skipped, not started late."""
    grace, run_for, gap = 0.8, 0.3, 0.7
    slow = Slow(run_for)
    handler = rs.TaskHandler(stop_grace=2.0)
    if kind == "def":

        def tick(ctx: rs.TaskContext) -> None:
            slow.started(ctx)
            if ctx.term == 2:  # the catch-up's runs take long
                ctx.sleep(run_for)

        handler.interval(PERIOD, name="tick", misfire="all", misfire_grace=grace)(tick)
    else:

        async def atick(ctx: rs.TaskContext) -> None:
            slow.started(ctx)
            if ctx.term == 2:
                await ctx.asleep(run_for)

        handler.interval(PERIOD, name="tick", misfire="all", misfire_grace=grace)(atick)
    leader = leaders(handler, claimer=rs.MemoryClaimer())
    skipped = Recorder()
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        leader.start()
        wait_until(lambda: len(slow.late()) >= 3, 10.0, "three runs in term 1")
        stepped = datetime.now(UTC)
        # About 0.7 s without a leader: term 2 catches up some six fires, the oldest
        # about 0.7 s late; with runs of 0.3 s the later ones pass the 0.8 s grace first.
        leader.step_down(hold=gap)
        wait_until(lambda: sum(at > stepped for at, _ in slow.late()) >= 3, 10.0, "runs in term 2")
        leader.stop(timeout=10)
    late = [(at.isoformat(), round(lateness, 3)) for at, lateness in slow.late()]
    # 50 ms between the check and the task's first line covers a busy machine.
    assert all(lateness <= grace + 0.05 for _, lateness in late), late
    missed = {c["scheduled_at"] for c in skipped.of("tick", reason="misfire")}
    assert {at for at, _ in slow.late()}.isdisjoint(missed)
    assert any(at > stepped for at in missed), ("no catch-up fire passed its grace", late)


# -- claims: failures, configuration ----------------------------------------------------


class FailingClaimer:
    """A claimer whose backend is down: every claim raises."""

    ttl = 600.0

    def __init__(self) -> None:
        self.calls = 0

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        self.calls += 1
        raise rs.BackendUnavailable("claims database unreachable")


def test_a_failed_claim_skips_the_fire(leaders: Callable[..., rs.SingleNodeLeader]) -> None:
    handler = rs.TaskHandler(stop_grace=2.0)
    runs = Runs()
    handler.interval(PERIOD, name="tick")(runs)  # type: ignore[arg-type]
    claimer = FailingClaimer()
    leader = leaders(handler, claimer=claimer)
    skipped = Recorder()
    with signals.fire_skipped.connected_to(skipped, sender=handler):
        leader.start()
        wait_until(
            lambda: len(skipped.of("tick", reason="claim-error")) >= 3, 10.0, "failed claims"
        )
        leader.stop(timeout=10)
    assert runs.instants() == []  # fail closed
    assert handler.health()["tick"]["runs"] == 0
    assert handler.health()["tick"]["skipped"] == len(skipped.of("tick"))


def test_an_unaligned_interval_is_rejected_with_claims() -> None:
    handler = rs.TaskHandler()
    task = rs.GenericTask("t", rs.TaskType.SCHEDULED, rs.IntervalSchedule(1.0, align=False))
    handler.register("t", task)
    with pytest.raises(rs.ConfigError, match="not aligned"):
        rs.SingleNodeLeader(handler, claimer=rs.MemoryClaimer())
    rs.SingleNodeLeader(handler)  # without claims it is fine
    start = datetime(2026, 1, 1, tzinfo=UTC)
    other = rs.TaskHandler()
    anchored = rs.IntervalSchedule(1.0, align=False, start=start)
    other.register("t", rs.GenericTask("t", rs.TaskType.SCHEDULED, anchored))
    rs.SingleNodeLeader(other, claimer=rs.MemoryClaimer())  # same start on every node


def test_a_grace_beyond_the_claim_ttl_is_rejected() -> None:
    handler = rs.TaskHandler()
    handler.interval(1.0, name="t", misfire_grace=120)(lambda ctx: None)
    with pytest.raises(rs.ConfigError, match="exceeds the claim ttl"):
        rs.SingleNodeLeader(handler, claimer=rs.MemoryClaimer(ttl=60))
    rs.SingleNodeLeader(handler, claimer=rs.MemoryClaimer(ttl=120))


def test_tasks_registered_after_the_leader_are_checked_at_start() -> None:
    handler = rs.TaskHandler()
    leader = rs.SingleNodeLeader(handler, claimer=rs.MemoryClaimer(ttl=10))
    handler.interval(1.0, name="t", misfire_grace=30)(lambda ctx: None)
    with pytest.raises(rs.ConfigError, match="misfire_grace"):
        leader.start()
    leader.stop(timeout=5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"misfire": "newest"}, "misfire must be one of"),
        ({"misfire_grace": 0}, "misfire_grace must be"),
        ({"misfire_grace": float("inf")}, "misfire_grace must be"),
        ({"misfire_grace": True}, "misfire_grace must be"),
        ({"misfire_grace": "60"}, "misfire_grace must be"),
    ],
)
def test_bad_misfire_options(options: dict[str, Any], message: str) -> None:
    handler = rs.TaskHandler()
    with pytest.raises(rs.ConfigError, match=message):
        handler.interval(1.0, **options)
    with pytest.raises(rs.ConfigError, match=message):
        handler.cron("* * * * *", **options)
    task = rs.GenericTask("t", rs.TaskType.SCHEDULED, rs.IntervalSchedule(1.0))
    with pytest.raises(rs.ConfigError, match=message):
        handler.register("t", task, **options)


def test_misfire_grace_accepts_a_timedelta() -> None:
    handler = rs.TaskHandler()
    handler.interval(1.0, name="t", misfire_grace=timedelta(minutes=2))(lambda ctx: None)
    with pytest.raises(rs.ConfigError, match=r"misfire_grace \(120 s\)"):
        rs.SingleNodeLeader(handler, claimer=rs.MemoryClaimer(ttl=60))


def test_memory_claimer_binds_until_its_ttl() -> None:
    claimer = rs.MemoryClaimer(ttl=0.2)
    assert claimer.claim("k", term=1)
    assert not claimer.claim("k", term=2)
    wait_until(lambda: "k" not in claimer.claims(), 5.0, "the claim to expire")
    assert claimer.claim("k", term=2)
    assert claimer.claims() == {"k": 2}
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(rs.ConfigError, match="ttl must be"):
            rs.MemoryClaimer(ttl=bad)  # type: ignore[arg-type]
    with pytest.raises(rs.ConfigError, match="fire_key"):
        claimer.claim("")


def test_memory_claimer_claims_missed_fires_after_the_newest_held() -> None:
    claimer = rs.MemoryClaimer()
    keys = [f"k{i}" for i in range(6)]
    assert claimer.claim("k1") and claimer.claim("k3")
    assert claimer.claim_missed(keys, term=2) == ["k4", "k5"]
    assert claimer.claim_missed(keys, term=3) == []
    assert claimer.claim("k2")  # before the newest held: not a missed fire


def test_claim_missed_walks_back_with_a_plain_claimer() -> None:
    """A claimer without claim_missed gets the same answer one claim at a time."""
    from rselection.claiming import claim_missed

    class Plain:
        ttl = 600.0

        def __init__(self) -> None:
            self.inner = rs.MemoryClaimer()

        def claim(self, fire_key: str, *, term: int | None = None) -> bool:
            return self.inner.claim(fire_key, term=term)

    plain = Plain()
    keys = [f"k{i}" for i in range(6)]
    assert plain.claim("k3")
    assert claim_missed(plain, keys, term=1) == ["k4", "k5"]


class CountingClaimer(rs.MemoryClaimer):
    """A memory claimer that counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        self.calls.append("claim")
        return super().claim(fire_key, term=term)

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        self.calls.append("claim_missed")
        return super().claim_missed(fire_keys, term=term)


def test_lease_claims_prefix_every_key_with_the_lease_name() -> None:
    from rselection.claiming import LeaseClaims

    inner = rs.MemoryClaimer()
    billing, reports = LeaseClaims(inner, "billing"), LeaseClaims(inner, "reports")
    assert billing.ttl == inner.ttl
    assert billing.claim("tick@t1", term=1)
    assert not billing.claim("tick@t1", term=2)
    assert reports.claim("tick@t1", term=1)  # same task and fire, another lease
    assert billing.claim_missed(["tick@t0", "tick@t1", "tick@t2"], term=3) == ["tick@t2"]
    assert inner.claims() == {"billing/tick@t1": 1, "reports/tick@t1": 1, "billing/tick@t2": 3}


def test_lease_claims_of_leases_with_a_slash_in_the_name_never_collide() -> None:
    """Lease "jobs" task "eu/purge" and lease "jobs/eu" task "purge" claim apart: the
    lease name's "/" (and "%") are percent-encoded in the claim key."""
    from rselection.claiming import LeaseClaims

    inner = rs.MemoryClaimer()
    jobs, jobs_eu = LeaseClaims(inner, "jobs"), LeaseClaims(inner, "jobs/eu")
    assert jobs.claim("eu/purge@t1", term=1)
    assert jobs_eu.claim("purge@t1", term=1)  # another lease's fire: not already claimed
    assert jobs_eu.claim_missed(["purge@t1", "purge@t2"], term=2) == ["purge@t2"]
    percent = LeaseClaims(inner, "jobs%2Feu")  # a name that looks encoded stays apart
    assert percent.claim("purge@t1", term=1)
    assert set(inner.claims()) == {
        "jobs/eu/purge@t1",
        "jobs%2Feu/purge@t1",
        "jobs%2Feu/purge@t2",
        "jobs%252Feu/purge@t1",
    }


def test_lease_claims_use_the_claimers_own_claim_missed_in_one_call() -> None:
    from rselection.claiming import LeaseClaims

    inner = CountingClaimer()
    claims = LeaseClaims(inner, "l")
    assert claims.claim_missed([f"k{i}" for i in range(5)], term=1) == [f"k{i}" for i in range(5)]
    assert inner.calls == ["claim_missed"]


def test_lease_claims_fall_back_to_one_claim_per_missed_fire() -> None:
    """A claimer without claim_missed (any FireClaimer) still catches up missed fires."""
    from rselection.claiming import LeaseClaims

    class Plain:
        ttl = 600.0

        def __init__(self) -> None:
            self.inner = rs.MemoryClaimer()

        def claim(self, fire_key: str, *, term: int | None = None) -> bool:
            return self.inner.claim(fire_key, term=term)

    plain = Plain()
    assert plain.claim("l/k1")
    claims = LeaseClaims(plain, "l")
    assert claims.claim_missed([f"k{i}" for i in range(4)], term=2) == ["k2", "k3"]
    assert plain.inner.claims() == {"l/k1": None, "l/k2": 2, "l/k3": 2}


def test_a_leader_catches_up_missed_fires_through_a_plain_claimer() -> None:
    """The misfire catch-up works with a claimer that only has claim(): the core walks
    back one fire at a time."""

    class Plain:
        ttl = 600.0

        def __init__(self) -> None:
            self.inner = rs.MemoryClaimer()

        def claim(self, fire_key: str, *, term: int | None = None) -> bool:
            return self.inner.claim(fire_key, term=term)

    handler = rs.TaskHandler(stop_grace=2.0)
    runs = Runs()
    handler.interval(PERIOD, name="tick", misfire="all")(runs)  # type: ignore[arg-type]
    plain = Plain()
    # A fire key claimed long before: every fire after it within the grace is missed.
    started = datetime.now(UTC)
    schedule = handler.spec("tick").schedule
    assert schedule is not None
    old = fires(schedule, started - timedelta(seconds=1), until=started)
    assert len(old) >= 3
    assert plain.claim("single-node/" + rs.format_fire_key("tick", old[0]), term=1)
    leader = rs.SingleNodeLeader(handler, claimer=plain)
    try:
        leader.start()
        wait_until(lambda: len(runs.items) >= len(old), 10.0, "the missed fires to run")
    finally:
        leader.stop(timeout=10)
    # Every fire after the one held ran, oldest first; the held one did not run again.
    assert [at for at, _ in runs.items if at <= started] == old[1:]


# -- the pure policy functions --------------------------------------------------------


def test_due_fires_lists_every_fire_due_and_drops_beyond_the_cap() -> None:
    from rselection.misfire import MAX_SCAN, due_fires

    every = rs.IntervalSchedule(1)
    first = datetime(2026, 1, 1, tzinfo=UTC)
    due, dropped = due_fires(every, first, first + timedelta(seconds=2.5))
    assert due == [first, first + timedelta(seconds=1), first + timedelta(seconds=2)]
    assert dropped == []
    due, dropped = due_fires(every, first, first + timedelta(seconds=MAX_SCAN + 9))
    assert len(due) == MAX_SCAN and len(dropped) == 10
    assert dropped[-1] + timedelta(seconds=1) == due[0]  # nothing lost between them


def test_window_holds_the_fires_within_the_grace() -> None:
    from rselection.misfire import window

    started = datetime(2026, 1, 1, 0, 0, 10, 500_000, tzinfo=UTC)
    fires = window(rs.IntervalSchedule(1), started, grace=3)
    assert [f.second for f in fires] == [8, 9, 10]  # 7.5 .. 10.5, oldest first
    assert window(rs.IntervalSchedule(60), started, grace=3) == []


def test_split_by_policy() -> None:
    from rselection.misfire import MAX_CATCH_UP, split_by_policy

    missed = [datetime(2026, 1, 1, 0, 0, s, tzinfo=UTC) for s in range(5)]
    assert split_by_policy("latest", missed) == (missed[-1:], missed[:-1])
    assert split_by_policy("all", missed) == (missed, [])
    assert split_by_policy("skip", missed) == ([], missed)
    many = [missed[0] + timedelta(seconds=i) for i in range(MAX_CATCH_UP + 3)]
    assert split_by_policy("all", many) == (many[3:], many[:3])


def test_a_task_that_never_ran_starts_at_its_next_instant_and_reports_nothing(
    leaders: Callable[..., rs.SingleNodeLeader],
) -> None:
    """A first start is no outage: no catch-up and no misfire, with claims as without."""
    for claimer in (rs.MemoryClaimer(), None):
        handler = rs.TaskHandler(stop_grace=2.0)
        runs = Runs()
        handler.interval(PERIOD, name="tick", misfire_grace=5.0)(runs)  # type: ignore[arg-type]
        leader = leaders(handler, claimer=claimer)
        skipped = Recorder()
        with signals.fire_skipped.connected_to(skipped, sender=handler):
            started = datetime.now(UTC)
            leader.start()
            wait_until(lambda r=runs: len(r.instants()) >= 3, 10.0, "three runs")
            leader.stop(timeout=10)
        assert skipped.of("tick", reason="misfire") == [], claimer
        assert min(runs.instants()) > started, claimer


def test_memory_claimer_remembers_each_task_that_ran_and_forgets_expired_claims() -> None:
    claimer = rs.MemoryClaimer(ttl=0.05)
    keys = [
        rs.format_fire_key("a/tick", datetime(2026, 1, 1, second=i, tzinfo=UTC)) for i in range(5)
    ]
    assert not claimer.ran_before("a/tick@")
    assert claimer.claim_missed(keys[:3]) == keys[:3] and claimer.claim(keys[3])
    assert claimer.claim("not-a-fire-key")
    assert claimer.ran_before("a/tick@") and not claimer.ran_before("a/tock@")
    wait_until(lambda: claimer.claims() == {}, 5.0, "the claims to expire")
    assert claimer.cleanup(batch=2) == 2
    assert claimer.cleanup() == 3
    assert claimer.cleanup() == 0
    assert claimer.ran_before("a/tick@")  # kept beyond the claims' ttl
