"""A node process that runs many ``PostgresLeader``s (or, with ``--redis-url``,
``RedisLeader``s) at once, for scale tests and benchmarks.

Runs ``--count`` leaders of the leases ``<prefix>/0`` .. ``<prefix>/<count - 1>`` in one
process, all with one ``--node`` id, and prints one JSON object per line on stdout. Every
line carries ``event``, ``node``, ``mono`` (``time.monotonic()``: CLOCK_MONOTONIC, which
every process of the machine shares) and ``t`` (``time.time()``):

- ``ready``: every leader was built and started: ``count``, ``build_seconds``,
  ``start_seconds``, ``pid``, ``threads`` and ``rselection`` (the file the library was
  imported from, so a caller can check which code tree ran).
- ``elected`` / ``demoted``: ``lease`` (its full name), ``index``, ``term``, and for a
  demotion ``reason``.
- ``renewed`` (with ``--renewals``): ``lease``, ``index``, ``term``, ``latency`` and
  ``remaining``, from ``signals.lease_renewed``.
- ``stuck``: a task ignored cancellation past ``stop_grace`` (``lease``, ``task``).
- ``threads``: on SIGUSR2, the process's threads by name with digits taken out
  (``names``: name -> count).
- ``stopping``: SIGTERM or SIGINT arrived; every leader is asked to stop at once;
  ``asked``: every leader was asked (``seconds`` since ``stopping``).
- ``released``: one leader's ``stop()`` returned (``lease``, ``index``, ``seconds`` since
  ``stopping``); ``stopped``: all of them did (``seconds``).

``--start-workers N`` builds and starts the leaders from N threads at once instead of one
after another (``ready`` reports how long each step took).

Only the public API is used, so the same program measures any version of the library:
run it by path with ``PYTHONPATH`` naming the code tree to measure (it imports nothing
else from this repository). The connection string comes from ``--dsn`` or, so that it
stays off the command line, the ``SCALE_NODE_DSN`` environment variable; a Redis URL
from ``--redis-url`` or ``SCALE_NODE_REDIS_URL``.

Tasks: every lease runs one persistent task (and, with ``--pooled-work SECONDS``, an
interval task that claims each fire, saves a checkpoint and reads the nodes, while a
thread asks every leader ``leader()`` as often). By default (``--idle-task async``) it waits
for cancellation on the event loop; ``def`` waits in a thread; ``none`` registers no
task. ``--block`` names leases whose ``def`` task ignores cancellation: it sleeps
``--block-seconds`` at a time and only then looks at ``ctx.cancelled``; ``--spin`` names
leases whose task does the same while spinning the CPU (a CPU-bound loop, which holds
the GIL whenever it runs). ``--fail`` names leases whose task raises at once (the handler
restarts it with backoff). Index lists are ``3,5,10-19``. With ``--misbehave-on-usr1``
those tasks wait quietly until the process gets SIGUSR1 (then it reports ``go``), so
that a test can let every lease be elected first.

    SCALE_NODE_DSN=postgresql://... python tests/support/scale_node.py \\
        --prefix p1 --count 100 --node n0 --ttl 6 --renew-interval 0.5 \\
        --renew-deadline 4 --retry-interval 1 --spin 0-4 --block 5-9 --fail 10-14 --renewals
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import rselection as rs
from rselection import signals


class Reporter:
    """Writes the node's events, one line each, from a thread of its own.

    Many threads report (every leader's ``elected`` receiver runs on the library's
    threads): a write on the caller's thread would make those threads queue for the
    output and for the GIL behind one another, and a reader slow to drain the pipe would
    hold up the library's work, so a benchmark would measure its own output. Each event
    takes its clocks when it happens; :meth:`close` writes out what is queued.
    """

    def __init__(self, node: str) -> None:
        self.node = node
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="reporter", daemon=True)
        self._writer.start()

    def emit(self, event: str, **fields: Any) -> None:
        """Queue one event line with the node id and both clocks."""
        record = {"event": event, "node": self.node, "mono": time.monotonic(), "t": time.time()}
        record.update(fields)
        self._lines.put(json.dumps(record) + "\n")

    def close(self, timeout: float = 10.0) -> None:
        """Write every queued line, then stop the writer (bounded by ``timeout``)."""
        self._lines.put(None)
        self._writer.join(timeout)

    def _write(self) -> None:
        while True:
            line = self._lines.get()
            batch = []
            while line is not None:
                batch.append(line)
                try:
                    line = self._lines.get_nowait()
                except queue.Empty:
                    break
            try:
                sys.stdout.write("".join(batch))
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                pass  # the reader went away; the node goes on until it is stopped
            if line is None:
                return


def parse_indices(text: str, count: int) -> set[int]:
    """``"3,5,10-19"`` -> ``{3, 5, 10, ..., 19}``; every index must be below ``count``."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if not 0 <= lo <= hi < count:
            raise SystemExit(f"index range {part!r} is outside 0..{count - 1}")
        out.update(range(lo, hi + 1))
    return out


def thread_names() -> dict[str, int]:
    """The process's threads now, counted by name with the digits taken out (so a
    thread per term or per lease shows as one name with its count)."""
    names = Counter(re.sub(r"\d+", "N", t.name) for t in threading.enumerate())
    return dict(sorted(names.items()))


def make_handler(kind: str, args: argparse.Namespace, go: threading.Event) -> rs.TaskHandler:
    """A fresh handler (one per leader) whose one task behaves as ``kind`` says.

    A blocking, spinning or failing task misbehaves only once ``go`` is set (at once,
    unless ``--misbehave-on-usr1``); until then it waits for cancellation like the rest.
    """
    handler = rs.TaskHandler()

    def wait_for_go(ctx: rs.TaskContext) -> bool:
        while not go.wait(0.05):
            if ctx.cancelled.is_set():
                return False
        return True

    if args.pooled_work:

        @handler.interval(args.pooled_work, name="pooled")
        def pooled(ctx: rs.TaskContext) -> None:
            # A claimed fire (the claimer's default), a fenced checkpoint save and a
            # membership read: every pooled call a leader's tasks make.
            snap = ctx.checkpoint.load()
            ctx.checkpoint.save((snap.state if snap is not None else 0) + 1)
            ctx.nodes()

    if kind == "none":
        return handler
    if kind == "async":

        @handler.persistent("idle")
        async def idle(ctx: rs.TaskContext) -> None:
            await asyncio.Event().wait()  # until the term is cancelled

    elif kind == "def":

        @handler.persistent("idle")
        def idle_thread(ctx: rs.TaskContext) -> None:
            ctx.cancelled.wait()

    elif kind in ("block", "spin"):
        spin = kind == "spin"
        seconds = args.block_seconds

        @handler.persistent("block")
        def block(ctx: rs.TaskContext) -> None:
            if not wait_for_go(ctx):
                return
            # Ignores cancellation for up to ``seconds`` at a time, as careless code does.
            while not ctx.cancelled.is_set():
                if spin:
                    until = time.monotonic() + seconds
                    while time.monotonic() < until:
                        pass
                else:
                    time.sleep(seconds)

    elif kind == "fail":

        @handler.persistent("fail")
        def fail(ctx: rs.TaskContext) -> None:
            if wait_for_go(ctx):
                raise RuntimeError("this task fails on purpose")

    else:
        raise SystemExit(f"unknown task kind {kind!r}")
    return handler


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("SCALE_NODE_DSN", ""))
    p.add_argument(
        "--redis-url",
        default=os.environ.get("SCALE_NODE_REDIS_URL", ""),
        help="run RedisLeaders on this Redis instead of PostgresLeaders",
    )
    p.add_argument("--prefix", required=True, help="lease names are <prefix>/<i>")
    p.add_argument("--count", type=int, required=True, help="number of leases (leaders)")
    p.add_argument("--node", required=True, help="node id of every leader")
    p.add_argument("--ttl", type=float, default=15.0)
    p.add_argument("--renew-interval", type=float, default=2.0)
    p.add_argument("--renew-deadline", type=float, default=10.0)
    p.add_argument("--retry-interval", type=float, default=2.0)
    p.add_argument("--table", default=None, help="lease table (library default if unset)")
    p.add_argument("--idle-task", choices=("async", "def", "none"), default="async")
    p.add_argument("--block", default="", help="indices whose task sleeps, deaf to cancel")
    p.add_argument("--spin", default="", help="indices whose task spins the CPU, deaf to cancel")
    p.add_argument("--block-seconds", type=float, default=1.0)
    p.add_argument("--fail", default="", help="indices whose task raises")
    p.add_argument(
        "--misbehave-on-usr1",
        action="store_true",
        help="blocking, spinning and failing tasks start misbehaving at SIGUSR1",
    )
    p.add_argument("--renewals", action="store_true", help="report every lease_renewed")
    p.add_argument(
        "--pooled-work",
        type=float,
        default=0.0,
        help="every SECONDS: each lease's interval task claims its fire, saves a checkpoint "
        "and reads the nodes, and every leader is asked leader() (0: none)",
    )
    # One after another by default: with one keeper per lease, starting 300 leaders
    # from 16 threads took 26 s of start() calls against 10 s one by one on 2 cores (the
    # threads fight over the GIL), and leases reached their deadline while starting.
    p.add_argument(
        "--start-workers",
        type=int,
        default=1,
        help="threads that build and start the leaders (default 1: one after another)",
    )
    p.add_argument("--stop-timeout", type=float, default=30.0, help="bound on each leader's stop()")
    args = p.parse_args(argv)
    if not args.dsn and not args.redis_url:
        p.error("give --dsn or set SCALE_NODE_DSN (or --redis-url)")
    if args.count < 1 or args.start_workers < 1:
        p.error("--count and --start-workers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the leaders until SIGTERM or SIGINT, then stop them all at once."""
    args = parse_args(argv)
    # Blocked in every thread (threads inherit the mask; the reporter's too, so it is
    # blocked first) and taken by sigwait() in the main thread below: no handler runs at
    # an arbitrary point while locks are held. A thread started before the mask would be
    # the one thread the kernel could hand SIGUSR2 to while the main thread is not in
    # sigwait(), and SIGUSR2's default action ends the process.
    wanted = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    out = Reporter(args.node)
    names = [f"{args.prefix}/{i}" for i in range(args.count)]
    index = {name: i for i, name in enumerate(names)}
    kinds = {i: "block" for i in parse_indices(args.block, args.count)}
    kinds.update((i, "spin") for i in parse_indices(args.spin, args.count))
    kinds.update((i, "fail") for i in parse_indices(args.fail, args.count))
    go = threading.Event()
    if not args.misbehave_on_usr1:
        go.set()

    # Receivers filter by lease name: other leaders in the process (none today) are not ours.
    def on_elected(sender: Any, **kw: Any) -> None:
        if kw.get("name") in index:
            out.emit("elected", lease=kw["name"], index=index[kw["name"]], term=kw["term"])

    def on_demoted(sender: Any, **kw: Any) -> None:
        if kw.get("name") in index:
            out.emit(
                "demoted",
                lease=kw["name"],
                index=index[kw["name"]],
                term=kw["term"],
                reason=kw.get("reason"),
            )

    def on_renewed(sender: Any, **kw: Any) -> None:
        if kw.get("name") in index:
            out.emit(
                "renewed",
                lease=kw["name"],
                index=index[kw["name"]],
                term=kw["term"],
                latency=kw["latency"],
                remaining=kw["remaining"],
            )

    # Once every lease has a holder in this node's eyes, the node says so ("seen_all"): a
    # follower's start-up ends there, and an idle window begins no earlier.
    seen: set[str] = set()
    seen_lock = threading.Lock()

    def on_leader_changed(sender: Any, **kw: Any) -> None:
        name = kw.get("name")
        if name not in index or kw.get("leader") is None:
            return
        with seen_lock:
            first = name not in seen and len(seen) == args.count - 1
            seen.add(name)
        if first:
            out.emit("seen_all", count=args.count)

    def on_stuck(sender: Any, **kw: Any) -> None:
        out.emit("stuck", task=kw.get("task"), term=kw.get("term"))

    # blinker holds receivers weakly: these locals live until main returns.
    receivers: list[tuple[Any, Callable[..., None]]] = [
        (signals.elected, on_elected),
        (signals.demoted, on_demoted),
        (signals.task_stuck, on_stuck),
        (signals.leader_changed, on_leader_changed),
    ]
    if args.renewals:
        receivers.append((signals.lease_renewed, on_renewed))
    for sig, receiver in receivers:
        sig.connect(receiver)

    timings: dict[str, Any] = {
        "ttl": args.ttl,
        "renew_interval": args.renew_interval,
        "renew_deadline": args.renew_deadline,
        "retry_interval": args.retry_interval,
    }
    if args.table:
        timings["table"] = args.table

    def build(i: int) -> rs.LeaseLeader:
        handler = make_handler(kinds.get(i, args.idle_task), args, go)
        if args.redis_url:
            redis_timings = {k: v for k, v in timings.items() if k != "table"}
            return rs.RedisLeader(
                args.redis_url, handler, name=names[i], node_id=args.node, **redis_timings
            )
        return rs.PostgresLeader(args.dsn, handler, name=names[i], node_id=args.node, **timings)

    began = time.monotonic()
    with ThreadPoolExecutor(args.start_workers, thread_name_prefix="scale-build") as pool:
        leaders = list(pool.map(build, range(args.count)))
    built = time.monotonic()
    with ThreadPoolExecutor(args.start_workers, thread_name_prefix="scale-start") as pool:
        list(pool.map(lambda leader: leader.start(), leaders))
    started = time.monotonic()
    out.emit(
        "ready",
        count=args.count,
        build_seconds=built - began,
        start_seconds=started - built,
        pid=os.getpid(),
        threads=threading.active_count(),
        rselection=rs.__file__,
    )

    asking = threading.Event()

    def ask_leaders() -> None:
        while not asking.wait(args.pooled_work):
            for leader in leaders:
                leader.leader()

    if args.pooled_work:
        threading.Thread(target=ask_leaders, name="scale-ask-leader", daemon=True).start()

    while (signum := signal.sigwait(wanted)) in (signal.SIGUSR1, signal.SIGUSR2):
        if signum == signal.SIGUSR2:
            out.emit("threads", names=thread_names())
        elif not go.is_set():
            go.set()
            out.emit("go")
    asking.set()
    out.emit("stopping", signal=signal.Signals(signum).name)
    stopping = time.monotonic()
    # Ask every leader first (stop(timeout=0) only asks, but asking a follower may cost a
    # round trip to interrupt its wait: ask from many threads), so that all of them wind
    # down together; then wait for each and report when it was done.
    workers = min(64, args.count)
    with ThreadPoolExecutor(workers, thread_name_prefix="scale-ask") as pool:
        list(pool.map(lambda leader: leader.stop(timeout=0), leaders))
    out.emit("asked", seconds=time.monotonic() - stopping)

    def finish(i: int) -> None:
        leaders[i].stop(timeout=args.stop_timeout)
        out.emit(
            "released",
            lease=names[i],
            index=i,
            seconds=time.monotonic() - stopping,
            leading=leaders[i].is_leader,
        )

    with ThreadPoolExecutor(workers, thread_name_prefix="scale-stop") as pool:
        list(pool.map(finish, range(args.count)))
    out.emit("stopped", seconds=time.monotonic() - stopping)
    for sig, receiver in receivers:
        sig.disconnect(receiver)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
