"""Leadership history, on every backend: every term is recorded by the statements or
scripts that acquire and release, with why it ended; a crashed holder's term is closed
by its successor; the history is trimmed to its limit; ``rselection history`` and
``status`` show it. Each record is checked against which node's tasks really ran in that
term (the tasks' own reports, or the node processes' ``elected`` events).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from rselection.admin import LeaseAdmin
from rselection.commands.demo_fleet import Fleet
from rselection.history import TermRecord
from tests.support.backends import Backend
from tests.support.waiting import wait_until

# Shards balanced and moved within bounds, frozen and killed processes: one at a time.
pytestmark = pytest.mark.serial

FAST = {"ttl": 3, "renew_interval": 0.5, "renew_deadline": 2, "retry_interval": 0.5}
FLEET_ARGS = ["--ttl", "3", "--renew-interval", "0.5", "--renew-deadline", "2"]
FLEET_ARGS += ["--retry-interval", "0.5", "--tick", "0.2"]


class Runs:
    """Which node's task ran in each term, from the task itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.terms: dict[int, str] = {}

    def handler(self) -> rs.TaskHandler:
        tasks = rs.TaskHandler(stop_grace=0.5)

        @tasks.persistent(name="work")
        def work(ctx: rs.TaskContext) -> None:
            with self.lock:
                self.terms[ctx.term] = ctx.node_id
            ctx.cancelled.wait()

        return tasks


@pytest.fixture
def admin(backend: Backend) -> Iterator[LeaseAdmin]:
    found = backend.admin()
    yield found
    found.close()


@pytest.fixture
def make(backend: Backend) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def build(name: str, node_id: str, runs: Runs, **kw: Any) -> Any:
        leader = backend.leader(runs.handler(), name, node_id=node_id, **FAST, **kw)
        made.append(leader)
        return leader

    yield build
    for leader in made:
        leader.stop(timeout=10)


def ends(records: list[TermRecord]) -> list[tuple[str, str | None, str | None, str | None]]:
    """(node, end_reason, handed_to, by) of each record, newest first."""
    return [(r.node_id, r.end_reason, r.handed_to, r.by) for r in records]


def test_each_term_is_recorded_with_why_it_ended(
    make: Callable[..., Any], admin: LeaseAdmin
) -> None:
    name = f"h-{uuid.uuid4().hex[:8]}"
    runs = Runs()
    a = make(name, "a", runs, version="1.0")
    b = make(name, "b", runs)
    a.start()
    assert a.wait_until_leader(10)
    b.start()
    wait_until(lambda: len(a.nodes()) == 2, 10, "both heartbeats")
    # An operator hands it to b; b steps down by itself (held off, so a takes it); a
    # stops; b takes it and stops.
    admin.request_handover(name, to="b")
    wait_until(lambda: b.is_leader, 10, "the handover to b")
    b.step_down(hold=3.0)
    wait_until(lambda: a.is_leader, 10, "a to take the lease back")
    a.stop(timeout=10)
    wait_until(lambda: b.is_leader, 10, "b to lead once a stopped")
    b.stop(timeout=10)

    records = admin.history(name)
    assert ends(records) == [
        ("b", "released", None, None),
        ("a", "released", None, None),
        ("b", "stepped_down", None, None),
        ("a", "handed_over", "b", "operator"),
    ]
    # Each record names the node whose tasks ran in that term, and only those terms.
    assert {r.term: r.node_id for r in records} == runs.terms
    assert [r.version for r in records] == [None, "1.0", None, "1.0"]
    assert {(r.hostname, r.pid) for r in records} == {(socket.gethostname(), os.getpid())}
    for newer, older in itertools.pairwise(records):
        assert newer.term > older.term
        assert older.ended_at is not None and older.ended_at <= newer.began_at
    assert all(r.ended_at is not None and r.began_at <= r.ended_at for r in records)
    # The status snapshot's last change is the newest ended term.
    (status,) = admin.status([name]).leases
    assert status.last_change == records[0]


def test_handing_over_to_a_newer_version_is_nobody_s_doing(
    make: Callable[..., Any], admin: LeaseAdmin
) -> None:
    name = f"h-{uuid.uuid4().hex[:8]}"
    runs = Runs()
    old = make(name, "old", runs, version="1.0", settle=1.0, heartbeat_interval=0.2)
    old.start()
    assert old.wait_until_leader(10)
    new = make(name, "new", runs, version="2.0", settle=1.0, heartbeat_interval=0.2)
    new.start()
    wait_until(lambda: new.is_leader, 15, "the newer node to lead")
    (current, handed) = admin.history(name)
    assert (current.node_id, current.end_reason, current.version) == ("new", None, "2.0")
    assert ends([handed]) == [("old", "handed_over", "new", None)]


def test_the_history_keeps_its_limit(make: Callable[..., Any], admin: LeaseAdmin) -> None:
    name = f"h-{uuid.uuid4().hex[:8]}"
    runs = Runs()
    alone = make(name, "alone", runs, history_limit=3)
    alone.start()
    assert alone.wait_until_leader(10)
    for _ in range(5):  # terms 2..6: each step-down releases, then takes a new term
        before = alone.term
        alone.step_down(hold=0.0)
        wait_until(lambda b=before: alone.is_leader and alone.term != b, 10, "a new term")
    records = admin.history(name)
    assert len(records) == 3
    assert [r.term for r in records] == sorted(runs.terms, reverse=True)[:3]
    assert ends(records)[1:] == [("alone", "stepped_down", None, None)] * 2
    assert records[0].end_reason is None and records[0].ended_at is None


def test_a_crashed_frozen_or_stopped_holder_s_term_has_its_reason(
    backend: Backend, admin: LeaseAdmin
) -> None:
    name = f"h-{uuid.uuid4().hex[:8]}"
    with Fleet(backend.url, name, [*backend.fleet_args, *FLEET_ARGS]) as fleet:
        first = fleet.start(4)
        fleet.kill(first["node"])  # kill -9: its session or connection goes with it
        second = fleet.wait_for(15, ev="elected")
        assert second is not None
        fleet.kill(second["node"], signal.SIGSTOP)  # frozen: its lease expires
        third = fleet.wait_for(15, ev="elected")
        assert third is not None
        fleet.kill(second["node"], signal.SIGCONT)
        fleet.kill(third["node"], signal.SIGTERM)  # a graceful stop: it releases
        fourth = fleet.wait_for(15, ev="elected")
        assert fourth is not None
        # The resumed node found its term over (ended by its deadline, released by
        # nobody): the record its successor closed stays.
        time.sleep(1.0)
        records = admin.history(name)
        fleet.stop_all()
    by_term = {r.term: r for r in records}
    assert ends([by_term[first["term"]]]) == [(first["node"], "session_lost", None, None)]
    assert ends([by_term[second["term"]]]) == [(second["node"], "expired", None, None)]
    # The successor closed each at its takeover: when the next term began.
    assert by_term[first["term"]].ended_at == by_term[second["term"]].began_at
    assert by_term[second["term"]].ended_at == by_term[third["term"]].began_at
    assert ends([by_term[third["term"]]]) == [(third["node"], "released", None, None)]
    # Every term recorded is a term a node was elected in, and the other way round.
    elected = {e["term"]: e["node"] for e in fleet.history if e["ev"] == "elected"}
    assert {r.term: r.node_id for r in records} == elected


def test_forgetting_closes_a_term_nobody_ended(backend: Backend, admin: LeaseAdmin) -> None:
    name = f"h-{uuid.uuid4().hex[:8]}"
    with Fleet(backend.url, name, [*backend.fleet_args, *FLEET_ARGS]) as fleet:
        first = fleet.start(1)
        fleet.kill(first["node"])
        fleet.stop_all()
    wait_until(lambda: admin.current_holder(name) is None, 10, "the lease to expire")
    admin.retire(name, check_nodes=False)
    (record,) = admin.history(name)
    assert ends([record]) == [(first["node"], "retired", None, "operator")]


def rselection(backend: Backend, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rselection", *args, *backend.cli_args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_history_command(backend: Backend, make: Callable[..., Any]) -> None:
    name = f"h-{uuid.uuid4().hex[:8]}"
    runs = Runs()
    a = make(name, "a", runs, version="1.0")
    a.start()
    assert a.wait_until_leader(10)
    # A term's tasks start once its task controls are read (one read after the term
    # began when they were not current): the second term is told by its tasks' runs.
    wait_until(lambda: runs.terms, 5, "the first term's tasks")
    a.step_down(hold=0.0)
    wait_until(lambda: a.is_leader and a.term != min(runs.terms), 10, "a second term")

    shown = rselection(backend, "history", name, "--json")
    assert shown.returncode == 0, shown.stderr
    terms = json.loads(shown.stdout)["terms"]
    assert [t["term"] for t in terms] == sorted(runs.terms, reverse=True)
    assert terms[1]["end_reason"] == "stepped_down" and terms[0]["end_reason"] is None
    assert set(terms[0]) >= {"term", "node_id", "version", "began_at", "ended_at"}
    assert set(terms[0]) >= {"end_reason", "handed_to", "by", "hostname", "pid"}
    assert terms[0]["began_at"].endswith("Z") and terms[0]["version"] == "1.0"

    table = rselection(backend, "history", name, "--limit", "1")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[1].split()[:3] == ["TERM", "NODE", "VERSION"]
    assert len(lines) == 3 and "(leading)" in lines[2]

    status = rselection(backend, "status", name, "--json")
    (lease,) = json.loads(status.stdout)["leases"]
    assert lease["last_change"] == terms[1]

    missing = rselection(backend, "history", f"none-{uuid.uuid4().hex[:6]}")
    assert missing.returncode == 1 and "no lease" in missing.stderr
    missing_json = rselection(backend, "history", f"none-{uuid.uuid4().hex[:6]}", "--json")
    assert missing_json.returncode == 1
    assert json.loads(missing_json.stdout)["exit_code"] == 1
    bad = rselection(backend, "history", name, "--limit", "0")
    assert bad.returncode == 2 and "--limit" in bad.stderr


def test_shards_record_their_versions_and_never_move_for_them(shard_server: Any) -> None:
    """A node of a newer version gets its share of shards and no more: the coordinator
    balances by count. Each shard's term is on record with its node's version."""
    name = f"hs{uuid.uuid4().hex[:6]}"
    options: dict[str, Any] = {"name": name, "shards": 4, "heartbeat_interval": 0.2, **FAST}
    nodes = [
        shard_server.sharded_leader(rs.TaskHandler(), node_id=node, version=version, **options)
        for node, version in (("old", "1.0"), ("new", "2.0"))
    ]
    redis_url = shard_server.cli_args[0] == "--redis-url"
    admin = Backend("redis" if redis_url else "postgres", shard_server.cli_args[1]).admin()
    try:
        nodes[0].start()
        wait_until(lambda: len(nodes[0].owned()) == 4, 20, "the first node to lead all four")
        nodes[1].start()  # the rebalancer moves two shards to it
        wait_until(lambda: [len(n.owned()) for n in nodes] == [2, 2], 20, "two shards each")
        owned = [n.owned() for n in nodes]
        time.sleep(2.0)  # the newer node settled long since: still two each, the same
        assert [n.owned() for n in nodes] == owned
        version_of = {"old": "1.0", "new": "2.0"}
        for shard in range(4):
            records = admin.history(f"{name}/{shard}")
            assert records, shard
            assert all(r.version == version_of[r.node_id] for r in records), records
            # A shard the rebalancer moved was handed over by nobody's command.
            assert all(r.by is None for r in records), records
        moved = [r for shard in range(4) for r in admin.history(f"{name}/{shard}")]
        assert any(r.end_reason == "handed_over" for r in moved), moved
    finally:
        for node in nodes:
            node.stop(timeout=15)
        admin.close()


def test_a_drained_sharded_node_hands_its_shards_on_and_takes_none(shard_server: Any) -> None:
    """Drained under its sharded name, a node gives every shard it leads to the others
    (each such term on record as drained, by the operator) and takes none until it is
    undrained; then it gets its share again."""
    name = f"hd{uuid.uuid4().hex[:6]}"
    options: dict[str, Any] = {"name": name, "shards": 6, "heartbeat_interval": 0.2, **FAST}
    nodes = [
        shard_server.sharded_leader(rs.TaskHandler(), node_id=node, settle=0.5, **options)
        for node in ("a", "b", "c")
    ]
    redis_url = shard_server.cli_args[0] == "--redis-url"
    admin = Backend("redis" if redis_url else "postgres", shard_server.cli_args[1]).admin()
    try:
        for node in nodes:
            node.start()
        wait_until(lambda: [len(n.owned()) for n in nodes] == [2, 2, 2], 20, "two shards each")
        given = nodes[2].owned()
        started = time.monotonic()
        admin.drain(name, "c")
        wait_until(lambda: not nodes[2].owned(), 10, "the drained node to hand its shards on")
        took = time.monotonic() - started
        wait_until(lambda: [len(n.owned()) for n in nodes] == [3, 3, 0], 10, "three each")
        print(f"\na drained sharded node handed its shards on in {took:.2f} s")
        time.sleep(1.0)  # looked at several times over: it takes none back
        assert [len(n.owned()) for n in nodes] == [3, 3, 0]
        for shard in given:
            drained = admin.history(f"{name}/{shard}")[1]
            assert (drained.node_id, drained.end_reason, drained.by) == ("c", "drained", "operator")
        admin.undrain(name, "c")
        wait_until(lambda: [len(n.owned()) for n in nodes] == [2, 2, 2], 20, "two each again")
    finally:
        for node in nodes:
            node.stop(timeout=15)
        admin.close()
