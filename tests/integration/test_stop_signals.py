"""SIGTERM and Ctrl-C to a program whose last line is ``leader.lead()``: a graceful stop.

Every kind of leader, in a real process: the persistent task's ``finally`` runs, ``lead()``
returns with the program's own handlers back in place, the process exits 0, and the lease
(or every shard) is given back so that a follower leads at once instead of at expiry.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

import rselection as rs
from tests.support.node_process import NodeProcess
from tests.support.signal_node import TTL

NODE = "tests.support.signal_node"
# The lease lasts 6 s: a follower that leads well before that was handed the lease.
HANDED_OVER_WITHIN = 3.0


def _idle_tasks() -> rs.TaskHandler:
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.sleep(3600)

    return tasks


def _reap(node: NodeProcess) -> None:
    if node.proc.poll() is None:
        node.kill()


def _stop_gracefully(node: NodeProcess, sig: signal.Signals, *, shards: int = 1) -> float:
    """Send ``sig`` once the node's tasks run; check the graceful stop; return the time
    the signal was sent (``time.monotonic()``)."""
    node.wait_for("ready", lambda seen: bool(node.of("ready")), 30)
    node.wait_for("tasks running", lambda seen: len(node.of("running")) >= shards, 30)
    sent = time.monotonic()
    node.proc.send_signal(sig)
    node.wait_for("lead() to return", lambda seen: bool(node.of("returned")), 20)
    assert node.proc.wait(10) == 0
    assert len(node.of("joined")) == len(node.of("running")), node.seen
    names = [e["event"] for e in node.seen]
    assert names.index("returned") > max(i for i, n in enumerate(names) if n == "joined")
    assert node.of("returned")[0]["restored"] is True
    return sent


def _follower_takes_over(
    follower: rs.Leader, start: Callable[[], NodeProcess], sig: signal.Signals
) -> float:
    node = start()
    try:
        # The follower starts only once the node leads: it cannot win the first race.
        node.wait_for("tasks running", lambda seen: bool(node.of("running")), 30)
        with follower:
            sent = _stop_gracefully(node, sig)
            assert follower.wait_until_leader(HANDED_OVER_WITHIN + 10)
            took = time.monotonic() - sent
    finally:
        _reap(node)
    assert took < HANDED_OVER_WITHIN, f"the follower led {took:.2f} s after the signal"
    return took


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_postgres_leader_stops_gracefully_on_signal(pg_dsn: str, sig: signal.Signals) -> None:
    follower = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="signals", **TTL)
    _follower_takes_over(follower, lambda: NodeProcess(NODE, "postgres", pg_dsn, "signals"), sig)


def test_redis_leader_stops_gracefully_on_sigterm(redis_url: str) -> None:
    name = f"signals-{uuid.uuid4().hex[:8]}"
    follower = rs.RedisLeader(redis_url, _idle_tasks(), name=name, **TTL)
    _follower_takes_over(
        follower, lambda: NodeProcess(NODE, "redis", redis_url, name), signal.SIGTERM
    )


def test_lease_leader_stops_gracefully_on_sigterm(tmp_path: Path) -> None:
    from tests.support.file_lease import FileLease

    follower = rs.LeaseLeader(
        FileLease(tmp_path, name="signals", ttl=TTL["ttl"]), _idle_tasks(), **TTL
    )
    _follower_takes_over(
        follower, lambda: NodeProcess(NODE, "lease", str(tmp_path), "signals"), signal.SIGTERM
    )


def test_single_node_leader_stops_gracefully_on_sigterm() -> None:
    node = NodeProcess(NODE, "single", "-", "-")
    try:
        _stop_gracefully(node, signal.SIGTERM)
    finally:
        _reap(node)


def test_sharded_leader_hands_its_shards_over_on_sigterm(pg_dsn: str) -> None:
    node = NodeProcess(NODE, "sharded", pg_dsn, "signals")
    try:
        node.wait_for("all shards", lambda seen: len(node.of("running")) == 4, 30)
        with rs.PostgresShardedLeader(
            pg_dsn, _idle_tasks(), name="signals", shards=4, **TTL
        ) as follower:
            assert follower.wait_until_balanced(30)
            sent = _stop_gracefully(node, signal.SIGTERM, shards=len(node.of("running")))
            deadline = sent + HANDED_OVER_WITHIN + 10
            while len(follower.owned()) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            took = time.monotonic() - sent
            assert follower.owned() == frozenset(range(4))
    finally:
        _reap(node)
    assert took < HANDED_OVER_WITHIN, f"the shards were led {took:.2f} s after the signal"


def test_a_sharded_leader_stops_at_once_on_sigterm_while_its_start_reads(pg_dsn: str) -> None:
    """lead() acts on a signal where it waits; the read of the recorded number of shards
    that its start makes is such a wait, or a SIGTERM would come into effect only once
    the server answered, after the statement timeout (30 s) on a locked table: after a
    process manager's grace, which then kills the node."""
    import psycopg

    with rs.PostgresShardedLeader(pg_dsn, _idle_tasks(), name="signals", shards=4, **TTL):
        pass  # creates the tables
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("LOCK TABLE rselection_checkpoints IN ACCESS EXCLUSIVE MODE")
        node = NodeProcess(NODE, "sharded", pg_dsn, "signals")
        try:
            node.wait_for("ready", lambda seen: bool(node.of("ready")), 30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # its start waits for the table
                waiting = locker.execute(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted"
                    " AND relation = 'rselection_checkpoints'::regclass"
                ).fetchone()
                if waiting and waiting[0]:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the node never read the recorded number of shards")
            sent = time.monotonic()
            node.proc.send_signal(signal.SIGTERM)
            node.wait_for("lead() to return", lambda seen: bool(node.of("returned")), 20)
            took = time.monotonic() - sent
            assert node.proc.wait(10) == 0
            assert node.of("returned")[0]["restored"] is True
            assert not node.of("running")
        finally:
            _reap(node)
    assert took < 5, f"lead() returned {took:.2f} s after the signal"


def test_a_process_forked_while_lead_runs_has_the_programs_own_handlers() -> None:
    """A worker a task forks (multiprocessing's fork start method) runs no ``lead()``:
    SIGTERM (``Process.terminate()``) ends it as the program's own handler says."""
    statuses: list[int] = []
    handlers: list[bool] = []
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: report its handlers, then be terminated
            try:
                own = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and (
                    signal.getsignal(signal.SIGINT) is signal.default_int_handler
                )
                os.write(write, b"1" if own else b"0")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
            finally:
                os._exit(3)  # not terminated by the signal (nor back in the task's code)
        os.close(write)
        handlers.append(os.read(read, 1) == b"1")
        os.close(read)
        statuses.append(os.waitpid(pid, 0)[1])
        leader.stop()

    leader = rs.SingleNodeLeader(tasks)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        leader.lead()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handlers == [True]
    assert [os.waitstatus_to_exitcode(s) for s in statuses] == [-signal.SIGTERM]
