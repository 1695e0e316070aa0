"""Sharded leadership: balance, churn, failover and cost, against independent leases.

For each S (shards) and N (node processes), two fleets run in turn on a fresh schema:

* **sharded**: N ``tests/support/shard_node.py`` processes, one ``PostgresShardedLeader``
  of S shards each;
* **baseline**: N ``tests/support/scale_node.py`` processes, each running S independent
  ``PostgresLeader``s of the same names (first come, first served: no balance).

Measured, for each:

* **balance**: shards held per node (max / min) once the fleet settled (sharded: after
  ``wait_until_balanced``'s condition held, by the lease table; baseline: once every
  lease was led and 3 s passed), and the seconds from the last node's start to it.
* **idle cost** over ``--window`` seconds: sessions per process (the process's TCP
  connections to the server, largest sample, psutil) and transactions per second of the
  whole fleet (``pg_stat_database.xact_commit`` of the benchmark's own database).
* **crash**: ``kill -9`` of the node that holds the most shards (sharded: the
  coordinator's node); per shard it held, from the kill to another node's ``elected``
  (CLOCK_MONOTONIC, shared by the processes): p50 / p95 / max. Sharded: then the seconds
  until balanced again over N - 1 nodes, and the moves (ownership changes after the
  kill) against the minimum (the killed node's shards).
* **join**: one node more; sharded: seconds from its start until balanced, moves against
  the minimum (``floor(S / N)``: the new node's share), and each move's handover time
  (the old owner's demotion to the new owner's election, p50 / p95); baseline: how many
  shards the new node got (none: every lease is held).

With ``--backend redis`` the sharded fleet runs ``RedisShardedLeader``s on
``--redis-url`` (the benchmark's keys are deleted afterwards): sessions per process are
its TCP connections to Redis, and the rate is Redis's commands per second
(``INFO stats``, the whole server's: run it on a quiet one). There is no Redis
baseline, and the sessions target is Postgres's (a Redis lease keeps connections of its
own): on Redis it is reported, not judged.

Usage::

    python bench/shards.py [--sizes 16,256,1024] [--nodes 2,4,8] [--window 10]
                           [--max-leaders 10000] [--dsn DSN] [--no-baseline]
                           [--backend postgres|redis] [--redis-url URL]

Configurations with more than ``--max-leaders`` leaders in all (S x (N + 1), the joining
node included) are skipped. Library timings are the defaults (ttl 15 s,
renewal every 2 s; heartbeats every 1 s for the sharded leader).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.pg import with_search_path  # noqa: E402
from tests.support.scale_fleet import ScaleFleet, percentile  # noqa: E402
from tests.support.shard_fleet import (  # noqa: E402
    PostgresShards,
    RedisShards,
    ShardFleet,
    ShardServer,
    balanced,
)

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DATABASE = "rselection_bench_shards"
SETTLE_TIMEOUT = 120.0


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``predicate`` until it holds; the seconds it took (raises on timeout)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(0.1)
    return time.monotonic() - start


def holders(dsn: str, prefix: str) -> dict[int, str]:
    """Who holds each lease ``<prefix>/<i>`` now, from the lease table."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT name, holder FROM rselection_leases WHERE name LIKE %s"
                " AND holder IS NOT NULL AND expires_at > clock_timestamp()",
                (prefix + "/%",),
            ).fetchall()
    except psycopg.errors.UndefinedTable:
        return {}
    return {int(name.rsplit("/", 1)[1]): holder for name, holder in rows}


def counts(table: dict[int, str], nodes: list[str]) -> dict[str, int]:
    out = dict.fromkeys(nodes, 0)
    for node in table.values():
        out[node] = out.get(node, 0) + 1
    return out


def idle_cost(server: str, pids: list[int], window: float) -> tuple[int, float]:
    """Largest sessions count of any process, and the fleet's transactions per second."""

    def xacts() -> int:
        with psycopg.connect(server, autocommit=True) as conn:
            row = conn.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                (DATABASE,),
            ).fetchone()
        assert row is not None
        return int(row[0])

    return sampled_cost(pids, 5432, xacts, window)


def redis_idle_cost(url: str, pids: list[int], window: float) -> tuple[int, float]:
    """Largest connections count of any process to Redis, and the server's commands per
    second."""
    import redis

    client = redis.Redis.from_url(url)
    port = int(client.connection_pool.connection_kwargs.get("port", 6379))

    def commands() -> int:
        return int(client.info("stats")["total_commands_processed"])

    try:
        return sampled_cost(pids, port, commands, window)
    finally:
        client.close()


def sampled_cost(
    pids: list[int], port: int, counter: Callable[[], int], window: float
) -> tuple[int, float]:
    """Largest count of any process's connections to ``port`` over ``window`` seconds,
    and ``counter``'s rate over it."""
    time.sleep(1.5)  # the counters of the settling phase reach the view first
    first, start = counter(), time.monotonic()
    sessions = 0
    while time.monotonic() - start < window:
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                conns = psutil.Process(pid).net_connections(kind="inet")
                sessions = max(sessions, sum(1 for c in conns if c.raddr and c.raddr.port == port))
        time.sleep(0.5)
    time.sleep(1.0)
    rate = (counter() - first) / (time.monotonic() - start)
    return sessions, rate


def pct(values: list[float]) -> str:
    if not values:
        return "-"
    return (
        f"{statistics.median(values) * 1000:.0f} / {percentile(values, 95) * 1000:.0f} / "
        f"{max(values) * 1000:.0f} ms"
    )


def sharded(
    target: ShardServer, cost: Callable[[list[int]], tuple[int, float]], shards: int, nodes: int
) -> dict[str, Any]:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    out: dict[str, Any] = {}
    with ShardFleet(target, name, shards, ["--task", "async"]) as fleet:
        names = [f"s{i}" for i in range(nodes)]
        for node in names:
            fleet.add(node)
        for node in fleet.nodes.values():
            node.ready(120)
        started = time.monotonic()
        wait(lambda: balanced(fleet, names), SETTLE_TIMEOUT, "balance")
        held = counts(fleet.holders(), names)
        out["balance"] = f"{max(held.values())} / {min(held.values())}"
        out["settle"] = time.monotonic() - started
        pids = [node.proc.pid for node in fleet.nodes.values()]
        out["sessions"], out["xacts"] = cost(pids)

        before = fleet.holders()
        victim = fleet.coordinator() or names[0]
        theirs = {s for s, n in before.items() if n == victim}
        killed = fleet.nodes[victim].kill()
        rest = [n for n in names if n != victim]
        wait(
            lambda: (
                {
                    e["shard"]
                    for e in fleet.events()
                    if e["event"] == "elected" and e["mono"] > killed
                }
                >= theirs
            ),
            SETTLE_TIMEOUT,
            "takeover",
        )
        firsts: dict[int, float] = {}
        for e in fleet.events():
            if e["event"] == "elected" and e["mono"] > killed and e["shard"] in theirs:
                firsts.setdefault(e["shard"], e["mono"] - killed)
        out["failover"] = pct(list(firsts.values()))
        out["failover_p95"] = percentile(list(firsts.values()), 95)
        out["rebalance"] = wait(lambda: balanced(fleet, rest), 60, "rebalance")
        time.sleep(2.0)
        moved = sum(1 for e in fleet.events() if e["event"] == "elected" and e["mono"] > killed)
        out["moves_leave"] = f"{moved} (min {len(theirs)})"
        out["extra_on_crash"] = moved - len(theirs)

        joined = time.monotonic()
        fleet.add("joiner").ready(120)
        after = [*rest, "joiner"]
        wait(lambda: balanced(fleet, after), 60, "balance after the join")
        out["join"] = time.monotonic() - joined
        time.sleep(2.0)
        events = fleet.events()
        moves = [e for e in events if e["event"] == "elected" and e["mono"] > joined]
        out["moves_join"] = f"{len(moves)} (min {shards // len(after)})"
        out["extra_on_join"] = len(moves) - shards // len(after)
        gaps = []
        for e in moves:
            released = [
                d["mono"]
                for d in events
                if d["event"] == "demoted"
                and d["shard"] == e["shard"]
                and joined < d["mono"] <= e["mono"]
            ]
            if released:
                gaps.append(e["mono"] - max(released))
        out["handover"] = pct(gaps)
        out["handover_p95"] = percentile(gaps, 95) if gaps else float("inf")
    return out


#: The issue's targets for a sharded fleet: (what, the result's key, bound, unit).
TARGETS = (
    ("crash failover p95", "failover_p95", 1.0, "s"),
    ("join at its share", "join", 5.0, "s"),
    ("handover p95", "handover_p95", 0.1, "s"),
    ("moves on crash beyond the dead node's shards", "extra_on_crash", 0, ""),
    ("moves on join beyond the new node's share", "extra_on_join", 0, ""),
    ("sessions per process", "sessions", 3, ""),
)


def _figure(value: float, unit: str) -> str:
    if unit != "s":
        return f"{value:g}"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def verdicts(results: list[tuple[int, int, dict[str, Any]]], backend: str) -> list[str]:
    """One line per sharded configuration and target: the figure against its bound."""
    lines = []
    for shards, nodes, r in results:
        for what, key, bound, unit in TARGETS:
            value = r[key]
            shown, limit = (_figure(value, unit), _figure(bound, unit))
            verdict = "PASS" if value <= bound else "FAIL"
            if key == "sessions" and backend != "postgres":
                verdict = "(Postgres's target: reported only)"
            lines.append(f"S={shards} N={nodes}: {what}: {shown} (bound {limit}) {verdict}")
    return lines


def baseline(server: str, dsn: str, shards: int, nodes: int, window: float) -> dict[str, Any]:
    prefix = f"base-{uuid.uuid4().hex[:6]}"
    out: dict[str, Any] = {}
    with ScaleFleet(dsn, prefix, shards, ["--idle-task", "async"]) as fleet:
        names = [f"b{i}" for i in range(nodes)]
        for node in names:
            fleet.add(node)
        for node in fleet.nodes.values():
            node.ready(120)
        started = time.monotonic()
        wait(lambda: len(holders(dsn, prefix)) == shards, SETTLE_TIMEOUT, "every lease led")
        time.sleep(3.0)
        out["settle"] = time.monotonic() - started
        held = counts(holders(dsn, prefix), names)
        out["balance"] = f"{max(held.values())} / {min(held.values())}"
        pids = [node.proc.pid for node in fleet.nodes.values()]
        out["sessions"], out["xacts"] = idle_cost(server, pids, window)

        victim = max(held, key=lambda n: held[n])
        theirs = {s for s, n in holders(dsn, prefix).items() if n == victim}
        killed = fleet.nodes[victim].kill()
        leases = {f"{prefix}/{s}" for s in theirs}

        def taken() -> dict[str, float]:
            firsts: dict[str, float] = {}
            for node in fleet.nodes.values():
                for e in node.of("elected", since=killed):
                    if e["lease"] in leases:
                        firsts[e["lease"]] = min(firsts.get(e["lease"], math.inf), e["mono"])
            return firsts

        wait(lambda: set(taken()) >= leases, SETTLE_TIMEOUT, "takeover")
        out["failover"] = pct([t - killed for t in taken().values()])
        out["rebalance"] = "never"
        out["moves_leave"] = f"{len(theirs)} (min {len(theirs)})"
        joined = time.monotonic()
        fleet.add("joiner").ready(120)
        time.sleep(5.0)
        got = counts(holders(dsn, prefix), ["joiner"])["joiner"]
        out["join"] = f"never (got {got})"
        out["moves_join"] = f"{got} (min {shards // nodes})"
        out["handover"] = "-"
        del joined
    return out


@contextlib.contextmanager
def bench_schema(server: str) -> Iterator[str]:
    """A fresh schema in the benchmark's own database, dropped afterwards."""
    with psycopg.connect(server, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
        if exists.fetchone() is None:
            conn.execute(f"CREATE DATABASE {DATABASE}")
    base = psycopg.conninfo.make_conninfo(server, dbname=DATABASE)
    schema = f"b_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield with_search_path(base, schema)
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def run(args: argparse.Namespace, kind: str, shards: int, nodes: int) -> dict[str, Any]:
    """One configuration of one fleet kind on the chosen backend."""
    if args.backend == "redis":
        target = RedisShards(args.redis_url)
        try:
            return sharded(
                target,
                lambda pids: redis_idle_cost(args.redis_url, pids, args.window),
                shards,
                nodes,
            )
        finally:
            target.forget_keys()
    with bench_schema(args.dsn) as dsn:
        if kind == "baseline":
            return baseline(args.dsn, dsn, shards, nodes, args.window)
        return sharded(
            PostgresShards(dsn),
            lambda pids: idle_cost(args.dsn, pids, args.window),
            shards,
            nodes,
        )


def seconds(value: Any) -> str:
    return f"{value:.2f} s" if isinstance(value, float) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,256,1024")
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--max-leaders", type=int, default=10000)
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="a server (any database on it)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--backend", choices=("postgres", "redis"), default="postgres")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    args = parser.parse_args()
    rows = [
        (
            "fleet",
            "S",
            "N",
            "balance max/min",
            "settle",
            "sessions/proc",
            "xact/s",
            "crash p50/p95/max",
            "rebalance",
            "moves on crash",
            "join",
            "moves on join",
            "handover p50/p95/max",
        ),
    ]
    results: list[tuple[int, int, dict[str, Any]]] = []
    for shards in (int(s) for s in args.sizes.split(",")):
        for nodes in (int(n) for n in args.nodes.split(",")):
            if shards * (nodes + 1) > args.max_leaders:
                print(f"skipping S={shards} N={nodes}: over --max-leaders", flush=True)
                continue
            kinds = ["sharded"]
            if not args.no_baseline and args.backend == "postgres":
                kinds.append("baseline")
            for kind in kinds:
                print(f"running {kind} S={shards} N={nodes} on {args.backend} ...", flush=True)
                try:
                    r = run(args, kind, shards, nodes)
                except Exception as exc:  # report and go on with the next configuration
                    print(f"  failed: {exc}", flush=True)
                    continue
                row = (
                    kind,
                    str(shards),
                    str(nodes),
                    r["balance"],
                    seconds(r["settle"]),
                    str(r["sessions"]),
                    f"{r['xacts']:.1f}",
                    r["failover"],
                    seconds(r["rebalance"]),
                    r["moves_leave"],
                    seconds(r["join"]),
                    r["moves_join"],
                    r["handover"],
                )
                print("  " + " | ".join(row), flush=True)
                rows.append(row)
                if kind == "sharded":
                    results.append((shards, nodes, r))
    print()
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows[1:]:
        print("| " + " | ".join(row) + " |")
    lines = verdicts(results, args.backend)
    if lines:
        print()
        print("Targets of the sharded fleet:")
        for line in lines:
            print("  " + line)
    return 1 if any(line.endswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
