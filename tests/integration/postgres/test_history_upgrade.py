"""A rolling upgrade to the release that records the leadership history: node processes
of the release before it (lease table schema version 5, no history) and of this one on
one lease. The history table is created beside the lease table without a new schema
version, so a node of the older release started after it was created keeps working; it
writes no records, and the nodes of this release record theirs. The activity ledger
shows no two nodes' tasks ever ran at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from rselection.postgres import PostgresAdmin
from tests.integration.postgres.test_protocol_upgrade import MixedFleet
from tests.support.previous_release import BuildFailed, PreviousRelease, previous_release

BEFORE_HISTORY = "ec5c5e0"
"""The last commit before the leadership history (lease protocol 2, schema version 5)."""


@pytest.fixture(scope="module")
def release_before_history() -> PreviousRelease:
    try:
        return previous_release(BEFORE_HISTORY)
    except BuildFailed as exc:
        pytest.fail(f"could not build the release before the history: {exc}", pytrace=False)


@pytest.fixture
def fleet(
    pg_dsn: str, release_before_history: PreviousRelease, tmp_path: Path
) -> Iterator[MixedFleet]:
    mixed = MixedFleet(pg_dsn, release_before_history, tmp_path)
    try:
        yield mixed
    finally:
        mixed.stop_all()


def stop(fleet: MixedFleet, node: str) -> None:
    """Stop ``node`` gracefully (its stdin closed) and wait for it to exit."""
    stdin = fleet.procs[node].stdin
    assert stdin is not None
    with contextlib.suppress(OSError):
        stdin.close()
    assert fleet.exit_code(node) == 0


def test_an_older_node_keeps_working_beside_the_history_and_records_nothing(
    fleet: MixedFleet, pg_dsn: str
) -> None:
    fleet.spawn("new-a", "new")  # creates the history table on connect
    first = fleet.wait_for(15, ev="elected", node="new-a")["term"]
    fleet.spawn("old-b", "old")  # creates tables on connect too: nothing to do for it
    started = fleet.wait_for(15, ev="started", node="old-b")
    assert (started["schema"], started["protocol"]) == (5, 2), started
    stop(fleet, "new-a")
    second = fleet.wait_for(15, ev="elected", node="old-b")["term"]
    fleet.spawn("new-c", "new")
    fleet.wait_for(15, ev="started", node="new-c")
    stop(fleet, "old-b")
    third = fleet.wait_for(15, ev="elected", node="new-c")["term"]
    assert first < second < third
    with PostgresAdmin(pg_dsn) as admin:
        records = admin.history(fleet.lease)
    # The older node's term has no record; the nodes of this release have theirs.
    assert [(r.term, r.node_id, r.end_reason) for r in records] == [
        (third, "new-c", None),
        (first, "new-a", "released"),
    ]
    fleet.stop_all()
    report = fleet.check()
    assert [(r.node, r.term) for r in report.runs] == [
        ("new-a", first),
        ("old-b", second),
        ("new-c", third),
    ]
