"""Prometheus metrics for leadership, lease renewals, tasks, fires and broadcasters.

Off by default and free while off: importing this module imports nothing from
``prometheus_client`` and connects no receiver, so no signal does any extra work.
:func:`enable` (extra ``prometheus``: ``pip install 'rselection[prometheus]'``) creates
the collectors, registers them and connects receivers to :mod:`rselection.signals`;
:func:`disable` undoes all of it. Labels are lease and task names, never node ids.

Every metric, what it measures, and an example: ``docs/how-to/metrics.md``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from . import signals

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.metrics_core import Metric

    from .broadcast import Broadcaster

__all__ = [
    "DURATION_BUCKETS",
    "RENEW_LATENCY_BUCKETS",
    "REMAINING_BUCKETS",
    "Metrics",
    "disable",
    "enable",
    "enabled",
    "watch_broadcaster",
]

logger = logging.getLogger(__name__)

_C = TypeVar("_C")

RENEW_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Buckets of the renewal latency histogram (seconds): one statement, usually a few ms."""

REMAINING_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 10.0, 15.0, 30.0, 60.0)
"""Buckets of the lease-remaining histogram (seconds), around the default renew_deadline."""

DURATION_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    1800.0,
)
"""Buckets of the task duration histogram (seconds); persistent runs land in the top ones."""

_lock = threading.Lock()
_active: Metrics | None = None

# The signals the metrics follow; each one's receiver is the method ``_on_<signal>``.
_EVENTS = (
    "started",
    "elected",
    "demoted",
    "leader_changed",
    "lease_renewed",
    "task_started",
    "task_failed",
    "task_finished",
    "task_stuck",
    "fire_skipped",
    "node_joined",
    "node_lost",
)


class Metrics:
    """The collectors of one :func:`enable` call and the receivers that feed them.

    Built by :func:`enable`; read its attributes to reach a collector directly (for
    example ``metrics.task_runs.labels(task="purge")``).

    Args:
        registry: where the collectors are registered.
        namespace: prefix of every metric name.
    """

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = registry
        self.namespace = namespace
        # Registered together by _start(), not each on creation (registry=None).
        self._collectors: list[Any] = []

        def made(collector: _C) -> _C:
            self._collectors.append(collector)
            return collector

        def gauge(name: str, doc: str, labels: list[str]) -> Gauge:
            return made(Gauge(name, doc, labels, namespace=namespace, registry=None))

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return made(Counter(name, doc, labels, namespace=namespace, registry=None))

        def histogram(
            name: str, doc: str, labels: list[str], buckets: tuple[float, ...]
        ) -> Histogram:
            return made(
                Histogram(name, doc, labels, namespace=namespace, buckets=buckets, registry=None)
            )

        self.is_leader: Gauge = gauge(
            "is_leader",
            "1 while a leader in this process leads the lease, 0 while it only follows.",
            ["lease"],
        )
        self.term: Gauge = gauge(
            "term", "Highest fencing term of the lease seen by this process.", ["lease"]
        )
        self.transitions: Counter = counter(
            "leadership_transitions",
            "Leadership changes of this process: elected, or the reason it stopped leading.",
            ["lease", "reason"],
        )
        self.renew_latency: Histogram = histogram(
            "lease_renew_latency_seconds",
            "Round trip of each successful lease renewal.",
            ["lease"],
            RENEW_LATENCY_BUCKETS,
        )
        self.remaining: Histogram = histogram(
            "lease_remaining_seconds",
            "Time left before the leader's own deadline, right after each renewal.",
            ["lease"],
            REMAINING_BUCKETS,
        )
        self.task_runs: Counter = counter("task_runs", "Task runs started.", ["task"])
        self.task_failures: Counter = counter("task_failures", "Task runs that raised.", ["task"])
        self.task_stuck: Counter = counter(
            "task_stuck",
            "Task runs still going stop_grace after their term was cancelled.",
            ["task"],
        )
        self.task_duration: Histogram = histogram(
            "task_duration_seconds", "Run time of each task run.", ["task"], DURATION_BUCKETS
        )
        self.fires_skipped: Counter = counter(
            "fires_skipped", "Scheduled fires that did not run, by reason.", ["task", "reason"]
        )
        self.nodes_joined: Counter = counter(
            "nodes_joined",
            "Nodes of the lease that came alive, as seen by a heartbeat monitor here.",
            ["lease"],
        )
        self.nodes_lost: Counter = counter(
            "nodes_lost",
            "Nodes of the lease that stopped heartbeating, as seen by a monitor here.",
            ["lease"],
        )
        self._broadcasts = made(_BroadcastCollector(namespace))
        self._dropped = made(_DroppedCollector(namespace))
        self._state_lock = threading.Lock()
        self._leading: dict[str, set[tuple[int, str]]] = {}
        self._terms: dict[str, int] = {}
        self._connected: list[tuple[Any, Any]] = []

    # -- lifecycle ------------------------------------------------------------------

    def _start(self) -> None:
        registered: list[Any] = []
        try:
            for collector in self._collectors:
                self.registry.register(collector)
                registered.append(collector)
        except ValueError:
            for collector in registered:
                self.registry.unregister(collector)
            raise
        for event in _EVENTS:
            # Strong references: the receivers must live exactly until disable().
            signal, receiver = getattr(signals, event), getattr(self, f"_on_{event}")
            signal.connect(receiver, weak=False)
            self._connected.append((signal, receiver))

    def _stop(self) -> None:
        for signal, receiver in self._connected:
            signal.disconnect(receiver)
        self._connected.clear()
        for collector in self._collectors:
            try:
                self.registry.unregister(collector)
            except KeyError:  # the caller unregistered it already
                logger.debug("collector %r was not registered", collector)

    def watch_broadcaster(self, broadcaster: Broadcaster, name: str) -> None:
        """Report ``broadcaster``'s overflows and subscribers under ``name``."""
        self._broadcasts.watch(broadcaster, name)

    # -- receivers (run in the thread that sends; keep them short) --------------------

    def _on_started(self, sender: object, **kw: Any) -> None:
        # A follower exports 0 at once: an alert on the sum over the fleet sees every node.
        lease = str(kw["name"])
        with self._state_lock:
            self.is_leader.labels(lease=lease).set(1 if self._leading.get(lease) else 0)

    def _on_elected(self, sender: object, **kw: Any) -> None:
        lease = str(kw["name"])
        with self._state_lock:
            self._leading.setdefault(lease, set()).add((id(sender), str(kw["node_id"])))
            self._see_term(lease, int(kw["term"]))
            self.is_leader.labels(lease=lease).set(1)
        self.transitions.labels(lease=lease, reason="elected").inc()
        broadcaster = getattr(sender, "broadcaster", None)
        if broadcaster is not None and callable(getattr(broadcaster, "stats", None)):
            self._broadcasts.watch(broadcaster, lease, replace=False)

    def _on_demoted(self, sender: object, **kw: Any) -> None:
        lease = str(kw["name"])
        with self._state_lock:
            holders = self._leading.setdefault(lease, set())
            holders.discard((id(sender), str(kw["node_id"])))
            self.is_leader.labels(lease=lease).set(1 if holders else 0)
        self.transitions.labels(lease=lease, reason=str(kw["reason"])).inc()

    def _on_leader_changed(self, sender: object, **kw: Any) -> None:
        info = kw.get("leader")
        if info is None:
            return
        with self._state_lock:
            self._see_term(str(kw["name"]), int(info.term))

    def _see_term(self, lease: str, term: int) -> None:
        # Terms never decrease; observations from several nodes of one process may
        # arrive out of order, so keep the highest.
        if term > self._terms.get(lease, -1):
            self._terms[lease] = term
            self.term.labels(lease=lease).set(term)

    def _on_lease_renewed(self, sender: object, **kw: Any) -> None:
        lease = str(kw["name"])
        self.renew_latency.labels(lease=lease).observe(float(kw["latency"]))
        self.remaining.labels(lease=lease).observe(float(kw["remaining"]))

    def _on_task_started(self, sender: object, **kw: Any) -> None:
        self.task_runs.labels(task=str(kw["task"])).inc()

    def _on_task_failed(self, sender: object, **kw: Any) -> None:
        self.task_failures.labels(task=str(kw["task"])).inc()

    def _on_task_finished(self, sender: object, **kw: Any) -> None:
        self.task_duration.labels(task=str(kw["task"])).observe(float(kw["duration"]))

    def _on_task_stuck(self, sender: object, **kw: Any) -> None:
        self.task_stuck.labels(task=str(kw["task"])).inc()

    def _on_fire_skipped(self, sender: object, **kw: Any) -> None:
        self.fires_skipped.labels(task=str(kw["task"]), reason=str(kw["reason"])).inc()

    def _on_node_joined(self, sender: object, **kw: Any) -> None:
        self.nodes_joined.labels(lease=str(kw["name"])).inc()

    def _on_node_lost(self, sender: object, **kw: Any) -> None:
        self.nodes_lost.labels(lease=str(kw["name"])).inc()


class _DroppedCollector:
    """Reads the count of dropped notifications at scrape time."""

    def __init__(self, namespace: str) -> None:
        self._name = f"{namespace}_notifications_dropped" if namespace else "notifications_dropped"

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        return CounterMetricFamily(
            self._name,
            "Notifications on rselection's channels that rselection does not send, dropped.",
        )

    def collect(self) -> Iterator[Metric]:
        from .postgres.notices import dropped

        family = self._family()
        family.add_metric([], dropped.count)
        yield family


class _BroadcastCollector:
    """Reads broadcasters' stats at scrape time, so publishing costs nothing extra."""

    def __init__(self, namespace: str) -> None:
        self._prefix = f"{namespace}_" if namespace else ""
        self._lock = threading.Lock()
        # Weak: watching a broadcaster must not keep it (and its buffers) alive.
        self._watched: weakref.WeakKeyDictionary[Broadcaster, str] = weakref.WeakKeyDictionary()

    def watch(self, broadcaster: Broadcaster, name: str, *, replace: bool = True) -> None:
        with self._lock:
            if replace or broadcaster not in self._watched:
                self._watched[broadcaster] = name

    def describe(self) -> Iterable[Metric]:
        # Names only, so registering never reads a broadcaster.
        return list(self._families())

    def _families(self) -> tuple[Any, Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        overflowed = CounterMetricFamily(
            f"{self._prefix}broadcast_overflowed",
            "Messages dropped because a subscription's buffer was full.",
            labels=["broadcaster"],
        )
        subscribers = GaugeMetricFamily(
            f"{self._prefix}broadcast_subscribers",
            "Open subscriptions per channel.",
            labels=["broadcaster", "channel"],
        )
        return overflowed, subscribers

    def collect(self) -> Iterator[Metric]:
        overflowed, subscribers = self._families()
        with self._lock:
            watched = list(self._watched.items())
        totals: dict[str, float] = {}
        channels: dict[tuple[str, str], float] = {}
        for broadcaster, name in watched:
            stats = broadcaster.stats()
            totals[name] = totals.get(name, 0.0) + stats.overflowed
            for channel, subs in stats.subscribers.items():
                channels[(name, channel)] = channels.get((name, channel), 0.0) + subs
        for name, total in sorted(totals.items()):
            overflowed.add_metric([name], total)
        for (name, channel), value in sorted(channels.items()):
            subscribers.add_metric([name, channel], value)
        yield overflowed
        yield subscribers


def enable(registry: CollectorRegistry | None = None, *, namespace: str = "rselection") -> Metrics:
    """Create the collectors, register them and start feeding them from the signals.

    Calling it again with the same registry returns the active :class:`Metrics`.

    Args:
        registry: a ``prometheus_client.CollectorRegistry`` (default: the global
            ``prometheus_client.REGISTRY``).
        namespace: prefix of every metric name (default ``"rselection"``).

    Raises:
        ImportError: prometheus-client is not installed (extra ``prometheus``).
        RuntimeError: metrics are already enabled on another registry.
        ValueError: the registry already holds metrics with these names.
    """
    global _active
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "rselection.metrics needs prometheus-client: pip install 'rselection[prometheus]'"
        ) from exc
    target = registry if registry is not None else prometheus_client.REGISTRY
    with _lock:
        if _active is not None:
            if _active.registry is target and _active.namespace == namespace:
                return _active
            raise RuntimeError(
                "rselection metrics are already enabled on another registry or namespace; "
                "call rselection.metrics.disable() first"
            )
        metrics = Metrics(target, namespace)
        metrics._start()
        _active = metrics
    logger.debug("rselection metrics enabled (namespace %r)", namespace)
    return metrics


def disable() -> None:
    """Disconnect every receiver and unregister the collectors; a no-op when disabled."""
    global _active
    with _lock:
        metrics, _active = _active, None
    if metrics is not None:
        metrics._stop()
        logger.debug("rselection metrics disabled")


def enabled() -> Metrics | None:
    """The active :class:`Metrics`, or ``None`` while metrics are off."""
    return _active


def watch_broadcaster(broadcaster: Broadcaster, name: str = "default") -> None:
    """Report ``broadcaster``'s overflow count and subscribers under ``name``.

    The broadcaster of every leader elected while metrics are on is watched by itself
    (under the lease name); call this for any other one. Broadcasters are held weakly.

    Raises:
        RuntimeError: metrics are off; call :func:`enable` first.
    """
    metrics = _active
    if metrics is None:
        raise RuntimeError("rselection metrics are off; call rselection.metrics.enable() first")
    metrics.watch_broadcaster(broadcaster, name)
