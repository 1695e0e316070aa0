"""Failover and cost benchmark of :class:`rselection.PostgresLeader`.

Runs a fleet of node processes (``python -m rselection.commands.demo_fleet``, see
:class:`rselection.commands.demo_fleet.Fleet`) against a private Postgres and measures:

* crash failover: ``kill -9`` of the leader until another node reports ``elected``;
* graceful handover: SIGTERM (the node calls ``leader.stop()``) until another node
  reports ``elected``;
* pause failover: SIGSTOP of the leader until another node reports ``elected``; then
  SIGCONT and wait for the paused node to report ``demoted``;
* safety: the fenced ledger every leader writes has no row of an older term after a
  row of a newer term, and every term was written by one node only;
* cost: queries per second sent by the leader's and each idle follower's keeper session
  (counted per backend pid in the server's statement log) and the CPU an idle
  follower process uses.

Then the same crash, handover and pause rounds run for :class:`rselection.RedisLeader`
(``--backend redis``, a private ``redis-server`` unless ``--redis-url``), with its fenced
``RPUSH`` ledger checked the same way; and, in the same run against the same Redis, the
leader election of ``tooz`` (OpenStack's coordination library, Redis driver, default
settings, ``run_watchers()`` every 100 ms) through kill -9 and graceful-stop rounds. The
three are printed side by side with the ratios.

It prints a table of the design targets against the measurements and exits 1 if any
target is missed, 2 if the benchmark itself could not run.

Usage::

    python bench/failover.py [--nodes 3] [--rounds 20] [--pause-rounds 3] [--ttl 15]
                             [--cost-window 30] [--dsn DSN --server-log PATH]
                             [--redis-url URL | --no-redis] [--tooz-rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from rselection.commands.demo_fleet import Fleet  # noqa: E402

#: Server settings of the private Postgres: every statement is logged with the pid and
#: application name of its session, so statements can be counted per session.
LOG_SETTINGS = {
    "log_statement": "'all'",
    "log_line_prefix": "'%p %a '",
    "log_destination": "'stderr'",
    "logging_collector": "off",
}

#: A statement-log entry: ``<pid> <application_name> LOG:  statement: ...`` (simple
#: protocol) or ``... LOG:  execute <name>: ...`` (extended protocol).
_LOGGED = re.compile(r"^(\d+) (\S*) ?LOG:  (?:statement|execute [^:]*):(.*)$")

#: Options that make a node's tasks idle (no ledger writes, no ticks) for the cost phase.
IDLE_TASKS = ["--ledger-every", "1000000", "--tick", "1000000"]

LEASE_TABLE = "rselection_leases"


class BenchError(RuntimeError):
    """The benchmark could not go on (a bounded wait expired, the fleet misbehaved)."""


# -- settings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Timings:
    """Lease timings given to every node, in seconds."""

    ttl: float = 15.0
    renew_interval: float = 2.0
    renew_deadline: float = 10.0
    retry_interval: float = 2.0

    @classmethod
    def for_ttl(cls, ttl: float | None) -> Timings:
        """The defaults, or ``ttl`` with ``renew_deadline = ttl * 2/3`` and the same intervals.

        Args:
            ttl: the lease length, or ``None`` for the library defaults.
        """
        if ttl is None:
            return cls()
        return cls(ttl=ttl, renew_deadline=round(ttl * 2 / 3, 3))

    def node_args(self) -> list[str]:
        """The node program's command-line options for these timings."""
        return [
            "--ttl",
            f"{self.ttl:g}",
            "--renew-interval",
            f"{self.renew_interval:g}",
            "--renew-deadline",
            f"{self.renew_deadline:g}",
            "--retry-interval",
            f"{self.retry_interval:g}",
        ]


# -- small helpers ----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, interpolated linearly between ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` (all its threads), in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rpartition(")")[2].split()
    # fields[0] is the state (field 3 of proc(5)); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _is_event(kind: str, node: str, event: dict[str, Any]) -> bool:
    return bool(event["ev"] == kind and event["node"] == node)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


# -- the fleet --------------------------------------------------------------------------


class BenchFleet(Fleet):
    """A :class:`Fleet` whose nodes write their stderr to a file, with event helpers.

    Args:
        dsn: the database every node uses.
        name: the lease name.
        node_args: extra command-line options for every node.
        stderr: where the nodes' stderr (their log warnings) goes.
    """

    def __init__(self, dsn: str, name: str, node_args: list[str], stderr: IO[str]) -> None:
        super().__init__(dsn, name, node_args)
        self.stderr = stderr
        self.serial = 0
        self.leader: dict[str, Any] | None = None
        self.elections: list[dict[str, Any]] = []
        self.surprises: list[str] = []
        self.expect_demotion: str | None = None

    def command(self, node_id: str, extra: list[str] | None = None) -> list[str]:
        """The command line of node ``node_id`` (other fleets run other node programs)."""
        cmd = [sys.executable, "-m", "rselection.commands.demo_fleet", "--dsn", self.dsn]
        return [*cmd, "--name", self.name, "--node-id", node_id, *self.node_args, *(extra or [])]

    def spawn(self, node_id: str, extra: list[str] | None = None) -> subprocess.Popen[str]:
        """Start a node process called ``node_id`` (stderr to :attr:`stderr`)."""
        cmd = self.command(node_id, extra)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1
        )
        self.procs[node_id] = proc
        assert proc.stdout is not None
        reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        reader.start()
        self._readers.append(reader)
        return proc

    def fresh_node(self) -> str:
        """Spawn a node with a new id and return the id."""
        node = f"n{self.serial}"
        self.serial += 1
        self.spawn(node)
        return node

    def observe(self, event: dict[str, Any]) -> None:
        """Track elections and note events no scenario asked for."""
        kind = event.get("ev")
        if kind == "elected":
            if self.elections and event["term"] <= self.elections[-1]["term"]:
                self.surprises.append(
                    f"term went backwards: {event['node']} elected with term {event['term']} "
                    f"after term {self.elections[-1]['term']}"
                )
            self.elections.append(event)
            self.leader = event
        elif kind == "demoted":
            if event["node"] != self.expect_demotion and event["reason"] != "stopped":
                self.surprises.append(
                    f"{event['node']} demoted from term {event['term']} ({event['reason']})"
                )
            if self.leader is not None and self.leader["node"] == event["node"]:
                self.leader = None
        elif kind == "stale":
            self.surprises.append(f"{event['node']}: fenced write refused in term {event['term']}")

    def await_event(
        self, timeout: float, what: str, accept: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any]:
        """The next event that ``accept`` approves; :class:`BenchError` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            event = self.next_event(left)
            if event is None:
                break
            self.observe(event)
            if accept(event):
                return event
        raise BenchError(f"timed out after {timeout:g}s waiting for {what}")

    def drain(self, seconds: float) -> None:
        """Consume events for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            event = self.next_event(left)
            if event is not None:
                self.observe(event)

    def elected_other(self, timeout: float, exclude: str) -> dict[str, Any]:
        """The next ``elected`` event of a node other than ``exclude``."""
        return self.await_event(
            timeout,
            f"a node other than {exclude} to be elected",
            lambda e: e["ev"] == "elected" and e["node"] != exclude,
        )

    def reported(self, kind: str, node: str, timeout: float) -> dict[str, Any]:
        """The ``kind`` event of ``node``: seen already, or arriving within ``timeout``."""
        for event in self.history:
            if _is_event(kind, node, event):
                return event
        return self.await_event(timeout, f"{node} to report {kind}", partial(_is_event, kind, node))

    def ready(self, node: str, timeout: float) -> None:
        """Wait until ``node`` reported ``ready``."""
        self.reported("ready", node, timeout)

    def current_leader(self, timeout: float) -> dict[str, Any]:
        """The ``elected`` event of the current leader (waiting for one if needed)."""
        if self.leader is None:
            self.await_event(timeout, "a leader", lambda e: e["ev"] == "elected")
        assert self.leader is not None
        return self.leader

    def reap(self, node: str, timeout: float) -> None:
        """Wait for ``node``'s process to exit; SIGKILL it after ``timeout``."""
        proc = self.procs[node]
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.surprises.append(f"{node} did not exit within {timeout:g}s; killed")
            proc.kill()
            proc.wait(5)


# -- failover scenarios -----------------------------------------------------------------


@dataclass
class Scenario:
    """Failover times of one scenario, in seconds."""

    name: str
    times: list[float] = field(default_factory=list)

    def summary(self, bases: Sequence[tuple[str, float]]) -> str:
        """One line: n, p50, p95, max (ms) and the ratios of p95 and max to ``bases``."""
        t = self.times
        if not t:
            return f"{self.name:<10} n=0"
        p50, p95, worst = percentile(t, 0.5), percentile(t, 0.95), max(t)
        line = (
            f"{self.name:<10} n={len(t):<3} p50={p50 * 1000:8.1f} ms  "
            f"p95={p95 * 1000:8.1f} ms  max={worst * 1000:8.1f} ms"
        )
        for label, base in bases:
            line += f"  p95/{label}={p95 / base:.3f} max/{label}={worst / base:.3f}"
        return line


def settle(fleet: BenchFleet) -> None:
    """Let a round's aftermath pass before the next signal.

    The new leader writes its ledger; followers start waiting. The random part keeps
    the next signal out of step with any follower's polling period (a Redis follower
    checks the holder's connection every 0.5 s from the moment the new leader was
    elected), so no backend is timed at a lucky phase.
    """
    fleet.drain(0.5 + random.uniform(0.0, 1.0))


def elect_timeout_for(timings: Timings) -> float:
    """How long a round waits for the next leader before it gives up."""
    return timings.ttl + timings.retry_interval + 15.0


def crash_rounds(
    fleet: BenchFleet,
    timings: Timings,
    rounds: int,
    log: Callable[[str], None],
) -> Scenario:
    """``kill -9`` the leader ``rounds`` times; each killed node is replaced."""
    crash = Scenario("crash")
    elect_timeout = elect_timeout_for(timings)
    for i in range(rounds):
        victim = fleet.current_leader(elect_timeout)["node"]
        began = time.time()
        fleet.kill(victim, signal.SIGKILL)
        heir = fleet.elected_other(elect_timeout, victim)
        crash.times.append(heir["t"] - began)
        log(
            f"crash    {i + 1:>3}/{rounds}: {victim} killed, {heir['node']} leads term "
            f"{heir['term']} after {crash.times[-1] * 1000:.1f} ms"
        )
        fleet.reap(victim, 10)
        fleet.ready(fleet.fresh_node(), 30)
        settle(fleet)
    return crash


def handover_rounds(
    fleet: BenchFleet,
    timings: Timings,
    rounds: int,
    log: Callable[[str], None],
) -> Scenario:
    """SIGTERM the leader ``rounds`` times; each stopped node is replaced."""
    handover = Scenario("handover")
    elect_timeout = elect_timeout_for(timings)
    for i in range(rounds):
        victim = fleet.current_leader(elect_timeout)["node"]
        began = time.time()
        fleet.kill(victim, signal.SIGTERM)
        heir = fleet.elected_other(elect_timeout, victim)
        handover.times.append(heir["t"] - began)
        stopped = fleet.reported("stopped", victim, 30)
        log(
            f"handover {i + 1:>3}/{rounds}: {victim} stopped, {heir['node']} leads term "
            f"{heir['term']} after {handover.times[-1] * 1000:.1f} ms "
            f"(its stop() returned after {stopped['took'] * 1000:.1f} ms)"
        )
        fleet.reap(victim, 30)
        fleet.ready(fleet.fresh_node(), 30)
        settle(fleet)
    return handover


def pause_rounds(
    fleet: BenchFleet,
    timings: Timings,
    rounds: int,
    log: Callable[[str], None],
) -> Scenario:
    """SIGSTOP the leader until another node leads, then SIGCONT it, ``rounds`` times."""
    pause = Scenario("pause")
    elect_timeout = elect_timeout_for(timings)
    for i in range(rounds):
        victim = fleet.current_leader(elect_timeout)["node"]
        fleet.expect_demotion = victim
        began = time.time()
        fleet.kill(victim, signal.SIGSTOP)
        try:
            heir = fleet.elected_other(elect_timeout, victim)
        finally:
            resumed = time.time()
            fleet.kill(victim, signal.SIGCONT)
        pause.times.append(heir["t"] - began)
        demoted = fleet.await_event(
            15,
            f"{victim} to report demoted after SIGCONT",
            partial(_is_event, "demoted", victim),
        )
        fleet.expect_demotion = None
        log(
            f"pause    {i + 1:>3}/{rounds}: {victim} paused, {heir['node']} leads term "
            f"{heir['term']} after {pause.times[-1] * 1000:.1f} ms; {victim} demoted "
            f"({demoted['reason']}) {(demoted['t'] - resumed) * 1000:.0f} ms after SIGCONT"
        )
        settle(fleet)
    return pause


def run_failover(
    fleet: BenchFleet,
    timings: Timings,
    rounds: int,
    pauses: int,
    log: Callable[[str], None],
) -> dict[str, Scenario]:
    """Run the kill -9, graceful-stop and SIGSTOP rounds; return their failover times."""
    return {
        "crash": crash_rounds(fleet, timings, rounds, log),
        "handover": handover_rounds(fleet, timings, rounds, log),
        "pause": pause_rounds(fleet, timings, pauses, log),
    }


# -- ledger -----------------------------------------------------------------------------


@dataclass
class LedgerCheck:
    """What the fenced ledger says about the run."""

    rows: int
    terms: int
    overlap_by_id: int
    overlap_by_time: int
    shared_terms: dict[int, set[str]]
    mismatched: list[str]


def check_ledger(dsn: str, table: str, elections: list[dict[str, Any]]) -> LedgerCheck:
    """Overlaps (older term written after newer), terms with several writers, and terms
    written by a node other than the one that reported ``elected`` for it."""
    t = sql.Identifier(table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(t)).fetchone()
        by_id = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {t} a JOIN {t} b ON a.term < b.term AND a.id > b.id"
            ).format(t=t)
        ).fetchone()
        by_time = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {t} a JOIN {t} b"
                " ON a.term < b.term AND a.written_at > b.written_at"
            ).format(t=t)
        ).fetchone()
        writers: dict[int, set[str]] = {}
        for term, node in conn.execute(sql.SQL("SELECT DISTINCT term, node FROM {}").format(t)):
            writers.setdefault(int(term), set()).add(str(node))
    assert rows is not None and by_id is not None and by_time is not None
    elected = {int(e["term"]): str(e["node"]) for e in elections}
    mismatched = [
        f"term {term}: written by {sorted(nodes)}, elected {elected.get(term)}"
        for term, nodes in sorted(writers.items())
        if elected.get(term) not in nodes
    ]
    return LedgerCheck(
        rows=int(rows[0]),
        terms=len(writers),
        overlap_by_id=int(by_id[0]),
        overlap_by_time=int(by_time[0]),
        shared_terms={k: v for k, v in writers.items() if len(v) > 1},
        mismatched=mismatched,
    )


# -- cost -------------------------------------------------------------------------------


@dataclass
class SessionCost:
    """Queries one keeper session sent during the window."""

    pid: int
    role: str
    node: str | None
    kinds: Counter[str]
    window: float

    @property
    def queries(self) -> int:
        """Query messages sent in the window."""
        return sum(self.kinds.values())

    @property
    def renewals(self) -> int:
        """Renewals among them."""
        return self.kinds["renew"]

    @property
    def per_second(self) -> float:
        """Queries per second."""
        return self.queries / self.window


@dataclass
class CostResult:
    """The cost phase: per-session query rates and per-process CPU."""

    window: float
    sessions: list[SessionCost]
    cpu: dict[str, float]  # node id -> % of one core
    leader_node: str
    measured_statements: bool
    surprises: list[str]


def classify(text: str) -> str:
    """What a keeper query does: ``renew``, ``acquire``, ``wait``, ``release`` or ``other``."""
    if text.startswith("UPDATE") and "renewed_at = now()" in text:
        return "renew"
    if "ON CONFLICT (name) DO NOTHING" in text:
        return "acquire"
    if "pg_advisory_lock(" in text:
        return "wait"
    if "'released'" in text:
        return "release"
    return "other"


def count_statements(log_path: Path, start: int, end: int) -> dict[int, Counter[str]]:
    """Statement-log entries between two byte offsets: per backend pid, per kind.

    One entry is one query message (one round trip), which may hold several SQL
    statements (the acquire and the follower's wait each are one message).
    """
    with open(log_path, "rb") as f:
        f.seek(start)
        chunk = f.read(max(0, end - start)).decode(errors="replace")
    counts: dict[int, Counter[str]] = {}
    for line in chunk.splitlines():
        m = _LOGGED.match(line)
        if m is not None:
            counts.setdefault(int(m.group(1)), Counter())[classify(m.group(3).strip())] += 1
    return counts


def keeper_sessions(dsn: str, lease: str) -> tuple[int | None, list[int]]:
    """The leader's keeper pid (``holder_pid``) and every keeper session of ``lease``."""
    with psycopg.connect(dsn, autocommit=True, application_name="rselection-bench") as conn:
        row = conn.execute(
            sql.SQL("SELECT holder_pid FROM {} WHERE name = %s").format(
                sql.Identifier(LEASE_TABLE)
            ),
            (lease,),
        ).fetchone()
        pids = [
            int(r[0])
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s ORDER BY pid",
                (f"rselection:{lease}",),
            )
        ]
    return (int(row[0]) if row and row[0] is not None else None), pids


def keeper_owner(fleet: BenchFleet, dsn: str, pids: list[int]) -> dict[int, str]:
    """Map keeper backend pids to node ids through the client ports of the sessions."""
    with psycopg.connect(dsn, autocommit=True, application_name="rselection-bench") as conn:
        ports = {
            int(port): int(pid)
            for pid, port in conn.execute(
                "SELECT pid, client_port FROM pg_stat_activity WHERE pid = ANY(%s)"
                " AND client_port IS NOT NULL",
                (pids,),
            )
        }
    inode_port: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                local_port = int(cols[1].rsplit(":", 1)[1], 16)
                inode_port[cols[9]] = local_port
    owners: dict[int, str] = {}
    for node, proc in fleet.procs.items():
        if proc.poll() is not None:
            continue
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{proc.pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    port = inode_port.get(target[8:-1])
                    if port in ports:
                        owners[ports[port]] = node
    return owners


def run_cost(
    dsn: str,
    timings: Timings,
    nodes: int,
    window: float,
    server_log: Path | None,
    stderr: IO[str],
    log: Callable[[str], None],
    *,
    lease: str,
    extra: Sequence[str] = (),
) -> CostResult:
    """Run 1 leader and ``nodes - 1`` idle followers; measure their keeper sessions."""
    fleet = BenchFleet(dsn, lease, [*timings.node_args(), *IDLE_TASKS, *extra], stderr)
    try:
        for _ in range(nodes):
            fleet.fresh_node()
        for node in list(fleet.procs):
            fleet.ready(node, 30)
        leader = fleet.current_leader(timings.ttl + 15)["node"]
        # Let every follower finish its start-up queries and settle into its wait.
        fleet.drain(max(3.0, 2 * timings.retry_interval))
        holder_pid, pids = keeper_sessions(dsn, lease)
        if holder_pid is None or holder_pid not in pids or len(pids) != nodes:
            raise BenchError(f"unexpected keeper sessions: holder {holder_pid}, all {pids}")
        owners = keeper_owner(fleet, dsn, pids)
        log(
            f"cost: {nodes} nodes, {leader} leads (keeper pid {holder_pid}); "
            f"measuring for {window:g} s"
        )
        node_pids = {node: proc.pid for node, proc in fleet.procs.items()}
        cpu_before = {node: cpu_seconds(pid) for node, pid in node_pids.items()}
        offset = server_log.stat().st_size if server_log else 0
        began = time.monotonic()
        elections = len(fleet.elections)
        fleet.drain(window)
        elapsed = time.monotonic() - began
        offset_end = server_log.stat().st_size if server_log else 0
        cpu_after = {node: cpu_seconds(pid) for node, pid in node_pids.items()}
        if len(fleet.elections) != elections or fleet.leader is None:
            raise BenchError("leadership changed during the cost window; measurement void")
        holder_after, pids_after = keeper_sessions(dsn, lease)
        if holder_after != holder_pid or pids_after != pids:
            raise BenchError("keeper sessions changed during the cost window; measurement void")
        counts = count_statements(server_log, offset, offset_end) if server_log else {}
        sessions = [
            SessionCost(
                pid=pid,
                role="leader" if pid == holder_pid else "follower",
                node=owners.get(pid),
                kinds=counts.get(pid, Counter()),
                window=elapsed,
            )
            for pid in sorted(pids, key=lambda p: (p != holder_pid, p))
        ]
        cpu = {node: (cpu_after[node] - cpu_before[node]) / elapsed * 100 for node in node_pids}
        return CostResult(elapsed, sessions, cpu, leader, server_log is not None, fleet.surprises)
    finally:
        fleet.stop_all()


# -- report -----------------------------------------------------------------------------


@dataclass
class Target:
    """One line of the final table."""

    name: str
    target: str
    measured: str
    ok: bool | None  # None: not measured


def targets_table(targets: list[Target]) -> str:
    """The targets as an aligned text table with PASS/FAIL/SKIP."""
    rows = [("target", "bound", "measured", "result")]
    for t in targets:
        verdict = "SKIP" if t.ok is None else ("PASS" if t.ok else "FAIL")
        rows.append((t.name, t.target, t.measured, verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summarize_node_log(path: Path) -> list[str]:
    """The distinct messages (digits masked) the nodes wrote to stderr, most common first."""
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
    return [f"{n:>4} x {msg}" for msg, n in kinds.most_common(8)]


# -- Redis and tooz ---------------------------------------------------------------------


def redis_ledger(url: str, lease: str, ledger: str, elections: list[dict[str, Any]]) -> LedgerCheck:
    """The Redis ledger (a list in commit order) checked like the Postgres one."""
    import json

    import redis

    from rselection.commands.demo_fleet import redis_ledger_key

    client = redis.Redis.from_url(url)
    try:
        raw = client.lrange(redis_ledger_key(ledger, lease), 0, -1)
    finally:
        client.close()
    entries = [json.loads(x) for x in raw]
    overlap, newest = 0, 0
    writers: dict[int, set[str]] = {}
    for e in entries:
        term = int(e["term"])
        overlap += term < newest
        newest = max(newest, term)
        writers.setdefault(term, set()).add(str(e["node"]))
    elected = {int(e["term"]): str(e["node"]) for e in elections}
    mismatched = [
        f"term {term}: written by {sorted(nodes)}, elected {elected.get(term)}"
        for term, nodes in sorted(writers.items())
        if elected.get(term) not in nodes
    ]
    return LedgerCheck(
        rows=len(entries),
        terms=len(writers),
        overlap_by_id=overlap,
        overlap_by_time=0,
        shared_terms={k: v for k, v in writers.items() if len(v) > 1},
        mismatched=mismatched,
    )


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    """The Redis URL to use: a private ``redis-server`` unless ``url``."""
    if url:
        yield url
        return
    from tests.support.pg import PrivateRedis

    server = PrivateRedis(appendonly=False).start()
    try:
        yield server.url
    finally:
        server.close()


def run_redis(
    url: str,
    timings: Timings,
    args: argparse.Namespace,
    stderr: IO[str],
    log: Callable[[str], None],
) -> tuple[dict[str, Scenario], LedgerCheck, list[str]]:
    """The failover rounds for RedisLeader nodes; their times, ledger and surprises."""
    lease = f"bench-{uuid.uuid4().hex[:6]}"
    ledger = "rselection_bench_ledger"
    node_args = [*timings.node_args(), "--backend", "redis", "--ledger", ledger]
    fleet = BenchFleet(url, lease, node_args, stderr)
    try:
        for _ in range(args.nodes):
            fleet.fresh_node()
        for node in list(fleet.procs):
            fleet.ready(node, 30)
        first = fleet.current_leader(timings.ttl + 15)
        log(f"redis fleet ready: {first['node']} leads term {first['term']}")
        fleet.drain(1.0)
        scenarios = run_failover(fleet, timings, args.rounds, args.pause_rounds, log)
    finally:
        fleet.stop_all()
    return scenarios, redis_ledger(url, lease, ledger, fleet.elections), fleet.surprises


class ToozFleet(BenchFleet):
    """Node processes that elect a leader with tooz (``bench/failover.py tooz-node``)."""

    def command(self, node_id: str, extra: list[str] | None = None) -> list[str]:
        """The command line of tooz node ``node_id``."""
        return [
            sys.executable,
            str(Path(__file__).resolve()),
            "tooz-node",
            self.dsn,
            self.name,
            node_id,
        ]


def run_tooz_node(url: str, group: str, node_id: str) -> int:
    """One tooz node: join ``group``, run the watchers every 100 ms, report elections.

    tooz gives no fencing term; the node reports a growing number in its place so the
    event stream looks like rselection's.
    """
    import json

    from tooz import coordination

    from rselection.commands.demo_fleet import StopFlag

    def emit(event: str, **fields: Any) -> None:
        fields.update(ev=event, t=time.time())
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()

    stop = StopFlag.on_stop_signals()
    coord = coordination.get_coordinator(url, node_id.encode())
    coord.start(start_heart=True)
    with contextlib.suppress(coordination.GroupAlreadyExist):
        coord.create_group(group.encode()).get()
    coord.join_group(group.encode()).get()
    coord.watch_elected_as_leader(
        group.encode(), lambda event: emit("elected", node=node_id, term=time.time_ns())
    )
    emit("ready", node=node_id, pid=os.getpid())
    while not stop.wait(0.1):
        coord.run_watchers()
    began = time.monotonic()
    coord.stop()
    emit("stopped", node=node_id, took=time.monotonic() - began)
    return 0


def run_tooz(
    url: str, rounds: int, nodes: int, stderr: IO[str], log: Callable[[str], None]
) -> tuple[dict[str, Scenario] | None, str]:
    """kill -9 and graceful-stop rounds of tooz's Redis leader election.

    Returns the scenarios, or ``None`` and why tooz could not be measured.
    """
    try:
        import tooz.coordination  # noqa: F401
    except ImportError as exc:
        return None, f"tooz is not installed ({exc}); pip install -e '.[dev]'"
    fleet = ToozFleet(url, f"bench-tooz-{uuid.uuid4().hex[:6]}", [], stderr)
    # tooz's lock expires after its default timeout (30 s); allow for that and more.
    timings = Timings(ttl=45.0)
    try:
        for _ in range(nodes):
            fleet.fresh_node()
        for node in list(fleet.procs):
            fleet.ready(node, 60)
        first = fleet.current_leader(60)
        log(f"tooz fleet ready: {first['node']} leads")
        fleet.drain(1.0)
        scenarios = run_failover(fleet, timings, rounds, 0, log)
    except Exception as exc:  # report rselection's figures even if tooz misbehaves
        return None, f"tooz rounds failed: {type(exc).__name__}: {exc}"
    finally:
        fleet.stop_all()
    return scenarios, ""


def compare_line(label: str, ours: Scenario, theirs: Scenario | None) -> str:
    """One row of the side-by-side table: p50 and p95 of both, and tooz / ours."""

    def stats(s: Scenario | None) -> tuple[float, float]:
        if s is None or not s.times:
            return math.nan, math.nan
        return percentile(s.times, 0.5) * 1000, percentile(s.times, 0.95) * 1000

    o50, o95 = stats(ours)
    t50, t95 = stats(theirs)
    return (
        f"  {label:<9} rselection p50 {o50:8.1f} ms p95 {o95:8.1f} ms | "
        f"tooz p50 {t50:8.1f} ms p95 {t95:8.1f} ms | tooz/rselection p50 {t50 / o50:7.1f}x "
        f"p95 {t95 / o95:7.1f}x"
    )


def redis_report(
    timings: Timings,
    scenarios: dict[str, Scenario],
    ledger: LedgerCheck,
    tooz: dict[str, Scenario] | None,
    tooz_note: str,
    surprises: list[str],
) -> list[Target]:
    """Print the Redis results and the tooz comparison; return the Redis targets."""
    ttl, retry = timings.ttl, timings.retry_interval
    print()
    print("RedisLeader failover (ms, from the signal to the successor's 'elected' event):")
    print("  " + scenarios["crash"].summary([("ttl", ttl)]))
    print("  " + scenarios["handover"].summary([("ttl", ttl)]))
    print("  " + scenarios["pause"].summary([("ttl", ttl), ("(ttl+retry)", ttl + retry)]))
    print(
        f"  ledger: {ledger.rows} fenced RPUSHes in {ledger.terms} terms; overlap "
        f"{ledger.overlap_by_id}; terms with more than one writer: {len(ledger.shared_terms)}; "
        f"terms not written by their elected node: {len(ledger.mismatched)}"
    )
    for note in surprises[:10]:
        print(f"  event: {note}")
    print()
    print("Redis: rselection RedisLeader vs tooz (Redis driver, defaults), same Redis:")
    if tooz is None:
        print(f"  tooz could not be measured: {tooz_note}")
    print(compare_line("crash", scenarios["crash"], tooz["crash"] if tooz else None))
    print(compare_line("handover", scenarios["handover"], tooz["handover"] if tooz else None))
    out: list[Target] = []
    crash, handover = scenarios["crash"].times, scenarios["handover"].times
    if crash:
        p95 = percentile(crash, 0.95)
        out.append(
            Target("redis crash failover p95", "<= 1000 ms", f"{p95 * 1000:.1f} ms", p95 <= 1)
        )
    if handover:
        p95 = percentile(handover, 0.95)
        out.append(Target("redis handover p95", "<= 50 ms", f"{p95 * 1000:.1f} ms", p95 <= 0.05))
    if scenarios["pause"].times:
        worst = max(scenarios["pause"].times)
        out.append(
            Target(
                "redis pause failover max",
                f"<= ttl + retry = {(ttl + retry) * 1000:.0f} ms",
                f"{worst * 1000:.1f} ms",
                worst <= ttl + retry,
            )
        )
    out.append(
        Target(
            "redis ledger overlap / one writer per term",
            "0 / every term",
            f"{ledger.overlap_by_id} / {len(ledger.shared_terms)} shared, "
            f"{len(ledger.mismatched)} not elected",
            ledger.overlap_by_id == 0 and not ledger.shared_terms and not ledger.mismatched,
        )
    )
    return out


# -- main -------------------------------------------------------------------------------


@contextlib.contextmanager
def database(dsn: str | None, server_log: Path | None) -> Iterator[tuple[str, Path | None]]:
    """The DSN to use and the statement log to read: a private server unless ``dsn``."""
    if dsn:
        yield dsn, server_log
        return
    from tests.support.pg import PrivatePostgres

    with PrivatePostgres(settings=LOG_SETTINGS) as pg:
        yield pg.dsn, pg.log_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        prog="bench/failover.py",
        description="Failover time, fencing safety and idle cost of PostgresLeader.",
    )
    p.add_argument("--nodes", type=int, default=3, help="node processes (default 3)")
    p.add_argument("--rounds", type=int, default=20, help="crash and handover rounds each")
    p.add_argument("--pause-rounds", type=int, default=3, help="SIGSTOP rounds (each ~ttl)")
    p.add_argument("--ttl", type=float, help="lease ttl; renew_deadline = ttl*2/3 (default 15)")
    p.add_argument("--cost-window", type=float, default=30.0, help="cost window, seconds")
    p.add_argument("--dsn", help="use this server instead of a private one")
    p.add_argument(
        "--server-log",
        type=Path,
        help="with --dsn: that server's log, written with log_statement='all' and "
        "log_line_prefix='%%p %%a ' (else statement counts are skipped)",
    )
    p.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis and tooz rounds")
    p.add_argument(
        "--tooz-rounds",
        type=int,
        default=5,
        help="tooz crash and handover rounds each (a crash takes ~30 s; default 5)",
    )
    args = p.parse_args(argv)
    if args.nodes < 2:
        p.error("--nodes must be at least 2")
    if args.rounds < 0 or args.pause_rounds < 0 or args.cost_window <= 0:
        p.error("rounds must be >= 0 and the cost window positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 if every target is met, 1 if not, 2 on error."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tooz-node"]:
        return run_tooz_node(*argv[1:4])
    args = parse_args(argv)
    timings = Timings.for_ttl(args.ttl)
    from rselection.timing import Timings as Checked

    try:
        Checked(timings.ttl, timings.renew_interval, timings.renew_deadline, timings.retry_interval)
    except ValueError as exc:
        print(f"bad timings: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_exit)
    # Node processes import rselection and the demo from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )

    def log(text: str) -> None:
        print(text, flush=True)

    print(
        f"rselection failover benchmark: {args.nodes} nodes, {args.rounds} crash and "
        f"handover rounds, {args.pause_rounds} pause rounds; ttl {timings.ttl:g} s, "
        f"renew_interval {timings.renew_interval:g} s, renew_deadline "
        f"{timings.renew_deadline:g} s, retry_interval {timings.retry_interval:g} s; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    ledger_table = f"rselection_bench_ledger_{uuid.uuid4().hex[:6]}"
    lease = f"bench-{uuid.uuid4().hex[:6]}"
    cost_lease = f"bench-cost-{uuid.uuid4().hex[:6]}"
    node_args = [*timings.node_args(), "--ledger", ledger_table]
    workdir = tempfile.TemporaryDirectory(prefix="rselection-bench-")
    node_log_path = Path(workdir.name) / "nodes.log"
    started = time.monotonic()
    try:
        with (
            open(node_log_path, "w") as node_log,
            database(args.dsn, args.server_log) as (dsn, server_log),
        ):
            try:
                fleet = BenchFleet(dsn, lease, node_args, node_log)
                try:
                    for _ in range(args.nodes):
                        fleet.fresh_node()
                    for node in list(fleet.procs):
                        fleet.ready(node, 30)
                    first = fleet.current_leader(timings.ttl + 15)
                    log(f"fleet ready: {first['node']} leads term {first['term']}")
                    fleet.drain(1.0)
                    scenarios = run_failover(fleet, timings, args.rounds, args.pause_rounds, log)
                finally:
                    fleet.stop_all()
                ledger = check_ledger(dsn, ledger_table, fleet.elections)
                cost = run_cost(
                    dsn,
                    timings,
                    3,
                    args.cost_window,
                    server_log,
                    node_log,
                    log,
                    lease=cost_lease,
                    extra=["--ledger", ledger_table],
                )
            finally:
                if args.dsn:  # leave a shared server as we found it
                    drop_bench_objects(dsn, ledger_table, [lease, cost_lease])
    except Exception as exc:
        if isinstance(exc, BenchError):
            print(f"benchmark failed: {exc}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
        for line in summarize_node_log(node_log_path):
            print(f"  node stderr: {line}", file=sys.stderr)
        return 2
    else:
        node_messages = summarize_node_log(node_log_path)
    finally:
        workdir.cleanup()

    surprises = [*fleet.surprises, *(f"cost phase: {s}" for s in cost.surprises)]
    report(args, timings, scenarios, ledger, cost, surprises, node_messages, started)
    targets = build_targets(timings, scenarios, ledger, cost)
    if not args.no_redis:
        try:
            with (
                tempfile.TemporaryFile(mode="w+") as redis_log,
                redis_server(args.redis_url) as url,
            ):
                r_scen, r_ledger, r_surprises = run_redis(url, timings, args, redis_log, log)
                tooz, note = run_tooz(url, args.tooz_rounds, args.nodes, redis_log, log)
        except Exception as exc:
            if isinstance(exc, BenchError):
                print(f"redis benchmark failed: {exc}", file=sys.stderr, flush=True)
            else:
                traceback.print_exc()
            return 2
        redis_targets = redis_report(timings, r_scen, r_ledger, tooz, note, r_surprises)
        print()
        print(targets_table(redis_targets))
        targets += redis_targets
        print(f"\ntotal time {time.monotonic() - started:.0f} s")
    return 0 if all(t.ok is not False for t in targets) else 1


def drop_bench_objects(dsn: str, ledger_table: str, leases: list[str]) -> None:
    """Drop the ledger table and the lease rows of this run (best effort)."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(ledger_table)))
            conn.execute(
                sql.SQL("DELETE FROM {} WHERE name = ANY(%s)").format(sql.Identifier(LEASE_TABLE)),
                (leases,),
            )
    except psycopg.Error as exc:
        print(f"could not clean up {ledger_table}: {exc}", file=sys.stderr)


def build_targets(
    timings: Timings, scenarios: dict[str, Scenario], ledger: LedgerCheck, cost: CostResult
) -> list[Target]:
    """The design targets against the measurements."""
    ms = 1000.0
    crash = scenarios["crash"].times
    handover = scenarios["handover"].times
    pause = scenarios["pause"].times
    out: list[Target] = []
    if crash:
        p95 = percentile(crash, 0.95)
        note = "" if timings.ttl == 15 else f" (at ttl {timings.ttl:g})"
        out.append(
            Target("crash failover p95", "<= 1000 ms", f"{p95 * ms:.1f} ms{note}", p95 <= 1.0)
        )
    if handover:
        p95 = percentile(handover, 0.95)
        out.append(Target("handover p95 (issue)", "<= 100 ms", f"{p95 * ms:.1f} ms", p95 <= 0.1))
        out.append(Target("handover p95 (DESIGN)", "<= 50 ms", f"{p95 * ms:.1f} ms", p95 <= 0.05))
    if pause:
        bound = timings.ttl + timings.retry_interval
        worst = max(pause)
        out.append(
            Target(
                "pause failover max",
                f"<= ttl + retry = {bound * ms:.0f} ms",
                f"{worst * ms:.1f} ms",
                worst <= bound,
            )
        )
    out.append(
        Target(
            "ledger overlap",
            "0",
            f"{ledger.overlap_by_id} by id, {ledger.overlap_by_time} by time",
            ledger.overlap_by_id == 0 and ledger.overlap_by_time == 0,
        )
    )
    out.append(
        Target(
            "one writer per term",
            "every term",
            f"{ledger.terms} terms, "
            f"{len(ledger.shared_terms)} shared, {len(ledger.mismatched)} not elected",
            not ledger.shared_terms and not ledger.mismatched,
        )
    )
    leader = [s for s in cost.sessions if s.role == "leader"]
    followers = [s for s in cost.sessions if s.role == "follower"]
    if cost.measured_statements and leader:
        s = leader[0]
        expect = 1 / timings.renew_interval
        # A window of W seconds holds W / renew_interval renewals, +-1 at its edges.
        slack = 1.0 / cost.window
        out.append(
            Target(
                "leader: one statement per renewal",
                f"all renewals, ~{expect:.2f}/s",
                f"{s.per_second:.3f}/s, {s.renewals}/{s.queries} renewals",
                s.queries == s.renewals and abs(s.per_second - expect) <= slack + 1e-9,
            )
        )
    else:
        out.append(Target("leader: one statement per renewal", "", "no statement log", None))
    bound = 1 / timings.retry_interval
    if cost.measured_statements and followers:
        worst_f = max(s.per_second for s in followers)
        out.append(
            Target(
                "idle follower queries",
                f"<= 1/retry = {bound:.2f}/s",
                f"max {worst_f:.3f}/s",
                worst_f <= bound,
            )
        )
    else:
        out.append(Target("idle follower queries", f"<= {bound:.2f}/s", "no statement log", None))
    follower_cpu = [v for k, v in cost.cpu.items() if k != cost.leader_node]
    if follower_cpu:
        worst_cpu = max(follower_cpu)
        out.append(
            Target("idle follower CPU", "< 1% of a core", f"max {worst_cpu:.2f}%", worst_cpu < 1.0)
        )
    return out


def report(
    args: argparse.Namespace,
    timings: Timings,
    scenarios: dict[str, Scenario],
    ledger: LedgerCheck,
    cost: CostResult,
    surprises: list[str],
    node_messages: list[str],
    started: float,
) -> None:
    """Print the results and the targets table."""
    ttl, retry = timings.ttl, timings.retry_interval
    print()
    print("failover (ms, from the signal to the successor's 'elected' event):")
    print("  " + scenarios["crash"].summary([("ttl", ttl)]))
    print("  " + scenarios["handover"].summary([("ttl", ttl)]))
    print("  " + scenarios["pause"].summary([("ttl", ttl), ("(ttl+retry)", ttl + retry)]))
    print()
    print(
        f"ledger: {ledger.rows} fenced rows in {ledger.terms} terms; overlap "
        f"{ledger.overlap_by_id} (by id), {ledger.overlap_by_time} (by written_at); "
        f"terms with more than one writer: {len(ledger.shared_terms)}; "
        f"terms not written by their elected node: {len(ledger.mismatched)}"
    )
    for line in [
        *(f"  {t}: {sorted(n)}" for t, n in ledger.shared_terms.items()),
        *(f"  {m}" for m in ledger.mismatched),
    ][:10]:
        print(line)
    print()
    print(
        f"cost ({cost.window:.1f} s window, 1 leader + {len(cost.sessions) - 1} idle "
        "followers, tasks idle):"
    )
    for s in cost.sessions:
        who = f"{s.role} {s.node or '?'}"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(s.kinds.items()))
        if cost.measured_statements:
            print(
                f"  {who:<14} keeper pid {s.pid:<7} {s.queries:>3} queries = "
                f"{s.per_second:.3f}/s ({kinds or 'none'})"
            )
        else:
            print(f"  {who:<14} keeper pid {s.pid:<7} (no statement log)")
    for node, pct in sorted(cost.cpu.items(), key=lambda kv: (kv[0] != cost.leader_node, kv)):
        role = "leader" if node == cost.leader_node else "follower"
        print(f"  CPU {role:<8} {node:<4} {pct:.2f}% of a core")
    print(
        f"  bounds: leader 1/renew_interval = {1 / timings.renew_interval:.2f}/s; "
        f"idle follower <= 1/retry_interval = {1 / retry:.2f}/s; CPU < 1%"
    )
    if surprises or node_messages:
        print()
        print("notes:")
        for note in surprises[:20]:
            print(f"  event: {note}")
        for m in node_messages:
            print(f"  node stderr: {m}")
    print()
    print(targets_table(build_targets(timings, scenarios, ledger, cost)))
    print(f"\ntotal time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
