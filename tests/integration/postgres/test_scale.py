"""Many leases per process: 3 node processes with 100 ``PostgresLeader``s each.

Every node is ``tests/support/scale_node.py`` (public API only): one leader per lease
``<prefix>/<i>``, all with the process's node id. Sessions are counted on the server
(``pg_stat_activity``, matched to a process by its client ports); who leads what comes
from the nodes' ``elected`` and ``demoted`` events and from the lease table.

The budget is DESIGN.md's "Sessions budget": at most 2 sessions while a process only
follows, at most 4 while it leads any lease (no broadcaster here).

Server: a process of the one-keeper-per-lease design holds about 2 sessions per lease,
so 3 x 100 leases need about 600. The suite's server is used when it has room for
:data:`SESSIONS_NEEDED` more; else (a default ``max_connections`` of 100, or a server
other suites share) a private Postgres with room for them, so that this test never
starves other clients of the suite's server of connections.
"""

from __future__ import annotations

import itertools
import signal
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.conftest import unavailable
from tests.support.pg import PrivatePostgres, ServerStartError, pgserver_bin_dir, with_search_path
from tests.support.scale_fleet import ScaleFleet, ScaleNode, percentile
from tests.support.sessions import grouped, process_sessions

# serial: renewal latencies of 300 leases beside CPU-bound tasks are what it measures.
pytestmark = [pytest.mark.serial, pytest.mark.timeout(150)]

LEASES = 100
NODES = 3
SESSIONS_FOLLOWING = 2  # DESIGN.md "Sessions budget", a process that only follows
SESSIONS_LEADING = 4  # ... that leads at least one lease
SESSIONS_NEEDED = 1000  # room for today's design: 2 per leader (keeper, heartbeats) and more

# Short timings keep the file fast; the library's rules hold: renew_deadline + stop_grace
# (ttl - renew_deadline - 0.5 s = 1.5 s by default) + 0.5 s <= ttl.
TTL = 6.0
RENEW_INTERVAL = 0.5
TIMINGS = [
    "--ttl",
    str(TTL),
    "--renew-interval",
    str(RENEW_INTERVAL),
    "--renew-deadline",
    "4",
    "--retry-interval",
    "1",
]
START_TIMEOUT = 60.0  # every node built and started, every lease led
CRASH_FAILOVER_BOUND = 2.0  # issue: every lease of a killed process led elsewhere within 2 s
# The library's defaults, where the gap between a release and an expiry is wide.
DEFAULT_TTL = 15.0
DEFAULT_TIMINGS = [
    *("--ttl", str(DEFAULT_TTL), "--renew-interval", "2"),
    *("--renew-deadline", "10", "--retry-interval", "2"),
]
# A graceful stop releases every lease: none may wait for its expiry (at least
# ttl - renew_interval = 13 s after the stop). The one-keeper-per-lease design took up to
# 1.5 s on an idle 2-core machine and 5.5 s on a loaded one to hand over 40 leases.
HANDOVER_BOUND = DEFAULT_TTL / 2
# Renewal latency p99 of well-behaved leases beside misbehaving tasks. Measured on the
# one-keeper-per-lease design (2 cores): worst lease's p99 about 15-30 ms beside blocking
# and failing tasks, about 120-220 ms beside CPU-bound ones (the GIL); 1 s is 5x that.
RENEWAL_P99_BOUND = 1.0
# Longest stretch without a renewal of a well-behaved lease: renew_interval (0.5 s) when
# renewals are on time; a renewal sent on time and answered within the bound above, plus
# 0.5 s of scheduling, keeps it under 2 s. The one-keeper-per-lease design went 2.3-5.5 s
# beside two CPU-bound tasks (its 200 threads share the GIL with them).
RENEWAL_GAP_BOUND = RENEW_INTERVAL + RENEWAL_P99_BOUND + 0.5


@pytest.fixture(scope="module")
def scale_server(pg_server_dsn: str) -> Iterator[str]:
    """A server with room for :data:`SESSIONS_NEEDED` more sessions (see the docstring)."""
    with psycopg.connect(pg_server_dsn, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute(
            "SELECT current_setting('max_connections')::int"
            " - current_setting('superuser_reserved_connections')::int"
            " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
        ).fetchone()
    assert row is not None
    if int(row[0]) >= SESSIONS_NEEDED:
        yield pg_server_dsn
        return
    if pgserver_bin_dir() is None:
        unavailable(
            f"the suite's Postgres has room for {row[0]} more sessions, this test needs "
            f"{SESSIONS_NEEDED}; raise its max_connections or pip install -e '.[embedded]'"
        )
    server = PrivatePostgres(settings={"max_connections": str(SESSIONS_NEEDED + 100)})
    try:
        server.start()
    except (ServerStartError, OSError) as exc:
        unavailable(f"could not start a private Postgres with room for the sessions: {exc}")
    try:
        yield server.dsn
    finally:
        server.close()


@pytest.fixture
def scale_dsn(scale_server: str) -> Iterator[str]:
    """A DSN whose tables live in a fresh schema (a fresh lease table), dropped after."""
    schema = f"scale_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(scale_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    yield with_search_path(scale_server, schema)
    with psycopg.connect(scale_server, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '5s'")
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def make_fleet(scale_dsn: str, tmp_path: Path) -> Iterator[Callable[[list[str]], ScaleFleet]]:
    """Factory: a fleet on 100 fresh leases with the given timings; nodes are added by
    each test, and stopped after it."""
    fleets: list[ScaleFleet] = []

    def make(timings: list[str]) -> ScaleFleet:
        prefix = f"s{uuid.uuid4().hex[:8]}"
        fleets.append(ScaleFleet(scale_dsn, prefix, LEASES, timings, log_dir=tmp_path))
        return fleets[-1]

    yield make
    for fleet in fleets:
        fleet.close()


@pytest.fixture
def fleet(make_fleet: Callable[[list[str]], ScaleFleet]) -> ScaleFleet:
    """A fleet on 100 fresh leases with the short timings."""
    return make_fleet(TIMINGS)


def start(fleet: ScaleFleet, n: int = NODES, extra: list[str] | None = None) -> list[ScaleNode]:
    """Start ``n`` nodes at once and wait until every lease is led."""
    nodes = [fleet.add(f"n{i}", extra or []) for i in range(n)]
    for node in nodes:
        ready = node.ready(START_TIMEOUT)
        print(
            f"{node.node}: {LEASES} leaders built in {ready['build_seconds']:.2f}s, "
            f"started in {ready['start_seconds']:.2f}s, {ready['threads']} threads"
        )
    took = fleet.wait_all_led(START_TIMEOUT)
    print(f"every lease led {took:.2f}s after the last node was ready")
    return nodes


def table_holders(dsn: str, prefix: str) -> dict[str, tuple[str | None, int, bool]]:
    """From the lease table: lease -> (holder, term, unexpired by the server's clock)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, holder, term, expires_at > now() FROM rselection_leases"
            " WHERE name LIKE %s",
            (prefix + "/%",),
        ).fetchall()
    return {name: (holder, int(term), bool(live)) for name, holder, term, live in rows}


def busiest(nodes: list[ScaleNode]) -> ScaleNode:
    """The live node that leads the most leases."""
    return max((n for n in nodes if n.proc.poll() is None), key=lambda n: len(n.leading()))


def elected_since(
    nodes: list[ScaleNode], leases: set[str], since: float
) -> dict[str, tuple[float, str, int]]:
    """For each of ``leases``, its first election by ``nodes`` after ``since``: (seconds
    from ``since``, node, term)."""
    first: dict[str, tuple[float, str, int]] = {}
    for node in nodes:
        for e in node.of("elected", since=since):
            if e["lease"] in leases:
                took = e["mono"] - since
                if e["lease"] not in first or took < first[e["lease"]][0]:
                    first[e["lease"]] = (took, node.node, e["term"])
    return first


def wait_for_elections(
    nodes: list[ScaleNode], leases: set[str], since: float, timeout: float
) -> dict[str, tuple[float, str, int]]:
    """Wait (bounded) until each of ``leases`` was elected by ``nodes`` after ``since``."""
    deadline = time.monotonic() + timeout
    while True:
        got = elected_since(nodes, leases, since)
        if len(got) == len(leases) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def summary(seconds: list[float]) -> str:
    """p50 / p95 / max in milliseconds."""
    return (
        f"p50 {percentile(seconds, 50) * 1000:.0f} ms, p95 {percentile(seconds, 95) * 1000:.0f}"
        f" ms, max {max(seconds) * 1000:.0f} ms"
    )


def session_peaks(dsn: str, nodes: list[ScaleNode], window: float) -> dict[str, dict[str, int]]:
    """Each node's largest session count seen over ``window`` seconds, by application."""
    peaks: dict[str, dict[str, int]] = {n.node: {} for n in nodes}
    deadline = time.monotonic() + window
    while True:
        for node in nodes:
            counts = grouped(process_sessions(dsn, node.pid))
            if sum(counts.values()) > sum(peaks[node.node].values()):
                peaks[node.node] = counts
        if time.monotonic() > deadline:
            return peaks
        time.sleep(0.25)


def test_every_lease_has_exactly_one_holder(fleet: ScaleFleet, scale_dsn: str) -> None:
    nodes = start(fleet)
    # The events and the table are read at different moments: compare them only when no
    # event came in between (a stable fleet, so this takes one or two tries).
    for _ in range(20):
        before = fleet.holders()
        rows = table_holders(scale_dsn, fleet.prefix)
        if fleet.holders() == before:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the fleet's leadership never held still for a table read")
    doubled = {lease: who for lease, who in before.items() if len(who) != 1}
    assert not doubled, f"leases led by no node or by several: {dict(list(doubled.items())[:10])}"
    assert set(rows) == set(fleet.leases), f"lease rows: {len(rows)} of {LEASES}"
    wrong = {}
    for lease, (holder, term, live) in rows.items():
        (node,) = before[lease]
        expected = (node, fleet.nodes[node].leading()[lease], True)
        if (holder, term, live) != expected:
            wrong[lease] = ((holder, term, live), expected)
    assert not wrong, f"table (holder, term, live) vs the nodes' events: {wrong}"
    print("leases per node:", {n.node: len(n.leading()) for n in nodes})


def over_budget(dsn: str, nodes: list[ScaleNode], window: float) -> tuple[list[str], list[str]]:
    """Each node's peak sessions over ``window`` against the budget of its role now:
    (a line per node, the lines over budget)."""
    peaks = session_peaks(dsn, nodes, window)
    lines, over = [], []
    for node in nodes:
        led = len(node.leading())
        budget = SESSIONS_LEADING if led else SESSIONS_FOLLOWING
        total = sum(peaks[node.node].values())
        line = f"{node.node} leads {led} of {LEASES} leases: {total} sessions {peaks[node.node]}"
        lines.append(line)
        if total > budget:
            over.append(f"{line} > budget {budget}")
    return lines, over


def test_sessions_per_process_stay_within_the_budget(fleet: ScaleFleet, scale_dsn: str) -> None:
    # Every lease's tasks claim their fires, save checkpoints and read the nodes twice a
    # second, and every leader is asked leader() as often: the pooled sessions' load.
    work = ["--pooled-work", "0.5"]
    # One process alone leads every lease; the two started after it only follow.
    first = fleet.add("n0", work)
    first.ready(START_TIMEOUT)
    fleet.wait_all_led(START_TIMEOUT, [first])
    followers = [fleet.add(f"n{i}", work) for i in range(1, NODES)]
    for node in followers:
        node.ready(START_TIMEOUT)
    # A window of three follower polls: every session a follower opens is open by then.
    lines, over = over_budget(scale_dsn, [first, *followers], window=3.0)
    assert len(first.leading()) == LEASES, "the first node lost leases: the roles are mixed"
    assert all(not n.leading() for n in followers)
    # Then the leader stops: the other two share the leases, each leading and following.
    first.terminate()
    fleet.wait_all_led(START_TIMEOUT, followers)
    first.proc.wait(30)
    mixed_lines, mixed_over = over_budget(scale_dsn, followers, window=3.0)
    print("\n".join(["one leader, two followers:", *lines, "shared:", *mixed_lines]))
    problems = [*over, *(f"after the leader stopped: {line}" for line in mixed_over)]
    assert not problems, "sessions over DESIGN.md's budget:\n" + "\n".join(problems)


# Threads that belong to tasks, not to the machinery: a plain def task's own thread; and
# the test node's own threads. (The event loop of every term's async tasks is one of the
# machinery's: rselection-loop-N.)
TASK_THREADS = ("rselection-task-", "scale-", "MainThread")
# The machinery's threads of a process, whatever its number of leases: the driver, its
# pool, the shared keeper's session thread, the ring watcher, the I/O watchdogs and
# the like. The one-keeper-per-lease design had 2 per lease (keeper and watchdog), 200
# here; the driven leaders measured 12.
MACHINERY_THREADS_BOUND = 20


def machinery_threads(node: ScaleNode) -> dict[str, int]:
    """The machinery's threads of ``node`` now (by name, digits taken out)."""
    asked = node.signal(signal.SIGUSR2)
    node.wait_for(lambda evs: bool(node.of("threads", since=asked)), 10, "the threads report")
    report = node.of("threads", since=asked)[0]
    names: dict[str, int] = report["names"]
    return {name: n for name, n in names.items() if not name.startswith(TASK_THREADS)}


def test_the_machinerys_threads_do_not_grow_with_the_leases(fleet: ScaleFleet) -> None:
    nodes = start(fleet)
    for node in nodes:
        threads = machinery_threads(node)
        total = sum(threads.values())
        print(f"{node.node} leads {len(node.leading())} of {LEASES}: {total} threads {threads}")
        assert total <= MACHINERY_THREADS_BOUND, (
            f"{node.node}: {total} machinery threads for {LEASES} leases: {threads}"
        )


def test_kill_9_of_the_busiest_process_moves_each_of_its_leases_within_2s(
    fleet: ScaleFleet,
) -> None:
    nodes = start(fleet)
    victim = busiest(nodes)
    leases = set(victim.leading())
    survivors = [n for n in nodes if n is not victim]
    killed_at = victim.kill()
    got = wait_for_elections(survivors, leases, killed_at, timeout=CRASH_FAILOVER_BOUND + 10)
    missing = leases - set(got)
    assert not missing, f"{len(missing)} of {len(leases)} leases were not led again: {missing}"
    took = [t for t, _, _ in got.values()]
    print(f"kill -9 of {victim.node} ({len(leases)} leases): failover {summary(took)}")
    late = {lease: round(t, 3) for lease, (t, _, _) in got.items() if t > CRASH_FAILOVER_BOUND}
    assert not late, f"leases led again later than {CRASH_FAILOVER_BOUND}s after kill -9: {late}"


def test_graceful_stop_hands_each_lease_over(
    make_fleet: Callable[[list[str]], ScaleFleet],
) -> None:
    # The library's default timings: a lease that was not released is taken over only
    # after it expires, 13 s or more after the signal, far from any handover.
    nodes = start(make_fleet(DEFAULT_TIMINGS))
    victim = busiest(nodes)
    held = victim.leading()
    leases = set(held)
    survivors = [n for n in nodes if n is not victim]
    stopped_at = victim.terminate()
    got = wait_for_elections(survivors, leases, stopped_at, timeout=DEFAULT_TTL + 10)
    victim.wait_for(
        lambda evs: any(e["event"] == "stopped" for e in evs), 30, "stopped after SIGTERM"
    )
    assert victim.proc.wait(10) == 0
    missing = leases - set(got)
    assert not missing, f"{len(missing)} of {len(leases)} leases were not handed over: {missing}"
    took = [t for t, _, _ in got.values()]
    released = [e["seconds"] for e in victim.of("released")]
    (asked,) = victim.of("asked")
    print(
        f"SIGTERM of {victim.node} ({len(leases)} leases): handover {summary(took)}; "
        f"it asked every leader to stop within {asked['seconds'] * 1000:.0f} ms, and the "
        f"stop() calls returned {summary(released)} after SIGTERM"
    )
    assert len(released) == LEASES and not any(e["leading"] for e in victim.of("released"))
    skipped = {lease: (held[lease], term) for lease, (_, _, term) in got.items()}
    skipped = {lease: terms for lease, terms in skipped.items() if terms[1] != terms[0] + 1}
    assert not skipped, f"successor terms are not the stopped node's term + 1: {skipped}"
    slow = {lease: round(t, 3) for lease, (t, _, _) in got.items() if t > HANDOVER_BOUND}
    assert not slow, f"handovers slower than {HANDOVER_BOUND}s (waited for expiry?): {slow}"


def renewals(node: ScaleNode, start: float, end: float) -> dict[int, list[tuple[float, float]]]:
    """Each lease's renewals (monotonic time, latency) reported between ``start`` and ``end``."""
    out: dict[int, list[tuple[float, float]]] = {}
    for e in node.of("renewed", since=start):
        if e["mono"] <= end:
            out.setdefault(e["index"], []).append((e["mono"], e["latency"]))
    return out


def latencies(of: dict[int, list[tuple[float, float]]]) -> dict[int, list[float]]:
    """Renewal latencies per lease."""
    return {i: [lat for _, lat in seen] for i, seen in of.items()}


def gaps(
    of: dict[int, list[tuple[float, float]]], leases: range, start: float, end: float
) -> dict[int, list[float]]:
    """Per lease, the stretches without a renewal from ``start`` to ``end``: about
    ``renew_interval`` each when renewals are on time (a lease that never renewed has one
    stretch, the whole window)."""
    out = {}
    for i in leases:
        times = [start, *(t for t, _ in of.get(i, [])), end]
        out[i] = [b - a for a, b in itertools.pairwise(times)]
    return out


def describe(per_lease: dict[int, list[float]]) -> str:
    """Median and p99 of all values, and the worst lease's p99, in milliseconds."""
    every = [x for values in per_lease.values() for x in values]
    if not every:
        return "none"
    p99 = {i: percentile(values, 99) for i, values in per_lease.items() if values}
    worst = max(p99, key=lambda i: p99[i])
    return (
        f"median {statistics.median(every) * 1000:.0f} ms, p99 {percentile(every, 99) * 1000:.0f}"
        f" ms, worst lease's p99 {p99[worst] * 1000:.0f} ms (lease {worst}), n={len(every)}"
    )


MISBEHAVIOURS = {
    # 5 tasks that sleep deaf to cancellation, 5 that raise at once (restarted with backoff)
    "blocking-and-failing": (10, ["--block", "0-4", "--fail", "5-9"]),
    # 2 tasks in CPU-bound loops (one per core of a small machine): they hold the GIL
    # whenever they run, so this is what the machinery's threads must live with
    "cpu-bound": (2, ["--spin", "0-1"]),
}


@pytest.mark.parametrize(
    "misbehaviour",
    [
        "blocking-and-failing",
        "cpu-bound",
    ],
)
def test_misbehaving_tasks_do_not_slow_the_other_leases_renewals(
    fleet: ScaleFleet, misbehaviour: str
) -> None:
    # One process leads every lease; the first leases' tasks misbehave, from the moment
    # every lease is led (SIGUSR1), so the start-up is not measured.
    misbehaving, extra = MISBEHAVIOURS[misbehaviour]
    (node,) = start(fleet, 1, [*extra, "--renewals", "--misbehave-on-usr1"])
    quiet_start = time.monotonic()
    node.wait_for(lambda evs: evs[-1]["mono"] > quiet_start + 3, 15, "a quiet window")
    quiet = renewals(node, quiet_start, quiet_start + 3)
    node.signal(signal.SIGUSR1)
    node.wait_for(lambda evs: any(e["event"] == "go" for e in evs), 10, "go after SIGUSR1")
    window = 8.0  # 16 renewals per lease
    start_at = time.monotonic() + 0.5  # the tasks notice "go" within 50 ms
    node.wait_for(
        lambda evs: evs[-1]["mono"] > start_at + window, window + 15, "the measuring window"
    )
    end_at = start_at + window
    seen = renewals(node, start_at, end_at)
    behaved = range(misbehaving, LEASES)
    normal = {i: v for i, v in seen.items() if i >= misbehaving}
    quiet_normal = {i: v for i, v in quiet.items() if i >= misbehaving}
    quiet_gaps = gaps(quiet_normal, behaved, quiet_start, quiet_start + 3)
    normal_gaps = gaps(normal, behaved, start_at, end_at)
    print(
        f"well-behaved leases ({LEASES - misbehaving}), before the misbehaving tasks started:"
        f" latency {describe(latencies(quiet_normal))}; time between renewals "
        f"{describe(quiet_gaps)}"
    )
    print(
        f"while they ran: latency {describe(latencies(normal))}; time between renewals "
        f"{describe(normal_gaps)}"
    )
    demoted = [e for e in node.of("demoted") if e["index"] >= misbehaving]
    assert not demoted, f"{len(demoted)} well-behaved leases lost their term: {demoted[:3]}"
    p99 = {i: percentile(v, 99) for i, v in latencies(normal).items()}
    slow = {i: round(v, 3) for i, v in p99.items() if v > RENEWAL_P99_BOUND}
    assert not slow, f"leases whose renewal latency p99 exceeds {RENEWAL_P99_BOUND}s: {slow}"
    late = {i: round(max(v), 3) for i, v in normal_gaps.items() if max(v) > RENEWAL_GAP_BOUND}
    assert not late, (
        f"{len(late)} leases went longer than {RENEWAL_GAP_BOUND}s without a renewal "
        f"(renew_interval {RENEW_INTERVAL}s): {late}"
    )
