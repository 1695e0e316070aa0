"""What is Postgres's own in sharded leadership: the assignment read before the nodes
table exists.

The rest runs on both backends: the fleet scenarios, the status command, claims and
checkpoints, lead() and stop() against a silent server, and the number of shards
checked across nodes in ``tests/integration/conformance/test_sharding.py``; stopping
the hard ways and the coordinator's handover requests in
``tests/integration/conformance/test_sharding_stop.py``.
"""

from __future__ import annotations

import pytest

import rselection as rs
from tests.support.shard_fleet import FAST, idle_tasks
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_the_assignment_is_read_before_the_first_heartbeat_made_the_nodes_table(
    pg_dsn: str,
) -> None:
    # Before, assignment() read the holders and the nodes in one statement, and answered
    # "nobody holds a shard" while the nodes table did not exist yet: shards led before
    # the first heartbeat created it looked unled (seen on a loaded machine).
    leader = rs.PostgresShardedLeader(
        pg_dsn, idle_tasks(), name="early", shards=2, node_id="early-node", **FAST
    )
    reader = rs.PostgresShardedLeader(
        pg_dsn, idle_tasks(), name="early", shards=2, nodes_table="no_heartbeat_yet"
    )
    try:
        leader.start()
        wait_until(lambda: leader.owned() == {0, 1}, 20, "the node to lead both shards", 0.05)
        holders = reader.assignment()
        assert {shard: info.node_id for shard, info in holders.items()} == {
            0: "early-node",
            1: "early-node",
        }
        assert reader.state().nodes == {}
    finally:
        leader.stop(timeout=10)
        reader.stop(timeout=10)
