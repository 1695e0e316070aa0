"""Many leases per process: sessions, statements, CPU, failover and handover as K grows.

For each K (leases per process) and each code tree (this checkout, and a baseline
checked out from ``--baseline-ref``), a fleet of 3 node processes runs K
``PostgresLeader``s each (``tests/support/scale_node.py``, public API only, run with
``PYTHONPATH`` set to the tree): one process (the *leader side*) starts first and leads
every lease; the two started after it (the *follower side*) follow every lease. Each
process reaches the server through its own loopback proxy
(``tests/support/wire_counter.py``) that counts the frontend protocol messages it sends.

Measured, per tree and K:

* **sessions** per process: the server's view, ``pg_stat_activity`` rows whose
  ``client_port`` is one of the proxy's upstream ports, sampled every second over the
  idle window; the largest count.
* **statements per second** per process over an idle window (``--window``): ``Q``
  (simple query) plus ``E`` (execute) messages the proxy saw, i.e. statements the server
  was asked to run; renewals, heartbeats, waits and acquisition attempts alike.
* **CPU** per process over the same window: ``utime + stime`` (psutil), in % of a core.
* **threads** per process at the end of the window.
* **crash failover**: ``kill -9`` of the leader side; per lease, from the kill to a
  follower's ``elected`` (CLOCK_MONOTONIC, shared by the processes); p50 / p95 / max
  over every lease (of every round).
* **graceful handover**: SIGTERM of the leader side of a second fleet (its node calls
  ``stop()`` on every leader at once); per lease, from the signal to a follower's
  ``elected``.

The idle window starts once every follower has seen a holder of each lease, its session
count held still for 3 s, and its statements no longer fall from one 2 s window to the
next (start-up is over). Rounds (``--rounds``, default more for small K so that
percentiles have a few samples) repeat the crash and the handover with fresh fleets;
the idle window is measured in the first round. A tree that cannot make one process
lead all K leases within ``--start-timeout`` is reported as such for that K, and the
rest of that K is skipped for it.

Usage::

    python bench/scale.py [--ks 1,10,100,1000] [--baseline-ref main | --no-baseline]
                          [--window 20] [--rounds N] [--ttl 15] [--start-timeout 180]
                          [--start-workers 1] [--dsn DSN]
                          [--backend postgres|redis] [--redis-url URL]

Without ``--dsn`` a private Postgres (``pgserver`` binaries) with room for the
baseline's sessions runs for the benchmark. With ``--backend redis`` the nodes run
``RedisLeader``s on a private ``redis-server`` (or ``--redis-url``): sessions are each
process's TCP connections to Redis, and the statements are the whole server's commands
(``INFO stats``; Redis does not tell whose they were); the sessions targets are
Postgres's, reported but not judged. Exit status: 0 when this tree met every
target, 1 when one was missed, 2 when the benchmark could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # type: ignore[import-untyped]  # noqa: E402
import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import conninfo_to_dict  # noqa: E402

from tests.support.pg import with_search_path  # noqa: E402
from tests.support.scale_fleet import ScaleFleet, ScaleNode, percentile  # noqa: E402
from tests.support.sessions import fold, grouped, sessions_on_ports  # noqa: E402
from tests.support.wire_counter import CountingProxy, Snapshot  # noqa: E402

SESSIONS_FOLLOWING = 2  # DESIGN.md "Sessions budget"
SESSIONS_LEADING = 4
SETTLE_STILL = 3.0  # seconds the followers' session counts must hold still
QUIET_WINDOW = 2.0  # seconds of each window in which a settling follower's statements are counted
SAMPLE_EVERY = 1.0  # seconds between session samples in the window


class BenchError(RuntimeError):
    """The benchmark could not go on."""


class Incomplete(RuntimeError):
    """One tree could not reach the state to measure at one K (reported, not fatal)."""


@dataclass
class Tree:
    """A code tree the nodes import rselection from."""

    label: str
    path: Path


@dataclass
class Result:
    """What one tree did at one K."""

    tree: str
    k: int
    incomplete: str | None = None
    ready: dict[str, float] = field(default_factory=dict)  # build/start/all-led seconds
    sessions: dict[str, int] = field(default_factory=dict)  # "leader", "follower"
    session_detail: dict[str, dict[str, int]] = field(default_factory=dict)
    statements: dict[str, float] = field(default_factory=dict)  # per second
    statement_detail: dict[str, dict[str, float]] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)  # % of one core
    threads: dict[str, int] = field(default_factory=dict)
    crash: list[float] = field(default_factory=list)  # seconds per lease
    handover: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- servers and trees --------------------------------------------------------------------


@contextlib.contextmanager
def database(dsn: str | None, max_connections: int) -> Iterator[str]:
    """``dsn``, else a private Postgres with room for ``max_connections`` sessions."""
    if dsn:
        yield dsn
        return
    from tests.support.pg import PrivatePostgres

    settings = {"max_connections": str(max_connections), "shared_buffers": "256MB"}
    with PrivatePostgres(settings=settings) as pg:
        yield pg.dsn


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    """``url``, else a private ``redis-server`` (so that its commands are the fleet's)."""
    if url:
        yield url
        return
    from tests.support.pg import PrivateRedis

    with PrivateRedis(appendonly=False) as server:
        yield server.url


@contextlib.contextmanager
def baseline_tree(ref: str) -> Iterator[Tree]:
    """``ref`` checked out with ``git worktree add`` in a temporary directory."""
    commit = git("rev-parse", "--short", f"{ref}^{{commit}}").strip()
    parent = Path(tempfile.mkdtemp(prefix="rselection-baseline-"))
    path = parent / "tree"
    git("worktree", "add", "--detach", str(path), ref)
    try:
        yield Tree(f"baseline {ref} ({commit})", path)
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            git("worktree", "remove", "--force", str(path))
        shutil.rmtree(parent, ignore_errors=True)
        with contextlib.suppress(subprocess.CalledProcessError):
            git("worktree", "prune")


def git(*args: str) -> str:
    """Run git in this checkout; its stdout."""
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout


def this_tree() -> Tree:
    """This checkout, as it is on disk (uncommitted changes included)."""
    commit = git("rev-parse", "--short", "HEAD").strip()
    dirty = "+changes" if git("status", "--porcelain", "--", "rselection").strip() else ""
    return Tree(f"this tree ({commit}{dirty})", ROOT)


@contextlib.contextmanager
def fresh_schema(server_dsn: str) -> Iterator[str]:
    """A DSN whose tables (a fresh lease table) live in a new schema, dropped afterwards."""
    name = f"bench_scale_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    try:
        yield with_search_path(server_dsn, name)
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '10s'")
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


# -- one fleet ----------------------------------------------------------------------------


class BenchFleet:
    """A :class:`ScaleFleet` whose every node reaches the server through its own proxy."""

    def __init__(self, server_dsn: str, dsn: str, tree: Tree, k: int, args: list[str]) -> None:
        params = conninfo_to_dict(server_dsn)
        self.server = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
        self.server_dsn = server_dsn
        self.dsn = dsn
        self.fleet = ScaleFleet(dsn, f"b{uuid.uuid4().hex[:6]}", k, args, code_tree=tree.path)
        self.tree = tree
        self.proxies: dict[str, CountingProxy] = {}

    def add(self, node: str) -> ScaleNode:
        """Start a node behind a proxy of its own."""
        proxy = CountingProxy(*self.server)
        self.proxies[node] = proxy
        return self.fleet.add(node, dsn=proxy.dsn(self.dsn))

    def check_tree(self, node: ScaleNode) -> None:
        """The node imported rselection from the tree under test."""
        path = node.of("ready")[0]["rselection"]
        if not Path(path).resolve().is_relative_to(self.tree.path.resolve()):
            raise BenchError(f"node {node.node} imported rselection from {path}, not the tree")

    def sessions(self, node: str) -> Counter[str]:
        """The node's sessions as the server sees them, by application_name."""
        return sessions_on_ports(self.server_dsn, self.proxies[node].upstream_ports())

    def open_sessions(self, node: str) -> int:
        """The node's sessions open now, as its proxy sees them."""
        return sum(self.proxies[node].snapshot().open_sessions().values())

    def counters(self, nodes: list[ScaleNode]) -> dict[str, Snapshot]:
        """What each node's proxy counted so far."""
        return {n.node: self.proxies[n.node].snapshot() for n in nodes}

    @staticmethod
    def statements(before: Snapshot, after: Snapshot) -> int:
        """Statements counted between two of :meth:`counters`' snapshots."""
        return after.minus(before).statements()

    @staticmethod
    def detail(before: Snapshot, after: Snapshot, took: float) -> dict[str, float]:
        """Statements per second by application between two snapshots."""
        return statements_by_app(after.minus(before), took)

    def close(self) -> None:
        """Stop the nodes, then the proxies."""
        try:
            self.fleet.close()
        finally:
            for proxy in self.proxies.values():
                proxy.close()


class RedisBenchFleet:
    """A :class:`ScaleFleet` of ``RedisLeader``s on one Redis of the benchmark's own.

    Redis cannot tell whose commands it ran: the commands counted are the whole
    server's (``INFO stats``), reported for the fleet under the key ``"fleet"``; a
    node's sessions are its process's TCP connections to the server.
    """

    def __init__(self, url: str, tree: Tree, k: int, args: list[str]) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.port = int(self.client.connection_pool.connection_kwargs.get("port", 6379))
        prefix = f"b{uuid.uuid4().hex[:6]}"
        self.fleet = ScaleFleet("", prefix, k, [*args, "--redis-url", url], code_tree=tree.path)
        self.tree = tree

    def add(self, node: str) -> ScaleNode:
        """Start a node."""
        return self.fleet.add(node)

    check_tree = BenchFleet.check_tree

    def sessions(self, node: str) -> Counter[str]:
        """The node's connections to Redis."""
        return Counter({"redis": self.open_sessions(node)})

    def open_sessions(self, node: str) -> int:
        """The node's process's TCP connections to Redis now."""
        try:
            conns = psutil.Process(self.fleet.nodes[node].pid).net_connections(kind="inet")
        except psutil.Error:
            return 0
        return sum(1 for c in conns if c.raddr and c.raddr.port == self.port)

    def counters(self, nodes: list[ScaleNode]) -> dict[str, int]:
        """The server's commands so far, for the whole fleet."""
        return {"fleet": int(self.client.info("stats")["total_commands_processed"])}

    @staticmethod
    def statements(before: int, after: int) -> int:
        """Commands run between two of :meth:`counters`' counts."""
        return after - before

    @staticmethod
    def detail(before: int, after: int, took: float) -> dict[str, float]:
        """No detail: Redis does not tell whose commands it ran."""
        return {}

    def close(self) -> None:
        """Stop the nodes and delete the fleet's keys."""
        try:
            self.fleet.close()
        finally:
            keys = list(
                self.client.scan_iter(match=f"rselection:*{self.fleet.prefix}/*", count=1000)
            )
            if keys:
                self.client.delete(*keys)
            self.client.close()


Fleet = BenchFleet | RedisBenchFleet


def start_fleet(
    bf: BenchFleet, timeout: float, result: Result | None, log: Callable[[str], None]
) -> tuple[ScaleNode, list[ScaleNode]]:
    """Leader side first, until it leads every lease; then the two followers."""
    k = bf.fleet.count
    spawned = time.monotonic()
    leader = bf.add("a")
    deadline = spawned + timeout
    next_progress = spawned + 15
    while True:
        ready = leader.of("ready")
        led = len(leader.leading())
        now = time.monotonic()
        if ready and led == k:
            break
        if leader.proc.poll() is not None:
            raise BenchError(f"the leader side exited:\n{leader.log_tail()}")
        if now > deadline or now > next_progress:
            sessions = sum(bf.sessions("a").values())
            deadlines = sum(1 for e in leader.of("demoted") if e["reason"] == "deadline")
            state = (
                f"{led} of {k} leases led, start() calls "
                f"{'returned' if ready else 'not all returned yet'}, {sessions} sessions open, "
                f"{deadlines} terms ended by their deadline, {now - spawned:.0f}s after it started"
            )
            if now > deadline:
                raise Incomplete(f"leader side: {state}")
            log(f"    leader side: {state}")
            next_progress += 15
        time.sleep(0.1)
    bf.check_tree(leader)
    took = time.monotonic() - spawned
    (event,) = ready
    if result is not None:
        result.ready = {
            "build": event["build_seconds"],
            "start": event["start_seconds"],
            "all led": took,
        }
    log(
        f"    leader side: {k} leaders built in {event['build_seconds']:.2f}s, started in "
        f"{event['start_seconds']:.2f}s, all led {took:.2f}s after the process started"
    )
    followers = [bf.add("b"), bf.add("c")]
    for node in followers:
        try:
            node.ready(max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            raise Incomplete(
                f"follower {node.node}: start() calls had not all returned after {timeout:g}s"
            ) from None
    return leader, followers


def settle(bf: Fleet, nodes: list[ScaleNode], timeout: float) -> str | None:
    """Wait until the followers are idle; ``None`` once they are, else what was missing.

    Idle means: every follower has seen a holder of each of its leases (its "seen_all"
    event), its proxied session count held still for ``SETTLE_STILL`` s, and its
    statements in two windows of ``QUIET_WINDOW`` s in a row no longer fall (start-up
    work is over). Before, the idle window began once session counts held still, while
    followers were still starting, and counted their start-up as idleness.
    """
    deadline = time.monotonic() + timeout
    for node in nodes:
        try:
            node.wait_for(
                lambda events: any(e.get("event") == "seen_all" for e in events),
                max(0.0, deadline - time.monotonic()),
                "the follower to see a holder of every lease",
            )
        except TimeoutError:
            return "a follower never saw a holder of every lease"
    last: dict[str, int] = {}
    still_since = time.monotonic()
    while True:
        if time.monotonic() >= deadline:
            return f"the followers' sessions never held still for {SETTLE_STILL:g} s"
        now = {n.node: bf.open_sessions(n.node) for n in nodes}
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= SETTLE_STILL:
            break
        time.sleep(0.25)
    previous = statements_in(bf, nodes, QUIET_WINDOW)
    while time.monotonic() < deadline:
        current = statements_in(bf, nodes, QUIET_WINDOW)
        if all(current[n] >= 0.75 * previous[n] - 2 for n in current):
            return None
        previous = current
    return "the followers' statements never stopped falling"


def statements_in(bf: Fleet, nodes: list[ScaleNode], seconds: float) -> dict[str, int]:
    """Statements each node (on Redis: the fleet) sent in the next ``seconds`` seconds."""
    before: dict[str, Any] = bf.counters(nodes)
    time.sleep(seconds)
    after: dict[str, Any] = bf.counters(nodes)
    return {key: bf.statements(before[key], after[key]) for key in after}


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def statements_by_app(snapshot: Snapshot, window: float) -> dict[str, float]:
    """Statements per second by (folded) application_name."""
    folded: Counter[str] = Counter()
    for app, n in snapshot.by_application().items():
        folded[fold(app) or "?"] += n
    return {app: n / window for app, n in folded.most_common() if n}


def measure_idle(
    bf: Fleet, leader: ScaleNode, followers: list[ScaleNode], window: float, result: Result
) -> None:
    """Sessions, statements, CPU and threads of each process over an idle window."""
    nodes = [leader, *followers]
    k = bf.fleet.count
    before: dict[str, Any] = bf.counters(nodes)
    cpu_before = {n.node: cpu_seconds(n.pid) for n in nodes}
    began = time.monotonic()
    peaks: dict[str, Counter[str]] = {n.node: Counter() for n in nodes}
    while (left := began + window - time.monotonic()) > 0:
        for n in nodes:
            seen = bf.sessions(n.node)
            if sum(seen.values()) > sum(peaks[n.node].values()):
                peaks[n.node] = seen
        time.sleep(min(SAMPLE_EVERY, max(0.0, left)))
    took = time.monotonic() - began
    after: dict[str, Any] = bf.counters(nodes)
    cpu = {n.node: (cpu_seconds(n.pid) - cpu_before[n.node]) / took * 100 for n in nodes}
    threads = {n.node: psutil.Process(n.pid).num_threads() for n in nodes}
    if len(leader.leading()) != k or any(f.leading() for f in followers):
        result.notes.append("leadership moved during the idle window: figures are mixed")
    stmts = {n: bf.statements(before[n], after[n]) / took for n in after}
    detail = {n: bf.detail(before[n], after[n], took) for n in after}
    f_names = [f.node for f in followers]
    result.sessions = {
        "leader": sum(peaks[leader.node].values()),
        "follower": max(sum(peaks[f].values()) for f in f_names),
    }
    result.session_detail = {n: grouped(c) for n, c in peaks.items()}
    if "fleet" in stmts:  # Redis: the whole fleet's commands
        result.statements = {"fleet": stmts["fleet"]}
    else:
        result.statements = {
            "leader": stmts[leader.node],
            "follower": statistics.mean(stmts[f] for f in f_names),
        }
    result.statement_detail = detail
    result.cpu = {"leader": cpu[leader.node], "follower": statistics.mean(cpu[f] for f in f_names)}
    result.threads = {"leader": threads[leader.node], "follower": max(threads[f] for f in f_names)}


def wait_for_elections(
    nodes: list[ScaleNode], leases: set[str], since: float, timeout: float
) -> dict[str, float]:
    """Seconds from ``since`` to each lease's first election by ``nodes`` (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        got: dict[str, float] = {}
        for node in nodes:
            for e in node.of("elected", since=since):
                if e["lease"] in leases:
                    got[e["lease"]] = min(got.get(e["lease"], math.inf), e["mono"] - since)
        if len(got) == len(leases) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def run_round(
    server_dsn: str,
    tree: Tree,
    k: int,
    args: argparse.Namespace,
    fault: str,
    result: Result,
    idle: bool,
    log: Callable[[str], None],
) -> None:
    """One fleet: start it, maybe measure the idle window, then crash or stop the leader."""
    with contextlib.ExitStack() as stack:
        bf: Fleet
        if args.backend == "redis":
            bf = RedisBenchFleet(server_dsn, tree, k, node_args(args))
        else:
            dsn = stack.enter_context(fresh_schema(server_dsn))
            bf = BenchFleet(server_dsn, dsn, tree, k, node_args(args))
        try:
            leader, followers = start_fleet(bf, args.start_timeout, result if idle else None, log)
            if (unsettled := settle(bf, followers, args.start_timeout)) is not None:
                result.notes.append(unsettled)
            if idle:
                measure_idle(bf, leader, followers, args.window, result)
            leases = set(leader.leading())
            sent = leader.kill() if fault == "crash" else leader.terminate()
            took = wait_for_elections(followers, leases, sent, args.ttl + 15)
            if missing := leases - set(took):
                result.notes.append(
                    f"{fault}: {len(missing)} of {len(leases)} leases not led again within "
                    f"{args.ttl + 15:g}s"
                )
            (result.crash if fault == "crash" else result.handover).extend(took.values())
            moved = ms_summary(took.values())
            log(f"    {fault}: {len(took)} of {len(leases)} leases moved, {moved}")
        finally:
            bf.close()


def node_args(args: argparse.Namespace) -> list[str]:
    """Timings for every node: renew_deadline 2/3 of ttl, library default intervals."""
    return [
        "--ttl",
        f"{args.ttl:g}",
        "--renew-deadline",
        f"{args.ttl * 2 / 3:g}",
        "--renew-interval",
        "2",
        "--retry-interval",
        "2",
        "--start-workers",
        str(args.start_workers),
    ]


def ms_summary(values: Iterable[float]) -> str:
    """p50 / p95 / max in milliseconds."""
    values = list(values)
    if not values:
        return "none"
    return (
        f"p50 {percentile(values, 50) * 1000:.0f} ms, p95 {percentile(values, 95) * 1000:.0f}"
        f" ms, max {max(values) * 1000:.0f} ms"
    )


def rounds_for(k: int, args: argparse.Namespace) -> int:
    """Rounds at K: at least 20 leases' worth of samples, at most 5 rounds."""
    if args.rounds is not None:
        return int(args.rounds)
    return max(1, min(5, math.ceil(20 / k)))


def run_tree(
    server_dsn: str, tree: Tree, k: int, args: argparse.Namespace, log: Callable[[str], None]
) -> Result:
    """Every round of one tree at one K."""
    result = Result(tree.label, k)
    began = time.monotonic()
    try:
        for r in range(rounds_for(k, args)):
            log(f"  {tree.label}, K={k}, round {r + 1}")
            run_round(server_dsn, tree, k, args, "crash", result, r == 0, log)
            run_round(server_dsn, tree, k, args, "handover", result, False, log)
    except Incomplete as exc:
        result.incomplete = str(exc)
        log(f"    incomplete: {exc}")
    log(f"  {tree.label}, K={k}: {time.monotonic() - began:.0f}s")
    return result


# -- report -------------------------------------------------------------------------------


def fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    """A number with its unit, or ``-``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{unit}"


def ratio(new: float | None, old: float | None) -> str:
    """``new / old`` as ``0.02x``, or ``-``."""
    if new is None or old is None or math.isnan(new) or math.isnan(old) or old == 0:
        return "-"
    r = new / old
    return f"{r:.3g}x"


def rows_of(r: Result) -> list[tuple[str, float | None, str, int]]:
    """(measurement, value, unit, digits) for one result."""

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) * 1000 if values else None

    return [
        ("start: every lease led, after process start", r.ready.get("all led"), " s", 2),
        ("sessions, leader process", r.sessions.get("leader"), "", 0),
        ("sessions, follower process (max)", r.sessions.get("follower"), "", 0),
        ("statements/s, leader process", r.statements.get("leader"), "", 2),
        ("statements/s, follower process (mean)", r.statements.get("follower"), "", 2),
        ("commands/s, whole fleet (Redis)", r.statements.get("fleet"), "", 2),
        ("CPU, leader process (% of a core)", r.cpu.get("leader"), "%", 2),
        ("CPU, follower process (mean)", r.cpu.get("follower"), "%", 2),
        ("threads, leader process", r.threads.get("leader"), "", 0),
        ("threads, follower process (max)", r.threads.get("follower"), "", 0),
        ("crash failover p50", pct(r.crash, 50), " ms", 0),
        ("crash failover p95", pct(r.crash, 95), " ms", 0),
        ("graceful handover p50", pct(r.handover, 50), " ms", 0),
        ("graceful handover p95", pct(r.handover, 95), " ms", 0),
    ]


def report(results: dict[tuple[str, int], Result], trees: list[Tree], ks: list[int]) -> None:
    """The markdown table, then details and notes."""
    new = trees[0].label
    old = trees[1].label if len(trees) > 1 else None
    head = f"| K | measurement | {new} |"
    rule = "| --- | --- | --- |"
    if old:
        head += f" {old} | ratio (this / baseline) |"
        rule += " --- | --- |"
    print()
    print(head)
    print(rule)
    for k in ks:
        a = results[(new, k)]
        b = results.get((old, k)) if old else None
        if a.incomplete or (b is not None and b.incomplete):
            line = f"| {k} | could not measure | {a.incomplete or 'ok'} |"
            if b is not None:
                line += f" {b.incomplete or 'ok'} | |"
            print(line)
        if a.incomplete and (b is None or b.incomplete):
            continue
        b_rows = rows_of(b) if b is not None else None
        for i, (name, value, unit, digits) in enumerate(rows_of(a)):
            line = f"| {k} | {name} | {fmt(value, unit, digits)} |"
            if b_rows is not None:
                other = b_rows[i][1]
                line += f" {fmt(other, unit, digits)} | {ratio(value, other)} |"
            print(line)
    print()
    print("Details:")
    for (label, k), r in results.items():
        print(f"- {label}, K={k}:")
        if r.incomplete:
            print(f"  - incomplete: {r.incomplete}")
        if r.ready:
            print(
                f"  - leader side start: leaders built in {r.ready['build']:.2f}s, start() "
                f"calls {r.ready['start']:.2f}s, every lease led {r.ready['all led']:.2f}s "
                "after the process started"
            )
        for node, counts in r.session_detail.items():
            print(f"  - sessions of {node}: {counts}")
        for node, apps in r.statement_detail.items():
            shown = ", ".join(f"{app} {rate:.2f}" for app, rate in apps.items())
            print(f"  - statements/s of {node}: {shown or 'none'}")
        if r.crash:
            crash = ms_summary(r.crash)
            print(f"  - crash failover over {len(r.crash)} leases: {crash}")
        if r.handover:
            print(f"  - graceful handover over {len(r.handover)} leases: {ms_summary(r.handover)}")
        for note in r.notes:
            print(f"  - note: {note}")


def targets(
    results: dict[tuple[str, int], Result], tree: Tree, ks: list[int], backend: str
) -> bool:
    """The issue's targets for this tree; print PASS / FAIL / SKIP; True when none failed."""
    mine = {k: results[(tree.label, k)] for k in ks}
    lines: list[tuple[str, str, str]] = []

    def add(name: str, measured: str, ok: bool | None) -> None:
        lines.append((name, measured, "SKIP" if ok is None else "PASS" if ok else "FAIL"))

    for k, r in mine.items():
        if r.incomplete:
            add(f"K={k}: fleet reaches a measurable state", r.incomplete, False)
            continue
        lead, follow = r.sessions.get("leader"), r.sessions.get("follower")
        if backend != "postgres":  # a Redis lease keeps connections of its own
            add(f"K={k}: sessions (Postgres's target)", f"{lead} / {follow}", None)
            continue
        add(
            f"K={k}: sessions <= {SESSIONS_LEADING} leading, <= {SESSIONS_FOLLOWING} following",
            f"{lead} / {follow}",
            lead is not None
            and follow is not None
            and lead <= SESSIONS_LEADING
            and follow <= SESSIONS_FOLLOWING,
        )
    measured = [k for k, r in mine.items() if "leader" in r.statements]
    if len(measured) >= 2:
        lo, hi = min(measured), max(measured)
        a, b = mine[lo].statements["leader"], mine[hi].statements["leader"]
        add(
            f"leader statements/s independent of K (K={hi} <= 2 x K={lo})",
            f"{b:.2f} vs {a:.2f}",
            b <= 2 * a,
        )
    else:
        add("leader statements/s independent of K", "needs two K values", None)
    big = mine.get(1000)
    if big is None:
        add("K=1000: crash failover p95 <= 1 s", "not run", None)
        add("K=1000: idle follower CPU < 2% of a core", "not run", None)
    elif big.incomplete or not big.crash or "follower" not in big.cpu:
        add("K=1000: crash failover p95 <= 1 s", "not reached", False)
        add("K=1000: idle follower CPU < 2% of a core", "not reached", False)
    else:
        p95 = percentile(big.crash, 95)
        add("K=1000: crash failover p95 <= 1 s", f"{p95 * 1000:.0f} ms", p95 <= 1.0)
        cpu = big.cpu["follower"]
        add("K=1000: idle follower CPU < 2% of a core", fmt(cpu, "%", 2), cpu < 2.0)
    print()
    print(f"Targets ({tree.label}):")
    print()
    print("| target | measured | result |")
    print("| --- | --- | --- |")
    for name, value, verdict in lines:
        print(f"| {name} | {value} | {verdict} |")
    return all(v != "FAIL" for _, _, v in lines)


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        prog="bench/scale.py",
        description="Sessions, statements, CPU, failover and handover with K leases per "
        "process, this tree against a baseline.",
    )
    p.add_argument("--ks", default="1,10,100,1000", help="K values (default 1,10,100,1000)")
    base = p.add_mutually_exclusive_group()
    base.add_argument("--baseline-ref", default="main", help="git ref of the baseline")
    base.add_argument("--no-baseline", action="store_true", help="measure this tree only")
    p.add_argument("--window", type=float, default=20.0, help="idle window, s (default 20)")
    p.add_argument("--rounds", type=int, help="rounds per K (default: 5 at K=1 .. 1 at K>=20)")
    p.add_argument("--ttl", type=float, default=15.0, help="lease ttl (default 15)")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=180.0,
        help="seconds for one process to lead every lease (default 180)",
    )
    p.add_argument(
        "--start-workers",
        type=int,
        default=1,
        help="threads that start each node's leaders (default 1: one after another)",
    )
    p.add_argument("--dsn", help="an existing server instead of a private one")
    p.add_argument(
        "--backend",
        choices=("postgres", "redis"),
        default="postgres",
        help="PostgresLeaders (default) or RedisLeaders",
    )
    p.add_argument(
        "--redis-url", help="with --backend redis: an existing Redis instead of a private one"
    )
    args = p.parse_args(argv)
    try:
        args.ks = [int(k) for k in args.ks.split(",") if k.strip()]
    except ValueError:
        p.error("--ks takes integers: 1,10,100")
    if not args.ks or min(args.ks) < 1:
        p.error("--ks needs positive values")
    if args.window <= 0 or args.ttl <= 0 or args.start_timeout <= 0:
        p.error("--window, --ttl and --start-timeout must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring for the exit status."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    load = os.getloadavg()[0]
    print(
        f"scale benchmark: K={','.join(map(str, args.ks))}, 3 processes, ttl {args.ttl:g} s, "
        f"idle window {args.window:g} s; {os.cpu_count()} CPUs, load average {load:.2f}"
    )
    # The one-keeper-per-lease design opens about 2 sessions per lease per process.
    max_connections = max(200, 7 * max(args.ks) + 100)
    results: dict[tuple[str, int], Result] = {}
    trees = [this_tree()]
    began = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            if not args.no_baseline:
                trees.append(stack.enter_context(baseline_tree(args.baseline_ref)))
            if args.backend == "redis":
                server = stack.enter_context(redis_server(args.redis_url))
            else:
                server = stack.enter_context(database(args.dsn, max_connections))
            for k in args.ks:
                for tree in trees:
                    results[(tree.label, k)] = run_tree(server, tree, k, args, log)
    except Exception as exc:
        if isinstance(exc, (BenchError, subprocess.CalledProcessError)):
            print(f"benchmark failed: {exc}", file=sys.stderr)
        else:
            traceback.print_exc()
        return 2
    print(f"(the run took {time.monotonic() - began:.0f} s)")
    report(results, trees, args.ks)
    return 0 if targets(results, trees[0], args.ks, args.backend) else 1


if __name__ == "__main__":
    sys.exit(main())
