"""A node that records every fire of one interval task, and the accounting of those fires.

Run as a program (``python tests/support/fire_node.py --dsn DSN --ledger TABLE ...``), it
is one process of a fleet that runs the same 'fire' task on an epoch-aligned interval,
under one of three schemes:

* ``rselection``: a :class:`rselection.PostgresLeader` with its default claimer, so each
  fire is claimed before it runs;
* ``leader-only``: the same leader built with ``claimer=None`` (only the leader runs
  fires, nothing claims them);
* ``apscheduler``: APScheduler 3 with an ``IntervalTrigger``, started in every process
  alike (the usual "each worker runs the scheduler" deployment).

A fire is recorded when it has run: one ledger row with its fire key and instant. The
node reports on stdout, one JSON object a line: ``ready``, ``elected``, ``demoted``,
``skipped`` (every ``fire_skipped`` signal: reason, instant, key), ``duplicate`` (the
ledger refused a second row for a key: it has a UNIQUE constraint in the tests),
``failed`` (the ledger write failed) and ``stopped``.

Imported, it gives the parent side: :class:`FireFleet` spawns these nodes, and
:func:`tally` sorts every instant of the run into ran once, ran more than once,
missed with an explanation, and missed without one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg import errors, sql

from rselection.commands.demo_fleet import Fleet, StopFlag

__all__ = [
    "SCHEMES",
    "FireFleet",
    "Tally",
    "claims_held_by",
    "create_ledger",
    "instant_of_key",
    "ledger_rows",
    "sleep_until_phase",
    "tally",
    "to_micros",
]

NODE_PROGRAM = Path(__file__).resolve()
SCHEMES = ("rselection", "leader-only", "apscheduler")
TASK = "fire"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_out_lock = threading.Lock()


def _emit(event: str, **fields: Any) -> None:
    fields.update(ev=event, t=time.time())
    line = json.dumps(fields, default=str) + "\n"
    with _out_lock:  # task threads, the scheduler and the main thread all report
        sys.stdout.write(line)
        sys.stdout.flush()


def to_micros(at: datetime) -> int:
    """An aware datetime as whole microseconds since the Unix epoch (exact, unlike floats)."""
    return (at - EPOCH) // timedelta(microseconds=1)


def from_micros(us: int) -> datetime:
    """The inverse of :func:`to_micros`."""
    return EPOCH + timedelta(microseconds=us)


def instant_of_key(key: str) -> int:
    """The instant (microseconds) of a fire key ``"[<lease>/]<task>@<RFC 3339 nanos>Z"``."""
    stamp = key.rpartition("@")[2]
    # 26 characters are the instant to the microsecond; the key pads it to nanoseconds.
    return to_micros(datetime.strptime(stamp[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC))


# -- the node ---------------------------------------------------------------------------


class Ledger:
    """Writes one row per fire that ran, on one connection shared by the fire threads."""

    def __init__(self, dsn: str, table: str, node: str) -> None:
        self.dsn = dsn
        self.node = node
        self.insert = sql.SQL(
            "INSERT INTO {} (fire_key, scheduled_at, node, term) VALUES (%s, %s, %s, %s)"
        ).format(sql.Identifier(table))
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None

    def record(self, key: str, at: datetime, term: int | None) -> None:
        """Write the row; report a duplicate or a failure instead of raising."""
        with self.lock:
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
                self.conn.execute(self.insert, (key, at, self.node, term))
            except errors.UniqueViolation:
                _emit("duplicate", node=self.node, key=key, term=term)
            except psycopg.Error as exc:
                _emit("failed", node=self.node, key=key, error=f"{type(exc).__name__}: {exc}")
                if self.conn is not None:
                    self.conn.close()  # reconnect on the next fire
                    self.conn = None


def _report_skip(node: str) -> Any:
    def receiver(sender: object, **kw: Any) -> None:
        _emit("skipped", node=node, reason=kw["reason"], at=kw["scheduled_at"], key=kw["fire_key"])

    return receiver


def _run_leader(args: argparse.Namespace, ledger: Ledger, stop: StopFlag) -> None:
    import rselection as rs

    tasks = rs.TaskHandler(stop_grace=args.stop_grace)

    @tasks.interval(
        args.every,
        name=TASK,
        overlap=args.overlap,
        misfire=args.misfire,
        misfire_grace=args.misfire_grace,
    )
    def fire(ctx: rs.TaskContext) -> None:
        # Plain sleep, not ctx.sleep: the work of a fire finishes within stop_grace even
        # when a graceful stop cancels the term, as a well-behaved short task does. A fire
        # cut short is claimed but not done, which only a crash may cause here.
        time.sleep(args.work)
        assert ctx.fire_key is not None and ctx.scheduled_at is not None
        ledger.record(ctx.fire_key, ctx.scheduled_at, ctx.term)

    rs.signals.fire_skipped.connect(_report_skip(args.node_id), weak=False)
    rs.signals.elected.connect(
        lambda sender, **kw: _emit("elected", node=kw["node_id"], term=kw["term"]), weak=False
    )
    rs.signals.demoted.connect(
        lambda sender, **kw: _emit(
            "demoted", node=kw["node_id"], term=kw["term"], reason=kw["reason"]
        ),
        weak=False,
    )
    options: dict[str, Any] = {}
    if args.scheme == "leader-only":
        options["claimer"] = None
    leader = rs.PostgresLeader(
        args.dsn,
        tasks,
        name=args.name,
        node_id=args.node_id,
        ttl=args.ttl,
        renew_interval=args.renew_interval,
        renew_deadline=args.renew_deadline,
        retry_interval=args.retry_interval,
        **options,
    )
    leader.start()
    _emit("ready", node=args.node_id)
    while not stop.wait(0.1):
        pass
    leader.stop()


def _run_apscheduler(args: argparse.Namespace, ledger: Ledger, stop: StopFlag) -> None:
    from apscheduler.events import (
        EVENT_JOB_EXECUTED,
        EVENT_JOB_MAX_INSTANCES,
        EVENT_JOB_MISSED,
        JobExecutionEvent,
        JobSubmissionEvent,
    )
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.interval import IntervalTrigger

    from rselection.schedules import format_fire_key

    def job() -> None:
        time.sleep(args.work)

    def listener(event: JobExecutionEvent | JobSubmissionEvent) -> None:
        # The job itself is not told its scheduled time; the events are. EXECUTED is sent
        # after the job returned, from the thread that ran it: the fire is done then.
        if event.code == EVENT_JOB_EXECUTED:
            at = event.scheduled_run_time
            ledger.record(format_fire_key(TASK, at), at, None)
        elif event.code == EVENT_JOB_MISSED:
            at = event.scheduled_run_time
            key = format_fire_key(TASK, at)
            _emit("skipped", node=args.node_id, reason="misfire", at=at, key=key)
        else:
            for at in event.scheduled_run_times:
                key = format_fire_key(TASK, at)
                _emit("skipped", node=args.node_id, reason="overlap", at=at, key=key)

    scheduler = BackgroundScheduler(timezone=UTC)
    scheduler.add_listener(
        listener, EVENT_JOB_EXECUTED | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES
    )
    # Started at the epoch, the trigger fires at the same instants as rselection's aligned
    # interval, and at the same instants on every node.
    trigger = IntervalTrigger(seconds=args.every, start_date=EPOCH, timezone=UTC)
    scheduler.add_job(
        job,
        trigger,
        id=TASK,
        max_instances=10,
        coalesce=False,
        misfire_grace_time=max(1, math.ceil(args.misfire_grace)),
    )
    scheduler.start()
    _emit("ready", node=args.node_id)
    while not stop.wait(0.1):
        pass
    scheduler.shutdown(wait=True)


def run_node(argv: list[str] | None = None) -> int:
    """Run one node until SIGTERM/SIGINT (see the module docstring)."""
    args = node_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"{args.node_id} %(levelname)s %(message)s")
    stop = StopFlag.on_stop_signals()
    ledger = Ledger(args.dsn, args.ledger, args.node_id)
    if args.scheme == "apscheduler":
        _run_apscheduler(args, ledger, stop)
    else:
        _run_leader(args, ledger, stop)
    _emit("stopped", node=args.node_id)
    return 0


def node_parser() -> argparse.ArgumentParser:
    """Options of one node."""
    p = argparse.ArgumentParser(prog="fire_node.py")
    p.add_argument("--dsn", required=True)
    p.add_argument("--ledger", required=True, help="table the parent created")
    p.add_argument("--node-id", required=True)
    p.add_argument("--name", default="fires", help="lease name")
    p.add_argument("--scheme", choices=SCHEMES, default="rselection")
    p.add_argument("--every", type=float, default=0.2, help="interval, seconds")
    p.add_argument("--work", type=float, default=0.0, help="seconds each fire works")
    p.add_argument("--overlap", choices=("skip", "allow"), default="skip")
    p.add_argument("--misfire", choices=("latest", "all", "skip"), default="latest")
    p.add_argument("--misfire-grace", type=float, default=10.0)
    p.add_argument("--ttl", type=float, default=15.0)
    p.add_argument("--renew-interval", type=float, default=2.0)
    p.add_argument("--renew-deadline", type=float, default=10.0)
    p.add_argument("--retry-interval", type=float, default=2.0)
    p.add_argument("--stop-grace", type=float, default=None)
    return p


# -- the parent side --------------------------------------------------------------------


def create_ledger(dsn: str, table: str, *, unique: bool) -> None:
    """Create the ledger; ``unique`` makes a second row for a fire key fail."""
    constraint = sql.SQL("UNIQUE" if unique else "")
    ddl = sql.SQL(
        "CREATE TABLE {} (id bigserial PRIMARY KEY, fire_key text NOT NULL {},"
        " scheduled_at timestamptz NOT NULL, node text NOT NULL, term bigint,"
        " ran_at timestamptz NOT NULL DEFAULT clock_timestamp())"
    ).format(sql.Identifier(table), constraint)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl)


def ledger_rows(dsn: str, table: str) -> list[tuple[int, str, int]]:
    """Every ledger row as (instant in microseconds, node, id), in insertion order."""
    query = sql.SQL("SELECT scheduled_at, node, id FROM {} ORDER BY id").format(
        sql.Identifier(table)
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(to_micros(at), node, id_) for at, node, id_ in conn.execute(query)]


def claims_held_by(dsn: str, lease: str, nodes: Iterable[str]) -> set[int]:
    """Instants of the lease's fires whose claim is held by one of ``nodes``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('rselection_claims')").fetchone()
        if exists is None or exists[0] is None:  # a fleet that never claimed
            return set()
        keys = conn.execute(
            "SELECT fire_key FROM rselection_claims WHERE holder = ANY(%s) AND fire_key LIKE %s",
            (list(nodes), f"{lease}/{TASK}@%"),
        ).fetchall()
    return {instant_of_key(key) for (key,) in keys}


def sleep_until_phase(every: float, offset: float, lead: float = 0.05) -> float:
    """Sleep until ``offset`` seconds past a fire instant, at least ``lead`` s from now.

    Returns the instant (Unix seconds) the phase is relative to. Lets a test kill a node
    in the middle of a fire, or between two fires, on purpose.
    """
    now = time.time()
    instant = math.ceil((now + lead - offset) / every) * every
    time.sleep(max(0.0, instant + offset - time.time()))
    return instant


@dataclass
class Tally:
    """Every instant from the first fire that ran to the last, sorted by what happened.

    Instants are microseconds since the epoch.
    """

    expected: int
    ran: int
    duplicates: dict[int, int] = field(default_factory=dict)  # instant -> rows
    misfire: list[int] = field(default_factory=list)  # missed, reported as a misfire
    killed: list[int] = field(default_factory=list)  # missed, claimed by a killed node
    unexplained: list[int] = field(default_factory=list)
    off_grid: list[int] = field(default_factory=list)  # rows at no instant of the schedule

    @property
    def extra_runs(self) -> int:
        """Runs beyond the first of each instant."""
        return sum(n - 1 for n in self.duplicates.values())

    @property
    def explained(self) -> int:
        """Missed instants with an explanation."""
        return len(self.misfire) + len(self.killed)


def tally(
    ran: Iterable[int], every: float, misfire: Iterable[int] = (), killed: Iterable[int] = ()
) -> Tally:
    """Account for every instant between the first and the last one that ran.

    Args:
        ran: the instant of each ledger row (repeated for each duplicate row).
        every: the interval in seconds.
        misfire: instants some node reported skipped as a misfire.
        killed: instants whose claim is held by a node that was killed.
    """
    counts = Counter(ran)
    if not counts:
        return Tally(expected=0, ran=0)
    step = round(every * 1_000_000)
    first, last = min(counts), max(counts)
    result = Tally(expected=(last - first) // step + 1, ran=0)
    result.off_grid = sorted(at for at in counts if (at - first) % step)
    misfire_set, killed_set = set(misfire), set(killed)
    for at in range(first, last + 1, step):
        runs = counts.get(at, 0)
        if runs:
            result.ran += 1
            if runs > 1:
                result.duplicates[at] = runs
        elif at in killed_set:
            result.killed.append(at)
        elif at in misfire_set:
            result.misfire.append(at)
        else:
            result.unexplained.append(at)
    return result


def describe(instants: Iterable[int]) -> str:
    """Instants as readable UTC times, for messages."""
    return ", ".join(from_micros(at).strftime("%H:%M:%S.%f")[:-3] for at in instants)


class FireFleet(Fleet):
    """Node processes of this module's program, with their events in one queue.

    Args:
        dsn: the database every node uses.
        name: the lease name.
        node_args: extra options for every node (see :func:`node_parser`).
        stderr: where the nodes' stderr goes (default: inherited).
    """

    def __init__(
        self, dsn: str, name: str, node_args: list[str], stderr: IO[str] | None = None
    ) -> None:
        super().__init__(dsn, name, node_args)
        self.stderr = stderr

    def spawn(self, node_id: str, extra: list[str] | None = None) -> subprocess.Popen[str]:
        """Start a node called ``node_id``."""
        cmd = [sys.executable, str(NODE_PROGRAM), "--dsn", self.dsn, "--name", self.name]
        cmd += ["--node-id", node_id, *self.node_args, *(extra or [])]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1
        )
        self.procs[node_id] = proc
        assert proc.stdout is not None
        reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        reader.start()
        self._readers.append(reader)
        return proc

    def pump(self) -> None:
        """Move every event that has arrived into :attr:`history`, without waiting."""
        while self.next_event(0) is not None:
            pass

    def elected(self, timeout: float, exclude: Iterable[str] = ()) -> dict[str, Any] | None:
        """The next ``elected`` event of a node not in ``exclude``; ``None`` on timeout."""
        excluded = set(exclude)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            event = self.next_event(left)
            if event and event["ev"] == "elected" and event["node"] not in excluded:
                return event
        return None

    def stop_nodes(self, nodes: Iterable[str], timeout: float = 20.0) -> None:
        """SIGTERM ``nodes`` and wait for them to exit (SIGKILL after ``timeout``)."""
        procs = [self.procs[n] for n in nodes if self.procs[n].poll() is None]
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def of_kind(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        """Events of ``kind`` in :attr:`history` whose fields equal ``match``."""
        return [
            e
            for e in self.history
            if e["ev"] == kind and all(e.get(k) == v for k, v in match.items())
        ]

    def skipped(self, reason: str) -> set[int]:
        """Instants some node reported skipped for ``reason``."""
        return {instant_of_key(e["key"]) for e in self.of_kind("skipped", reason=reason)}


if __name__ == "__main__":
    sys.exit(run_node())
