"""The demo's fleet: its node program and :class:`Fleet`, which runs node processes.

A node (``python -m rselection.commands.demo_fleet [options]``) is a
:class:`~rselection.PostgresLeader` (or, with ``--backend redis``, a
:class:`~rselection.RedisLeader`) with a ticking task and a fenced ledger writer; it
reports what happens as JSON lines on stdout. :class:`Fleet` starts node processes and
gathers their events: ``rselection demo`` (:mod:`rselection.commands.demo`) kills and
stops its leaders and measures the failovers; the multi-process tests and the chaos
soak (``bench/chaos.py``) drive the same program.

Every task of a node reports its activity: an ``activity`` event when it starts (``end``
is ``null``) and another when it ends, stamped with this machine's wall clock, so a
harness can check that no two terms' tasks ever ran at the same time. Connection strings
reach the nodes through the environment (``RSELECTION_DSN``, ``RSELECTION_LEASE_DSN``),
never the command line, where any local user could read a password.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import itertools
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

from ..errors import ConfigError
from ..redaction import check_userinfo

if TYPE_CHECKING:
    import rselection as rs

__all__ = [
    "DSN_ENV",
    "LEASE_DSN_ENV",
    "Fleet",
    "add_node_arguments",
    "main",
    "redis_ledger_key",
    "run_node",
]

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    id bigserial PRIMARY KEY,
    lease text NOT NULL,
    term bigint NOT NULL,
    node text NOT NULL,
    written_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


#: Environment variables that carry connection strings to node processes.
DSN_ENV = "RSELECTION_DSN"
LEASE_DSN_ENV = "RSELECTION_LEASE_DSN"

_emit_lock = threading.Lock()
_runs = itertools.count(1)


def _emit(event: str, **fields: Any) -> None:
    fields.update(ev=event, t=time.time())
    line = json.dumps(fields, default=str) + "\n"
    with _emit_lock:  # tasks, receivers and the main thread all report: one line each
        sys.stdout.write(line)
        sys.stdout.flush()


@contextlib.contextmanager
def _activity(ctx: rs.TaskContext, task: str) -> Iterator[None]:
    """Report when one run of a task starts and when it ends (also if it raises).

    The start is written before the task does anything, so a node killed mid-run still
    leaves it behind; the harness then ends that run at the moment it killed the node.
    """
    run, start = next(_runs), time.time()
    fields = {"node": ctx.node_id, "term": ctx.term, "task": task, "run": run}
    _emit("activity", **fields, start=start, end=None)
    try:
        yield
    finally:
        _emit("activity", **fields, start=start, end=time.time())


# -- one node ------------------------------------------------------------------------


def run_node(args: argparse.Namespace) -> int:
    """Run one node until SIGTERM/SIGINT; report events as JSON lines on stdout."""
    if args.log_level:
        logging.basicConfig(
            level=args.log_level.upper(),
            format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
        )
    if args.backend == "redis":
        return _run_redis_node(args)
    if not args.dsn:
        raise SystemExit(f"--dsn (or {DSN_ENV}) is required with --backend postgres")
    import psycopg
    from psycopg import sql

    import rselection as rs

    stop = StopFlag.on_stop_signals()

    ledger = sql.Identifier(args.ledger)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(4242)")  # nodes start at once: DDL one at a time
        conn.execute(sql.SQL(LEDGER_DDL).format(table=ledger))
        conn.execute("SELECT pg_advisory_unlock(4242)")

    tasks = _task_handler(args)

    @tasks.persistent("ledger")
    def write_ledger(ctx: rs.TaskContext) -> None:
        # Every write is fenced: it commits only while this term holds the lease.
        insert = sql.SQL("INSERT INTO {} (lease, term, node) VALUES (%s, %s, %s)").format(ledger)
        with _activity(ctx, "ledger"), psycopg.connect(args.dsn) as conn:
            while ctx.sleep(args.ledger_every):
                try:
                    with conn.transaction():
                        ctx.fence(conn)
                        conn.execute(insert, (args.name, ctx.term, ctx.node_id))
                except rs.StaleLeaderError:
                    _emit("stale", node=ctx.node_id, term=ctx.term)
                    return

    leader = rs.PostgresLeader(args.lease_dsn or args.dsn, tasks, **_leader_options(args))
    return _serve(leader, stop, args.raising_receivers)


def redis_ledger_key(ledger: str, lease: str) -> str:
    """The Redis list a node of lease ``lease`` appends its fenced ledger entries to.

    It carries the lease name as hash tag, so a cluster keeps it in the lease's slot (a
    fenced write may only touch keys there).
    """
    return f"{ledger}:{{{lease}}}"


def _run_redis_node(args: argparse.Namespace) -> int:
    """The Redis node: the same tasks, a fenced ``RPUSH`` ledger in the same Redis."""
    import redis

    import rselection as rs
    from rselection.redis import RedisFence, RedisLeader

    url = args.redis_url or args.dsn
    if not url:
        raise SystemExit(f"--redis-url (or --dsn, or {DSN_ENV}) is required with --backend redis")
    stop = StopFlag.on_stop_signals()

    key = redis_ledger_key(args.ledger, args.name)
    tasks = _task_handler(args)
    fence: list[Any] = []

    @tasks.persistent("ledger")
    def write_ledger(ctx: rs.TaskContext) -> None:
        # Every write is fenced: the RPUSH runs only while this term holds the lease.
        with _activity(ctx, "ledger"):
            while ctx.sleep(args.ledger_every):
                entry = json.dumps({"term": ctx.term, "node": ctx.node_id, "t": time.time()})
                try:
                    fence[0].call(ctx.term, "RPUSH", key, entry)
                except rs.StaleLeaderError:
                    _emit("stale", node=ctx.node_id, term=ctx.term)
                    return
                except rs.BackendUnavailable:
                    continue  # Redis is away; the lease keeper decides whether we still lead

    leader = RedisLeader(args.lease_dsn or url, tasks, **_leader_options(args))
    # Ledger writes go straight to Redis (not through a --lease-dsn proxy).
    fence.append(RedisFence(redis.Redis.from_url(url, socket_timeout=5), name=args.name))
    return _serve(leader, stop, args.raising_receivers)


def _leader_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options a node's leader takes from its command line, on either backend."""
    options = (
        "name",
        "node_id",
        "ttl",
        "renew_interval",
        "renew_deadline",
        "retry_interval",
        "version",
        "settle",
    )
    return {option: getattr(args, option) for option in options}


def _task_handler(args: argparse.Namespace) -> rs.TaskHandler:
    """A handler of the tasks both backends' nodes run besides the ledger writer."""
    import rselection as rs

    # Without --stop-grace the library chooses.
    options = {} if args.stop_grace is None else {"stop_grace": args.stop_grace}
    tasks = rs.TaskHandler(**options)

    @tasks.interval(args.tick, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        with _activity(ctx, "tick"):
            _emit("tick", node=ctx.node_id, term=ctx.term, at=ctx.scheduled_at)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        # Runs the whole term; with --wind-down it goes on for that long after it was
        # cancelled, as a task finishing a unit of work (or ignoring cancellation) does.
        with _activity(ctx, "work"):
            ctx.cancelled.wait()
            if args.wind_down:
                time.sleep(args.wind_down)

    if args.block_loop:

        @tasks.persistent("loop-blocker", restart="never")
        async def block_loop(ctx: rs.TaskContext) -> None:
            time.sleep(args.block_loop)  # blocks the event loop on purpose
            _emit("unblocked", node=ctx.node_id, term=ctx.term)

    return tasks


class StopFlag:
    """Set by SIGTERM or SIGINT (see :meth:`on_stop_signals`); like a
    ``threading.Event`` without its lock. A handler runs in the main thread between any
    two of its bytecodes, so one that sets an Event deadlocks when the signal comes
    while the main thread is inside that Event's own ``wait()``, holding its lock (it
    happened once in 200 chaos rounds). :meth:`wait` still returns at once: the
    signal's arrival writes to a socket it selects on (``signal.set_wakeup_fd``)."""

    def __init__(self) -> None:
        self._set = False
        self._read, self._write = socket.socketpair()
        for sock in (self._read, self._write):
            sock.setblocking(False)

    @classmethod
    def on_stop_signals(cls) -> StopFlag:
        """A flag that SIGTERM and SIGINT set (their handlers replaced; main thread)."""
        flag = cls()
        signal.set_wakeup_fd(flag._write.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: flag.set())
        return flag

    def set(self) -> None:
        """Set it (takes no lock)."""
        self._set = True
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._write.send(b"\0")

    def is_set(self) -> bool:
        """Whether it was set."""
        return self._set

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds unless set; whether it is set."""
        if not self._set:
            select.select([self._read], [], [], timeout)
        return self._set


def _serve(leader: Any, stop: StopFlag, raising: bool = False) -> int:
    import rselection as rs

    # A node that will not stop can be asked where its threads are (Fleet.stop_all does
    # before it kills one): SIGUSR1 writes every thread's stack to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    rs.signals.elected.connect(
        lambda sender, **kw: _emit("elected", node=kw["node_id"], term=kw["term"]), weak=False
    )
    rs.signals.demoted.connect(
        lambda sender, **kw: _emit(
            "demoted", node=kw["node_id"], term=kw["term"], reason=kw["reason"]
        ),
        weak=False,
    )
    rs.signals.task_stuck.connect(
        lambda sender, **kw: _emit(
            "stuck", node=leader.node_id, term=kw["term"], task=kw["task"], waited=kw["waited"]
        ),
        weak=False,
    )
    if raising:
        # A user's receiver that raises (connected after the reporting ones, so the
        # events above are still written): the library must log it and carry on.
        for signal_ in (rs.signals.elected, rs.signals.demoted, rs.signals.lease_renewed):
            signal_.connect(_raise_in_receiver, weak=False)
    leader.start()
    _emit("ready", node=leader.node_id, pid=os.getpid())
    while not stop.wait(0.1):
        pass
    began = time.monotonic()
    leader.stop()
    _emit("stopped", node=leader.node_id, took=time.monotonic() - began)
    return 0


def _raise_in_receiver(sender: Any, **kw: Any) -> None:
    raise RuntimeError("a signal receiver that raises (node option --raising-receivers)")


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """Options of one node process (shared by the demo and the tests)."""
    p.add_argument(
        "--dsn",
        default=os.environ.get(DSN_ENV),
        help=f"the Postgres (or, with --backend redis, the Redis URL); default ${DSN_ENV}",
    )
    p.add_argument(
        "--lease-dsn",
        default=os.environ.get(LEASE_DSN_ENV),
        help=f"connection for the lease only (e.g. via a proxy); default ${LEASE_DSN_ENV}",
    )
    p.add_argument("--backend", choices=["postgres", "redis"], default="postgres")
    p.add_argument("--redis-url", help="the Redis of --backend redis (default: --dsn)")
    p.add_argument("--name", default="demo")
    p.add_argument("--node-id")
    p.add_argument("--ttl", type=float, default=15.0)
    p.add_argument("--renew-interval", type=float, default=2.0)
    p.add_argument("--renew-deadline", type=float, default=10.0)
    p.add_argument("--retry-interval", type=float, default=2.0)
    p.add_argument(
        "--stop-grace",
        type=float,
        help="seconds to wait for cancelled tasks (default: the library's)",
    )
    p.add_argument("--version", help="the release the node runs (PEP 440)")
    p.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds a newer node heartbeats before it is handed the lease",
    )
    p.add_argument("--tick", type=float, default=1.0)
    p.add_argument("--ledger", default="rselection_demo_ledger")
    p.add_argument("--ledger-every", type=float, default=0.02)
    p.add_argument("--block-loop", type=float, default=0.0)
    p.add_argument(
        "--wind-down",
        type=float,
        default=0.0,
        help="seconds the 'work' task goes on after it was cancelled",
    )
    p.add_argument("--log-level", help="log to stderr from this level on (e.g. INFO)")
    p.add_argument(
        "--raising-receivers",
        action="store_true",
        help="connect receivers that raise on elected, demoted and lease_renewed",
    )


# -- a fleet of node processes --------------------------------------------------------


class Fleet:
    """Node processes of one lease, with their events gathered in one queue.

    Connection strings go to the nodes in their environment, never on their command
    line (which every local user can read in ``/proc``).

    Args:
        dsn: the database every node uses.
        name: the lease name.
        node_args: extra command-line options for every node.
        log_dir: when given, each node's stderr (its log) goes to ``<log_dir>/<node>.log``
            instead of this process's stderr.
    """

    def __init__(
        self,
        dsn: str,
        name: str,
        node_args: list[str] | None = None,
        *,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.dsn = dsn
        self.name = name
        self.node_args = node_args or []
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.history: list[dict[str, Any]] = []
        self.ended_at: dict[str, float] = {}
        """When each node was killed (``kill -9``) or seen to have exited (wall clock)."""
        self.paused: dict[str, list[tuple[float, float]]] = {}
        """Per node, the windows (wall clock) it was frozen by SIGSTOP until SIGCONT."""
        self._paused_since: dict[str, float] = {}
        self._readers: list[threading.Thread] = []

    def spawn(
        self,
        node_id: str,
        extra: list[str] | None = None,
        *,
        dsn: str | None = None,
        lease_dsn: str | None = None,
    ) -> subprocess.Popen[str]:
        """Start a node process called ``node_id``.

        Args:
            node_id: the node's id.
            extra: more command-line options for this node.
            dsn: this node's connection instead of the fleet's.
            lease_dsn: a separate connection for its lease (e.g. through a proxy).
        """
        cmd = [sys.executable, "-m", "rselection.commands.demo_fleet"]
        cmd += ["--name", self.name, "--node-id", node_id, *self.node_args, *(extra or [])]
        env = {**os.environ, DSN_ENV: dsn if dsn is not None else self.dsn}
        env.pop(LEASE_DSN_ENV, None)
        if lease_dsn is not None:
            env[LEASE_DSN_ENV] = lease_dsn
        with contextlib.ExitStack() as stack:
            log: IO[str] | None = None
            if self.log_dir is not None:
                log = stack.enter_context(open(os.path.join(self.log_dir, f"{node_id}.log"), "a"))
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env
            )
        self.procs[node_id] = proc
        assert proc.stdout is not None
        reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        reader.start()
        self._readers.append(reader)
        return proc

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(line))

    def start(self, nodes: int, timeout: float = 30.0) -> dict[str, Any]:
        """Spawn ``nodes`` nodes (``n0``, ``n1``, ...), wait until all are up and one
        leads; return that ``elected`` event."""
        for i in range(nodes):
            self.spawn(f"n{i}")
        self.wait_ready(timeout)
        return self.first_elected(timeout)

    def first_elected(self, timeout: float) -> dict[str, Any]:
        """The first ``elected`` event, seen already or arriving within ``timeout``."""
        for event in self.history:
            if event["ev"] == "elected":
                return event
        found = self.wait_for(timeout, ev="elected")
        if found is None:
            raise TimeoutError(f"no node was elected within {timeout}s")
        return found

    def wait_ready(self, timeout: float) -> None:
        """Wait until every spawned node reported ``ready``; raise on timeout."""
        ready: set[str] = {e["node"] for e in self.history if e["ev"] == "ready"}
        deadline = time.monotonic() + timeout
        while not ready >= set(self.procs):
            left = deadline - time.monotonic()
            event = self.next_event(left) if left > 0 else None
            if event is None:
                raise TimeoutError(f"nodes not ready within {timeout}s: {set(self.procs) - ready}")
            if event["ev"] == "ready":
                ready.add(event["node"])

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next event from any node, or ``None`` after ``timeout`` seconds."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        self.history.append(event)
        return event

    def wait_for(self, timeout: float, **match: Any) -> dict[str, Any] | None:
        """The next event whose fields equal ``match``; ``None`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            event = self.next_event(left)
            if event is not None and all(event.get(k) == v for k, v in match.items()):
                return event
        return None

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a node process.

        The times of ``kill -9`` (:attr:`ended_at`) and of SIGSTOP to SIGCONT
        (:attr:`paused`) are recorded, on the safe side: a kill after the signal was
        sent, a pause from after SIGSTOP was sent until before SIGCONT is.
        """
        proc = self.procs[node_id]
        if sig == signal.SIGCONT and node_id in self._paused_since:
            self._end_pause(node_id)
        proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.ended_at.setdefault(node_id, time.time())
        elif sig == signal.SIGSTOP and proc.poll() is None:
            self._paused_since.setdefault(node_id, time.time())

    def _end_pause(self, node_id: str) -> None:
        since = self._paused_since.pop(node_id)
        self.paused.setdefault(node_id, []).append((since, time.time()))

    def stop_all(self, timeout: float = 20.0) -> None:
        """SIGTERM (after SIGCONT) every live node, wait, then SIGKILL stragglers.

        Afterwards :attr:`history` holds every event the nodes wrote.
        """
        for node_id, proc in self.procs.items():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if node_id in self._paused_since:
                        self._end_pause(node_id)
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
        deadline = time.monotonic() + timeout
        for node_id, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGUSR1)  # its threads' stacks to its stderr
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.5)
                proc.kill()
                proc.wait(5)
            self.ended_at.setdefault(node_id, time.time())
        for reader in self._readers:
            reader.join(5)
        while self.next_event(0) is not None:
            pass

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def main(argv: list[str] | None = None) -> int:
    """Entry point of a node, ``python -m rselection.commands.demo_fleet [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m rselection.commands.demo_fleet",
        description="One node of the demo's fleet: leads or follows a lease, reports JSON lines.",
    )
    add_node_arguments(parser)
    args = parser.parse_args(argv)
    for option in ("dsn", "lease_dsn", "redis_url"):
        # Checked before the node's own connections, whose errors would quote the pieces.
        if value := getattr(args, option):
            try:
                check_userinfo(value, "--" + option.replace("_", "-"))
            except ConfigError as exc:
                parser.error(str(exc))
    return run_node(args)


if __name__ == "__main__":
    sys.exit(main())
