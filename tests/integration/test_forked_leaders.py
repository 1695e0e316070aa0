"""Leaders and forks: a leader built before ``fork()`` is a node of its own in each
child; one started before it is the parent's, and refuses to run in a child.

What gunicorn ``--preload``, uvicorn ``--workers`` and ``multiprocessing`` do: the
children are real ``os.fork()`` children reporting through a pipe.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest

import rselection as rs
from tests.support.forking import in_child

FAST = {"ttl": 6.0, "renew_interval": 0.5, "renew_deadline": 3.0, "retry_interval": 0.5}


def _idle_tasks() -> rs.TaskHandler:
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.sleep(3600)

    return tasks


def _leaders(pg_dsn: str, redis_url: str) -> list[rs.Leader]:
    return [
        rs.PostgresLeader(pg_dsn, _idle_tasks(), name="forked", **FAST),
        rs.RedisLeader(
            redis_url, _idle_tasks(), name=f"forked-{os.getpid()}-{time.time_ns()}", **FAST
        ),
        rs.PostgresShardedLeader(pg_dsn, _idle_tasks(), name="forked-shards", shards=2, **FAST),
    ]


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["postgres", "redis", "sharded"])
def test_a_leader_built_before_fork_is_a_node_of_its_own_in_each_child(
    pg_dsn: str, redis_url: str, kind: int
) -> None:
    leader = _leaders(pg_dsn, redis_url)[kind]
    built_as = leader.node_id

    def child() -> dict[str, Any]:
        leader.start()
        try:
            led = leader.wait_until_leader(20)
            deadline = time.monotonic() + 20
            while leader.node_id not in (nodes := [n.node_id for n in leader.nodes()]):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            return {"node_id": leader.node_id, "led": led, "nodes": nodes}
        finally:
            leader.stop()

    first, second = in_child(child), in_child(child)
    assert "error" not in first and "error" not in second, (first, second)
    ids = {built_as, first["node_id"], second["node_id"]}
    assert len(ids) == 3, ids
    for report in (first, second):
        assert report["led"] and report["node_id"] in report["nodes"], report
    assert str(os.getpid()) not in first["node_id"].split("-")


def test_an_explicit_node_id_stays_in_a_child(pg_dsn: str) -> None:
    leader = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="forked", node_id="web-1", **FAST)
    assert in_child(lambda: {"node_id": leader.node_id}) == {"node_id": "web-1"}


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["postgres", "redis", "sharded"])
def test_a_leader_started_before_fork_refuses_to_run_in_the_child(
    pg_dsn: str, redis_url: str, kind: int
) -> None:
    leader = _leaders(pg_dsn, redis_url)[kind]
    with leader:
        assert leader.wait_until_leader(20)
        term = getattr(leader, "term", None)

        def child() -> dict[str, Any]:
            report: dict[str, Any] = {"is_leader": leader.is_leader}
            for call in ("start", "lead"):
                try:
                    getattr(leader, call)()
                    report[call] = "returned"
                except rs.RSelectionError as exc:
                    report[call] = str(exc)
            began = time.monotonic()
            leader.stop()
            report["stop_took"] = time.monotonic() - began
            return report

        report = in_child(child)
        assert report["is_leader"] is False, report
        for call in ("start", "lead"):
            assert "fork" in report[call] and "post_fork" in report[call], report
        assert report["stop_took"] < 0.5, report
        # The parent never noticed: it leads on in the same term, its session intact.
        time.sleep(2 * FAST["renew_interval"])
        assert leader.is_leader and getattr(leader, "term", None) == term


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["postgres", "redis", "sharded"])
def test_a_default_node_id_is_the_one_its_heartbeats_and_claims_carry(
    pg_dsn: str, redis_url: str, kind: int
) -> None:
    leader = _leaders(pg_dsn, redis_url)[kind]
    claimer = getattr(leader, "claimer", None) or leader._options["claimer"]  # type: ignore[attr-defined]
    assert claimer.node_id == leader.node_id
    with leader:
        assert leader.wait_until_leader(20)  # the tables exist from here on
        deadline = time.monotonic() + 20
        while leader.node_id not in [n.node_id for n in leader.nodes()]:
            assert time.monotonic() < deadline, [n.node_id for n in leader.nodes()]
            time.sleep(0.05)


def test_a_sharded_leader_whose_construction_failed_is_no_trouble_in_a_child(
    pg_dsn: str,
) -> None:
    # Before, a sharded leader refused at construction (a bad table name) but still
    # referenced (by the exception's traceback) was reset in every forked child, which
    # logged "could not reset ... has no attribute '_coordinator'" there.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    forks_logger = logging.getLogger("rselection.forks")
    forks_logger.addHandler(handler)
    try:
        with pytest.raises(rs.ConfigError) as refused:
            rs.PostgresShardedLeader(
                pg_dsn, rs.TaskHandler(), name="half", shards=2, table="no such;table"
            )
        report = in_child(lambda: {"errors": [r.getMessage() for r in records]})
    finally:
        forks_logger.removeHandler(handler)
    assert refused.traceback  # the half-built leader was still referenced at the fork
    assert report == {"errors": []}
