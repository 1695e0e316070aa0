"""Task controls and run history cost the renewal path nothing: counted on the wire, a
holder whose tasks fire 20 times a second, each run recorded, still sends one statement
per renewal on its keeper session; the runs go in batches on the pooled sessions, one
statement per batch.
"""

from __future__ import annotations

import time

import pytest
from psycopg.conninfo import conninfo_to_dict

import rselection as rs
from rselection.postgres import PostgresAdmin, PostgresLeader
from rselection.postgres.session_pool import APPLICATION_NAME as POOL
from rselection.task_desk import TaskDesk
from rselection.task_runs import RUN_HISTORY_LIMIT
from tests.support.waiting import wait_until
from tests.support.wire_counter import CountingProxy

# Statements counted over a window of renewals: one at a time.
pytestmark = pytest.mark.serial

KEEPER = "rselection:keeper"  # the application_name of every keeper session
RENEW_INTERVAL = 0.5
WINDOW = 5.0


def test_recorded_runs_add_no_statement_to_renewals_and_one_per_batch(pg_dsn: str) -> None:
    params = conninfo_to_dict(pg_dsn)
    host, port = str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    handler = rs.TaskHandler()
    fired = [0]

    @handler.interval(0.05, name="tick")
    def tick(ctx: rs.TaskContext) -> None:
        fired[0] += 1

    @handler.interval(0.05, name="tock")
    async def tock(ctx: rs.TaskContext) -> None:
        fired[0] += 1

    desk = TaskDesk.shared()
    with CountingProxy(host, port) as proxy:
        leader = PostgresLeader(
            proxy.dsn(pg_dsn),
            handler,
            name="task-cost",
            node_id="a",
            ttl=3.0,
            renew_interval=RENEW_INTERVAL,
            renew_deadline=2.0,
            retry_interval=0.5,
            heartbeat_interval=60.0,  # no heartbeat in the window: renewals and runs only
            claimer=None,  # no claims in the window either
        )
        leader.start()
        try:
            assert leader.wait_until_leader(10)
            wait_until(lambda: fired[0] >= 20, 5, "the first fires")
            time.sleep(1.0)  # the start-up round trips are over
            before, batches, written = proxy.snapshot(), desk.counts.batches, desk.counts.written
            time.sleep(WINDOW)
            after = proxy.snapshot().minus(before)
            batches = desk.counts.batches - batches
            written = desk.counts.written - written
            renewing, pooled = after.statements(KEEPER), after.statements(POOL)
            print(
                f"\n{renewing} keeper statements in {WINDOW:g} s of renewals; {written} runs "
                f"recorded in {batches} batches, {pooled} pooled statements"
            )
            # One statement a renewal, give or take the window's edges: as without runs.
            assert WINDOW / RENEW_INTERVAL - 3 <= renewing <= WINDOW / RENEW_INTERVAL + 1
            # About 200 runs (2 tasks, 20 fires a second each), in batches of a quarter
            # second or so: one statement each (a batch across the window's edge counts
            # on one side only).
            assert written >= 100 and 10 <= batches <= 4 * WINDOW
            assert batches - 2 <= pooled <= batches + 2
        finally:
            leader.stop(timeout=10)
    with PostgresAdmin(pg_dsn) as admin:
        assert len(admin.task_runs("task-cost", "tick")) == RUN_HISTORY_LIMIT
