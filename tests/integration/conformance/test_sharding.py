"""Sharded leadership on every backend: balance, crash failover, joins, pauses, graceful
stops and chaos with real processes; the status command, claims and checkpoints per
shard, lead() and stop() against a silent server, and the number of shards checked
across nodes in one process.

Every node is ``tests/support/shard_node.py``: one sharded leader
(``PostgresShardedLeader`` or ``RedisShardedLeader``) whose task records, per shard,
when each term's run started and ended (the activity ledger) and writes fenced entries
(the fenced ledger). Who holds what comes from the server; when it changed, from the
nodes' ``elected`` and ``demoted`` events, stamped with ``time.monotonic()``, which
every process of the machine shares.

Bounds are several times what this 2-core machine measured (kept in the comments), so a
loaded machine does not fail them; the figures are printed (``pytest -s``). On Redis a
crash is noticed by the liveness beats (``liveness_interval`` 0.5 s), not at once as a
dead Postgres session is.
"""

from __future__ import annotations

import json
import math
import random
import signal
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection import signals
from rselection.sharded import SHARDS_RECORD
from tests.support.proxy import TcpProxy
from tests.support.resign_cli import cli
from tests.support.scale_fleet import percentile
from tests.support.shard_fleet import (
    ARGS,
    FAST,
    TTL,
    Event,
    PostgresShards,
    ShardFleet,
    ShardServer,
    assert_no_overlap_per_shard,
    balanced,
    idle_tasks,
    unique,
)
from tests.support.waiting import wait_until

# serial: the bounds are measured deadlines of fleets of node processes (under four
# workers a node of two stopped together once did not exit within 60 s).
pytestmark = [pytest.mark.serial, pytest.mark.timeout(240)]

START_BOUND = 30.0  # every node started and the fleet balanced (measured about 3-5 s)
FAILOVER_P95_BOUND = 2.0  # the test bound (the target is 1 s; measured below)
FAILOVER_MAX_BOUND = 3.0  # no single shard of a killed node later than this
REBALANCE_BOUND = 15.0  # balanced again after a death or a join (measured about 0.5-2 s)


def changes(fleet: ShardFleet, since: float) -> dict[int, list[Event]]:
    """Each shard's ``elected`` events after ``since``, in order."""
    out: dict[int, list[Event]] = {}
    for event in fleet.events():
        if event["event"] == "elected" and event["mono"] > since:
            out.setdefault(event["shard"], []).append(event)
    return out


def test_four_nodes_balance_a_killed_nodes_shards_move_and_a_fifth_joins_with_few_moves(
    shard_server: ShardServer,
) -> None:
    shards = 32
    name = f"pollers-{uuid.uuid4().hex[:6]}"
    with ShardFleet(shard_server, name, shards, ARGS) as fleet:
        start = time.monotonic()
        for i in range(4):
            fleet.add(f"n{i}")
        for node in fleet.nodes.values():
            node.ready()
        took = wait_until(
            lambda: balanced(fleet, ["n0", "n1", "n2", "n3"]), START_BOUND, "8 shards each", 0.1
        )
        print(f"\n4 nodes x 32 shards balanced {time.monotonic() - start:.2f} s after start")
        assert took < START_BOUND
        assert fleet.counts(["n0", "n1", "n2", "n3"]) == dict.fromkeys(["n0", "n1", "n2", "n3"], 8)

        # kill -9 of the node that balances the shards: only its shards move, each led
        # elsewhere at once, without waiting for a new coordinator.
        before = fleet.holders()
        victim = fleet.coordinator()
        assert victim is not None
        theirs = {shard for shard, node in before.items() if node == victim}
        killed = fleet.nodes[victim].kill()
        survivors = [n for n in ["n0", "n1", "n2", "n3"] if n != victim]

        def all_taken() -> bool:
            moved = changes(fleet, killed)
            return all(shard in moved for shard in theirs)

        wait_until(all_taken, 10.0, "the killed node's shards led elsewhere", 0.05)
        moved = changes(fleet, killed)
        latency = [moved[shard][0]["mono"] - killed for shard in theirs]
        p50, p95 = statistics.median(latency), percentile(latency, 95)
        print(f"killed node's shards led elsewhere: p50 {p50 * 1000:.0f}, p95 {p95 * 1000:.0f} ms")
        assert p95 <= FAILOVER_P95_BOUND
        assert max(latency) <= FAILOVER_MAX_BOUND
        wait_until(lambda: balanced(fleet, survivors), REBALANCE_BOUND, "10/11/11", 0.1)
        after = fleet.holders()
        assert sorted(fleet.counts(survivors).values()) == [10, 11, 11]
        assert {s for s in range(shards) if after[s] != before[s]} == theirs, (
            "only the killed node's shards may change owner"
        )
        assert set(changes(fleet, killed)) == theirs

        assert fleet.coordinator() in survivors

        # A new node joins: it reaches its share, and only that many shards move, each by
        # a graceful handover.
        time.sleep(1.0)  # let the coordinator's last moves settle
        # Each shard of the killed node moved once: the survivors took them over by one
        # plan, so the coordinator had nothing to move on (before, the fastest survivor
        # took most of them, and the coordinator moved them again).
        twice = {s: len(e) for s, e in changes(fleet, killed).items() if len(e) > 1}
        assert not twice, f"shards of the killed node that moved more than once: {twice}"
        before = fleet.holders()
        joined = time.monotonic()
        fleet.add("n4").ready()
        nodes = [*survivors, "n4"]
        wait_until(lambda: balanced(fleet, nodes), REBALANCE_BOUND, "8 shards each", 0.1)
        share_at = time.monotonic()
        after = fleet.holders()
        moved_shards = {s for s in range(shards) if after[s] != before[s]}
        print(f"a joining node reached its share in {share_at - joined:.2f} s (from its start)")
        assert len(moved_shards) == 8 <= math.ceil(shards / 4)
        assert all(after[s] == "n4" for s in moved_shards)
        # The nodes' event logs lag the lease rows read above: wait for them to tell
        # every move; then nothing else may have changed hands, not even twice.
        wait_until(
            lambda: set(changes(fleet, joined)) >= moved_shards, 10, "the moves' events", 0.1
        )
        moves = changes(fleet, joined)
        assert set(moves) == moved_shards
        gaps = []
        for shard in moved_shards:
            demoted = [
                e
                for e in fleet.events()
                if e["event"] == "demoted" and e["shard"] == shard and e["mono"] > joined
            ]
            assert [e["reason"] for e in demoted] == ["handover"]
            gaps.append(moves[shard][0]["mono"] - demoted[0]["mono"])
        print(
            f"handover (old owner's demotion to new owner's election): "
            f"p50 {statistics.median(gaps) * 1000:.0f} ms, max {max(gaps) * 1000:.0f} ms"
        )
        assert max(gaps) < 2.0

        # A node stops gracefully: it hands each of its shards straight to a node below
        # its share, so only its shards move, each once.
        time.sleep(1.0)
        before = fleet.holders()
        leaving = survivors[0]
        theirs = {shard for shard, node in before.items() if node == leaving}
        stopped = time.monotonic()
        fleet.nodes[leaving].stop()
        rest = [n for n in nodes if n != leaving]
        wait_until(lambda: balanced(fleet, rest), REBALANCE_BOUND, "10/11/11 again", 0.1)
        took = time.monotonic() - stopped
        time.sleep(1.0)  # any further move would show now
        after = fleet.holders()
        assert sorted(fleet.counts(rest).values()) == [10, 11, 11]
        assert {s for s in range(shards) if after[s] != before[s]} == theirs
        moves = changes(fleet, stopped)
        assert set(moves) == theirs and all(len(e) == 1 for e in moves.values()), moves
        print(f"a stopping node's shards handed over and balanced in {took:.2f} s")
    runs = assert_no_overlap_per_shard(fleet)
    assert runs >= shards + 8 + 8 + 8
    assert fleet.assert_fenced_ledger() > shards


def test_a_paused_node_loses_its_shards_and_gets_a_share_back_after_it_resumes(
    shard_server: ShardServer,
) -> None:
    shards = 12
    name = f"paused-{uuid.uuid4().hex[:6]}"
    nodes = ["p0", "p1", "p2"]
    with ShardFleet(shard_server, name, shards, ARGS) as fleet:
        for node in nodes:
            fleet.add(node)
        for process in fleet.nodes.values():
            process.ready()
        wait_until(lambda: balanced(fleet, nodes), START_BOUND, "4 shards each", 0.1)
        frozen = fleet.nodes["p1"]
        theirs = {s for s, n in fleet.holders().items() if n == "p1"}
        frozen.pause()
        # Beyond the ttl: its leases expire and the others take them (expiry, not the
        # session: the paused process's session lives).
        wait_until(
            lambda: (
                not ({s for s, n in fleet.holders().items() if n == "p1"})
                and len(fleet.holders()) == shards
            ),
            TTL + 10.0,
            "the paused node's shards led elsewhere",
            0.1,
        )
        time.sleep(1.0)
        assert "p1" not in fleet.holders().values()
        resumed = frozen.resume()
        wait_until(lambda: balanced(fleet, nodes), REBALANCE_BOUND, "4 shards each again", 0.1)
        print(f"\nresumed node back at its share {time.monotonic() - resumed:.2f} s after SIGCONT")
        assert fleet.counts(nodes)["p1"] == 4
        assert theirs  # it had a share before
    # A run frozen while its lease passed on may run the few instructions that tell it
    # its term is over after SIGCONT: that tail is excused, nothing else is.
    assert_no_overlap_per_shard(fleet, resume_grace=1.0)
    fleet.assert_fenced_ledger()


SHARDS = 16
# Every kind of fault more than once, the coordinator's node among the killed.
ACTIONS = ["kill-coordinator", "pause", "stop", "kill", "pause", "stop", "kill", "pause"]
BALANCE_BOUND = 30.0  # balanced again after a round (measured 1-5 s, a pause's ttl included)


def test_kills_pauses_and_stops_never_let_two_terms_of_a_shard_run_at_once(
    shard_server: ShardServer,
) -> None:
    rng = random.Random(15)
    name = f"chaos-{uuid.uuid4().hex[:6]}"
    with ShardFleet(shard_server, name, SHARDS, ARGS) as fleet:
        live = [f"c{i}" for i in range(4)]
        for node in live:
            fleet.add(node)
        for process in fleet.nodes.values():
            process.ready()
        wait_until(lambda: balanced(fleet, live), BALANCE_BOUND, "the first balance", 0.1)
        spare = 0
        for action in ACTIONS:
            victim = rng.choice(live)
            if action == "kill-coordinator":
                action, victim = "kill", fleet.coordinator() or victim
            if action == "pause":
                process = fleet.nodes[victim]
                process.pause()
                time.sleep(TTL + 1.0)  # its leases expire and pass on meanwhile
                process.resume()
            else:
                if action == "kill":
                    fleet.nodes[victim].kill()
                else:
                    fleet.nodes[victim].stop()
                live.remove(victim)
                spare += 1
                replacement = f"r{spare}"
                fleet.add(replacement).ready()
                live.append(replacement)
            wait_until(
                lambda: balanced(fleet, live),
                BALANCE_BOUND,
                f"balance after {action} of {victim}",
                0.1,
            )
            time.sleep(0.5)
    runs = assert_no_overlap_per_shard(fleet, resume_grace=1.0)
    assert runs > SHARDS
    fleet.assert_fenced_ledger()


# -- stopping: from a receiver, two nodes at once ---------------------------------------

INSIDE_BOUND = 1.0  # a stop() from inside only asks (measured a few ms)
STOPPED_BOUND = 15.0  # lead() returned after such a stop (measured about 0.1-0.5 s)


@pytest.fixture
def receivers() -> Iterator[Callable[[Any, Callable[..., None]], None]]:
    """``connect(signal, receiver)``: connected for this test only."""
    connected: list[tuple[Any, Callable[..., None]]] = []

    def connect(sig: Any, receiver: Callable[..., None]) -> None:
        sig.connect(receiver, weak=False)
        connected.append((sig, receiver))

    yield connect
    for sig, receiver in connected:
        sig.disconnect(receiver)


def ours(name: str, kw: dict[str, Any]) -> bool:
    """Whether a signal's ``name`` is the sharded name's coordinator or one of its shards."""
    lease = kw.get("name")
    return isinstance(lease, str) and (lease == name or lease.startswith(name + "/"))


def stop_from_receivers(
    leader: Any,
    sig: Any,
    connect: Callable[[Any, Callable[..., None]], None],
    trigger: Callable[[], None],
) -> list[float]:
    """Run ``lead()`` in a thread, make every ``sig`` of the leader call ``stop()``, then
    ``trigger()``; return how long each of those calls took, once ``lead()`` returned."""
    calls: list[float] = []
    returned = threading.Event()
    armed = threading.Event()

    def receiver(sender: Any, **kw: Any) -> None:
        if not armed.is_set() or not ours(leader.name, kw):
            return
        began = time.monotonic()
        leader.stop()  # what users write: "stop when we are demoted"
        calls.append(time.monotonic() - began)
        returned.set()

    connect(sig, receiver)
    thread = threading.Thread(target=leader.lead, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(leader.owned()) == leader.shards, 20, "every shard led", 0.05)
        armed.set()
        trigger()
        wait_until(returned.is_set, STOPPED_BOUND, "a stop() called in a receiver to return", 0.05)
        thread.join(STOPPED_BOUND)
        assert not thread.is_alive(), "lead() did not return after a stop() from a receiver"
    finally:
        armed.clear()
        leader.stop(timeout=10)
    assert leader.owned() == frozenset()
    assert leader.assignment() == {}, "the shards were released"
    return calls


def test_stop_from_a_demoted_receiver_only_asks_and_lead_returns_after_the_stop(
    shard_server: ShardServer, receivers: Callable[[Any, Callable[..., None]], None]
) -> None:
    # Before, the first stop() waited for the shards' pool threads, which waited in the
    # receivers' own stop(): lead() never returned.
    leader = shard_server.sharded_leader(
        idle_tasks(), name=unique("demoted-stop"), shards=4, heartbeat_interval=0.5, **FAST
    )
    calls = stop_from_receivers(
        leader, signals.demoted, receivers, lambda: leader.step_down(wait=False)
    )
    print(f"\nstop() in demoted receivers: {len(calls)} calls, longest {max(calls) * 1000:.0f} ms")
    assert calls and max(calls) < INSIDE_BOUND


def test_stop_from_a_leader_changed_receiver_only_asks_and_lead_returns_after_the_stop(
    shard_server: ShardServer, receivers: Callable[[Any, Callable[..., None]], None]
) -> None:
    leader = shard_server.sharded_leader(
        idle_tasks(), name=unique("changed-stop"), shards=4, heartbeat_interval=0.5, **FAST
    )
    # Every shard given up: each release is a change of holder its shard's leader sees.
    calls = stop_from_receivers(
        leader, signals.leader_changed, receivers, lambda: leader.step_down(wait=False)
    )
    print(f"\nstop() in leader_changed receivers: {len(calls)}, longest {max(calls) * 1000:.0f} ms")
    assert calls and max(calls) < INSIDE_BOUND


TOGETHER_ARGS = [  # the default lease timings (the reservation of a handover: 5.5 s)
    *("--ttl", "15", "--renew-interval", "2", "--renew-deadline", "10"),
    *("--retry-interval", "2", "--heartbeat-interval", "0.5", "--rebalance-interval", "0.25"),
]
UNLED_BOUND = 1.0  # the design's target (measured: median 35-73 ms, longest 52-288 ms)


def test_two_nodes_stopped_together_leave_no_shard_unled_for_more_than_a_second(
    shard_server: ShardServer,
) -> None:
    # Before, each stopping node handed shards to the other one too: those stayed
    # reserved for a node that was gone, unled for the reservation (5.5 s here).
    shards = 12
    nodes = ["s0", "s1", "s2"]
    with ShardFleet(
        shard_server, f"together-{uuid.uuid4().hex[:6]}", shards, TOGETHER_ARGS
    ) as fleet:
        for node in nodes:
            fleet.add(node)
        for process in fleet.nodes.values():
            process.ready()
        wait_until(lambda: balanced(fleet, nodes), 60, "4 shards each", 0.1)
        time.sleep(1.0)  # the coordinator's last moves settled
        survivor = fleet.coordinator() or "s0"
        leaving = [n for n in nodes if n != survivor]
        theirs = {s for s, n in fleet.holders().items() if n in leaving}
        began = time.time()
        for node in leaving:  # Ctrl-C to both at once, as a scale-down does
            fleet.nodes[node].proc.send_signal(signal.SIGINT)
        for node in leaving:
            assert fleet.nodes[node].exit_code(60) == 0, fleet.nodes[node].tail()
        wait_until(
            lambda: unled_gaps(fleet, theirs, leaving, began) is not None,
            30,
            "every shard of the stopped nodes to run on the survivor",
            0.1,
        )
        gaps = unled_gaps(fleet, theirs, leaving, began)
        assert gaps is not None
        ordered = sorted(gaps.values())
        print(
            f"\ntwo of three nodes stopped together: {len(gaps)} shards moved, unled "
            f"median {statistics.median(ordered) * 1000:.0f} ms, "
            f"longest {ordered[-1] * 1000:.0f} ms"
        )
        assert max(ordered) <= UNLED_BOUND, {s: round(g, 3) for s, g in gaps.items()}
    assert_no_overlap_per_shard(fleet)


def unled_gaps(
    fleet: ShardFleet, shards: set[int], leaving: list[str], since: float
) -> dict[int, float] | None:
    """Per shard, from the end of its last run on a leaving node to the start of its
    first run on another node (wall clock of the activity ledger, one machine); ``None``
    while a shard has not run on another node yet."""
    ended: dict[int, float] = {}
    started: dict[int, float] = {}
    for event in fleet.events():
        if event.get("ev") != "activity" or event["shard"] not in shards:
            continue
        shard = event["shard"]
        if event["node"] in leaving and event["end"] is not None and event["end"] >= since:
            ended[shard] = max(ended.get(shard, 0.0), event["end"])
        elif event["node"] not in leaving and event["end"] is None and event["start"] >= since:
            started.setdefault(shard, event["start"])
    if set(ended) != shards or set(started) != shards:
        return None
    return {shard: started[shard] - ended[shard] for shard in shards}


# -- the status command, claims and checkpoints, lead() and stop() ------------------------


def test_status_shows_the_shards_each_node_leads(shard_server: ShardServer) -> None:
    name = unique("st")
    leaders = []
    for node in ("a", "b"):
        leaders.append(
            shard_server.sharded_leader(
                idle_tasks(), name=name, shards=6, node_id=node, heartbeat_interval=0.5, **FAST
            )
        )
    try:
        for leader in leaders:
            leader.start()
        assert leaders[1].wait_until_balanced(20)
        result = cli("status", *shard_server.cli_args, name, "--json")
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)
        [sharded] = status["shards"]
        assert sharded["name"] == name and sharded["shards"] == 6 and not sharded["unled"]
        assert {node: len(mine) for node, mine in sharded["nodes"].items()} == {"a": 3, "b": 3}
        assert sorted(s for mine in sharded["nodes"].values() for s in mine) == list(range(6))
        text = cli("status", *shard_server.cli_args).stdout
        assert f"shards of {name!r}: 6 of 6 led, by 2 nodes" in text, text
    finally:
        for leader in leaders:
            leader.stop()


def test_an_ineligible_node_is_given_no_shard_and_leaves_the_balance_to_the_others(
    shard_server: ShardServer,
) -> None:
    name = unique("elig")
    options: dict[str, Any] = {"name": name, "shards": 6, "heartbeat_interval": 0.5, **FAST}
    a = shard_server.sharded_leader(idle_tasks(), node_id="a", **options)
    b = shard_server.sharded_leader(idle_tasks(), node_id="b", **options)
    canary = shard_server.sharded_leader(idle_tasks(), node_id="canary", eligible=False, **options)
    leaders = [canary, a, b]  # the canary first: it would coordinate, if it could
    try:
        for leader in leaders:
            leader.start()
        assert a.wait_until_balanced(20) and canary.wait_until_balanced(20)
        wait_until(lambda: len(a.nodes()) == 3, 10, "three nodes' heartbeats")
        assert {n.node_id: n.eligible for n in a.nodes()} == {"a": True, "b": True, "canary": False}
        # Settled, with rebalancing rounds every 0.5 s: the shards stay split 3/3.
        time.sleep(2.0)
        holders = a.assignment()
        assert sorted(holders) == list(range(6))
        assert sorted(info.node_id for info in holders.values()) == ["a"] * 3 + ["b"] * 3
        assert canary.owned() == frozenset() and not canary.is_leader
        # b stops: its shards go to a, never to the canary.
        b.stop(timeout=20)
        wait_until(lambda: a.owned() == frozenset(range(6)), 20, "a to lead every shard")
        assert canary.owned() == frozenset()
    finally:
        for leader in leaders:
            leader.stop(timeout=20)


def test_each_shard_claims_its_own_fires_and_keeps_its_own_checkpoint(
    shard_server: ShardServer,
) -> None:
    # Checkpoints are Postgres's alone (a RedisShardedLeader has no checkpoint store):
    # on Redis the task and the test leave them out.
    checkpoints = shard_server.backend == "postgres"
    name = unique("ticks")
    ran: list[tuple[str, int, str]] = []
    leaders = []
    for node in ("a", "b"):
        tasks = rs.TaskHandler()

        @tasks.interval(0.2, name="tick")
        def tick(ctx: rs.TaskContext, node: str = node) -> None:
            assert ctx.shard is not None and ctx.fire_key is not None
            ran.append((node, ctx.shard, ctx.fire_key))
            if checkpoints:
                last = ctx.checkpoint.load()
                ctx.checkpoint.save(
                    {"shard": ctx.shard, "fires": (last.state["fires"] if last else 0) + 1}
                )

        leaders.append(
            shard_server.sharded_leader(
                tasks, name=name, shards=4, node_id=node, heartbeat_interval=0.5, **FAST
            )
        )
    try:
        for leader in leaders:
            leader.start()
        assert leaders[1].wait_until_balanced(20)
        time.sleep(1.5)
    finally:
        for leader in leaders:
            leader.stop()
    # One run per shard and fire across both nodes, whoever owned the shard then.
    per_fire = Counter((shard, key) for _, shard, key in ran)
    assert per_fire and max(per_fire.values()) == 1, per_fire.most_common(3)
    assert {shard for _, shard, _ in ran} == set(range(4))
    keys = shard_server.claimed(name)
    assert {k.split("/tick@")[0] for k in keys} == {f"{name}%2F{shard}" for shard in range(4)}
    # Every run was claimed under its shard's lease name ("ticks/2" -> "ticks%2F2/...").
    assert {f"{name}%2F{shard}/{key}" for _, shard, key in ran} <= set(keys)
    if checkpoints:
        assert isinstance(shard_server, PostgresShards)
        with psycopg.connect(shard_server.dsn, autocommit=True) as conn:
            saved = dict(
                conn.execute(  # not the coordinator's record of the number of shards
                    "SELECT key[1], state FROM rselection_checkpoints WHERE key[1] <> %s",
                    (SHARDS_RECORD,),
                ).fetchall()
            )
        # Checkpoints are kept per shard (keyed by the shard's lease name and the task).
        assert {state["shard"] for state in saved.values()} == set(range(4)), saved


def test_lead_returns_once_stop_is_called_from_another_thread(shard_server: ShardServer) -> None:
    leader = shard_server.sharded_leader(
        idle_tasks(),
        name=unique("leads"),
        shards=3,
        ttl=3.0,
        renew_interval=0.5,
        renew_deadline=2.0,
    )
    thread = threading.Thread(target=leader.lead)
    thread.start()
    try:
        assert leader.wait_until_leader(20)
        wait_until(lambda: leader.owned() == {0, 1, 2}, 20, "every shard led")
        assert leader.leader() is not None  # the coordinator is this node
    finally:
        started = time.monotonic()
        leader.stop(timeout=20)
        thread.join(20)
    assert not thread.is_alive() and time.monotonic() - started < 10
    assert leader.owned() == frozenset() and leader.assignment() == {}


def test_stop_with_a_timeout_returns_within_it_while_the_server_is_silent(
    shard_server: ShardServer, make_tcp_proxy: Callable[[str, int], TcpProxy]
) -> None:
    # Before, the hand-off that starts stop() read the shards' holders before the
    # timeout applied: with a database that stopped answering, stop(timeout=3) took 15 s.
    proxy = make_tcp_proxy(*shard_server.host_port())
    name = unique("silent")
    tasks = idle_tasks()
    silent = shard_server.sharded_leader(
        tasks,
        via=proxy.address,
        name=name,
        shards=4,
        node_id="behind-the-proxy",
        heartbeat_interval=0.5,
        **FAST,
    )
    other = shard_server.sharded_leader(tasks.copy(), name=name, shards=4, node_id="direct", **FAST)
    try:
        silent.start()
        wait_until(lambda: silent.owned() == {0, 1, 2, 3}, 20, "every shard led")
        other.start()
        assert silent.wait_until_balanced(20)
        proxy.blackhole()  # connections stay open; nothing gets through
        started = time.monotonic()
        silent.stop(timeout=3)
        took = time.monotonic() - started
        # About 3 s; 15 s before.
        assert took < 4.5, f"stop(timeout=3) took {took:.1f} s"
        wait_until(lambda: other.owned() == {0, 1, 2, 3}, 20, "the other node to lead every shard")
    finally:
        proxy.heal()
        other.stop(timeout=10)
        silent.stop(timeout=5)


def test_a_node_built_with_another_number_of_shards_is_refused_while_the_fleet_runs(
    shard_server: ShardServer,
) -> None:
    # Before, a node with shards=4 joined a coordinator planning for 8: it was handed
    # shards it never competes for, and they bounced for ever (led 36 % of the time),
    # with nothing logged.
    name = unique("mixed")
    tasks = idle_tasks()

    def recorded() -> object:
        return shard_server.shards_record(name)

    eight = shard_server.sharded_leader(tasks, name=name, shards=8, node_id="eight", **FAST)
    try:
        eight.start()
        wait_until(lambda: recorded() is not None, 20, "the number of shards to be recorded")
        four = shard_server.sharded_leader(
            tasks.copy(), name=name, shards=4, node_id="four", **FAST
        )
        with pytest.raises(rs.ConfigError, match=r"shards=8 .*shards=4"):
            four.start()
        four.stop(timeout=5)
    finally:
        eight.stop(timeout=10)
    # Once the fleet is stopped, it may start again with another number.
    again = shard_server.sharded_leader(tasks.copy(), name=name, shards=4, node_id="four", **FAST)
    try:
        again.start()
        wait_until(lambda: again.owned() == {0, 1, 2, 3}, 20, "every shard of four led")
        wait_until(
            lambda: recorded() == {"shards": 4, "node_id": "four"}, 20, "the new number recorded"
        )
    finally:
        again.stop(timeout=10)
