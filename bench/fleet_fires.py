"""Duplicate and missed fires of one interval task run by a fleet of processes.

Three ways to run the same task in ``--nodes`` processes, one after the other, each
through a ``kill -9`` of its leader at a third of the run and a graceful stop (SIGTERM)
of the next leader at two thirds:

* ``rselection``: :class:`rselection.PostgresLeader` with its default claimer: the leader
  claims each fire before it runs it, and a new leader catches up the fires missed while
  none led (``misfire="latest"``);
* ``apscheduler``: APScheduler 3, a ``BackgroundScheduler`` with an ``IntervalTrigger`` in
  every process (the "each worker runs the scheduler" deployment); the processes killed
  and stopped are the first two;
* ``leader-only``: the same ``PostgresLeader`` built with ``claimer=None``: only the
  leader runs fires, nothing claims them, nothing catches up.

Each node is ``tests/support/fire_node.py``. Every fire that runs writes one row (fire key
and instant) into the scheme's own ledger table, which has no unique constraint, so
duplicates are counted afterwards (GROUP BY instant). Every instant from the first fire
that ran to the last is accounted for: run once, run more than once, missed with a
reason the scheduler stated (a ``misfire`` skip report, or a claim held by the killed
node: claimed, then killed before the run finished), or missed without one.

Exit status: 0 when rselection had no duplicate and no unexplained miss, 1 otherwise,
2 when the benchmark could not run.

Usage::

    python bench/fleet_fires.py [--nodes 5] [--fires 1000] [--every 0.1] [--work 0.02]
                                [--schemes rselection,apscheduler,leader-only] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from tests.support.fire_node import (  # noqa: E402
    SCHEMES,
    FireFleet,
    Tally,
    claims_held_by,
    create_ledger,
    describe,
    instant_of_key,
    ledger_rows,
    sleep_until_phase,
    tally,
)
from tests.support.pg import with_search_path  # noqa: E402

LEADER_SCHEMES = ("rselection", "leader-only")


class BenchError(RuntimeError):
    """The benchmark could not go on (a bounded wait expired, the fleet misbehaved)."""


@dataclass
class Outcome:
    """What one scheme did."""

    scheme: str
    tally: Tally
    rows: int
    failover: float | None = None  # seconds from kill -9 to the next leader's election
    handover: float | None = None  # seconds from SIGTERM to the next leader's election
    reported: Counter[str] = field(default_factory=Counter)  # skip reasons, in the window
    failures: list[str] = field(default_factory=list)  # duplicate or failed ledger writes
    wall: float = 0.0


# -- one scheme ---------------------------------------------------------------------------


@contextlib.contextmanager
def scheme_schema(dsn: str, scheme: str) -> Iterator[str]:
    """A fresh schema for one scheme (its leases, claims and ledger), dropped afterwards."""
    name = f"bench_fires_{scheme.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
    ident = sql.Identifier(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
    try:
        yield with_search_path(dsn, name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '10s'")
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))


def window_fires(dsn: str, table: str, every: float) -> int:
    """Instants from the first fire that ran to the last one, so far."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT extract(epoch FROM max(scheduled_at) - min(scheduled_at)) FROM {}"
            ).format(sql.Identifier(table))
        ).fetchone()
    if row is None or row[0] is None:
        return 0
    return round(float(row[0]) / every) + 1


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s; :class:`BenchError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def run_scheme(
    args: argparse.Namespace,
    server_dsn: str,
    scheme: str,
    stderr: IO[str],
    log: Callable[[str], None],
) -> Outcome:
    """Run ``args.fires`` fires of ``scheme`` through a kill -9 and a graceful stop."""
    began = time.monotonic()
    table = f"fires_{scheme.replace('-', '_')}"
    every = args.every
    run_time = args.fires * every
    with scheme_schema(server_dsn, scheme) as dsn:
        create_ledger(dsn, table, unique=False)
        node_args = ["--scheme", scheme, "--ledger", table, "--every", f"{every:g}"]
        node_args += ["--work", f"{args.work:g}", "--misfire-grace", f"{args.misfire_grace:g}"]
        node_args += ["--overlap", args.overlap]
        deadline = args.ttl * 2 / 3
        node_args += ["--ttl", f"{args.ttl:g}", "--renew-deadline", f"{deadline:g}"]
        node_args += ["--renew-interval", f"{min(2.0, deadline / 4):g}"]
        fleet = FireFleet(dsn, f"bench-{uuid.uuid4().hex[:6]}", node_args, stderr)
        failover = handover = None
        with fleet:
            for i in range(args.nodes):
                fleet.spawn(f"n{i}")
            try:
                fleet.wait_ready(60)
            except TimeoutError as exc:
                raise BenchError(str(exc)) from None
            leaders = scheme in LEADER_SCHEMES
            if leaders:
                try:
                    first = fleet.first_elected(30)
                except TimeoutError as exc:
                    raise BenchError(f"{scheme}: {exc}") from None
                victim = first["node"]
            else:
                victim = "n0"
            wait_for(
                lambda: window_fires(dsn, table, every) >= args.fires // 3,
                run_time + 60,
                f"{scheme}: a third of the fires",
            )
            # Mid-run (half the work done): the fire in flight dies with the process.
            sleep_until_phase(every, args.work / 2)
            killed_at = time.time()
            fleet.kill(victim)
            if leaders:
                heir = fleet.elected(30, exclude={victim})
                if heir is None:
                    raise BenchError(f"{scheme}: no failover within 30 s of kill -9")
                failover = heir["t"] - killed_at
                stopped = heir["node"]
            else:
                stopped = "n1"
            log(
                f"  {scheme}: kill -9 {victim} at {describe([int(killed_at * 1e6)])}"
                + (f", {stopped} took over" if leaders else "")
            )
            wait_for(
                lambda: window_fires(dsn, table, every) >= 2 * args.fires // 3,
                run_time + 60,
                f"{scheme}: two thirds of the fires",
            )
            # Between two runs: a graceful stop should lose nothing.
            sleep_until_phase(every, args.work + (every - args.work) / 2)
            stopped_at = time.time()
            fleet.kill(stopped, signal.SIGTERM)
            last = stopped
            if leaders:
                third = fleet.elected(30, exclude={victim, stopped})
                if third is None:
                    raise BenchError(f"{scheme}: no handover within 30 s of SIGTERM")
                handover = third["t"] - stopped_at
                last = third["node"]
            log(
                f"  {scheme}: SIGTERM {stopped} at {describe([int(stopped_at * 1e6)])}"
                + (f", {last} took over" if leaders else "")
            )
            wait_for(
                lambda: window_fires(dsn, table, every) >= args.fires,
                run_time + 60,
                f"{scheme}: {args.fires} fires",
            )
            # Followers first: no election while the fleet shuts down.
            fleet.stop_nodes([n for n in fleet.procs if n not in (victim, last)])
            fleet.stop_nodes([last])
        fleet.pump()
        rows = ledger_rows(dsn, table)
        killed = claims_held_by(dsn, fleet.name, [victim]) if scheme == "rselection" else set()
        instants = [at for at, _, _ in rows]
        result = tally(instants, every, fleet.skipped("misfire"), killed)
        lo, hi = min(instants), max(instants)
        reported: Counter[str] = Counter(
            e["reason"] for e in fleet.of_kind("skipped") if lo <= instant_of_key(e["key"]) <= hi
        )
        failures = [
            f"{e['node']} {e['ev']} {e['key']} {e.get('error', '')}".strip()
            for e in fleet.history
            if e["ev"] in ("duplicate", "failed")
        ]
    return Outcome(
        scheme,
        result,
        len(rows),
        failover,
        handover,
        reported,
        failures,
        time.monotonic() - began,
    )


# -- report -------------------------------------------------------------------------------


def report(outcomes: list[Outcome], args: argparse.Namespace) -> bool:
    """Print the table and the ratios; return whether rselection met its target."""
    head = (
        f"{'scheme':<12} {'expected':>8} {'ran':>6} {'rows':>6} {'dup fires':>9} "
        f"{'extra runs':>10} {'missed':>6} {'explained':>20} {'failover':>9} {'handover':>9}"
    )
    print()
    print(head)
    print("-" * len(head))
    for o in outcomes:
        t = o.tally
        explained = f"{t.explained} ({len(t.misfire)} misfire, {len(t.killed)} killed)"
        print(
            f"{o.scheme:<12} {t.expected:>8} {t.ran:>6} {o.rows:>6} {len(t.duplicates):>9} "
            f"{t.extra_runs:>10} {len(t.unexplained):>6} {explained:>20} "
            f"{_ms(o.failover):>9} {_ms(o.handover):>9}"
        )
    print()
    print("ratios (per expected fire):")
    for o in outcomes:
        t = o.tally
        n = max(t.expected, 1)
        print(
            f"  {o.scheme:<12} runs {o.rows / n:.3f}, "
            f"duplicated fires {len(t.duplicates) / n:.2%}, "
            f"unexplained misses {len(t.unexplained) / n:.2%}, explained misses "
            f"{t.explained / n:.2%}; {o.wall:.0f} s wall"
        )
    print()
    print("details:")
    for o in outcomes:
        t = o.tally
        skips = ", ".join(f"{k} {v}" for k, v in sorted(o.reported.items())) or "none"
        print(f"  {o.scheme}: skip reports in the window: {skips}")
        if t.unexplained:
            print(f"    unexplained misses: {describe(t.unexplained[:20])}")
        if t.misfire:
            print(f"    reported as misfires: {describe(t.misfire[:20])}")
        if t.killed:
            print(f"    claimed by the killed node, not run: {describe(t.killed)}")
        if t.off_grid:
            print(f"    rows off the schedule: {describe(t.off_grid[:20])}")
        for line in o.failures[:5]:
            print(f"    {line}")
    mine = [o for o in outcomes if o.scheme == "rselection"]
    ok = all(
        not o.tally.duplicates and not o.tally.unexplained and not o.tally.off_grid for o in mine
    )
    if mine:
        t = mine[0].tally
        verdict = "PASS" if ok else "FAIL"
        print()
        print(
            f"target: rselection 0 duplicates, 0 unexplained misses -> "
            f"{len(t.duplicates)} duplicates, {len(t.unexplained)} unexplained: {verdict}"
        )
    return ok


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def summarize_node_log(path: Path) -> list[str]:
    """The most frequent distinct lines the nodes wrote to stderr (digits folded)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    kinds: Counter[str] = Counter()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("Traceback", "File ", "^")) or line[0] in " ~":
            continue
        kinds[re.sub(r"\d+", "#", line)[:140]] += 1
    return [f"{n:>4} x {msg}" for msg, n in kinds.most_common(6)]


# -- main ---------------------------------------------------------------------------------


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """The server to use: ``dsn``, else a private Postgres for the run."""
    if dsn:
        yield dsn
        return
    from tests.support.pg import PrivatePostgres

    with PrivatePostgres(settings={"max_connections": "200"}) as pg:
        yield pg.dsn


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        prog="bench/fleet_fires.py",
        description="Duplicate and missed fires across a fleet: rselection, APScheduler 3, "
        "a leader without claims.",
    )
    p.add_argument("--nodes", type=int, default=5, help="processes per scheme (default 5)")
    p.add_argument("--fires", type=int, default=1000, help="fires per scheme (default 1000)")
    p.add_argument("--every", type=float, default=0.1, help="interval, seconds (default 0.1)")
    p.add_argument("--work", type=float, default=0.02, help="seconds each fire works")
    p.add_argument("--misfire-grace", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument(
        "--overlap",
        choices=("allow", "skip"),
        default="allow",
        help="overlap policy of the leader schemes (default allow: a fire's work is shorter "
        "than the interval, so only a catch-up run can overlap the live fire after it)",
    )
    p.add_argument("--ttl", type=float, default=15.0, help="lease ttl (renew_deadline 2/3 of it)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated, in order")
    p.add_argument("--dsn", help="use this server (a schema per scheme) instead of a private one")
    args = p.parse_args(argv)
    args.schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    if unknown := set(args.schemes) - set(SCHEMES):
        p.error(f"unknown schemes {sorted(unknown)}; choose from {', '.join(SCHEMES)}")
    if args.nodes < 3:
        p.error("--nodes must be at least 3 (one is killed, one stopped, one goes on)")
    if args.fires < 30:
        p.error("--fires must be at least 30")
    if not 0 <= args.work < args.every / 2:
        p.error("--work must be below half of --every (the stop lands between two runs)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 if rselection met its target, 1 if not, 2 on error."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    # Node processes import rselection from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )

    def log(text: str) -> None:
        print(text, flush=True)

    log(
        f"fleet fires benchmark: {args.nodes} processes per scheme, {args.fires} fires every "
        f"{args.every * 1000:g} ms, {args.work * 1000:g} ms of work each, overlap="
        f"{args.overlap!r}; kill -9 at 1/3, "
        f"graceful stop at 2/3; ttl {args.ttl:g} s; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    workdir = tempfile.TemporaryDirectory(prefix="rselection-bench-")
    node_log_path = Path(workdir.name) / "nodes.log"
    outcomes: list[Outcome] = []
    try:
        with open(node_log_path, "w") as node_log, database(args.dsn) as dsn:
            for scheme in args.schemes:
                log(f"{scheme}: starting {args.nodes} nodes")
                outcomes.append(run_scheme(args, dsn, scheme, node_log, log))
    except Exception as exc:
        if isinstance(exc, BenchError):
            print(f"benchmark failed: {exc}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
        for line in summarize_node_log(node_log_path):
            print(f"  node stderr: {line}", file=sys.stderr)
        workdir.cleanup()
        return 2
    ok = report(outcomes, args)
    messages = summarize_node_log(node_log_path)
    if messages:
        print()
        print("node stderr (most frequent lines):")
        for line in messages:
            print(f"  {line}")
    workdir.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
