"""Stopping a sharded leader the hard ways, on every backend: from its own tasks, before
it started, and while the server does not answer; and the coordinator's handover
requests: fenced by its term, only to members, opened when their target leaves.

Figures are printed (``pytest -s``); bounds are several times what this 2-core machine
measured (kept in the comments), so that a loaded machine does not fail them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

import rselection as rs
from rselection.sharded import HAND_OFF_WAIT, Rebalancer
from tests.support.proxy import TcpProxy
from tests.support.shard_fleet import FAST, REPO_ROOT, ShardServer, idle_tasks, unique
from tests.support.waiting import wait_until

# serial: how long a stop takes is what these tests check (under four workers the
# stops during an outage failed their bound in 2 full runs of 6).
pytestmark = [pytest.mark.serial, pytest.mark.timeout(240)]

INSIDE_BOUND = 1.0  # a stop() from inside only asks (measured a few ms)


def stop_node(server: ShardServer, name: str, *args: str) -> list[str]:
    """The command line of a ``tests.support.shard_stop_node`` process of ``name`` on
    ``server`` (whose keys go with the test's)."""
    server.register(name)
    cmd = [sys.executable, "-m", "tests.support.shard_stop_node", "--backend", server.backend]
    return [*cmd, "--name", name, *args]


@pytest.mark.parametrize("kind", ["def", "async"])
def test_stop_from_a_task_only_asks_and_no_task_is_reported_stuck(
    shard_server: ShardServer, kind: str
) -> None:
    # Before, the tasks that called stop() waited in it for their own join: reported stuck
    # after stop_grace, and with on_stuck="exit" the process exited with code 70 mid-stop.
    env = dict(os.environ, **shard_server.env(), PYTHONPATH=str(REPO_ROOT))
    cmd = stop_node(shard_server, unique(f"task-stop-{kind}"), "--stop-in", kind)
    result = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"exit code {result.returncode}\n{result.stderr[-3000:]}"
    took = [float(line.split("took=")[1]) for line in result.stdout.splitlines() if "took=" in line]
    assert took and max(took) < INSIDE_BOUND, result.stdout
    assert "lead-returned owned=0" in result.stdout, result.stdout
    assert "still running" not in result.stderr, result.stderr[-3000:]


def test_a_stop_before_start_is_final(shard_server: ShardServer) -> None:
    # Before, start() after stop() started every shard's leader, and a second stop()
    # returned at once with the shards still owned.
    name = unique("final")
    stopped = shard_server.sharded_leader(
        idle_tasks(), name=name, shards=3, node_id="stopped", **FAST
    )
    other = shard_server.sharded_leader(idle_tasks(), name=name, shards=3, node_id="other", **FAST)
    try:
        stopped.stop()
        stopped.start()  # as LeaseLeader: no error, and nothing starts
        with pytest.raises(RuntimeError, match="already started"):
            stopped.start()
        other.start()
        # The other node leads every shard alone: the stopped one never competed.
        wait_until(lambda: other.owned() == {0, 1, 2}, 20, "the other node to lead all", 0.05)
        assert stopped.owned() == frozenset()
        assert {info.node_id for info in other.assignment().values()} == {"other"}
        began = time.monotonic()
        stopped.stop(timeout=10)
        assert time.monotonic() - began < 1.0
    finally:
        stopped.stop(timeout=10)
        other.stop(timeout=10)
    # lead() after stop() returns at once, and leads nothing.
    again = shard_server.sharded_leader(idle_tasks(), name=name, shards=3, **FAST)
    again.stop()
    thread = threading.Thread(target=again.lead, daemon=True)
    began = time.monotonic()
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "lead() after stop() did not return"
    assert time.monotonic() - began < 5.0 and again.owned() == frozenset()
    assert again.assignment() == {}


# stop_grace (0.5 s) + renew_deadline (2 s) + HAND_OFF_WAIT (1 s) + a margin for load.
OUTAGE_STOP_BOUND = 0.5 + 2.0 + HAND_OFF_WAIT + 2.5


@pytest.mark.parametrize("outage_before_stop", [0.5, 1.5, 3.0])
def test_stop_during_an_outage_leaves_no_task_stuck_and_ends_in_bounded_time(
    shard_server: ShardServer,
    make_tcp_proxy: Callable[[str, int], TcpProxy],
    outage_before_stop: float,
) -> None:
    # Before, the coordinator's rebalancer blocked in its reads and requests: it was
    # reported stuck, and with on_stuck="exit" the process exited with code 70 mid-stop.
    # A stop arriving later in the outage (1.5 s, 3 s: the renew deadline has passed
    # and the leases reconnect) waited for each shard's reconnect in turn, up to the
    # connect timeout each: 20 to 25 s on Postgres.
    proxy = make_tcp_proxy(*shard_server.host_port())
    env = dict(os.environ, **shard_server.env(via=proxy.address), PYTHONPATH=str(REPO_ROOT))
    cmd = stop_node(shard_server, unique("outage"), "--stop-in", "stdin")
    cmd += ["--rebalance-interval", "0.05"]
    node = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stdout is not None and node.stdin is not None
        assert node.stdout.readline().strip() == "ready"
        proxy.blackhole()  # connections stay open; nothing gets through
        time.sleep(outage_before_stop)  # the rebalancer's round in flight waits now
        node.stdin.write("stop\n")
        node.stdin.flush()
        out, err = node.communicate(timeout=90)
    finally:
        proxy.heal()
        if node.poll() is None:
            node.kill()
            node.wait(10)
    assert node.returncode == 0, f"exit code {node.returncode}\n{err[-3000:]}"
    assert "task 'rebalance'" not in err, err[-3000:]
    took = float(out.split("took=")[1].split()[0])
    print(f"\n{shard_server.backend}: stop() during an outage took {took:.2f} s")
    # The shards' releases wait for the round trip in flight, which ends at the renew
    # deadline (2 s here); the hand-off waits HAND_OFF_WAIT at most. Measured 1.9 s on
    # Postgres (32 s before: the hand-off and the rebalancer waited for answers) and
    # 2.0 s on Redis (4.0 to 6.5 s before: after the renewal in flight timed out, the
    # lease's watch began again, a reconnect bounded by the same 2 s, before the lease
    # could be closed; and the node's heartbeat was deleted twice, 0.5 s each).
    assert took < OUTAGE_STOP_BOUND


# -- the coordinator's handover requests ---------------------------------------------------


def test_a_deposed_coordinators_moves_are_not_recorded_nor_those_to_a_node_that_left(
    shard_server: ShardServer,
) -> None:
    # Before, a coordinator whose term had ended could still record a round of moves
    # planned from its stale view. Its requests are fenced by its term.
    name = unique("dep")
    shard_server.register(name)
    shards = [
        shard_server.leader(idle_tasks(), f"{name}/{k}", node_id="a", **FAST) for k in range(4)
    ]
    coordinators = {
        node: shard_server.leader(
            rs.TaskHandler(), name, node_id=node, heartbeat_interval=0.5, **FAST
        )
        for node in ("a", "b")
    }
    view = shard_server.sharded_leader(
        idle_tasks(), name=name, shards=4, node_id="a", heartbeat_interval=0.5, settle=0
    )
    try:
        for leader in shards:
            leader.start()
        coordinators["a"].start()
        assert coordinators["a"].wait_until_leader(20)
        coordinators["b"].start()
        stale = coordinators["a"].term
        assert stale is not None
        coordinators["a"].step_down(hold=30)  # deposed: b coordinates from now on
        assert coordinators["b"].wait_until_leader(20)
        current = coordinators["b"].term
        assert current is not None and current > stale
        wait_until(lambda: all(leader.is_leader for leader in shards), 20, "a leads every shard")
        wait_until(
            lambda: {n.node_id for n in coordinators["b"].nodes() if n.alive} == {"a", "b"},
            20,
            "both nodes heartbeat",
        )

        # The request itself: nothing written under the stale term (to a member).
        assert view._request_handovers({f"{name}/0": "b"}, fence=(name, stale)) == {}
        assert shard_server.requests(name) == {}
        # A's rebalancer, deposed: it plans moves to b (a holds every shard) but none is
        # recorded, round after round, while b heartbeats and settles.
        rebalancer = Rebalancer(view)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert rebalancer.step(stale) == []
            time.sleep(0.1)
        assert shard_server.requests(name) == {}
        moved = rebalancer.step(current)  # the same round under the live term is recorded
        assert [m.target for m in moved] == ["b", "b"], moved
        assert set(shard_server.requests(name).values()) == {"b"}
        # A node that is not a member of the name is never asked to take a shard.
        left = next(f"{name}/{k}" for k in range(4) if k not in {m.shard for m in moved})
        assert view._request_handovers({left: "ghost"}, fence=(name, current)) == {}
        assert left not in shard_server.requests(name)
    finally:
        for leader in [*shards, *coordinators.values()]:
            leader.stop(timeout=10)
        view.stop(timeout=10)


def test_requests_go_only_to_members_and_a_node_that_left_opens_what_was_reserved_for_it(
    shard_server: ShardServer,
) -> None:
    name = unique("mem")
    shard_server.register(name)
    holders = [
        shard_server.leader(idle_tasks(), f"{name}/{k}", node_id="a", **FAST) for k in range(2)
    ]
    member = shard_server.leader(
        rs.TaskHandler(), name, node_id="b", heartbeat_interval=0.5, **FAST
    )
    # Node b's view of the sharded name (never started): its requests and its leaving.
    view = shard_server.sharded_leader(idle_tasks(), name=name, shards=2, node_id="b", **FAST)
    names = [f"{name}/0", f"{name}/1"]
    try:
        for leader in [*holders, member]:
            leader.start()
        wait_until(lambda: all(h.is_leader for h in holders), 20, "a leads both leases")
        wait_until(lambda: [n.node_id for n in member.nodes()] == ["b"], 20, "b's heartbeat")
        # "c" is no member of the name: it is not asked to take anything.
        asked = view._request_handovers({names[0]: "b", names[1]: "c"})
        assert set(asked) == {names[0]}
        assert shard_server.requests(name) == {names[0]: "b"}
        # b leaves: the lease reserved for it is opened to every node but its old holder.
        assert view._reopen_handovers(names) == [names[0]]
        assert shard_server.requests(name) == {names[0]: None}
        assert view._reopen_handovers(names) == []
    finally:
        for leader in [*holders, member]:
            leader.stop(timeout=10)
        view.stop(timeout=10)
