"""Drains without a server: whom a drained holder hands over to, and what the
notification parsers make of a drain notice (a wake-up, never more)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rselection.drains import heir
from rselection.members import NodeInfo
from rselection.postgres.notices import parse_lease_notice
from rselection.redis.messages import event_kind

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def node(node_id: str, version: str | None, **kw: object) -> NodeInfo:
    fields: dict[str, object] = {
        "node_id": node_id,
        "name": "jobs",
        "hostname": "h",
        "pid": 1,
        "client_addr": None,
        "started_at": NOW - timedelta(seconds=60),
        "last_seen": NOW,
        "alive": True,
        "is_leader": False,
        "version": version,
        "eligible": True,
    }
    fields.update(kw)
    return NodeInfo(**fields)  # type: ignore[arg-type]


def test_the_heir_is_the_newest_live_eligible_node_ties_to_the_longest_running() -> None:
    nodes = [
        node("holder", "3.0", is_leader=True),
        node("old", "1.0"),
        node("new-late", "2.0", started_at=NOW - timedelta(seconds=5)),
        node("new-early", "2.0", started_at=NOW - timedelta(seconds=50)),
        node("canary", "9.0", eligible=False),
        node("lost", "8.0", alive=False),
        node("silent", "7.0", last_seen=NOW - timedelta(seconds=30)),
        node("drained", "6.0"),
    ]
    since = NOW - timedelta(seconds=10)
    found = heir(nodes, "holder", since, frozenset({"drained"}))
    assert found is not None and found.node_id == "new-early"


def test_no_heir_without_versions_any_eligible_node_may_take_the_lease() -> None:
    nodes = [node("holder", None), node("a", None), node("b", "not a version")]
    assert heir(nodes, "holder", None) is None


def test_a_drain_notice_is_parsed_as_a_wake_up_and_malformed_ones_are_dropped() -> None:
    notice = parse_lease_notice('{"event": "drain", "name": "jobs", "node_id": "n1"}')
    assert notice is not None and notice.event == "drain" and notice.node_id == "n1"
    assert parse_lease_notice('{"event": "drained"}') is None
    assert event_kind(b"drain:0") == "drain"
    assert event_kind(b"drain:") is None and event_kind(b"drain:n1") is None


def test_a_flood_of_wake_ups_reads_a_leader_s_drain_at_most_every_50_ms() -> None:
    import time

    from rselection.drains import READ_EVERY, DrainWatch

    class Counting:
        def __init__(self) -> None:
            self.reads = 0

        def check_drained(self) -> None:
            self.reads += 1

    watch, leader = DrainWatch(), Counting()
    began = time.monotonic()
    while time.monotonic() - began < 0.5:  # wake-ups as fast as a flood brings them
        watch.wake(leader)
    time.sleep(2 * READ_EVERY)  # the last one due is read
    took = time.monotonic() - began
    assert 1 <= leader.reads <= took / READ_EVERY + 1, leader.reads
    watch.discard(leader)
