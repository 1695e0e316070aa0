"""rselection.metrics against a real prometheus_client registry under a SingleNodeLeader."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import rselection as rs
import rselection.metrics as metrics
from rselection import signals
from tests.support.waiting import wait_until

ALL_SIGNALS = [getattr(signals, name) for name in signals.__all__ if name != "namespace"]


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A private registry with metrics enabled on it; metrics are off again afterwards."""
    reg = CollectorRegistry()
    metrics.enable(registry=reg)
    try:
        yield reg
    finally:
        metrics.disable()


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value, 0 when it does not exist (yet)."""
    found = reg.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_enable_connects_receivers_and_disable_removes_every_one() -> None:
    before = {s.name: len(s.receivers) for s in ALL_SIGNALS}
    reg = CollectorRegistry()
    active = metrics.enable(registry=reg)
    try:
        assert metrics.enabled() is active
        assert metrics.enable(registry=reg) is active  # same registry: the same metrics
        with pytest.raises(RuntimeError, match="already enabled"):
            metrics.enable(registry=CollectorRegistry())
        for s in ALL_SIGNALS:
            assert len(s.receivers) == before[s.name] + 1, s.name
        assert b"rselection_is_leader" in generate_latest(reg)
    finally:
        metrics.disable()
    assert metrics.enabled() is None
    assert {s.name: len(s.receivers) for s in ALL_SIGNALS} == before
    assert generate_latest(reg) == b""
    metrics.disable()  # a second disable is a no-op
    # Enabling again on the same registry works: the old collectors are gone from it.
    metrics.enable(registry=reg)
    metrics.disable()


def test_leadership_tasks_and_skips_under_a_single_node_leader(
    registry: CollectorRegistry,
) -> None:
    tasks = rs.TaskHandler(stop_grace=2.0)
    release = threading.Event()

    @tasks.interval(0.05, name="slow")
    def slow(ctx: rs.TaskContext) -> None:
        # Outlives its period, so the next fires are skipped as overlapping.
        release.wait(0.3)

    @tasks.interval(0.05, name="boom")
    def boom(ctx: rs.TaskContext) -> None:
        raise ValueError("boom")

    @tasks.persistent("steady", restart="never")
    def steady(ctx: rs.TaskContext) -> None:
        ctx.sleep(0.02)

    leader = rs.SingleNodeLeader(tasks, name="metrics-lease")
    with leader:
        assert leader.wait_until_leader(5)
        wait_until(lambda: value(registry, "rselection_is_leader", lease="metrics-lease") == 1)
        assert value(registry, "rselection_term", lease="metrics-lease") == 1
        wait_until(
            lambda: value(registry, "rselection_task_failures_total", task="boom") >= 2,
            10,
            "two failures of boom",
        )
        wait_until(
            lambda: (
                value(registry, "rselection_fires_skipped_total", task="slow", reason="overlap")
                >= 1
            ),
            10,
            "an overlap skip of slow",
        )
        leader.step_down()
        assert leader.wait_until_leader(5)
        wait_until(lambda: value(registry, "rselection_term", lease="metrics-lease") == 2)
        release.set()
    lease = {"lease": "metrics-lease"}
    assert value(registry, "rselection_is_leader", **lease) == 0
    assert (
        value(registry, "rselection_leadership_transitions_total", reason="elected", **lease) == 2
    )
    assert (
        value(registry, "rselection_leadership_transitions_total", reason="step_down", **lease) == 1
    )
    assert (
        value(registry, "rselection_leadership_transitions_total", reason="stopped", **lease) == 1
    )

    health = tasks.health()
    for name in ("slow", "boom", "steady"):
        assert value(registry, "rselection_task_runs_total", task=name) == health[name]["runs"]
        # Every run was timed, including the ones that raised.
        assert (
            value(registry, "rselection_task_duration_seconds_count", task=name)
            == (health[name]["runs"])
        )
    assert (
        value(registry, "rselection_task_failures_total", task="boom") == health["boom"]["failures"]
    )
    assert value(registry, "rselection_task_failures_total", task="slow") == 0
    # steady ran once per term: about 20 ms in term 1; term 2 ended while it slept.
    assert value(registry, "rselection_task_runs_total", task="steady") == 2
    assert value(registry, "rselection_task_duration_seconds_sum", task="steady") >= 0.018
    assert value(registry, "rselection_task_duration_seconds_bucket", task="steady", le="0.01") <= 1


def test_async_task_runs_are_timed(registry: CollectorRegistry) -> None:
    tasks = rs.TaskHandler()
    done = threading.Event()

    @tasks.persistent("waiter", restart="never")
    async def waiter(ctx: rs.TaskContext) -> None:
        await asyncio.sleep(0.05)
        done.set()

    with rs.SingleNodeLeader(tasks, name="async-lease"):
        assert done.wait(5)
        wait_until(
            lambda: value(registry, "rselection_task_duration_seconds_count", task="waiter") == 1
        )
    assert value(registry, "rselection_task_duration_seconds_sum", task="waiter") >= 0.04


def test_nothing_is_recorded_while_off() -> None:
    tasks = rs.TaskHandler()
    ran = threading.Event()

    @tasks.persistent("once", restart="never")
    def once(ctx: rs.TaskContext) -> None:
        ran.set()

    with rs.SingleNodeLeader(tasks, name="off-lease"):
        assert ran.wait(5)
    assert metrics.enabled() is None
    assert not signals.task_finished.receivers  # no receiver connected while off


def test_lease_renewals_feed_latency_and_remaining(registry: CollectorRegistry) -> None:
    leader = rs.SingleNodeLeader(rs.TaskHandler(), name="renew-lease")
    signals.lease_renewed.send(leader, name="renew-lease", term=1, latency=0.003, remaining=9.5)
    signals.lease_renewed.send(leader, name="renew-lease", term=1, latency=0.2, remaining=2.5)
    lease = {"lease": "renew-lease"}
    assert value(registry, "rselection_lease_renew_latency_seconds_count", **lease) == 2
    assert (
        value(registry, "rselection_lease_renew_latency_seconds_bucket", le="0.005", **lease) == 1
    )
    assert value(registry, "rselection_lease_remaining_seconds_sum", **lease) == pytest.approx(12.0)
    assert value(registry, "rselection_lease_remaining_seconds_bucket", le="3.0", **lease) == 1


def test_broadcaster_overflows_and_subscribers(registry: CollectorRegistry) -> None:
    leaders_own = rs.Broadcaster()
    other = rs.Broadcaster()
    metrics.watch_broadcaster(other, "side")
    started = threading.Event()

    @(tasks := rs.TaskHandler()).persistent("idle", restart="never")
    def idle(ctx: rs.TaskContext) -> None:
        started.set()

    with rs.SingleNodeLeader(tasks, name="bus-lease", broadcaster=leaders_own):
        assert started.wait(5)
        sub = leaders_own.subscribe("events", maxsize=1)
        for n in range(4):
            leaders_own.publish("events", n)
        side = other.subscribe("alerts", maxsize=2)
        for n in range(3):
            other.publish("alerts", n)
        # The leader's broadcaster is watched by itself, under the lease name, once the
        # elected signal is out (it follows the start of the term's tasks).
        wait_until(
            lambda: (
                value(registry, "rselection_broadcast_overflowed_total", broadcaster="bus-lease")
                == 3
            ),
            5,
            "the leader's broadcaster in the scrape",
        )
        assert value(registry, "rselection_broadcast_overflowed_total", broadcaster="side") == 1
        assert (
            value(
                registry,
                "rselection_broadcast_subscribers",
                broadcaster="bus-lease",
                channel="events",
            )
            == 1
        )
        sub.close()
        side.close()
    assert (
        value(registry, "rselection_broadcast_subscribers", broadcaster="side", channel="alerts")
        == 0
    )
    del other, side
    # Watched broadcasters are held weakly: a dropped one leaves the scrape.
    gc.collect()
    gone = registry.get_sample_value(
        "rselection_broadcast_overflowed_total", {"broadcaster": "side"}
    )
    assert gone is None


def test_watch_broadcaster_needs_metrics_on() -> None:
    with pytest.raises(RuntimeError, match="enable"):
        metrics.watch_broadcaster(rs.Broadcaster())


def test_membership_signals_count_nodes(registry: CollectorRegistry) -> None:
    node: Any = object()
    signals.node_joined.send(None, name="fleet", node=node)
    signals.node_joined.send(None, name="fleet", node=node)
    signals.node_lost.send(None, name="fleet", node=node)
    assert value(registry, "rselection_nodes_joined_total", lease="fleet") == 2
    assert value(registry, "rselection_nodes_lost_total", lease="fleet") == 1


def test_namespace_prefixes_every_name() -> None:
    reg = CollectorRegistry()
    metrics.enable(registry=reg, namespace="billing")
    try:
        text = generate_latest(reg).decode()
    finally:
        metrics.disable()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names and all(n.startswith("billing_") for n in names), names


def test_a_follower_exports_is_leader_0_from_its_start_so_a_headless_lease_alerts(
    registry: CollectorRegistry,
) -> None:
    from rselection.memory import MemoryLease

    lease = MemoryLease(name="alerting", ttl=3.0)
    outside = lease.try_acquire("another-process")  # the holder lives elsewhere
    assert outside.holder is not None
    follower = rs.LeaseLeader(
        lease,
        rs.TaskHandler(),
        node_id="follower",
        renew_interval=0.2,
        renew_deadline=1.0,
        retry_interval=0.2,
    )
    name = "rselection_is_leader"
    assert registry.get_sample_value(name, {"lease": "alerting"}) is None
    follower.start()
    try:
        # Exported at once, before any election: `sum by (lease) (...) == 0` sees it.
        assert registry.get_sample_value(name, {"lease": "alerting"}) == 0.0
        assert not follower.is_leader
        lease.release("another-process", outside.holder.term)
        wait_until(lambda: value(registry, name, lease="alerting") == 1.0, 10, "elected")
    finally:
        follower.stop(timeout=10)
    assert registry.get_sample_value(name, {"lease": "alerting"}) == 0.0


def test_dropped_notifications_are_counted(registry: CollectorRegistry) -> None:
    from rselection.postgres.notices import lease_notice

    before = value(registry, "rselection_notifications_dropped_total")
    for payload in ("[" * 7990, "not json", '{"event": "forged"}'):
        assert lease_notice("rselection:public.rselection_leases:x", payload, 1) is None
    assert value(registry, "rselection_notifications_dropped_total") == before + 3
