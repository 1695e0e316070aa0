"""The leadership history costs the renewal path nothing: counted on the wire, a
holder's keeper session sends one statement per renewal, as before the history (its
records are written by the statements that acquire and release). And a step-down, which
releases and takes a new term, costs the same round trips as before: one each.
"""

from __future__ import annotations

import time

import pytest
from psycopg.conninfo import conninfo_to_dict

import rselection as rs
from rselection.postgres import PostgresAdmin, PostgresLeader
from tests.support.waiting import wait_until
from tests.support.wire_counter import CountingProxy

# Statements counted over a window of renewals: one at a time.
pytestmark = pytest.mark.serial

KEEPER = "rselection:keeper"  # the application_name of every keeper session
RENEW_INTERVAL = 0.5
WINDOW = 5.0


def test_renewals_send_one_statement_each_and_the_terms_are_on_record(pg_dsn: str) -> None:
    params = conninfo_to_dict(pg_dsn)
    host, port = str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    with CountingProxy(host, port) as proxy:
        leader = PostgresLeader(
            proxy.dsn(pg_dsn),
            rs.TaskHandler(),
            name="cost",
            node_id="a",
            ttl=3.0,
            renew_interval=RENEW_INTERVAL,
            renew_deadline=2.0,
            retry_interval=0.5,
            heartbeat_interval=60.0,  # no heartbeat in the window: renewals only
            claimer=None,
        )
        leader.start()
        try:
            assert leader.wait_until_leader(10)
            time.sleep(1.0)  # the start-up round trips are over
            before = proxy.snapshot()
            time.sleep(WINDOW)
            renewing = proxy.snapshot().minus(before).statements(KEEPER)
            # One statement a renewal (a renewal a RENEW_INTERVAL), give or take the
            # window's edges; the history would show as more.
            print(f"\n{renewing} keeper statements in {WINDOW:g} s of renewals")
            assert WINDOW / RENEW_INTERVAL - 3 <= renewing <= WINDOW / RENEW_INTERVAL + 1
            first = leader.term
            before = proxy.snapshot()
            leader.step_down(hold=0.0)  # a release, then a new term
            wait_until(lambda: leader.is_leader and leader.term != first, 10, "a new term")
            stepping = proxy.snapshot().minus(before).statements(KEEPER)
            print(f"{stepping} keeper statements for a step-down and the next term")
        finally:
            leader.stop(timeout=10)
    # A release and an acquisition (renewals in between, at most a few).
    assert 2 <= stepping <= 5
    with PostgresAdmin(pg_dsn) as admin:
        records = admin.history("cost")
    assert [(r.node_id, r.end_reason) for r in records] == [
        ("a", "released"),
        ("a", "stepped_down"),
    ]
