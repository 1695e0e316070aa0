"""How late scheduled fires start when many are due at one instant, and what each costs.

Every case registers ``N`` interval tasks with the same period on one
:class:`rselection.TaskHandler`. Intervals are aligned to the epoch, so all ``N`` fires
of a period are due at the same instant. Each task does nothing but note how late it
started (``time.time() - ctx.scheduled_at``). A case runs a few periods after the leader
starts (the first, partial, period is left out) and prints lateness p50/p99/max, the
process CPU per fire (scheduler, event loop and the tasks' own empty bodies together),
and whether any fire was lost or doubled.

Cases: 1, 100, 1,000 and 10,000 tasks; ``def`` and ``async def``; without claims (a
:class:`rselection.SingleNodeLeader`) and with claims (a :class:`rselection.PostgresLeader`
with its default claimer, in a schema of its own that is dropped afterwards); with the
run history on (the default: every run recorded, in memory or in Postgres) or off (the
leader keeps no task controls). Each case runs in a process of its own.

With the history on, a case also prints the batches the run history was written in
during the window (one statement each on Postgres, one call in memory), and how long
after it started one fire of the instant after the window was visible in its task's
history (``visible ms``: the batch's wait and its write). With both ``--history
off,on``, the added CPU per fire and the ratio are printed for each case.

With ``--baseline PATH`` (a checkout of another version, such as ``git worktree add
/path/main main``) every case runs on that code too, in the same run, and both are
printed side by side (only for cases of at most ``--baseline-max`` tasks, 1,000 by
default: the older code takes minutes for 10,000).

Usage::

    python bench/runtime.py [--dsn DSN] [--baseline PATH] [--baseline-max 1000]
                            [--sizes 1,100,200,1000,10000]
                            [--kinds def,async] [--claims off,on] [--history on]
                            [--profile CASE]

``--dsn`` defaults to ``RSELECTION_TEST_DSN``; without either, the claims cases are
skipped. ``--profile 1000,async,off`` runs one case under cProfile (in this process) and
prints the 30 costliest functions by own time.

Targets (PASS/FAIL, exit status 1 on a FAIL): ``1`` task at 50 ms p99 <= 20 ms; 1,000
``async def`` p99 <= 20 ms and 1,000 ``def`` p99 <= 50 ms without claims; with claims
200 ``async def`` p99 <= 50 ms and 1,000 p99 <= 100 ms; no fire lost or doubled anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (tasks, period in seconds, measured periods): the period leaves every fire of one
# instant time to start before the next instant on a 2-core machine.
PLAN = {1: (0.05, 100), 100: (0.1, 30), 200: (1.0, 3), 1000: (1.0, 3), 10000: (3.0, 2)}

TARGETS = [
    # (tasks, kind, claims, p99 bound in ms)
    (1, "async", "off", 20.0),
    (1, "def", "off", 20.0),
    (1000, "async", "off", 20.0),
    (1000, "def", "off", 50.0),
    (200, "async", "on", 50.0),
    (1000, "async", "on", 100.0),
]


@dataclass
class Result:
    """One case's figures."""

    tasks: int
    kind: str
    claims: str
    fires: int
    p50: float
    p99: float
    max: float
    cpu_us: float
    lost: int
    doubled: int
    version: str
    history: str = "-"  # "on", "off"; "-": a version without run history
    batches: int = 0  # run history writes during the window
    written: int = 0  # runs they carried
    visible_ms: float = float("nan")  # from a fire's start to its record's visibility

    def row(self) -> str:
        batches = (
            f"{self.batches:>7} {self.visible_ms:>10.0f}" if self.batches else f"{'-':>7} {'-':>10}"
        )
        return (
            f"{self.tasks:>6} {self.kind:>5} {self.claims:>6} {self.history:>7} {self.fires:>7} "
            f"{self.p50:>8.1f} {self.p99:>8.1f} {self.max:>8.1f} {self.cpu_us:>9.0f} "
            f"{self.lost:>5} {self.doubled:>7} {batches}"
        )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _schema_dsn(dsn: str, schema: str) -> str:
    sep = "&" if "?" in dsn else "?"
    return f"{dsn}{sep}options=-csearch_path%3D{schema}"


def _visible(leader: Any, task: str, at: float, started: dict[tuple[str, float], float]) -> float:
    """Milliseconds from the start of ``task``'s fire at ``at`` until its run record can
    be read back (polled every 5 ms, for at most 10 s after the instant)."""
    while time.time() < at:
        time.sleep(0.002)
    deadline = at + 10
    while time.time() < deadline:
        runs = leader.task_runs(task, limit=5)
        if any(r.scheduled_at and abs(r.scheduled_at.timestamp() - at) < 1e-6 for r in runs):
            seen = time.time()
            began = started.get((task, round(at, 3)))
            return float("nan") if began is None else (seen - began) * 1000
        time.sleep(0.005)
    return float("nan")


def run_case(
    tasks: int, kind: str, claims: str, dsn: str | None, history: str = "on"
) -> dict[str, Any]:
    """Run one case in this process; return its figures."""
    import rselection as rs

    try:
        from rselection.task_desk import TaskDesk
    except ImportError:  # a version without run history
        TaskDesk = None
        history = "-"

    every, periods = PLAN[tasks]
    seen: list[tuple[str, float, float]] = []  # task, scheduled_at, started (wall clock)
    note = seen.append  # list.append is atomic: safe from every task thread

    handler = rs.TaskHandler()
    for i in range(tasks):
        name = f"t{i}"
        if kind == "async":

            async def job(ctx: rs.TaskContext) -> None:
                note((ctx.name, ctx.scheduled_at.timestamp(), time.time()))  # type: ignore[union-attr]

        else:

            def job(ctx: rs.TaskContext) -> None:
                note((ctx.name, ctx.scheduled_at.timestamp(), time.time()))  # type: ignore[union-attr]

        handler.interval(every, name=name)(job)

    schema = f"bench_runtime_{uuid.uuid4().hex[:8]}"
    leader: Any
    if claims == "on":
        import psycopg

        assert dsn is not None
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        leader = rs.PostgresLeader(_schema_dsn(dsn, schema), handler, name="bench")
    else:
        leader = rs.SingleNodeLeader(handler)
    if history == "off":
        # As a leader without a task store: no task controls, no run history.
        leader._state.tasks = None
    try:
        leader.start()
        if not leader.wait_until_leader(30):
            raise RuntimeError("the leader was not elected within 30 s")
        # Measured from the period after every task fired once: the start of a term
        # (looking for missed fires, task by task) is left out.
        settle = time.time() + 120
        while len({name for name, _, _ in list(seen)}) < tasks and time.time() < settle:
            time.sleep(0.05)
        now = time.time()
        first = (int((now + 0.2) / every) + 1) * every
        last = first + (periods - 1) * every
        while time.time() < first - 0.02:
            time.sleep(0.01)
        cpu0 = time.process_time()
        counts0 = (
            (0, 0)
            if TaskDesk is None
            else (TaskDesk.shared().counts.batches, TaskDesk.shared().counts.written)
        )
        expected = tasks * periods
        deadline = last + every + 30
        done, looked = 0, 0
        while time.time() < deadline:
            fresh = seen[looked:]  # only the new ones: the poll must cost next to nothing
            looked += len(fresh)
            done += sum(1 for _, at, _ in fresh if first - 1e-6 <= at <= last + 1e-6)
            if done >= expected and time.time() > last + min(every, 0.5):
                break
            time.sleep(0.05)
        cpu = time.process_time() - cpu0
        batches = written = 0
        visible = float("nan")
        if TaskDesk is not None and history == "on":
            counts = TaskDesk.shared().counts
            batches, written = counts.batches - counts0[0], counts.written - counts0[1]
            starts = {(name, round(at, 3)): began for name, at, began in list(seen)}
            probe = last + every * (1 + int((time.time() - last) / every))
            visible = _visible(leader, f"t{tasks - 1}", probe, starts)
            starts = {(name, round(at, 3)): began for name, at, began in list(seen)}
            if visible != visible:  # its start was noted after the first look
                visible = _visible(leader, f"t{tasks - 1}", probe, starts)
    finally:
        leader.stop()
        if claims == "on":
            import psycopg

            assert dsn is not None
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA {schema} CASCADE")
    window = [(name, at, began) for name, at, began in seen if first - 1e-6 <= at <= last + 1e-6]
    counts = Counter((name, round(at, 3)) for name, at, _ in window)
    doubled = sum(n - 1 for n in counts.values() if n > 1)
    lost = tasks * periods - len(counts)
    late = [(began - at) * 1000 for _, at, began in window]
    return {
        "tasks": tasks,
        "kind": kind,
        "claims": claims,
        "fires": len(window),
        "p50": _percentile(late, 0.5),
        "p99": _percentile(late, 0.99),
        "max": max(late) if late else float("nan"),
        "cpu_us": cpu / max(1, len(window)) * 1e6,
        "lost": lost,
        "doubled": doubled,
        "version": rs.__file__,
        "history": history,
        "batches": batches,
        "written": written,
        "visible_ms": visible,
    }


def run_in_child(
    tasks: int, kind: str, claims: str, dsn: str | None, code: Path | None, history: str = "on"
) -> Result | str:
    """Run one case in a fresh process, on ``code`` (a checkout) or this one."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    case = f"{tasks},{kind},{claims},{history}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case]
    if dsn:
        cmd += ["--dsn", dsn]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return "timed out"
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return f"failed: {out.stderr.strip().splitlines()[-1:] or out.returncode}"
    return Result(**json.loads(lines[-1]))


def profile(case: str, dsn: str | None) -> None:
    """Run one case under cProfile, one profiler per thread, and print the costliest
    functions by own time, every thread together."""
    import cProfile
    import pstats

    tasks, kind, claims, *history = case.split(",")
    profiles: list[cProfile.Profile] = []
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        profiler = cProfile.Profile()
        profiles.append(profiler)
        profiler.runcall(run, self)

    threading.Thread.run = profiled  # type: ignore[method-assign]
    main_profiler = cProfile.Profile()
    result = main_profiler.runcall(run_case, int(tasks), kind, claims, dsn, *history)
    threading.Thread.run = run  # type: ignore[method-assign]
    print(json.dumps(result))
    stats = pstats.Stats(main_profiler)
    for profiler in profiles:
        stats.add(profiler)
    stats.sort_stats("tottime").print_stats(30)


HEADER = (
    f"{'tasks':>6} {'kind':>5} {'claims':>6} {'history':>7} {'fires':>7} {'p50 ms':>8} "
    f"{'p99 ms':>8} {'max ms':>8} {'cpu us':>9} {'lost':>5} {'doubled':>7} {'batches':>7} "
    f"{'visible ms':>10}"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("RSELECTION_TEST_DSN"))
    parser.add_argument("--baseline", type=Path, help="a checkout of the code to compare")
    parser.add_argument(
        "--baseline-max",
        type=int,
        default=1000,
        help="run the baseline only for cases of at most this many tasks (default 1000)",
    )
    parser.add_argument("--sizes", default="1,100,200,1000,10000")
    parser.add_argument("--kinds", default="def,async")
    parser.add_argument("--claims", default="off,on")
    parser.add_argument("--history", default="on", help="run history: on, off or off,on")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--profile", metavar="CASE", help="tasks,kind,claims under cProfile")
    args = parser.parse_args()
    if args.case:
        tasks, kind, claims, *history = args.case.split(",")
        print(json.dumps(run_case(int(tasks), kind, claims, args.dsn, *history)))
        return 0
    if args.profile:
        profile(args.profile, args.dsn)
        return 0

    versions: list[tuple[str, Path | None]] = [("new", None)]
    if args.baseline is not None:
        versions.insert(0, ("old", args.baseline.resolve()))
    results: dict[tuple[str, int, str, str], Result | str] = {}
    by_history: dict[tuple[int, str, str, str], Result] = {}
    cases = [
        (int(n), kind, claims, history)
        for claims in args.claims.split(",")
        for kind in args.kinds.split(",")
        for n in args.sizes.split(",")
        for history in args.history.split(",")
    ]
    print(HEADER + "  version")
    for tasks, kind, claims, history in cases:
        if claims == "on" and not args.dsn:
            continue
        for label, code in versions:
            if label == "old" and (tasks > args.baseline_max or history == "off"):
                continue
            found = run_in_child(tasks, kind, claims, args.dsn, code, history)
            if history == "on" or ("new", tasks, kind, claims) not in results:
                results[(label, tasks, kind, claims)] = found
            if label == "new" and isinstance(found, Result):
                by_history[(tasks, kind, claims, history)] = found
            text = (
                found.row()
                if isinstance(found, Result)
                else f"{tasks:>6} {kind:>5} {claims:>6} {history:>7} {found}"
            )
            print(f"{text}  {label}", flush=True)

    pairs = [
        (key[:3], off, by_history[(*key[:3], "on")])
        for key, off in by_history.items()
        if key[3] == "off" and (*key[:3], "on") in by_history
    ]
    if pairs:
        print("\nrun history: added cost per fire (on against off, same run)")
        for (tasks, kind, claims), off, on in pairs:
            added = on.cpu_us - off.cpu_us
            per_batch = on.written / on.batches if on.batches else float("nan")
            writes = on.batches / on.fires if on.fires else float("nan")
            print(
                f"  {tasks:>5} {kind:>5} claims {claims}: cpu {off.cpu_us:.0f} -> "
                f"{on.cpu_us:.0f} us per fire (+{added:.0f} us, x{on.cpu_us / off.cpu_us:.2f}); "
                f"{on.batches} batches of {per_batch:.0f} runs, {writes:.4f} writes per fire; "
                f"p99 {off.p99:.1f} -> {on.p99:.1f} ms; visible after {on.visible_ms:.0f} ms"
            )

    print("\ntargets")
    failed = False
    for tasks, kind, claims, bound in TARGETS:
        found = results.get(("new", tasks, kind, claims))
        if not isinstance(found, Result):
            print(f"  {tasks:>5} {kind:>5} claims {claims}: p99 <= {bound:g} ms  not run")
            continue
        ok = found.p99 <= bound and not found.lost and not found.doubled
        failed |= not ok
        before = results.get(("old", tasks, kind, claims))
        was = f" (before: {before.p99:.1f})" if isinstance(before, Result) else ""
        print(
            f"  {tasks:>5} {kind:>5} claims {claims}: p99 <= {bound:g} ms  "
            f"{found.p99:.1f}{was}  {'PASS' if ok else 'FAIL'}"
        )
    for key, found in results.items():
        if key[0] == "new" and isinstance(found, Result) and (found.lost or found.doubled):
            print(f"  {key}: {found.lost} lost, {found.doubled} doubled  FAIL")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
