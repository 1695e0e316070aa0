"""Three nodes heartbeat; the leader's HeartbeatMonitor notices one of them die.

    python examples/heartbeat_monitor.py --dsn postgresql://postgres@127.0.0.1:5432/test

It starts three node processes of this file (``... node --id NAME``), waits until the
leader has seen all three, kills one follower with SIGKILL, and prints what the leader
reports: ``node_joined`` for each node, then ``node_lost`` for the killed one about
three heartbeats later. Run the nodes yourself, a second replica in another terminal::

    python examples/heartbeat_monitor.py --dsn postgresql://... node --id n1
    python examples/heartbeat_monitor.py --dsn postgresql://... node --id n2

Nodes with the same ``--name`` (default ``$RSELECTION_NAME``, else
``heartbeat-example``) are one lease's. Without ``--dsn`` (or ``RSELECTION_DSN``) one
node runs alone (a ``SingleNodeLeader``): it leads and its monitor announces itself
only. Ctrl-C or SIGTERM stops a node gracefully.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import rselection as rs

HEARTBEAT = 0.5  # seconds: short, so the example runs in a few seconds


def run_node(dsn: str | None, node_id: str, name: str = "heartbeat-example") -> None:
    """One node: follows or leads; while leading, its monitor prints membership changes.

    Without ``dsn`` it leads alone (a ``SingleNodeLeader``)."""
    tasks = rs.TaskHandler()
    tasks.register("heartbeat-monitor", rs.HeartbeatMonitor(poll_interval=0.2))

    def joined(sender: object, name: str, node: rs.NodeInfo) -> None:
        print(f"[{node_id}] node_joined {node.node_id} (pid {node.pid})", flush=True)

    def lost(sender: object, name: str, node: rs.NodeInfo) -> None:
        print(f"[{node_id}] node_lost {node.node_id} (last seen {node.last_seen:%X})", flush=True)

    rs.signals.node_joined.connect(joined)
    rs.signals.node_lost.connect(lost)
    leader: rs.Leader
    if dsn:
        leader = rs.PostgresLeader(
            dsn, tasks, name=name, node_id=node_id, heartbeat_interval=HEARTBEAT
        )
    else:
        leader = rs.SingleNodeLeader(tasks, name=name, node_id=node_id)
    rs.signals.elected.connect(
        lambda sender, **kw: print(f"[{node_id}] leads (term {kw['term']})", flush=True),
        weak=False,
    )
    leader.lead()  # until Ctrl-C or SIGTERM (systemd, Docker, Kubernetes): a graceful stop
    print(f"[{node_id}] stopped cleanly", flush=True)


def run_demo(dsn: str, name: str = "heartbeat-example") -> int:
    """Start three nodes, kill a follower, show what the leader saw."""
    lines: queue.Queue[str] = queue.Queue()
    procs: dict[str, subprocess.Popen[str]] = {}
    for node_id in ("n1", "n2", "n3"):
        proc = subprocess.Popen(
            [sys.executable, __file__, "--name", name, "node", "--id", node_id],
            env={**os.environ, "RSELECTION_DSN": dsn},  # not on the command line: ps shows it
            stdout=subprocess.PIPE,
            text=True,
        )
        procs[node_id] = proc
        threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()

    seen: list[str] = []

    def expect(needle: str, timeout: float) -> str:
        """The first line printed so far (or within ``timeout``) that holds ``needle``."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((line for line in seen if needle in line), None)
            if found is not None:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"gave up waiting for {needle!r}")
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            print(line, flush=True)
            seen.append(line)

    try:
        leader = expect(" leads ", 30).split("]")[0].lstrip("[")
        for node_id in procs:
            expect(f"[{leader}] node_joined {node_id}", 30)
        victim = next(n for n in procs if n != leader)
        print(f"--- kill -9 {victim}", flush=True)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        expect(f"[{leader}] node_lost {victim}", 30)
        print(f"--- the leader noticed after {time.monotonic() - killed:.1f} s", flush=True)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # a graceful stop: releases, leaves
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line.rstrip())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("RSELECTION_DSN"), help="Postgres (default: run alone)"
    )
    parser.add_argument(
        "--name",
        default=os.environ.get("RSELECTION_NAME") or "heartbeat-example",
        help="the lease name (default $RSELECTION_NAME, else heartbeat-example)",
    )
    sub = parser.add_subparsers(dest="command")
    node = sub.add_parser("node", help="run one node")
    node.add_argument("--id", required=True, help="this node's id")
    args = parser.parse_args()
    if args.command == "node":
        run_node(args.dsn, args.id, args.name)
    elif not args.dsn:
        print("no --dsn (or RSELECTION_DSN): one node runs alone", flush=True)
        run_node(None, "alone", args.name)
    else:
        sys.exit(run_demo(args.dsn, args.name))
