"""Node membership over Postgres only: heartbeats on the shared keeper session resume
after that session is terminated, and the nodes table's name is checked; also the
single-node leader's list and the monitor's options.

The behaviours every backend shares (three node processes that agree, a follower killed
and restarted, a graceful leave, ``nodes()`` in one process and ``ctx.nodes()``,
heartbeats across a server restart) are in
``tests/integration/conformance/test_membership.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.postgres.leader import PostgresLeader
from rselection.postgres.lease import PostgresLease
from tests.support.waiting import wait_until


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


def test_single_node_leader_lists_itself() -> None:
    leader = rs.SingleNodeLeader(rs.TaskHandler())
    with leader:
        (node,) = leader.nodes()
        assert node.node_id == "local" and node.alive and node.is_leader


@pytest.mark.parametrize(
    ("options", "message"),
    [
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
