"""Postgres leadership history at the edges: a release that a locked lease row holds up
still records why its term ended (not as a lost session when the next node takes the
lease), and a lease row deleted and made again starts a history of its own."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg

import rselection as rs
from rselection.postgres import PostgresAdmin, PostgresLeader
from tests.support.waiting import wait_until

FAST: dict[str, Any] = {"ttl": 4.0, "renew_interval": 0.5, "renew_deadline": 2.0}
FAST["retry_interval"] = 0.5


def leader(dsn: str, name: str, node: str) -> PostgresLeader:
    return PostgresLeader(dsn, rs.TaskHandler(), name=name, node_id=node, claimer=None, **FAST)


def reasons(dsn: str, name: str) -> list[tuple[int, str, str | None]]:
    with PostgresAdmin(dsn) as admin:
        return [(r.term, r.node_id, r.end_reason) for r in admin.history(name)]


def test_a_release_held_up_by_a_locked_row_records_its_reason(pg_dsn: str) -> None:
    name = f"locked-{uuid.uuid4().hex[:6]}"
    a = leader(pg_dsn, name, "a")
    a.start()
    assert a.wait_until_leader(10)
    term = a.term
    with psycopg.connect(pg_dsn) as locker:
        # An operator's transaction holds the row past the release's bound: the release
        # gives up, the keeper frees the term's lock, the row still names `a`.
        locker.execute("SELECT 1 FROM rselection_leases WHERE name = %s FOR UPDATE", (name,))
        a.stop(timeout=15)
        b = leader(pg_dsn, name, "b")
        b.start()
        time.sleep(0.5)
    try:
        wait_until(lambda: b.is_leader, 10, "b to take over once the row is free")
        assert reasons(pg_dsn, name) == [(b.term, "b", None), (term, "a", "released")]
    finally:
        b.stop(timeout=10)


def test_a_lease_row_made_again_starts_its_history_anew(pg_dsn: str) -> None:
    name = f"again-{uuid.uuid4().hex[:6]}"
    a = leader(pg_dsn, name, "a")
    a.start()
    try:
        assert a.wait_until_leader(10)
        for _ in range(2):
            before = a.term
            a.step_down(hold=0.0)
            wait_until(lambda b=before: a.is_leader and a.term != b, 10, "a new term")
    finally:
        a.stop(timeout=10)
    assert [term for term, _, _ in reasons(pg_dsn, name)] == [3, 2, 1]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM rselection_leases WHERE name = %s", (name,))
    again = leader(pg_dsn, name, "a")
    again.start()
    try:
        assert again.wait_until_leader(10)
        assert again.term == 1
        # Terms 2 and 3 were of the row deleted: the new term 1 is the newest record.
        assert reasons(pg_dsn, name) == [(1, "a", None)]
    finally:
        again.stop(timeout=10)
