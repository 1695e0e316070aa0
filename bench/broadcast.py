"""Cross-node delivery benchmark of :class:`rselection.postgres.PostgresBroadcaster`.

Measures, against raw ``pg_notify`` on the same server in the same run, with the
publisher in one process and the subscriber in another:

* latency: messages published at a steady pace (one every ``--interval`` seconds); each
  carries its send time, and the subscriber records receive minus send on the machine's
  monotonic clock (``CLOCK_MONOTONIC`` is system-wide on Linux, so two processes agree);
* throughput: ``--burst`` messages published as fast as the publisher can; messages per
  second from the first send to the last receive.

Raw runs and broadcaster runs alternate (``--rounds`` of each), so load changes on the
machine hit both alike. It prints p50, p95 and p99 latency, throughput and the ratios, then a
table of the targets (p50 within 2x of raw NOTIFY, at least 5,000 messages/s) with
PASS/FAIL; it exits 1 when a target is missed, 2 when the benchmark could not run.

Usage::

    python bench/broadcast.py [--dsn DSN] [--rounds 3] [--messages 2000]
                              [--interval 0.002] [--burst 20000]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from rselection.postgres import PostgresBroadcaster  # noqa: E402
from tests.support.pg import DEFAULT_DSN, with_search_path  # noqa: E402

#: The raw NOTIFY channel of the baseline (the broadcaster uses its own).
RAW_CHANNEL = "rselection_bench_raw"
CHANNEL = "bench"
#: Padding in every message, so both sides carry a realistic small JSON object.
PAD = "x" * 64


class BenchError(RuntimeError):
    """The benchmark could not go on (a child failed, a bounded wait expired)."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, interpolated linearly between ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _message(i: int) -> dict[str, Any]:
    return {"i": i, "t": time.monotonic_ns(), "pad": PAD}


# -- child processes ---------------------------------------------------------------------


def run_subscriber(dsn: str, kind: str, count: int, timeout: float) -> int:
    """Receive ``count`` messages; report each one's latency (us) and the last receive time."""
    deadline = time.monotonic() + timeout
    latencies: list[float] = []
    if kind == "raw":
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(RAW_CHANNEL)))
            _say(event="ready")
            while len(latencies) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for note in conn.notifies(timeout=remaining, stop_after=1):
                    now = time.monotonic_ns()
                    latencies.append((now - json.loads(note.payload)["t"]) / 1000)
    else:
        with PostgresBroadcaster(dsn) as bc:
            sub = bc.subscribe(CHANNEL, maxsize=count + 10)
            if not bc.wait_ready(30):
                raise BenchError("the subscriber's broadcaster did not connect")
            _say(event="ready")
            while len(latencies) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    msg: Any = sub.get(remaining)
                except TimeoutError:
                    break
                now = time.monotonic_ns()
                latencies.append((now - msg["t"]) / 1000)
    _say(event="done", latencies=latencies, last_ns=time.monotonic_ns())
    return 0 if len(latencies) == count else 3


def run_publisher(dsn: str, kind: str, count: int, interval: float) -> int:
    """Wait for ``go`` on stdin, publish ``count`` messages, report the first send time."""
    if kind == "raw":
        conn = psycopg.connect(dsn, autocommit=True)
        query = "SELECT pg_notify(%s, %s)"
        conn.execute(query, (RAW_CHANNEL + "_warmup", "{}"))

        def publish(i: int) -> None:
            conn.execute(query, (RAW_CHANNEL, json.dumps(_message(i))))

        finish = conn.close
    else:
        bc = PostgresBroadcaster(dsn, max_pending=100_000)
        if not bc.wait_ready(30):
            raise BenchError("the publisher's broadcaster did not connect")
        bc.publish(CHANNEL + "-warmup", {})  # opens the writer's connection
        bc.flush(30)

        def publish(i: int) -> None:
            bc.publish(CHANNEL, _message(i))

        def finish() -> None:
            bc.flush(60)
            bc.close()

    _say(event="ready")
    if sys.stdin.readline().strip() != "go":
        return 4
    first = time.monotonic_ns()
    next_at = time.monotonic()
    for i in range(count):
        if interval > 0:
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        publish(i)
    finish()
    _say(event="done", first_ns=first)
    return 0


# -- the driver --------------------------------------------------------------------------


@dataclass
class Child:
    """A child process of this script, its JSON lines read by a thread."""

    proc: subprocess.Popen[str]
    lines: list[dict[str, Any]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    @classmethod
    def start(cls, args: list[str]) -> Child:
        """Run ``python bench/broadcast.py <args>``."""
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        child = cls(proc)
        threading.Thread(target=child._read, daemon=True).start()
        return child

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(json.loads(line))
                self.cond.notify_all()

    def wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        """The first line with ``event``, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines:
                    if line.get("event") == event:
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self.lines):
                    raise BenchError(f"no {event!r} from a child within {timeout} s")
                self.cond.wait(min(remaining, 0.5))

    def go(self) -> None:
        """Tell the child to start."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Kill the child if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@dataclass
class Run:
    """One measured run: latencies in microseconds and throughput in messages/s."""

    latencies: list[float]
    rate: float


def measure(dsn: str, kind: str, count: int, interval: float, timeout: float) -> Run:
    """Run one subscriber and one publisher process of ``kind`` and collect the figures."""
    sub = Child.start(["--role", "sub", "--kind", kind, "--dsn", dsn, "--count", str(count)])
    pub: Child | None = None
    try:
        sub.wait_for("ready", 30)
        pub = Child.start(
            [
                *("--role", "pub", "--kind", kind, "--dsn", dsn),
                *("--count", str(count), "--interval", str(interval)),
            ]
        )
        pub.wait_for("ready", 30)
        pub.go()
        got = sub.wait_for("done", timeout)
        sent = pub.wait_for("done", timeout)
        if len(got["latencies"]) != count:
            raise BenchError(f"{kind}: {len(got['latencies'])} of {count} messages arrived")
        seconds = (got["last_ns"] - sent["first_ns"]) / 1e9
        return Run(got["latencies"], count / seconds)
    finally:
        sub.stop()
        if pub is not None:
            pub.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or one of its child roles); see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("RSELECTION_TEST_DSN") or DEFAULT_DSN,
        help="the server to measure (a schema of its own is created and dropped)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=2000, help="paced messages per run")
    parser.add_argument("--interval", type=float, default=0.002, help="pace, seconds")
    parser.add_argument("--burst", type=int, default=20000, help="messages per throughput run")
    parser.add_argument("--role", choices=["sub", "pub"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=["raw", "bc"], help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.role == "sub":
        return run_subscriber(args.dsn, args.kind, args.count, timeout=120)
    if args.role == "pub":
        return run_publisher(args.dsn, args.kind, args.count, args.interval)
    if args.rounds < 1 or args.messages < 10 or args.burst < 100 or args.interval < 0:
        parser.error("need --rounds >= 1, --messages >= 10, --burst >= 100, --interval >= 0")

    schema = f"rselection_bench_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(args.dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            version = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error as exc:
        print(f"cannot use the server: {exc}", file=sys.stderr)
        return 2
    dsn = with_search_path(args.dsn, schema)
    load = os.getloadavg()
    print(
        f"cpus={os.cpu_count()} load={load[0]:.2f},{load[1]:.2f},{load[2]:.2f} "
        f"postgres={version[0] if version else '?'} rounds={args.rounds} "
        f"paced={args.messages} every {args.interval * 1000:g} ms burst={args.burst}"
    )
    results: dict[str, dict[str, list[Any]]] = {k: {"lat": [], "rate": []} for k in ("raw", "bc")}
    try:
        for r in range(args.rounds):
            for kind in ("raw", "bc"):
                paced = measure(dsn, kind, args.messages, args.interval, 120)
                burst = measure(dsn, kind, args.burst, 0.0, 180)
                results[kind]["lat"].extend(paced.latencies)
                results[kind]["rate"].append(burst.rate)
                print(
                    f"round {r + 1} {kind:>3}: p50 {percentile(paced.latencies, 0.5):7.0f} us"
                    f"  p95 {percentile(paced.latencies, 0.95):7.0f} us"
                    f"  p99 {percentile(paced.latencies, 0.99):7.0f} us"
                    f"  burst {burst.rate:9.0f} msg/s"
                )
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 2
    finally:
        with psycopg.connect(args.dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

    def row(kind: str) -> tuple[float, float, float, float]:
        lat, rates = results[kind]["lat"], sorted(results[kind]["rate"])
        p50, p95, p99 = (percentile(lat, q) for q in (0.5, 0.95, 0.99))
        return p50, p95, p99, rates[len(rates) // 2]

    raw, bc = row("raw"), row("bc")
    print()
    print("| path | p50 latency | p95 latency | p99 latency | throughput (median of rounds) |")
    print("| --- | --- | --- | --- | --- |")
    for name, figures in (("raw pg_notify", raw), ("PostgresBroadcaster", bc)):
        p50, p95, p99, rate = figures
        print(f"| {name} | {p50:.0f} us | {p95:.0f} us | {p99:.0f} us | {rate:,.0f} msg/s |")
    ratios = " | ".join(f"{b / r:.2f}x" for b, r in zip(bc, raw, strict=True))
    print(f"| ratio (broadcaster / raw) | {ratios} |")
    targets = [
        ("p50 latency <= 2x raw NOTIFY", bc[0] <= 2 * raw[0], f"{bc[0] / raw[0]:.2f}x"),
        ("throughput >= 5,000 msg/s", bc[3] >= 5000, f"{bc[3]:,.0f} msg/s"),
    ]
    print()
    for name, ok, value in targets:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<32} {value}")
    return 0 if all(ok for _, ok, _ in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
