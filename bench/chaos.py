"""Chaos soak: rounds of one random fault each under a fleet of real node processes.

Every round starts a fresh fleet of node processes (``python -m rselection.commands.demo_fleet``,
see :class:`rselection.commands.demo_fleet.Fleet`) on one lease of a private Postgres (or a private
Redis), each node's lease connection through its own loopback :class:`TcpProxy`, waits
for a leader, injects one fault drawn at random, waits for the fleet to settle with one
leader, stops the fleet gracefully and checks:

* failover: time from the fault to the first election of a newer term;
* fenced ledger: no write of an older term committed after one of a newer term, and
  every term was written by one node;
* activity ledger (:mod:`tests.support.activity`): no task run of one term overlapped a
  task run of another term, except for the documented exception (a live leader's
  session ended from outside), whose window is printed;
* liveness: a new leader within a bound, and exactly one leader once the fault is over.

Fault kinds (``--kinds`` picks some; all by default):

==================  ====================================================================
kill9               ``kill -9`` of the leader
sigstop_short       SIGSTOP of the leader for 0.5 s .. ttl - renew_interval - 0.5 s, then
                    SIGCONT (it resumes before its lease can expire, with time to stop)
sigstop_long        SIGSTOP of the leader for ttl + 0.5 s .. ttl + 2 s, then SIGCONT
slow_renewal        the proxy delays the leader's replies so a renewal answers after its
                    deadline but before the keeper's I/O limit
stalled_renewal     the proxy delays the leader's replies beyond the keeper's I/O limit
sever               the proxy resets the leader's lease connections (RST to both ends)
blackhole           the proxy stops moving the leader's bytes (a silent partition)
terminate           ``pg_terminate_backend`` / ``CLIENT KILL`` of the leader's keeper
restart             server restart (fast shutdown, start)
promote             (Postgres) the leader is cut off from the primary, the primary stops,
                    a streaming standby is promoted and the followers move to it
raising             every node connects signal receivers that raise on elected, demoted
                    and lease_renewed; then ``kill -9`` of the leader
stubborn            the leader's task ignores cancellation for 0.8 * stop_grace; then a
                    slow or stalled renewal
==================  ====================================================================

``terminate`` and ``sever`` end the leader's session from outside: the server frees the
lease at once and followers take over while the old node's tasks are still being
cancelled; that window is the documented exception (fencing protects writes), measured
with tasks that stop at once and allowed up to ``stop_grace``. Every other kind must
show no activity overlap at all. A frozen process (SIGSTOP) runs nothing, so its frozen
time is cut out of its task runs; after SIGCONT it needs a moment to learn that its
term is over, excused up to 0.25 s when the lease passed on while it was frozen
(``sigstop_long`` rounds therefore run tasks that stop at once).

Usage::

    python bench/chaos.py [--rounds 200] [--seed N] [--backend postgres|redis|both]
                          [--kinds kill9,sever,...] [--nodes 3] [--quiet]

Exits 1 on any violation, 2 if the soak itself could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from rselection.commands.demo_fleet import Fleet, redis_ledger_key  # noqa: E402
from tests.support import activity  # noqa: E402
from tests.support.pg import (  # noqa: E402
    PrivatePostgres,
    PrivateRedis,
    ServerStartError,
    with_host_port,
)
from tests.support.proxy import TcpProxy  # noqa: E402

LEDGER = "rselection_demo_ledger"

# Short timings, so that a round takes seconds; they keep the library's rule
# renew_deadline + stop_grace + 0.5 <= ttl.
TTL = 4.0
RENEW_INTERVAL = 0.5
RENEW_DEADLINE = 2.0
RETRY_INTERVAL = 0.5
STOP_GRACE = 1.0

WIND_DOWN = 0.2  # every node's 'work' task needs this long to stop once cancelled
STUBBORN = 0.8 * STOP_GRACE  # ... and this long in the stubborn kind
RESUME_GRACE = 0.25  # a resumed process's time to learn its term is over
WARMUP = 0.8  # after the first election, before the fault: renewals are under way
SETTLE = 2.0  # after the fault is over: the fleet must have one leader by then
STOP_TIMEOUT = 10.0  # a node asked to stop (SIGTERM) is killed after this long

EXCEPTION_KINDS = ("terminate", "sever")
ALL_KINDS = (
    "kill9",
    "sigstop_short",
    "sigstop_long",
    "slow_renewal",
    "stalled_renewal",
    "sever",
    "blackhole",
    "terminate",
    "restart",
    "promote",
    "raising",
    "stubborn",
)
POSTGRES_ONLY = ("promote",)


class SoakError(RuntimeError):
    """The soak itself could not go on (a server would not start, a fleet never came up)."""


def node_timing_args() -> list[str]:
    """The node program's options for the soak's timings."""
    return [
        *("--ttl", f"{TTL:g}", "--renew-interval", f"{RENEW_INTERVAL:g}"),
        *("--renew-deadline", f"{RENEW_DEADLINE:g}", "--retry-interval", f"{RETRY_INTERVAL:g}"),
        *("--stop-grace", f"{STOP_GRACE:g}", "--tick", "0.2"),
    ]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, interpolated linearly between ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# -- servers ----------------------------------------------------------------------------


class Server:
    """A private lease server of one backend, and how a round uses it."""

    kind = ""

    @property
    def url(self) -> str:
        """What the nodes connect to directly (their fenced ledger writes)."""
        raise NotImplementedError

    @property
    def fleet_args(self) -> list[str]:
        """Node options that select this backend."""
        return []

    def address(self) -> tuple[str, int]:
        """Host and port, for a proxy in front of the server."""
        parts = urllib.parse.urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 0

    def via(self, proxy: TcpProxy) -> str:
        """The server's URL through ``proxy``."""
        raise NotImplementedError

    def restart(self) -> None:
        """Stop the server (fast) and start it again on the same port and data."""
        raise NotImplementedError

    def end_holder_session(self, lease: str) -> str:
        """End the lease holder's keeper session from the server side; say how."""
        raise NotImplementedError

    def ledger(self, lease: str) -> tuple[int, int]:
        """(writes of an older term after a newer term's, terms written by > 1 node)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the server and delete its data."""
        raise NotImplementedError


class PostgresServer(Server):
    """A private Postgres; ``promote`` rounds replace it by its promoted standby."""

    kind = "postgres"

    def __init__(self) -> None:
        self.pg = PrivatePostgres().start()

    @property
    def url(self) -> str:
        return self.pg.dsn

    def via(self, proxy: TcpProxy) -> str:
        return with_host_port(self.pg.dsn, proxy.host, proxy.port)

    def restart(self) -> None:
        self.pg.restart(mode="fast")

    def end_holder_session(self, lease: str) -> str:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT holder_pid FROM rselection_leases WHERE name = %s", (lease,)
            ).fetchone()
            if row is None or row[0] is None:
                return "no holder session"
            conn.execute("SELECT pg_terminate_backend(%s)", (row[0],))
        return f"pg_terminate_backend({row[0]})"

    def ledger(self, lease: str) -> tuple[int, int]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE INDEX IF NOT EXISTS {LEDGER}_lease ON {LEDGER} (lease, term)")
            late = conn.execute(
                f"SELECT count(*) FROM {LEDGER} a JOIN {LEDGER} b ON a.lease = b.lease"
                " AND a.term < b.term AND (a.id > b.id OR a.written_at > b.written_at)"
                " WHERE a.lease = %s",
                (lease,),
            ).fetchone()
            shared = conn.execute(
                f"SELECT count(*) FROM (SELECT term FROM {LEDGER} WHERE lease = %s"
                " GROUP BY term HAVING count(DISTINCT node) > 1) t",
                (lease,),
            ).fetchone()
        assert late is not None and shared is not None
        return int(late[0]), int(shared[0])

    def standby(self) -> PrivatePostgres:
        """A streaming standby of the current primary, started (it streams from it)."""
        standby = self.pg.make_standby()
        standby.start()
        return standby

    def promoted(self, standby: PrivatePostgres) -> None:
        """From now on the promoted ``standby`` is the server; the old primary is removed."""
        old, self.pg = self.pg, standby
        old.close()

    def close(self) -> None:
        self.pg.close()


class RedisServer(Server):
    """A private ``redis-server`` (append-only, so a restart keeps the term counters)."""

    kind = "redis"

    def __init__(self) -> None:
        import redis

        self.server = PrivateRedis().start()
        self.client = redis.Redis.from_url(self.server.url, socket_timeout=10)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def fleet_args(self) -> list[str]:
        return ["--backend", "redis"]

    def via(self, proxy: TcpProxy) -> str:
        return f"redis://{proxy.host}:{proxy.port}/0"

    def restart(self) -> None:
        self.server.restart()
        self.client.connection_pool.disconnect()

    def end_holder_session(self, lease: str) -> str:
        from rselection.redis.lease import lease_keys

        raw = self.client.get(lease_keys(lease)[0])
        if raw is None:
            return "no holder"
        client = json.loads(raw)["client"]
        self.client.client_kill_filter(_id=str(client))
        return f"CLIENT KILL ID {client}"

    def ledger(self, lease: str) -> tuple[int, int]:
        raw = self.client.lrange(redis_ledger_key(LEDGER, lease), 0, -1)
        late, newest = 0, 0
        writers: dict[int, set[str]] = {}
        for entry in map(json.loads, raw):
            term = int(entry["term"])
            late += term < newest
            newest = max(newest, term)
            writers.setdefault(term, set()).add(str(entry["node"]))
        return late, sum(1 for nodes in writers.values() if len(nodes) > 1)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.server.close()


# -- one round ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one round measured and what went wrong in it."""

    index: int
    backend: str
    kind: str
    detail: str = ""
    failover: float | None = None
    fenced: int = 0
    shared_terms: int = 0
    report: activity.Report | None = None
    allowance: float = 0.0
    stuck: int = 0
    handoff: float | None = None
    """First task start of the new term minus last task end of the faulted term."""
    problems: list[str] = field(default_factory=list)
    logs: str = ""

    @property
    def overlap(self) -> float:
        """The longest activity overlap in seconds."""
        return self.report.max_overlap if self.report is not None else 0.0

    @property
    def activity_violations(self) -> int:
        """Overlapping pairs beyond the allowance."""
        return len(self.report.violations) if self.report is not None else 0

    @property
    def violations(self) -> list[str]:
        """Everything that breaks a promise (empty when the round was clean)."""
        out = list(self.problems)
        if self.fenced:
            out.append(f"{self.fenced} fenced writes of an older term after a newer term's")
        if self.shared_terms:
            out.append(f"{self.shared_terms} terms written by more than one node")
        if self.activity_violations:
            assert self.report is not None
            out.append(
                f"activity overlap {self.overlap * 1000:.0f} ms "
                f"({self.activity_violations} pairs): {self.report.overlaps[0]}"
            )
        return out

    def line(self) -> str:
        """One line for the round log."""
        fo = f"{self.failover:.2f}s" if self.failover is not None else "-"
        verdict = "ok" if not self.violations else "VIOLATION: " + "; ".join(self.violations)
        return (
            f"round {self.index:3d} {self.backend:8s} {self.kind:15s} {self.detail:28s} "
            f"failover {fo:>6s}  overlap {self.overlap * 1000:5.0f} ms  {verdict}"
        )


def leaders_now(history: Sequence[dict[str, Any]], dead: set[str]) -> dict[str, int]:
    """Live nodes whose last ``elected``/``demoted``/``stopped`` event says they lead,
    with their term."""
    leading: dict[str, int] = {}
    for event in history:
        if event["ev"] == "elected":
            leading[event["node"]] = int(event["term"])
        elif event["ev"] in ("demoted", "stopped"):
            leading.pop(event["node"], None)
    return {node: term for node, term in leading.items() if node not in dead}


class Round:
    """One fault under one fresh fleet.

    Args:
        server: the lease server.
        kind: the fault kind.
        rng: the soak's random generator (the round's parameters come from it).
        index: the round number.
        nodes: how many node processes.
        log_dir: where node logs go.
    """

    def __init__(
        self,
        server: Server,
        kind: str,
        rng: random.Random,
        index: int,
        nodes: int,
        log_dir: Path,
    ) -> None:
        self.server = server
        self.kind = kind
        self.rng = rng
        self.out = Outcome(index, server.kind, kind)
        self.nodes = nodes
        self.log_dir = log_dir / f"round-{index:04d}"
        self.log_dir.mkdir(parents=True)
        wind_down = STUBBORN if kind == "stubborn" else WIND_DOWN
        if kind in (*EXCEPTION_KINDS, "sigstop_long"):
            # The lease passes on while the old node cannot act (its session is gone, or
            # it is frozen): its tasks' stop time is not the library's; measure without.
            wind_down = 0.0
        args = [*server.fleet_args, *node_timing_args(), "--wind-down", f"{wind_down:g}"]
        args += ["--log-level", "INFO"]
        if kind == "raising":
            args.append("--raising-receivers")
        self.name = f"chaos-{index}-{uuid.uuid4().hex[:6]}"
        self.fleet = Fleet(server.url, self.name, args, log_dir=self.log_dir)
        self.proxies: dict[str, TcpProxy] = {}
        self.data_proxies: dict[str, TcpProxy] = {}  # promote: the nodes' other connections
        self.standby: PrivatePostgres | None = None
        self.killed: set[str] = set()
        self.fault_term: int | None = None

    # -- events

    def watch(self, seconds: float, until: Callable[[], bool] | None = None) -> bool:
        """Read events for up to ``seconds``; stop early once ``until()`` holds."""
        deadline = time.monotonic() + seconds
        while until is None or not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return until is not None and until()
            self.fleet.next_event(min(left, 0.05))
        return True

    def successor(self, term: int, since: float) -> dict[str, Any] | None:
        """The first election of a term newer than ``term`` at or after ``since``."""
        for event in self.fleet.history:
            if event["ev"] == "elected" and event["term"] > term and event["t"] >= since:
                return event
        return None

    # -- the round

    def run(self) -> Outcome:
        """Run the round; never raises for a violation (it is recorded)."""
        try:
            self._start()
            self._fault()
        except SoakError as exc:
            self.out.problems.append(str(exc))
        finally:
            self._stop()
        self._check()
        return self.out

    def _start(self) -> None:
        host, port = self.server.address()
        if self.kind == "promote":
            assert isinstance(self.server, PostgresServer)
            try:
                self.standby = self.server.standby()
            except (ServerStartError, OSError, subprocess.SubprocessError) as exc:
                raise SoakError(f"could not start a standby: {exc}") from exc
        for i in range(self.nodes):
            node = f"n{i}"
            self.proxies[node] = TcpProxy(host, port)
            dsn = None
            if self.standby is not None:
                # Every connection of a node goes through a proxy, so it can be moved to
                # the promoted standby; the ledger writes through their own, never cut.
                self.data_proxies[node] = TcpProxy(host, port)
                dsn = self.server.via(self.data_proxies[node])
            self.fleet.spawn(node, dsn=dsn, lease_dsn=self.server.via(self.proxies[node]))
        try:
            self.fleet.wait_ready(60)
            self.fleet.first_elected(30)
        except TimeoutError as exc:
            raise SoakError(f"the fleet did not come up: {exc}") from exc
        self.watch(WARMUP)

    def _fault(self) -> None:
        leading = leaders_now(self.fleet.history, self.killed)
        if len(leading) != 1:
            raise SoakError(f"{len(leading)} leaders before the fault ({sorted(leading)})")
        ((leader, term),) = leading.items()
        self.fault_term = term
        getattr(self, f"_fault_{self.kind}")(leader, term)

    def _await(self, term: int, at: float, bound: float, *, required: bool = True) -> None:
        """Wait for a newer term's election (within ``bound`` seconds of ``at``)."""
        left = at + bound - time.time()
        self.watch(max(0.0, left), lambda: self.successor(term, at) is not None)
        found = self.successor(term, at)
        if found is not None:
            self.out.failover = found["t"] - at
        elif required:
            raise SoakError(f"no new leader within {bound:g} s of the fault")

    def _settle(self) -> None:
        self.watch(SETTLE)
        leading = leaders_now(self.fleet.history, self.killed)
        if len(leading) != 1:
            raise SoakError(f"{len(leading)} leaders {SETTLE:g} s after the fault")

    # -- fault kinds (each injects, waits for the new leader, undoes, settles)

    def _fault_kill9(self, leader: str, term: int) -> None:
        at = time.time()
        self.fleet.kill(leader)
        self.killed.add(leader)
        self._await(term, at, TTL + 5)
        self._settle()

    def _pause(self, leader: str, term: int, seconds: float, required: bool) -> None:
        self.out.detail = f"paused {seconds:.2f}s"
        at = time.time()
        self.fleet.kill(leader, signal.SIGSTOP)
        self.watch(seconds - (time.time() - at))
        self.fleet.kill(leader, signal.SIGCONT)
        self._await(term, at, seconds + TTL + 3, required=required)
        self._settle()

    def _fault_sigstop_short(self, leader: str, term: int) -> None:
        # A pause short enough that the leader resumes before its lease can expire, with
        # time to wind its tasks down: the lease lasts ttl after the last renewal, which
        # may have landed up to renew_interval before the pause began. A longer pause
        # resumes a process whose lease passes on while it winds down, which nothing can
        # prevent (it was frozen): that is a sigstop_long round (measured: a 3.50 s pause
        # begun 0.4 s after the last renewal resumed 0.09 s before the expiry, and the
        # tasks' 0.2 s wind-down overlapped the next term by 132 ms).
        longest = TTL - RENEW_INTERVAL - WIND_DOWN - 0.3
        self._pause(leader, term, self.rng.uniform(0.5, longest), required=False)

    def _fault_sigstop_long(self, leader: str, term: int) -> None:
        self._pause(leader, term, self.rng.uniform(TTL + 0.5, TTL + 2.0), required=True)

    def _delay(self, leader: str, term: int, seconds: float) -> None:
        self.out.detail = f"replies +{seconds:.2f}s"
        at = time.time()
        self.proxies[leader].delay(seconds)
        self._await(term, at, TTL + seconds + 5)
        self.proxies[leader].heal()
        self._settle()

    def _slow_delay(self) -> float:
        # A renewal sent renew_interval after the last good one answers this long after
        # the deadline (renew_deadline after the last good one), before its I/O limit.
        return RENEW_DEADLINE - RENEW_INTERVAL + self.rng.uniform(0.05, 0.45)

    def _stalled_delay(self) -> float:
        return RENEW_DEADLINE + self.rng.uniform(0.3, 1.5)

    def _fault_slow_renewal(self, leader: str, term: int) -> None:
        self._delay(leader, term, self._slow_delay())

    def _fault_stalled_renewal(self, leader: str, term: int) -> None:
        self._delay(leader, term, self._stalled_delay())

    def _fault_stubborn(self, leader: str, term: int) -> None:
        late = self.rng.random() < 0.5
        self._delay(leader, term, self._slow_delay() if late else self._stalled_delay())
        self.out.detail = ("slow " if late else "stalled ") + self.out.detail

    def _fault_sever(self, leader: str, term: int) -> None:
        at = time.time()
        cut = self.proxies[leader].sever()
        self.out.detail = f"{cut} connections reset"
        self._await(term, at, TTL + 5)
        self._settle()

    def _fault_blackhole(self, leader: str, term: int) -> None:
        at = time.time()
        self.proxies[leader].blackhole()
        self._await(term, at, TTL + 5)
        self.proxies[leader].heal()
        self._settle()

    def _fault_terminate(self, leader: str, term: int) -> None:
        at = time.time()
        self.out.detail = self.server.end_holder_session(self.name)
        self._await(term, at, TTL + 5)
        self._settle()

    def _fault_restart(self, leader: str, term: int) -> None:
        at = time.time()
        self.server.restart()
        self.out.detail = f"down {time.time() - at:.2f}s"
        self._await(term, at, 2 * TTL + 10)
        self._settle()

    def _fault_raising(self, leader: str, term: int) -> None:
        self._fault_kill9(leader, term)

    def _fault_promote(self, leader: str, term: int) -> None:
        server, standby = self.server, self.standby
        assert isinstance(server, PostgresServer) and standby is not None
        at = time.time()
        self.proxies[leader].blackhole()  # the leader is cut off from the primary
        server.pg.stop("fast")
        try:
            standby.promote()
        except ServerStartError as exc:
            raise SoakError(f"the standby could not be promoted: {exc}") from exc
        server.promoted(standby)
        target = server.address()
        for proxy in [*self.proxies.values(), *self.data_proxies.values()]:
            proxy.retarget(*target)
        self.out.detail = f"promoted after {time.time() - at:.2f}s"
        self._await(term, at, TTL + 8)
        # Still cut off: it must stop by its own deadline, not because a heal let the old
        # primary's goodbye through.
        self.watch(at + TTL + 2 - time.time(), lambda: self._demoted(leader, term))
        self.proxies[leader].heal()
        self._settle()

    def _demoted(self, node: str, term: int) -> bool:
        return any(
            e["ev"] == "demoted" and e["node"] == node and e["term"] == term
            for e in self.fleet.history
        )

    # -- the end of a round

    def _stop(self) -> None:
        for proxy in [*self.proxies.values(), *self.data_proxies.values()]:
            with contextlib.suppress(RuntimeError):
                proxy.heal()
        self.fleet.stop_all(timeout=STOP_TIMEOUT)
        for proxy in [*self.proxies.values(), *self.data_proxies.values()]:
            proxy.close()
        if self.standby is not None and self.server.url != self.standby.dsn:
            self.standby.close()  # the round ended before the promotion
        for node, proc in self.fleet.procs.items():
            expected = -signal.SIGKILL if node in self.killed else 0
            if proc.returncode == expected:
                continue
            if proc.returncode == -signal.SIGKILL:
                self.out.problems.append(f"node {node} did not stop within {STOP_TIMEOUT:g} s")
            else:
                self.out.problems.append(f"node {node} exited with code {proc.returncode}")

    def _handoff(self, report: activity.Report) -> float | None:
        """Seconds from the faulted term's last task end to the next term's first start."""
        old = self.fault_term
        if old is None:
            return None
        ends = [r.end for r in report.runs if r.term == old]
        newer = [r for r in report.runs if r.term > old]
        if not ends or not newer:
            return None
        following = min(r.term for r in newer)
        return min(r.start for r in newer if r.term == following) - max(ends)

    def _check(self) -> None:
        out = self.out
        try:
            out.fenced, out.shared_terms = self.server.ledger(self.name)
        except Exception as exc:  # the server may be gone after a failed round
            out.problems.append(f"could not read the fenced ledger: {exc}")
        out.allowance = STOP_GRACE if self.kind in EXCEPTION_KINDS else 0.0
        out.report = activity.check_fleet(
            self.fleet, allowance=out.allowance, resume_grace=RESUME_GRACE
        )
        if not out.report.runs:
            out.problems.append("no task activity was reported")
        out.handoff = self._handoff(out.report)
        out.stuck = sum(1 for e in self.fleet.history if e["ev"] == "stuck")
        if out.violations:
            out.logs = str(self.log_dir)
            with open(self.log_dir / "events.jsonl", "w") as f:
                for event in self.fleet.history:
                    f.write(json.dumps(event) + "\n")
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)


# -- the soak -----------------------------------------------------------------------------


def summarize(outcomes: Sequence[Outcome]) -> str:
    """The per-kind table."""
    header = (
        f"{'backend':8s} {'kind':15s} {'rounds':>6s} {'failover p50':>12s} {'p95':>6s} "
        f"{'max':>6s} {'fenced':>6s} {'activity overlaps':>24s} {'other':>5s}"
    )
    lines = [header, "-" * len(header)]
    keys = sorted(
        {(o.backend, o.kind) for o in outcomes}, key=lambda k: (k[0], ALL_KINDS.index(k[1]))
    )
    for backend, kind in keys:
        rows = [o for o in outcomes if (o.backend, o.kind) == (backend, kind)]
        failovers = [o.failover for o in rows if o.failover is not None]
        fenced = sum(o.fenced + o.shared_terms for o in rows)
        overlapping = [o for o in rows if o.overlap > 0]
        worst = max((o.overlap for o in rows), default=0.0)
        if kind in EXCEPTION_KINDS:
            cell = f"exception: max {worst * 1000:.0f} ms"
        else:
            cell = f"{len(overlapping)} rounds, max {worst * 1000:.0f} ms" if overlapping else "0"
        other = sum(1 for o in rows if o.problems)

        def sec(v: float) -> str:
            return "-" if math.isnan(v) else f"{v:.2f}s"

        lines.append(
            f"{backend:8s} {kind:15s} {len(rows):6d} {sec(percentile(failovers, 0.5)):>12s} "
            f"{sec(percentile(failovers, 0.95)):>6s} "
            f"{sec(max(failovers) if failovers else math.nan):>6s} {fenced:6d} {cell:>24s} "
            f"{other:5d}"
        )
    return "\n".join(lines)


def exception_window(outcomes: Sequence[Outcome]) -> list[str]:
    """Lines on the documented exception's measured overlap window."""
    lines = []
    for kind in EXCEPTION_KINDS:
        for backend in ("postgres", "redis"):
            rows = [o for o in outcomes if (o.backend, o.kind) == (backend, kind)]
            if not rows:
                continue
            windows = [o.overlap for o in rows]
            gaps = [o.handoff * 1000 for o in rows if o.handoff is not None]
            lines.append(
                f"documented exception, {backend} {kind}: old term's tasks ran alongside the "
                f"new term's in {sum(w > 0 for w in windows)} of {len(rows)} rounds; window "
                f"p50 {percentile(windows, 0.5) * 1000:.0f} ms, "
                f"p95 {percentile(windows, 0.95) * 1000:.0f} ms, max {max(windows) * 1000:.0f} ms "
                f"(allowed up to stop_grace = {STOP_GRACE:g} s)"
            )
            if gaps:
                lines.append(
                    f"  from the old term's last task end to the new term's first task start: "
                    f"min {min(gaps):.1f} ms, p50 {percentile(gaps, 0.5):.1f} ms "
                    "(negative: overlap)"
                )
    return lines


@contextlib.contextmanager
def servers(backends: Sequence[str]) -> Iterator[dict[str, Server]]:
    """Private servers for ``backends``, closed on exit."""
    made: dict[str, Server] = {}
    try:
        for backend in backends:
            made[backend] = PostgresServer() if backend == "postgres" else RedisServer()
        yield made
    finally:
        for server in made.values():
            server.close()


def main(argv: list[str] | None = None) -> int:
    """Run the soak; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--backend", choices=["postgres", "redis", "both"], default="both")
    parser.add_argument("--kinds", default=",".join(ALL_KINDS), help="comma-separated kinds")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--quiet", action="store_true", help="no line per round")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(ALL_KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {', '.join(ALL_KINDS)}")
    backends = ["postgres", "redis"] if args.backend == "both" else [args.backend]
    print(
        f"chaos soak: {args.rounds} rounds, seed {seed}, backends {'+'.join(backends)}, "
        f"{args.nodes} nodes; ttl {TTL:g} s, renew_interval {RENEW_INTERVAL:g} s, "
        f"renew_deadline {RENEW_DEADLINE:g} s, retry {RETRY_INTERVAL:g} s, "
        f"stop_grace {STOP_GRACE:g} s, task wind-down {WIND_DOWN:g} s",
        flush=True,
    )
    outcomes: list[Outcome] = []
    log_dir = Path(tempfile.mkdtemp(prefix="rselection-chaos-"))
    started = time.monotonic()
    try:
        with servers(backends) as made:
            for index in range(1, args.rounds + 1):
                backend = rng.choice(backends)
                choices = [k for k in kinds if backend == "postgres" or k not in POSTGRES_ONLY]
                if not choices:
                    continue
                kind = rng.choice(choices)
                outcome = Round(made[backend], kind, rng, index, args.nodes, log_dir).run()
                outcomes.append(outcome)
                if not args.quiet or outcome.violations:
                    print(outcome.line(), flush=True)
    except (ServerStartError, SoakError, OSError) as exc:
        traceback.print_exc()
        print(f"chaos soak could not run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; results so far:", flush=True)
    took = time.monotonic() - started
    print(f"\n{len(outcomes)} rounds in {took / 60:.1f} min (seed {seed})\n")
    print(summarize(outcomes))
    print()
    for line in exception_window(outcomes):
        print(line)
    tails = [o.report.max_resume_tail for o in outcomes if o.report is not None]
    if any(tails):
        print(
            f"resumed after the lease passed on (sigstop_long): longest tail after SIGCONT "
            f"{max(tails) * 1000:.1f} ms (excused up to {RESUME_GRACE * 1000:.0f} ms)"
        )
    bad = [o for o in outcomes if o.violations]
    stuck = sum(o.stuck for o in outcomes)
    if stuck:
        print(f"task_stuck reported {stuck} times")
    if bad:
        print(
            f"\nFAIL: {len(bad)} of {len(outcomes)} rounds broke a promise; node logs in {log_dir}"
        )
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    print("\nPASS: no fenced or activity overlap beyond the documented exception, always a leader")
    return 0


if __name__ == "__main__":
    sys.exit(main())
