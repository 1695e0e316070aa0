"""One leader conformance suite, run on every lease backend.

In-process scenarios (:class:`rselection.testing.LeaderConformance`: election and
agreement, a renewing leader keeps its lease beyond the ttl, a leader whose renewals stop
is replaced at expiry and not before, prompt graceful handover with a higher term, the
old term's tasks joined before the next term starts, terms that strictly grow, step-down
with a hold, a free lease after stop) run on ``PostgresLeader``, ``RedisLeader`` and a
``LeaseLeader`` over an example backend of a user's own (:mod:`tests.support.file_lease`,
a lease kept in a file). A backend of yours passes the same suite: subclass
``LeaderConformance`` in a test module and implement ``make_lease(name)``, as
``TestFileLease`` below does. The suite fails leases that could give two leaders or none
(:mod:`tests.support.broken_leases`) and passes one whose terms grow by 2.

Fleet scenarios run on Postgres and Redis: real node processes (``python -m
rselection.commands.demo_fleet --backend ...``) that write a fenced ledger and report
their task activity, through kill -9 failover, a leader paused beyond its ttl, a server
restart and slow renewals; each ends by checking that no write of an older term came
after a write of a newer term, and that no task of one term ran while a task of another
term ran. A fenced write of an old term is refused after a takeover on both.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.commands.demo_fleet import Fleet
from rselection.testing import LeaderConformance
from tests.support import activity
from tests.support.backends import Backend
from tests.support.broken_leases import (
    ExpiresEarly,
    HonestLease,
    NeverExpires,
    RenewNeverExtends,
    TermsSkip,
)
from tests.support.file_lease import FileLease
from tests.support.pg import with_host_port
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_until

BACKENDS = ["postgres", "redis"]
FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}
FAST_ARGS = [
    "--ttl",
    "3",
    "--renew-interval",
    "0.5",
    "--renew-deadline",
    "2",
    "--retry-interval",
    "0.5",
]


# -- the in-process suite on every backend ---------------------------------------------


class TestFileLease(LeaderConformance):
    """A LeaseLeader over a backend of a user's own: a lease kept in a file."""

    @pytest.fixture(autouse=True)
    def directory(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def make_lease(self, name: str) -> rs.LeaseBackend:
        return FileLease(self.tmp_path, name, ttl=self.timings.ttl)


class TestPostgresLeader(LeaderConformance):
    """PostgresLeader, the factory over PostgresLease."""

    @pytest.fixture(autouse=True)
    def server(self, pg_dsn: str) -> Iterator[None]:
        self.dsn = pg_dsn
        yield
        self.stop_leaders()  # before the test's schema is dropped

    def make_leader(self, name: str, handler: rs.TaskHandler, *, node_id: str) -> rs.LeaseLeader:
        from rselection.postgres import PostgresLeader

        t = self.timings
        return PostgresLeader(
            self.dsn,
            handler,
            name=name,
            node_id=node_id,
            ttl=t.ttl,
            renew_interval=t.renew_interval,
            renew_deadline=t.renew_deadline,
            retry_interval=t.retry_interval,
        )


class TestRedisLeader(LeaderConformance):
    """RedisLeader, the factory over RedisLease."""

    @pytest.fixture(autouse=True)
    def server(self, redis_url: str) -> Iterator[None]:
        self.url = redis_url
        yield
        self.stop_leaders()

    def make_leader(self, name: str, handler: rs.TaskHandler, *, node_id: str) -> rs.LeaseLeader:
        from rselection.redis import RedisLeader

        t = self.timings
        return RedisLeader(
            self.url,
            handler,
            name=name,
            node_id=node_id,
            ttl=t.ttl,
            renew_interval=t.renew_interval,
            renew_deadline=t.renew_deadline,
            retry_interval=t.retry_interval,
        )


# -- the suite fails broken leases -------------------------------------------------------


class TestTermsThatSkip(LeaderConformance):
    """A correct lease whose terms grow by 2 (a global revision counter, as etcd's)."""

    def make_lease(self, name: str) -> rs.LeaseBackend:
        return TermsSkip(name, self.timings.ttl)


def suite_over(lease: type[HonestLease]) -> LeaderConformance:
    """The conformance suite over ``lease``, to run one scenario by hand."""

    class Suite(LeaderConformance):
        def make_lease(self, name: str) -> rs.LeaseBackend:
            return lease(name, self.timings.ttl)

    return Suite()


@pytest.mark.parametrize(
    ("lease", "scenario", "failure"),
    [
        pytest.param(
            RenewNeverExtends,
            "test_a_renewing_leader_keeps_the_lease_longer_than_its_ttl",
            "lead at once",
            id="renew-never-extends",
        ),
        pytest.param(
            NeverExpires,
            "test_a_leader_whose_renewals_stop_is_replaced_after_its_ttl_not_before",
            "does the lease expire when its holder stops renewing",
            id="never-expires",
        ),
        pytest.param(
            ExpiresEarly,
            "test_a_leader_whose_renewals_stop_is_replaced_after_its_ttl_not_before",
            "before its ttl of 3 s",
            id="expires-early",
        ),
    ],
)
def test_the_suite_fails_a_lease_that_could_give_two_leaders_or_none(
    lease: type[HonestLease], scenario: str, failure: str
) -> None:
    suite = suite_over(lease)
    try:
        with pytest.raises(AssertionError, match=failure):
            getattr(suite, scenario)()
    finally:
        suite.stop_leaders()


# -- Postgres and Redis: fenced writes and node fleets -----------------------------------


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """The shared server of one backend (a fresh schema for Postgres)."""
    if request.param == "redis":
        return Backend("redis", request.getfixturevalue("redis_url"))
    return Backend("postgres", request.getfixturevalue("pg_dsn"))


@pytest.fixture(params=BACKENDS)
def private_backend(request: pytest.FixtureRequest) -> Backend:
    """A private server of one backend, which the test may restart."""
    if request.param == "redis":
        server = request.getfixturevalue("private_redis")
        return Backend("redis", server.url, restart=server.restart)
    server = request.getfixturevalue("private_pg")
    return Backend("postgres", server.dsn, restart=lambda: server.restart(mode="fast"))


@pytest.fixture
def make_leader(backend: Backend) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []
    name = f"t-{uuid.uuid4().hex[:8]}"

    def make(handler: rs.TaskHandler | None = None, **kw: Any) -> Any:
        leader = backend.leader(handler or rs.TaskHandler(), name, **{**FAST, **kw})
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


def elected(fleet: Fleet, timeout: float, exclude: str | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        event = fleet.next_event(left)
        if event and event["ev"] == "elected" and event["node"] != exclude:
            return event
    pytest.fail(f"no node was elected within {timeout}s; events: {fleet.history[-20:]}")


def next_of(fleet: Fleet, kind: str, timeout: float, **match: Any) -> dict[str, Any]:
    event = fleet.wait_for(timeout, ev=kind, **match)
    if event is None:
        pytest.fail(f"no {kind} {match} within {timeout}s; events: {fleet.history[-20:]}")
    return event


def settle(fleet: Fleet, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        fleet.next_event(left)


def current_leaders(fleet: Fleet) -> set[str]:
    leading: set[str] = set()
    for event in fleet.history:
        if event["ev"] == "elected":
            leading.add(event["node"])
        elif event["ev"] in ("demoted", "stopped"):
            leading.discard(event["node"])
    return leading


def fleet_of(backend: Backend, args: list[str]) -> Fleet:
    return Fleet(backend.url, f"t-{uuid.uuid4().hex[:6]}", [*backend.fleet_args, *args])


def assert_safe_ledger(backend: Backend, fleet: Fleet) -> None:
    assert backend.overlaps(fleet.name) == 0
    assert all(len(nodes) == 1 for nodes in backend.terms(fleet.name).values())
    # A resumed process (SIGSTOP, SIGCONT) needs a moment to learn its term has ended.
    activity.assert_no_overlap(fleet, resume_grace=0.25)


# -- in-process ----------------------------------------------------------------------


def test_fenced_write_of_an_old_term_is_refused_after_takeover(
    backend: Backend, make_leader: Callable[..., Any]
) -> None:
    contexts: list[rs.TaskContext] = []
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.persistent("remember")
    def remember(ctx: rs.TaskContext) -> None:
        contexts.append(ctx)
        ctx.cancelled.wait(30)

    first = make_leader(handler, node_id="first")
    first.start()
    wait_until(lambda: bool(contexts), 10, "the first term's task")
    old = contexts[0]

    if backend.kind == "redis":
        import redis

        client = redis.Redis.from_url(backend.url)
        key = f"fenced:{{{first.name}}}"

        def write(term: int) -> None:
            first.fence.call(term, "RPUSH", key, str(term))

        def written() -> list[int]:
            return [int(x) for x in client.lrange(key, 0, -1)]

    else:
        conn = psycopg.connect(backend.url)
        with conn.transaction():
            conn.execute("CREATE TABLE fenced_writes (term bigint)")

        def write(term: int) -> None:
            with conn.transaction():
                old.fence(conn)
                conn.execute("INSERT INTO fenced_writes VALUES (%s)", (term,))

        def written() -> list[int]:
            with conn.transaction():
                return [r[0] for r in conn.execute("SELECT term FROM fenced_writes")]

    write(old.term)
    first.stop()
    second = make_leader(rs.TaskHandler(), node_id="second")
    second.start()
    wait_until(lambda: second.is_leader, 10, "the takeover")
    assert second.term == old.term + 1
    with pytest.raises(rs.StaleLeaderError):
        write(old.term)
    assert written() == [old.term]


# -- node processes ------------------------------------------------------------------


def test_one_leader_runs_the_tasks(backend: Backend) -> None:
    fleet = fleet_of(backend, FAST_ARGS)
    with fleet:
        first = fleet.start(3)
        deadline = time.monotonic() + 2.5
        ticks: list[dict[str, Any]] = []
        while (left := deadline - time.monotonic()) > 0:
            event = fleet.next_event(left)
            assert event is None or event["ev"] != "elected", f"second leader: {event}"
            if event and event["ev"] == "tick":
                ticks.append(event)
        assert ticks and {e["node"] for e in ticks} == {first["node"]}
    assert_safe_ledger(backend, fleet)
    assert backend.terms(fleet.name) == {first["term"]: {first["node"]}}


def test_graceful_stop_hands_over_within_a_second(backend: Backend) -> None:
    fleet = fleet_of(backend, ["--ttl", "15"])  # default timings
    with fleet:
        first = fleet.start(3)
        stopped_at = time.time()
        fleet.kill(first["node"], signal.SIGTERM)
        heir = elected(fleet, 5, exclude=first["node"])
        handover = heir["t"] - stopped_at
        print(f"{backend.kind}: graceful handover {handover * 1000:.0f} ms")
        assert handover < 1.0
        assert heir["term"] == first["term"] + 1
    assert_safe_ledger(backend, fleet)


def test_kill_9_fails_over_well_before_the_ttl(backend: Backend) -> None:
    fleet = fleet_of(backend, ["--ttl", "10", "--renew-deadline", "7"])
    with fleet:
        first = fleet.start(3)
        settle(fleet, 0.3)
        killed_at = time.time()
        fleet.kill(first["node"])
        heir = elected(fleet, 12, exclude=first["node"])
        failover = heir["t"] - killed_at
        print(f"{backend.kind}: kill -9 failover {failover * 1000:.0f} ms (ttl 10 s)")
        assert failover < 5.0  # ttl / 2
        assert heir["term"] == first["term"] + 1
    assert_safe_ledger(backend, fleet)


def test_paused_leader_is_replaced_only_after_expiry_and_never_acts_again(
    backend: Backend,
) -> None:
    fleet = fleet_of(backend, FAST_ARGS)
    with fleet:
        first = fleet.start(3)
        settle(fleet, 0.3)  # let the ledger writer get going
        paused_at = time.time()
        fleet.kill(first["node"], signal.SIGSTOP)
        heir = elected(fleet, 10, exclude=first["node"])
        waited = heir["t"] - paused_at
        print(f"{backend.kind}: takeover after SIGSTOP {waited * 1000:.0f} ms (ttl 3 s)")
        # The last renewal was at most renew_interval (0.5 s) before the pause.
        assert waited >= 3.0 - 0.5 - 0.1
        assert waited <= 3.0 + 0.5 + 1.5  # ttl + retry_interval, plus scheduling slack
        writes_before = backend.writes_by(fleet.name, first["node"], first["term"])
        time.sleep(0.5)
        fleet.kill(first["node"], signal.SIGCONT)
        demoted = next_of(fleet, "demoted", 5, node=first["node"])
        assert demoted["reason"] in ("deadline", "lost", "connection")
        settle(fleet, 0.5)
        assert backend.writes_by(fleet.name, first["node"], first["term"]) == writes_before
        assert current_leaders(fleet) == {heir["node"]}
    assert_safe_ledger(backend, fleet)


def test_server_restart_under_a_running_fleet(private_backend: Backend) -> None:
    backend = private_backend
    assert backend.restart is not None
    fleet = fleet_of(backend, FAST_ARGS)
    with fleet:
        first = fleet.start(3)
        settle(fleet, 0.3)
        backend.restart()
        next_of(fleet, "demoted", 10, node=first["node"], reason="connection")
        next_of(fleet, "elected", 20)
        settle(fleet, 1.0)
        assert len(current_leaders(fleet)) == 1
    assert_safe_ledger(backend, fleet)


def test_a_stale_entry_is_never_written_by_a_deposed_node(backend: Backend) -> None:
    # Several crashes and handovers in a row; every term is written by its own node,
    # in term order.
    fleet = fleet_of(backend, FAST_ARGS)
    with fleet:
        leader = fleet.start(4)["node"]
        for sig in [signal.SIGKILL, signal.SIGTERM, signal.SIGKILL]:
            settle(fleet, 0.3)
            fleet.kill(leader, sig)
            leader = elected(fleet, 10, exclude=leader)["node"]
        settle(fleet, 0.3)
    entries = backend.entries(fleet.name)
    assert entries, "no ledger writes"
    assert [t for t, _ in entries] == sorted(t for t, _ in entries)
    assert_safe_ledger(backend, fleet)
    terms = sorted(backend.terms(fleet.name))
    print(f"{backend.kind}: {len(entries)} ledger writes in terms {json.dumps(terms)}")


# Room for a task that takes most of stop_grace to stop: renew_deadline + stop_grace +
# 0.5 s <= ttl.
ROOMY_ARGS = [*FAST_ARGS, "--ttl", "4", "--stop-grace", "1", "--wind-down", "0.8"]


def through(backend: Backend, proxy: TcpProxy) -> str:
    """The backend's URL through ``proxy``."""
    if backend.kind == "redis":
        return f"redis://{proxy.host}:{proxy.port}/0"
    return with_host_port(backend.url, proxy.host, proxy.port)


@pytest.mark.parametrize(
    "delay",
    [
        # The renewal sent renew_interval after the last good one answers 0.1 s after
        # the deadline, well before the keeper's I/O limit: the lease is still held.
        pytest.param(1.6, id="answered-after-the-deadline"),
        # No answer within the keeper's I/O limit (renew_deadline after sending).
        pytest.param(3.0, id="past-the-io-limit"),
    ],
)
def test_a_slow_renewal_never_lets_the_lease_pass_on_while_old_tasks_run(
    backend: Backend, make_tcp_proxy: Callable[[str, int], TcpProxy], delay: float
) -> None:
    # Every node's 'work' task takes 0.8 s (< stop_grace) to stop once cancelled. The
    # leader's lease connection answers `delay` seconds late: it must stop at its
    # deadline and no follower may start before its tasks have ended.
    fleet = fleet_of(backend, ROOMY_ARGS)
    proxies: dict[str, TcpProxy] = {}
    with fleet:
        for i in range(3):
            proxies[f"n{i}"] = make_tcp_proxy(*backend.host_port())
            fleet.spawn(f"n{i}", lease_dsn=through(backend, proxies[f"n{i}"]))
        fleet.wait_ready(30)
        first = fleet.first_elected(30)
        settle(fleet, 0.8)  # renewals under way
        slowed_at = time.time()
        proxies[first["node"]].delay(delay)
        next_of(fleet, "demoted", 10, node=first["node"], term=first["term"])
        deadline = time.monotonic() + 10
        while not any(e["ev"] == "elected" and e["term"] > first["term"] for e in fleet.history):
            assert time.monotonic() < deadline, f"no new leader: {fleet.history[-20:]}"
            fleet.next_event(0.1)
        heir = next(e for e in fleet.history if e["ev"] == "elected" and e["term"] > first["term"])
        print(f"{backend.kind}: replies +{delay} s, new leader after {heir['t'] - slowed_at:.2f}s")
        proxies[first["node"]].heal()
        settle(fleet, 1.0)
        assert len(current_leaders(fleet)) == 1
    assert_safe_ledger(backend, fleet)
