"""rselection next to its peers: one run, same machine, same scenarios, side by side.

Systems (each a fleet of ``--nodes`` processes competing for one lease):

* ``rs-pg``: rselection's :class:`~rselection.PostgresLeader` (``python -m
  rselection.commands.demo_fleet``), library default timings (ttl 15 s, renew every 2 s,
  renew deadline 10 s, retry 2 s);
* ``rs-redis``: rselection's :class:`~rselection.RedisLeader`, same timings;
* ``tooz``: OpenStack tooz's Redis leader election at its defaults
  (``bench/failover.py tooz-node``: ``watch_elected_as_leader``, ``run_watchers()``
  every 100 ms, ``coord.stop()`` on SIGTERM);
* ``k8s``: ``bench/k8s_style.py``, client-go's leader election algorithm over a lease
  row in Postgres with client-go's default timings (lease 15 s, renew deadline 10 s,
  retry period 2 s), with ``ReleaseOnCancel`` and, for the graceful stop only, also
  without it.

Scenarios:

* kill -9 failover: SIGKILL the leader's process; time until another node reports
  ``elected``;
* graceful handover: SIGTERM the leader (each program's graceful stop); time until
  another node reports ``elected``;
* idle follower cost: queries (Postgres) or commands (Redis) per second that one idle
  follower makes the server run, counted on the server.

Postgres is a private server (``tests/support/pg.py``) that logs every statement with
its backend pid, so statements are counted per session and mapped to node processes
through their client ports. Redis 7.0 has no per-client command counter, so Redis
commands come from ``INFO commandstats`` deltas of a private ``redis-server``: a window
with one leader and two idle followers, then, after stopping the followers, a window
with the leader alone; the difference over two is the rate per follower.

It prints one table (p50 and max per scenario, with the ratio to rselection on
Postgres) and writes it, with the date, the machine, the load and the command, to
``bench/RESULTS.md``.

Usage::

    python bench/peers.py [--nodes 3] [--rounds 5] [--slow-rounds 3] [--cost-window 30]
                          [--systems rs-pg,rs-redis,tooz,k8s] [--results PATH | --no-save]
                          [--dsn DSN --server-log PATH] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import psycopg  # noqa: E402
from failover import (  # noqa: E402
    IDLE_TASKS,
    ROOT,
    BenchError,
    BenchFleet,
    Timings,
    ToozFleet,
    count_statements,
    crash_rounds,
    database,
    drop_bench_objects,
    handover_rounds,
    keeper_owner,
    percentile,
    redis_server,
    summarize_node_log,
)

SYSTEMS = ("rs-pg", "rs-redis", "tooz", "k8s")
LABELS = {
    "rs-pg": "rselection (Postgres)",
    "rs-redis": "rselection (Redis)",
    "tooz": "tooz (Redis)",
    "k8s": "k8s-style (Postgres)",
}

#: How long a fleet gets after its leader is elected before a cost window opens: every
#: follower must have finished its start-up queries and settled into its idle loop (an
#: rselection follower waits up to a lease period per statement, a k8s-style one polls
#: every 2 to 4.4 s).
COST_SETTLE = 5.0

Log = Callable[[str], None]

#: File paths in the nodes' log lines (tracebacks); kept out of the saved results.
_PATHS = re.compile(r"(/[\w.+-]+)+")


@dataclass
class Result:
    """What one system measured."""

    key: str
    crash: list[float] = field(default_factory=list)
    handover: list[float] = field(default_factory=list)
    handover_no_release: list[float] = field(default_factory=list)
    follower_rates: list[float] = field(default_factory=list)  # per idle follower, 1/s
    leader_rate: float | None = None
    cost_detail: str = ""
    errors: list[str] = field(default_factory=list)
    surprises: list[str] = field(default_factory=list)


# -- fleets -----------------------------------------------------------------------------


class K8sFleet(BenchFleet):
    """Node processes of the client-go-style baseline (``bench/k8s_style.py node``)."""

    def command(self, node_id: str, extra: list[str] | None = None) -> list[str]:
        """The command line of k8s-style node ``node_id``."""
        script = str(HERE / "k8s_style.py")
        return [sys.executable, script, "node", self.dsn, self.name, node_id, *self.node_args]


def start_fleet(fleet: BenchFleet, nodes: int, timeout: float, log: Log, what: str) -> str:
    """Spawn ``nodes`` nodes, wait until all are up and one leads; return the leader."""
    for _ in range(nodes):
        fleet.fresh_node()
    for node in list(fleet.procs):
        fleet.ready(node, 30)
    leader = fleet.current_leader(timeout)
    log(f"{what}: {nodes} nodes ready, {leader['node']} leads term {leader['term']}")
    fleet.drain(1.0)
    return str(leader["node"])


@contextlib.contextmanager
def running(fleet: BenchFleet, result: Result) -> Iterator[BenchFleet]:
    """Stop every node of ``fleet`` at the end and keep what surprised it."""
    try:
        yield fleet
    finally:
        fleet.stop_all()
        result.surprises += fleet.surprises


def failover_phase(
    fleet: BenchFleet,
    timings: Timings,
    nodes: int,
    crashes: int,
    handovers: int,
    log: Log,
    what: str,
) -> tuple[list[float], list[float]]:
    """Crash rounds, then handover rounds, on one fleet; their times in seconds."""
    start_fleet(fleet, nodes, timings.ttl + timings.retry_interval + 15, log, what)
    crash = crash_rounds(fleet, timings, crashes, log).times if crashes else []
    handover = handover_rounds(fleet, timings, handovers, log).times if handovers else []
    return crash, handover


# -- cost: Postgres ---------------------------------------------------------------------


def client_pids(dsn: str) -> set[int]:
    """Backend pids of every client session in the database but this one."""
    with psycopg.connect(dsn, autocommit=True, application_name="rselection-bench") as conn:
        return {
            int(r[0])
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'"
                " AND datname = current_database() AND pid <> pg_backend_pid()"
            )
        }


def pg_cost(
    fleet: BenchFleet,
    dsn: str,
    server_log: Path | None,
    nodes: int,
    window: float,
    timeout: float,
    result: Result,
    log: Log,
    what: str,
) -> None:
    """Queries (round trips) per second of each node process, from the server's statement log.

    Every session of a node process counts (a rselection node has its keeper session
    and may have others), so the figure is what the node costs the server, not what
    one connection does.
    """
    leader = start_fleet(fleet, nodes, timeout, log, what)
    if server_log is None:
        result.cost_detail = "not measured (no statement log; pass --server-log with --dsn)"
        return
    fleet.drain(COST_SETTLE)
    pids = client_pids(dsn)
    owners = keeper_owner(fleet, dsn, sorted(pids))
    elections = len(fleet.elections)
    offset = server_log.stat().st_size
    began = time.monotonic()
    fleet.drain(window)
    elapsed = time.monotonic() - began
    offset_end = server_log.stat().st_size
    if len(fleet.elections) != elections or fleet.leader is None:
        raise BenchError(f"{what}: leadership changed during the cost window; void")
    # Sessions may come and go (a leader's pool closing an idle connection); a session
    # opened during the window is mapped now, while its process still holds it.
    if new := client_pids(dsn) - pids:
        owners |= keeper_owner(fleet, dsn, sorted(new))
    counts = count_statements(server_log, offset, offset_end)
    per_node: Counter[str] = Counter({node: 0 for node in fleet.procs})
    node_kinds: dict[str, Counter[str]] = {node: Counter() for node in fleet.procs}
    stray = 0
    for pid, kinds in counts.items():
        if pid in owners:
            per_node[owners[pid]] += sum(kinds.values())
            node_kinds[owners[pid]].update(kinds)
        else:
            stray += sum(kinds.values())  # sessions of nothing we started (should be none)
    rates = {node: n / elapsed for node, n in per_node.items()}
    result.leader_rate = rates.pop(leader)
    result.follower_rates = sorted(rates.values())
    sessions = Counter(owners.values())

    def described(node: str) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(node_kinds[node].items()))
        return f"{per_node[node]} ({kinds or 'none'})"

    # The kinds are failover.py's names for rselection's lease queries; anything else
    # (every k8s-style statement, rselection's other sessions) is "other".
    result.cost_detail = (
        f"{elapsed:.1f} s window; queries: leader {described(leader)}, followers "
        + ", ".join(described(n) for n in sorted(rates))
        + f"; sessions per node {dict(sorted(sessions.items()))}; unattributed {stray}"
    )
    log(f"{what} cost: {result.cost_detail}")


# -- cost: Redis ------------------------------------------------------------------------


def command_calls(client: Any) -> Counter[str]:
    """Calls per command so far (``INFO commandstats``), without this client's INFO."""
    stats = client.info("commandstats")
    calls: Counter[str] = Counter()
    for key, value in stats.items():
        name = key.removeprefix("cmdstat_")
        if name != "info":
            calls[name] = int(value["calls"])
    return calls


def redis_cost(
    fleet: BenchFleet,
    url: str,
    nodes: int,
    window: float,
    timeout: float,
    result: Result,
    log: Log,
    what: str,
) -> None:
    """Commands per second per idle follower: (all nodes - leader alone) / followers.

    Redis 7.0 counts commands per command name, not per client, so the follower share
    is the difference between a window with the whole fleet and one with the leader
    alone (the followers stopped gracefully in between).
    """
    import redis

    leader = start_fleet(fleet, nodes, timeout, log, what)
    client = redis.Redis.from_url(url)
    try:
        command_calls(client)  # connect now: the connection's own set-up is not counted
        fleet.drain(COST_SETTLE)
        elections = len(fleet.elections)

        def measure() -> tuple[Counter[str], float]:
            before = command_calls(client)
            began = time.monotonic()
            fleet.drain(window)
            elapsed = time.monotonic() - began
            after = command_calls(client)
            after.subtract(before)
            return after, elapsed

        full, full_s = measure()
        followers = [n for n in fleet.procs if n != leader]
        for node in followers:
            fleet.kill(node, signal.SIGTERM)
        for node in followers:
            fleet.reap(node, 30)
        fleet.drain(COST_SETTLE)
        alone, alone_s = measure()
    finally:
        client.close()
    if len(fleet.elections) != elections or fleet.leader is None:
        raise BenchError(f"{what}: leadership changed during the cost windows; void")
    total_rate = sum(full.values()) / full_s
    alone_rate = sum(alone.values()) / alone_s
    per_follower = (total_rate - alone_rate) / len(followers)
    result.leader_rate = alone_rate
    result.follower_rates = [per_follower]
    by_command = {
        name: (full[name] / full_s - alone[name] / alone_s) / len(followers)
        for name in set(full) | set(alone)
    }
    shown = ", ".join(
        f"{name} {rate:.2f}"
        for name, rate in sorted(by_command.items(), key=lambda kv: -kv[1])
        if abs(rate) >= 0.005
    )
    leader_shown = ", ".join(
        f"{name} {n / alone_s:.2f}" for name, n in alone.most_common() if n / alone_s >= 0.005
    )
    result.cost_detail = (
        f"2 x {window:g} s windows; all nodes {total_rate:.2f}/s, leader alone "
        f"{alone_rate:.2f}/s; per follower by command: {shown or 'none'}; "
        f"leader alone by command: {leader_shown or 'none'}"
    )
    log(f"{what} cost: {result.cost_detail}")


# -- systems ----------------------------------------------------------------------------


@dataclass
class Env:
    """What every system run needs."""

    args: argparse.Namespace
    stderr: IO[str]
    log: Log
    dsn: str = ""
    server_log: Path | None = None
    redis_url: str = ""
    leases: list[str] = field(default_factory=list)
    ledger: str = f"rselection_bench_ledger_{uuid.uuid4().hex[:6]}"

    def lease(self, prefix: str) -> str:
        """A new lease name, remembered for clean-up."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.leases.append(name)
        return name


def run_rs_pg(env: Env, result: Result) -> None:
    """rselection's PostgresLeader: crash and handover rounds, then the cost fleet."""
    a, t = env.args, Timings()
    node_args = [*t.node_args(), "--ledger", env.ledger]
    with running(BenchFleet(env.dsn, env.lease("bench"), node_args, env.stderr), result) as f:
        result.crash, result.handover = failover_phase(
            f, t, a.nodes, a.rounds, a.rounds, env.log, "rs-pg"
        )
    cost_args = [*t.node_args(), *IDLE_TASKS, "--ledger", env.ledger]
    with running(BenchFleet(env.dsn, env.lease("bench"), cost_args, env.stderr), result) as f:
        pg_cost(f, env.dsn, env.server_log, 3, a.cost_window, 30, result, env.log, "rs-pg")


def run_k8s(env: Env, result: Result) -> None:
    """The client-go-style baseline: with release (crash, handover), without (handover)."""
    a = env.args
    # Only the bench's own time-outs use these: a crash takes up to about
    # 2.2 * retry + lease + 2.2 * retry = 23.8 s.
    t = Timings(ttl=25.0)
    with running(K8sFleet(env.dsn, env.lease("k8s"), [], env.stderr), result) as f:
        result.crash, result.handover = failover_phase(
            f, t, a.nodes, a.slow_rounds, a.rounds, env.log, "k8s (release on cancel)"
        )
    if a.slow_rounds:
        no_release = K8sFleet(env.dsn, env.lease("k8s"), ["--no-release"], env.stderr)
        with running(no_release, result) as f:
            _, result.handover_no_release = failover_phase(
                f, t, a.nodes, 0, a.slow_rounds, env.log, "k8s (no release)"
            )
    with running(K8sFleet(env.dsn, env.lease("k8s"), [], env.stderr), result) as f:
        pg_cost(f, env.dsn, env.server_log, 3, a.cost_window, 40, result, env.log, "k8s")


def run_rs_redis(env: Env, result: Result) -> None:
    """rselection's RedisLeader: crash and handover rounds, then the cost fleet."""
    a, t = env.args, Timings()
    node_args = [*t.node_args(), "--backend", "redis", "--ledger", "rselection_bench_ledger"]
    fleet = BenchFleet(env.redis_url, env.lease("bench"), node_args, env.stderr)
    with running(fleet, result) as f:
        result.crash, result.handover = failover_phase(
            f, t, a.nodes, a.rounds, a.rounds, env.log, "rs-redis"
        )
    cost_args = [*node_args, *IDLE_TASKS]
    with running(BenchFleet(env.redis_url, env.lease("bench"), cost_args, env.stderr), result) as f:
        redis_cost(f, env.redis_url, 3, a.cost_window, 30, result, env.log, "rs-redis")


def run_tooz(env: Env, result: Result) -> None:
    """tooz's Redis election: crash rounds (each waits ~30 s lock expiry), handovers."""
    import tooz.coordination  # noqa: F401  (fail here, clearly, if tooz is missing)

    a = env.args
    t = Timings(ttl=45.0)  # time-outs only: tooz's lock expires after 30 s
    with running(ToozFleet(env.redis_url, env.lease("bench-tooz"), [], env.stderr), result) as f:
        result.crash, result.handover = failover_phase(
            f, t, a.nodes, a.slow_rounds, a.rounds, env.log, "tooz"
        )
    with running(ToozFleet(env.redis_url, env.lease("bench-tooz"), [], env.stderr), result) as f:
        redis_cost(f, env.redis_url, 3, a.cost_window, 60, result, env.log, "tooz")


RUNNERS: dict[str, Callable[[Env, Result], None]] = {
    "rs-pg": run_rs_pg,
    "k8s": run_k8s,
    "rs-redis": run_rs_redis,
    "tooz": run_tooz,
}


def run_guarded(key: str, env: Env) -> Result:
    """Run one system; a failure is recorded and the others still run."""
    result = Result(key)
    env.log(f"== {LABELS[key]}")
    try:
        RUNNERS[key](env, result)
    except Exception as exc:
        if not isinstance(exc, BenchError):
            traceback.print_exc()
        result.errors.append(f"{type(exc).__name__}: {exc}")
        env.log(f"{key} failed: {exc}")
    return result


# -- the table --------------------------------------------------------------------------


def fmt_time(seconds: float) -> str:
    """Milliseconds below 10 s, seconds above."""
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def fmt_ratio(value: float, base: float | None) -> str:
    """`` (N x)`` against ``base``, to two significant figures."""
    if base is None or base <= 0:
        return ""
    r = value / base
    return f" ({r:.2f}x)" if r < 1 else f" ({r:.1f}x)" if r < 10 else f" ({r:.0f}x)"


def build_table(results: dict[str, Result]) -> str:
    """The markdown table: rows are measurements, columns systems, ratios vs rs-pg."""
    keys = [k for k in SYSTEMS if k in results]
    base = results.get("rs-pg")

    def times(get: Callable[[Result], list[float]], stat: str) -> Callable[[Result], float | None]:
        def value(r: Result) -> float | None:
            t = get(r)
            if not t:
                return None
            return percentile(t, 0.5) if stat == "p50" else max(t)

        return value

    rows: list[tuple[str, Callable[[Result], float | None], Callable[[float], str], bool]] = [
        ("kill -9 failover, p50", times(lambda r: r.crash, "p50"), fmt_time, False),
        ("kill -9 failover, max", times(lambda r: r.crash, "max"), fmt_time, False),
        ("graceful handover, p50", times(lambda r: r.handover, "p50"), fmt_time, False),
        ("graceful handover, max", times(lambda r: r.handover, "max"), fmt_time, False),
        (
            "graceful handover without release, p50",
            times(lambda r: r.handover_no_release, "p50"),
            fmt_time,
            True,
        ),
        (
            "graceful handover without release, max",
            times(lambda r: r.handover_no_release, "max"),
            fmt_time,
            True,
        ),
        (
            "idle follower, queries or commands/s",
            lambda r: sum(r.follower_rates) / len(r.follower_rates) if r.follower_rates else None,
            lambda v: f"{v:.2f}/s",
            False,
        ),
        (
            "leader, queries or commands/s",
            lambda r: r.leader_rate,
            lambda v: f"{v:.2f}/s",
            False,
        ),
    ]
    header = ["measurement", *(LABELS[k] for k in keys)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for label, get, fmt, vs_handover in rows:
        cells = []
        for k in keys:
            v = get(results[k])
            if v is None:
                cells.append("-")
                continue
            # Without release only the baseline has a figure; compare it with what
            # rselection's graceful stop (which always releases) achieves.
            ref_label = label.replace(" without release", "") if vs_handover else label
            ref_get = next(g for lab, g, _, _ in rows if lab == ref_label)
            b = ref_get(base) if base is not None else None
            cells.append(fmt(v) + ("" if k == "rs-pg" else fmt_ratio(v, b)))
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


# -- the machine ------------------------------------------------------------------------


def command_output(cmd: list[str]) -> str:
    """The first line a command prints, or ``?``."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "?"
    return (out.stdout.strip().splitlines() or ["?"])[0]


def pg_version(dsn: str) -> str:
    """The server's version string, e.g. ``16.2``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def redis_version(url: str) -> str:
    """The server's ``redis_version``."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return str(client.info("server")["redis_version"])
    finally:
        client.close()


def package_version(name: str) -> str:
    """An installed distribution's version, or ``?``."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


# -- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        prog="bench/peers.py",
        description="rselection vs tooz and a client-go-style lease, side by side.",
    )
    p.add_argument("--nodes", type=int, default=3, help="node processes per fleet (default 3)")
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds that end in seconds: rselection crash and handover, tooz and "
        "k8s-style handover with release (default 5)",
    )
    p.add_argument(
        "--slow-rounds",
        type=int,
        default=3,
        help="rounds that wait for a lease to expire: tooz crash (~30 s), k8s-style "
        "crash and handover without release (~15-20 s) (default 3)",
    )
    p.add_argument("--cost-window", type=float, default=30.0, help="cost window, seconds")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="table file")
    p.add_argument("--no-save", action="store_true", help="print only; do not write --results")
    p.add_argument("--dsn", help="use this Postgres instead of a private one")
    p.add_argument(
        "--server-log",
        type=Path,
        help="with --dsn: its log, written with log_statement='all' and "
        "log_line_prefix='%%p %%a ' (else statement counts are skipped)",
    )
    p.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.nodes < 2 or args.rounds < 0 or args.slow_rounds < 0 or args.cost_window <= 0:
        p.error("need --nodes >= 2, rounds >= 0 and a positive cost window")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every system; print and save the table. 0 if all ran, 1 if one failed."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, _f: sys.exit(128 + signum))
    # Node processes import rselection and the demo from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )

    def log(text: str) -> None:
        print(text, flush=True)

    started = time.monotonic()
    load_before = os.getloadavg()
    machine: dict[str, str] = {
        "cores": command_output(["nproc"]),
        "python": platform.python_version(),
        "tooz": package_version("tooz"),
    }
    log(
        f"peers benchmark: {args.nodes} nodes per fleet, {args.rounds} fast rounds, "
        f"{args.slow_rounds} slow rounds, {args.cost_window:g} s cost windows; "
        f"{machine['cores']} cores, load average {load_before[0]:.2f}"
    )
    results: dict[str, Result] = {}
    with (
        tempfile.TemporaryDirectory(prefix="rselection-peers-") as tmp,
        open(Path(tmp) / "nodes.log", "w") as node_log,
    ):
        env = Env(args, node_log, log)
        pg_keys = [k for k in ("rs-pg", "k8s") if k in args.systems]
        if pg_keys:
            with database(args.dsn, args.server_log) as (dsn, server_log):
                env.dsn, env.server_log = dsn, server_log
                machine["postgres"] = pg_version(dsn)
                try:
                    for key in pg_keys:
                        results[key] = run_guarded(key, env)
                finally:
                    if args.dsn:
                        drop_bench_objects(dsn, env.ledger, env.leases)
                        with contextlib.suppress(psycopg.Error), psycopg.connect(dsn) as c:
                            c.execute(
                                "DELETE FROM k8s_style_leases WHERE name = ANY(%s)", (env.leases,)
                            )
        redis_keys = [k for k in ("rs-redis", "tooz") if k in args.systems]
        if redis_keys:
            with redis_server(args.redis_url) as url:
                env.redis_url = url
                machine["redis"] = redis_version(url)
                for key in redis_keys:
                    results[key] = run_guarded(key, env)
        node_log.flush()
        node_messages = summarize_node_log(Path(tmp) / "nodes.log")
    load_after = os.getloadavg()
    took = time.monotonic() - started

    table = build_table(results)
    print()
    print(table)
    print()
    details = detail_lines(results, node_messages)
    for line in details:
        print(line)
    print(f"\ntotal time {took:.0f} s; load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    if not args.no_save:
        command = shlex.join(["python", "bench/peers.py", *argv])
        text = results_markdown(
            args, table, details, machine, load_before, load_after, took, command
        )
        args.results.write_text(text)
        print(f"wrote {args.results.name}")
    return 1 if any(r.errors for r in results.values()) else 0


def detail_lines(results: dict[str, Result], node_messages: list[str]) -> list[str]:
    """Every round's time, the cost details, and anything that went wrong."""
    out = []
    for key in SYSTEMS:
        r = results.get(key)
        if r is None:
            continue
        out.append(f"- {LABELS[key]}:")
        for name, times in (
            ("kill -9", r.crash),
            ("handover", r.handover),
            ("handover without release", r.handover_no_release),
        ):
            if times:
                shown = ", ".join(f"{t * 1000:.0f}" for t in times)
                out.append(f"  - {name} (ms, in round order): {shown}")
        if r.cost_detail:
            out.append(f"  - cost: {r.cost_detail}")
        for e in r.errors:
            out.append(f"  - FAILED: {e}")
        for s in r.surprises[:5]:
            out.append(f"  - event: {s}")
    if node_messages:
        out.append("- distinct messages the nodes logged to stderr:")
        # Tracebacks name files; keep this machine's paths out of the saved results.
        out += [f"  - `{_PATHS.sub('<path>', m.strip())}`" for m in node_messages]
    return out


METHOD = """\
How each number was measured:

- Every system runs as {nodes} separate processes on this machine competing for one
  lease; each reports `elected` with its wall-clock time as a JSON line, and the
  benchmark times events against its own clock (same machine, same clock).
- **kill -9 failover**: SIGKILL of the leader's process until another node reports
  `elected`; the killed node is replaced and the next round starts 0.5-1.5 s (random)
  after the fleet is whole again.
- **graceful handover**: SIGTERM of the leader, which runs its program's graceful stop
  (rselection: `leader.stop()`, which cancels and joins the leader's tasks, then
  releases; tooz: `coord.stop()`; k8s-style: cancel, then release the lease if
  `ReleaseOnCancel`), until another node reports `elected`.
- **without release**: the k8s-style baseline with `ReleaseOnCancel` off, so a stopped
  leader's lease has to expire on the followers' clocks. rselection and tooz always
  release on a graceful stop; their ratio in that row is against rselection's graceful
  handover.
- **idle follower, Postgres**: a fresh fleet of 3 (1 leader, 2 idle followers, rselection
  tasks idle) on a private Postgres that logs every statement with its backend pid
  (`log_statement = 'all'`); over a {window:g} s window, the logged queries of every
  session of each node process (sessions mapped to processes through their client
  ports) are counted; the row shows the mean over the two followers. One log entry is
  one query message, i.e. one round trip (rselection's follower sends a lease check and
  a lock wait that lasts up to a lease period; the k8s-style follower one `SELECT` per
  retry).
- **idle follower, Redis**: Redis 7.0 counts commands per command name, not per client,
  so `INFO commandstats` deltas (the benchmark's own `INFO` left out) are taken over a
  {window:g} s window with the fleet of 3 and then over one with the leader alone (the
  followers stopped gracefully in between); (fleet - leader alone) / 2 is the rate per
  follower. Redis counts the commands a Lua script runs as commands too, so one
  rselection `EVAL` shows up as the `EVAL` and the calls inside it. An rselection
  follower's figure includes its membership heartbeats (every 10 s: `EVALSHA`, `TIME`,
  `ZADD`) and its lease checks (one script per lease period); it does not poll the
  holder's connection: the holder publishes a liveness beat every 0.25 s (counted in
  the leader's figure, as `PUBLISH`) and a follower runs `CLIENT LIST ID` only when
  beats stop for 0.5 s (`client|list` in the per-command figures).
- **leader**: the leader's own queries (its process's sessions) or commands (the
  leader-alone window) per second, for reference.
- Ratios are each value divided by rselection (Postgres)'s value in the same row.
"""


def results_markdown(
    args: argparse.Namespace,
    table: str,
    details: list[str],
    machine: dict[str, str],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    took: float,
    command: str,
) -> str:
    """The content of ``bench/RESULTS.md``."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    pg = machine.get("postgres", "not run")
    rd = machine.get("redis", "not run")
    where_pg = "the server given with --dsn" if args.dsn else "a private server"
    where_rd = "the server given with --redis-url" if args.redis_url else "a private redis-server"
    return f"""# rselection and its peers: one run

`bench/peers.py` (see `bench/README.md`). Date: {now}.

Command: `{command}`

Machine: {machine["cores"]} cores (`nproc`), Python {machine["python"]}, Postgres {pg}
({where_pg}), Redis {rd} ({where_rd}), tooz {machine["tooz"]}. Other test suites were
running on the machine at the same time: 1-minute load average {load_before[0]:.2f} before
the run, {load_after[0]:.2f} after. The run took {took:.0f} s.

Rounds: {args.rounds} per fast scenario (rselection kill -9 and handover; tooz and
k8s-style handover with release), {args.slow_rounds} per slow one (tooz kill -9, which
waits for its 30 s lock expiry; k8s-style kill -9 and handover without release, which
wait for the 15 s lease on the followers' clocks). Timings: rselection's defaults (ttl
15 s, renew 2 s, renew deadline 10 s, retry 2 s; Redis liveness interval 0.5 s, node
heartbeats every 10 s on Redis and 5 s on Postgres); tooz's
defaults; client-go's defaults for the k8s-style baseline (lease 15 s, renew deadline
10 s, retry period 2 s, jitter 1.2).

{table}

{METHOD.format(nodes=args.nodes, window=args.cost_window)}
Per round and per system:

{chr(10).join(details)}
"""


if __name__ == "__main__":
    sys.exit(main())
