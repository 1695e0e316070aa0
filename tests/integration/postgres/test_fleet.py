"""Real node processes competing for one Postgres lease: crash, pause, handover, faults.

Every node is ``python -m rselection.commands.demo_fleet`` (the demo's own node program): it leads
with a ticking task and a persistent task that writes fenced rows to a ledger. Each
test ends by checking the ledger (no row of an older term after a row of a newer one)
and the activity ledger (no task of one term ran while a task of another term ran).
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from rselection.commands.demo_fleet import Fleet
from tests.support import activity, ledger

# serial: crash, pause and handover deadlines of a fleet of processes.
pytestmark = [pytest.mark.serial]

# A resumed process needs a moment to learn that its term ended while it was frozen.
RESUME_GRACE = 0.25

# Small timings keep the suite fast; the ratios are those of the defaults.
FAST = ["--ttl", "3", "--renew-interval", "0.5", "--renew-deadline", "2", "--retry-interval", "0.5"]


def elected(fleet: Fleet, timeout: float, exclude: str | None = None) -> dict[str, Any]:
    """Wait for an ``elected`` event (from a node other than ``exclude``)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        event = fleet.next_event(left)
        if event and event["ev"] == "elected" and event["node"] != exclude:
            return event
    pytest.fail(f"no node was elected within {timeout}s; events: {fleet.history[-60:]}")


def start_fleet(
    dsn: str, n: int = 3, args: list[str] | None = None
) -> tuple[Fleet, dict[str, Any]]:
    fleet = Fleet(dsn, f"t-{uuid.uuid4().hex[:6]}", args if args is not None else FAST)
    return fleet, fleet.start(n)


def no_other_election(fleet: Fleet, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        event = fleet.next_event(left)
        assert event is None or event["ev"] != "elected", f"unexpected election: {event}"


def test_one_leader_runs_the_tasks(pg_dsn: str) -> None:
    fleet, first = start_fleet(pg_dsn)
    with fleet:
        ticks: list[dict[str, Any]] = []
        deadline = time.monotonic() + 3.5
        while (left := deadline - time.monotonic()) > 0:
            event = fleet.next_event(left)
            assert event is None or event["ev"] != "elected", f"second leader: {event}"
            if event and event["ev"] == "tick":
                ticks.append(event)
        assert ticks, "the leader ran no task"
        assert {e["node"] for e in ticks} == {first["node"]}
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT holder, term FROM rselection_leases WHERE name = %s", (fleet.name,)
            ).fetchone()
        assert row == (first["node"], first["term"])
    assert ledger.overlaps(pg_dsn) == 0
    activity.assert_no_overlap(fleet)


def test_graceful_stop_hands_over_within_a_second(pg_dsn: str) -> None:
    fleet, first = start_fleet(pg_dsn, args=["--ttl", "15"])  # default timings
    with fleet:
        stopped_at = time.time()
        fleet.kill(first["node"], signal.SIGTERM)
        heir = elected(fleet, 5, exclude=first["node"])
        handover = heir["t"] - stopped_at
        print(f"graceful handover: {handover * 1000:.0f} ms")
        assert handover < 1.0
        assert heir["term"] == first["term"] + 1
    assert ledger.overlaps(pg_dsn) == 0
    activity.assert_no_overlap(fleet)


def test_kill_9_fails_over_well_before_the_ttl(pg_dsn: str) -> None:
    args = ["--ttl", "10", "--renew-deadline", "7"]
    fleet, first = start_fleet(pg_dsn, args=args)
    with fleet:
        killed_at = time.time()
        fleet.kill(first["node"])
        heir = elected(fleet, 10, exclude=first["node"])
        failover = heir["t"] - killed_at
        print(f"kill -9 failover: {failover * 1000:.0f} ms (ttl 10 s)")
        assert failover < 5.0  # ttl / 2
    assert ledger.overlaps(pg_dsn) == 0
    activity.assert_no_overlap(fleet)


def test_paused_leader_is_replaced_only_after_expiry_and_never_acts_again(pg_dsn: str) -> None:
    fleet, first = start_fleet(pg_dsn)
    with fleet:
        time.sleep(0.3)  # let the ledger writer get going
        paused_at = time.time()
        fleet.kill(first["node"], signal.SIGSTOP)
        heir = elected(fleet, 10, exclude=first["node"])
        waited = heir["t"] - paused_at
        print(f"takeover after SIGSTOP: {waited * 1000:.0f} ms (ttl 3 s)")
        # The last renewal was at most renew_interval (0.5 s) before the pause.
        assert waited >= 3.0 - 0.5 - 0.1
        assert waited <= 3.0 + 0.5 + 1.0  # ttl + retry_interval, plus scheduling slack
        writes_before = ledger.writes_by(pg_dsn, first["node"], first["term"])
        time.sleep(0.5)
        fleet.kill(first["node"], signal.SIGCONT)
        demoted = fleet.wait_for(5, ev="demoted", node=first["node"])
        assert demoted is not None and demoted["reason"] in ("deadline", "lost", "connection")
        time.sleep(0.5)
        assert ledger.writes_by(pg_dsn, first["node"], first["term"]) == writes_before
    assert ledger.overlaps(pg_dsn) == 0
    activity.assert_no_overlap(fleet, resume_grace=RESUME_GRACE)
    assert all(len(nodes) == 1 for nodes in ledger.terms(pg_dsn).values())


def test_terminated_keeper_session_gives_one_leader(pg_dsn: str) -> None:
    fleet, first = start_fleet(pg_dsn)
    with fleet:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            pid = conn.execute(
                "SELECT holder_pid FROM rselection_leases WHERE name = %s", (fleet.name,)
            ).fetchone()
            assert pid is not None and pid[0] is not None
            conn.execute("SELECT pg_terminate_backend(%s)", (pid[0],))
        # The server frees a dead session's lease at once: a follower may be elected
        # while the old node still joins its tasks, so its demotion may come second.
        demoted: dict[str, Any] | None = None
        successor: dict[str, Any] | None = None
        deadline = time.monotonic() + 10
        while (demoted is None or successor is None) and (left := deadline - time.monotonic()) > 0:
            event = fleet.next_event(left)
            if event is None:
                break
            if event["ev"] == "demoted" and event["node"] == first["node"]:
                demoted = demoted or event
            elif event["ev"] == "elected" and event["term"] > first["term"]:
                successor = successor or event
        assert demoted is not None and demoted["reason"] == "connection", fleet.history[-60:]
        assert successor is not None, f"no node was elected: {fleet.history[-60:]}"
        time.sleep(1.0)
    assert ledger.overlaps(pg_dsn) == 0
    activity.assert_no_overlap(fleet, allowance=activity.KILLED_SESSION_ALLOWANCE)
    assert all(len(nodes) == 1 for nodes in ledger.terms(pg_dsn).values())


def test_blocked_event_loop_does_not_cost_the_lease(pg_dsn: str) -> None:
    # ttl 3 s; the async task blocks the loop for 6 s (2 * ttl).
    fleet, first = start_fleet(pg_dsn, args=[*FAST, "--block-loop", "6"])
    with fleet:
        deadline = time.monotonic() + 10
        unblocked = None
        while unblocked is None and (left := deadline - time.monotonic()) > 0:
            event = fleet.next_event(left)
            assert event is None or event["ev"] not in ("elected", "demoted"), event
            if event and event["ev"] == "unblocked":
                unblocked = event
        assert unblocked is not None and unblocked["node"] == first["node"]
        no_other_election(fleet, 1.0)
    assert ledger.overlaps(pg_dsn) == 0
    activity.assert_no_overlap(fleet)


def test_node_command_lines_carry_no_password(pg_dsn: str) -> None:
    # Any local user can read a process's command line; the connection strings must
    # reach the nodes through their environment (readable by their owner only).
    with_password = make_conninfo(pg_dsn, password="hunter2")  # a trusting server ignores it
    fleet = Fleet(with_password, f"t-{uuid.uuid4().hex[:6]}", FAST)
    with fleet:
        fleet.spawn("n0")
        fleet.spawn("n1", lease_dsn=with_password)
        fleet.wait_ready(30)
        fleet.first_elected(30)  # the nodes did get the connection strings
        for node, proc in fleet.procs.items():
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ")
            assert b"hunter2" not in cmdline, (node, cmdline)
            assert b"127.0.0.1" not in cmdline, (node, cmdline)
    assert activity.check_fleet(fleet).violations == []
