"""What is Postgres's own in sharded leadership: the assignment read before the nodes
table exists, and a psycopg connection or pool as ``conninfo``.

The rest runs on both backends: the fleet scenarios, the status command, claims and
checkpoints, lead() and stop() against a silent server, and the number of shards
checked across nodes in ``tests/integration/conformance/test_sharding.py``; stopping
the hard ways and the coordinator's handover requests in
``tests/integration/conformance/test_sharding_stop.py``.
"""

from __future__ import annotations

import pytest

import rselection as rs
from tests.support.pg import connection_or_pool
from tests.support.shard_fleet import FAST, idle_tasks
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]


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


@pytest.mark.parametrize("kind", ["connection", "pool"])
def test_a_sharded_leader_on_a_connection_or_a_pool_leads_every_shard(
    pg_dsn: str, kind: str
) -> None:
    shards: set[int | None] = set()
    tasks = rs.TaskHandler()

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        shards.add(ctx.shard)
        ctx.cancelled.wait()

    with connection_or_pool(kind, pg_dsn) as source:
        leader = rs.PostgresShardedLeader(
            source, tasks, name="given", shards=2, node_id="n1", **FAST
        )
        try:
            leader.start()
            wait_until(lambda: leader.owned() == {0, 1}, 20, "the node to lead both shards")
            wait_until(lambda: shards == {0, 1}, 10, "a task on each shard")
            assert {info.node_id for info in leader.assignment().values()} == {"n1"}
            if kind == "pool":
                assert source.get_stats()["requests_num"] > 0  # the reads borrowed from it
        finally:
            leader.stop(timeout=10)
