"""Node membership over Postgres: heartbeats, nodes(), and the HeartbeatMonitor.

Three node processes share a lease; each prints its own ``nodes()`` view, and the
leader's HeartbeatMonitor prints the nodes joining and lost. A follower is killed with
SIGKILL (lost within node_timeout + one heartbeat + one poll), restarted (joined again),
and stopped gracefully (its row is deleted at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.postgres.leader import PostgresLeader
from rselection.postgres.lease import PostgresLease
from tests.support.member_node import HEARTBEAT, NODE_TIMEOUT, POLL
from tests.support.node_process import Events, NodeProcess, count
from tests.support.pg import PrivatePostgres
from tests.support.waiting import wait_until

# Lost within node_timeout + one heartbeat + one poll; the bound doubles that for a busy
# 2-core machine (measured: about 1.2 s).
LOST_BOUND = 2 * (NODE_TIMEOUT + HEARTBEAT + POLL)


def member(dsn: str, node_id: str) -> NodeProcess:
    return NodeProcess("tests.support.member_node", dsn, "--lease", "m", "--node", node_id)


def agreed_view(ids: set[str]) -> Callable[[Events], bool]:
    """A predicate: the latest view lists exactly ``ids`` alive, one of them leading."""

    def check(seen: Events) -> bool:
        views = [e for e in seen if e["event"] == "view"]
        if not views:
            return False
        nodes = views[-1]["nodes"]
        alive = {n[0] for n in nodes if n[1]}
        return alive == ids and sum(1 for n in nodes if n[2]) == 1

    return check


def leader_of(view: Events) -> str:
    nodes = [e for e in view if e["event"] == "view"][-1]["nodes"]
    return next(n[0] for n in nodes if n[2])


@pytest.fixture
def fleet(pg_dsn: str) -> Iterator[dict[str, NodeProcess]]:
    nodes: dict[str, NodeProcess] = {}
    yield nodes
    for node in nodes.values():
        node.reap()


def test_three_nodes_agree_and_the_monitor_sees_a_follower_die_and_return(
    pg_dsn: str, fleet: dict[str, NodeProcess]
) -> None:
    ids = {"n1", "n2", "n3"}
    for node_id in sorted(ids):
        fleet[node_id] = member(pg_dsn, node_id)
    for node in fleet.values():
        node.wait_for("a view with all three nodes", agreed_view(ids), 30.0)
    leaders = {leader_of(node.seen) for node in fleet.values()}
    assert len(leaders) == 1
    (lead,) = leaders
    monitor = fleet[lead]
    monitor.wait_for("the monitor to announce every node", _joined(ids), 10.0)
    # Distinct nodes from one address (as behind a NAT): identity is the node id.
    view = [e for e in monitor.seen if e["event"] == "view"][-1]["nodes"]
    assert len({n[3] for n in view}) == 1 and len(view) == 3

    victim = sorted(ids - {lead})[0]
    fleet[victim].kill()
    killed_at = time.monotonic()
    monitor.wait_for("node_lost of the killed follower", count("lost", 1, node=victim), 15.0)
    lost_after = time.monotonic() - killed_at
    print(f"\nnode_lost {lost_after * 1000:.0f} ms after kill -9 (bound {LOST_BOUND:.1f} s)")
    assert lost_after < LOST_BOUND
    assert monitor.of("lost", node=victim)[0]["alive"] is False
    # Every node sees it lost, and still the same leader.
    for node_id in ids - {victim}:
        fleet[node_id].wait_for("the view without the victim", agreed_view(ids - {victim}), 10.0)

    fleet[victim] = member(pg_dsn, victim)
    joined_before = len(monitor.of("joined", node=victim))
    monitor.wait_for("node_joined again", count("joined", joined_before + 1, node=victim), 15.0)
    for node in fleet.values():
        node.wait_for("all three again", agreed_view(ids), 15.0)

    # A graceful stop deletes the row at once: lost within one poll, and gone from views.
    leaving = sorted(ids - {lead, victim})[0]
    fleet[leaving].stop()
    fleet[leaving].wait_for("the node to stop", count("stopped", 1), 15.0)
    stopped_at = time.monotonic()
    monitor.wait_for("node_lost of the leaving node", count("lost", 1, node=leaving), 5.0)
    assert time.monotonic() - stopped_at < NODE_TIMEOUT  # not by timeout: the row went
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT node_id FROM rselection_nodes WHERE name = 'm'").fetchall()
    assert {r[0] for r in rows} == ids - {leaving}


def _joined(ids: set[str]) -> Callable[[Events], bool]:
    def check(seen: Events) -> bool:
        return {e["node"] for e in seen if e["event"] == "joined"} >= ids

    return check


@pytest.fixture
def make_leader(pg_dsn: str) -> Iterator[Callable[..., PostgresLeader]]:
    made: list[PostgresLeader] = []

    def make(**kw: Any) -> PostgresLeader:
        options = {"ttl": 3, "renew_interval": 0.5, "renew_deadline": 2, "retry_interval": 0.5}
        leader = PostgresLeader(pg_dsn, kw.pop("handler", rs.TaskHandler()), **options, **kw)
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


def test_nodes_in_one_process(make_leader: Callable[..., PostgresLeader]) -> None:
    a = make_leader(node_id="a", heartbeat_interval=0.2)
    b = make_leader(node_id="b", heartbeat_interval=0.2)
    a.start()
    assert a.wait_until_leader(10)
    b.start()
    wait_until(lambda: len(b.nodes()) == 2, 10.0, "both heartbeats")
    seen = {n.node_id: n for n in b.nodes()}
    assert seen["a"].is_leader and not seen["b"].is_leader
    assert all(n.alive and n.name == "default" for n in seen.values())
    assert seen["a"].last_seen >= seen["a"].started_at
    assert [n.node_id for n in a.nodes()] == [n.node_id for n in b.nodes()]


def test_task_context_lists_the_nodes(make_leader: Callable[..., PostgresLeader]) -> None:
    handler = rs.TaskHandler()
    views: list[list[rs.NodeInfo]] = []

    @handler.persistent(restart="never")
    def look(ctx: rs.TaskContext) -> None:
        wait_until(lambda: len(ctx.nodes()) >= 1, 10.0, "this node's heartbeat")
        views.append(ctx.nodes())

    leader = make_leader(handler=handler, node_id="solo", heartbeat_interval=0.2)
    leader.start()
    wait_until(lambda: bool(views), 10.0, "the task's view")
    assert [(n.node_id, n.is_leader) for n in views[0]] == [("solo", True)]


def test_single_node_leader_lists_itself() -> None:
    leader = rs.SingleNodeLeader(rs.TaskHandler())
    with leader:
        (node,) = leader.nodes()
        assert node.node_id == "local" and node.alive and node.is_leader


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"heartbeat_interval": 0}, "heartbeat_interval must be"),
        ({"heartbeat_interval": True}, "heartbeat_interval must be"),
        ({"node_timeout": -1}, "node_timeout must be"),
        ({"heartbeat_interval": 2, "node_timeout": 1}, "must be longer than heartbeat_interval"),
        ({"nodes_table": "bad name"}, "table"),
    ],
)
def test_bad_membership_options(pg_dsn: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(rs.ConfigError, match=message):
        PostgresLeader(pg_dsn, rs.TaskHandler(), **options)


def test_bad_monitor_options() -> None:
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(rs.ConfigError, match="poll_interval"):
            rs.HeartbeatMonitor(poll_interval=bad)  # type: ignore[arg-type]


# -- heartbeats across outages ---------------------------------------------------------

# Heartbeats every 0.2 s; after an outage the next one lands within a heartbeat of the
# server answering again (measured: median 0.08 s, worst 0.18 s after the keeper
# reconnected, 5 runs).
BEAT = 0.2
RESUME_BOUND = 10.0


def _last_seen(dsn: str, node_id: str) -> Any:
    """The node's last heartbeat (server time), or ``None`` without a row (or table)."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        try:
            row = conn.execute(
                "SELECT last_seen FROM rselection_nodes WHERE node_id = %s", (node_id,)
            ).fetchone()
        except psycopg.errors.UndefinedTable:  # before the first heartbeat creates it
            return None
    return None if row is None else row[0]


def _server_now(dsn: str) -> Any:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def _beats_after(dsn: str, node_id: str, instant: Any) -> Callable[[], bool]:
    def check() -> bool:
        seen = _last_seen(dsn, node_id)
        return seen is not None and seen > instant

    return check


def _keeper_pid(leader: PostgresLeader) -> int | None:
    lease = leader._backend
    assert isinstance(lease, PostgresLease)
    return lease.backend_pid


def test_heartbeats_resume_after_the_keeper_session_is_terminated(
    pg_dsn: str, make_leader: Callable[..., PostgresLeader]
) -> None:
    leader = make_leader(
        node_id="beating", heartbeat_interval=BEAT, handler=rs.TaskHandler(stop_grace=0.5)
    )
    leader.start()
    assert leader.wait_until_leader(10)
    wait_until(lambda: _last_seen(pg_dsn, "beating") is not None, 10.0, "the first heartbeat")
    old_pid = _keeper_pid(leader)
    assert old_pid is not None
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
    # The keeper sees its session gone, drops the backend and reconnects.
    wait_until(
        lambda: _keeper_pid(leader) not in (None, old_pid) and leader.is_leader,
        RESUME_BOUND,
        "the keeper to reconnect and lead again",
    )
    reconnected = _server_now(pg_dsn)
    wait_until(
        _beats_after(pg_dsn, "beating", reconnected),
        RESUME_BOUND,
        "a heartbeat after the keeper reconnected",
    )
    (node,) = leader.nodes()
    assert node.node_id == "beating" and node.alive and node.is_leader


def test_heartbeats_resume_after_a_server_restart(private_pg: PrivatePostgres) -> None:
    leader = PostgresLeader(
        private_pg.dsn,
        rs.TaskHandler(stop_grace=0.5),
        node_id="beating",
        heartbeat_interval=BEAT,
        ttl=3,
        renew_interval=0.5,
        renew_deadline=2,
        retry_interval=0.5,
    )
    try:
        leader.start()
        assert leader.wait_until_leader(20)
        wait_until(
            lambda: _last_seen(private_pg.dsn, "beating") is not None, 10.0, "the first heartbeat"
        )
        private_pg.restart()
        wait_until(lambda: leader.is_leader, 30.0, "the keeper to lead again after the restart")
        reconnected = _server_now(private_pg.dsn)
        wait_until(
            _beats_after(private_pg.dsn, "beating", reconnected),
            RESUME_BOUND,
            "a heartbeat after the restart",
        )
    finally:
        leader.stop(timeout=10)
    # A graceful stop still leaves the membership at once.
    assert _last_seen(private_pg.dsn, "beating") is None
