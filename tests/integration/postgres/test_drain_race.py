"""A node drained while its attempt to take the lease is in flight never leads: the
term its attempt took is released at once, its task never starts, and the record says
drained. Before, the node kept the lease with its own flags saying it may not lead.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import rselection as rs
from rselection.postgres import PostgresAdmin, PostgresLeader
from tests.support.marker_proxy import MarkerProxy
from tests.support.waiting import wait_until

# An attempt held in flight for a measured window.
pytestmark = pytest.mark.serial

FAST: dict[str, Any] = {"ttl": 4.0, "renew_interval": 0.5, "renew_deadline": 2.5}
FAST |= {"retry_interval": 0.5, "heartbeat_interval": 0.2, "claimer": None}


def test_a_node_drained_while_its_attempt_is_in_flight_never_leads(pg_dsn: str) -> None:
    name = f"race-{uuid.uuid4().hex[:6]}"
    started: list[str] = []
    lock = threading.Lock()

    def handler(node: str) -> rs.TaskHandler:
        tasks = rs.TaskHandler(stop_grace=0.5)

        @tasks.persistent(name="work")
        def work(ctx: rs.TaskContext) -> None:
            with lock:
                started.append(node)
            ctx.cancelled.wait()

        return tasks

    params = conninfo_to_dict(pg_dsn)
    target = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    with MarkerProxy(target) as proxy, PostgresAdmin(pg_dsn) as admin:
        via = make_conninfo(pg_dsn, host="127.0.0.1", port=str(proxy.port), sslmode="disable")
        a = PostgresLeader(pg_dsn, handler("a"), name=name, node_id="a", **FAST)
        # d's process leads another lease, so its drain read takes a pooled session and
        # does not queue behind its attempt on the keeper session (a process that only
        # follows reads on that session: after the attempt, which then finds the term).
        x = PostgresLeader(via, handler("x"), name=f"{name}-x", node_id="x", **FAST)
        d = PostgresLeader(via, handler("d"), name=name, node_id="d", **FAST)
        try:
            a.start()
            x.start()
            wait_until(lambda: a.is_leader and x.is_leader, 10, "a and x to lead")
            d.start()
            wait_until(lambda: len(d.nodes()) == 2, 10, "d's heartbeat")
            proxy.hold(b"pg_try_advisory_lock(r.lock_key", 1.5)  # d's next attempt
            a.stop(timeout=10)  # released: d attempts, its attempt held in the proxy
            wait_until(lambda: proxy.held == 1, 5, "d's attempt in flight")
            admin.drain(name, "d")
            # Its notification comes on the keeper session, behind the held attempt:
            # read the drain now, as the process's drain thread does when woken.
            d.check_drained()
            assert d.drained and not d.eligible
            time.sleep(2.5)  # the held attempt landed long since
            assert not d.is_leader
            assert "d" not in started
            records = admin.history(name)
            assert records[0].node_id == "d" and records[0].end_reason == "drained"
        finally:
            for leader in (d, x, a):
                leader.stop(timeout=10)
