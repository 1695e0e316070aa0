"""Which node the newest-version rule hands a lease to (``rselection.succession``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from rselection.members import NodeInfo
from rselection.succession import CHECK_INTERVAL, LOOK_AT_MOST, Look

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


def node(
    node_id: str,
    version: str | None,
    *,
    settled: float = 60.0,
    silent: float = 0.0,
    alive: bool = True,
    eligible: bool = True,
) -> NodeInfo:
    """A node of lease "jobs", heartbeating for ``settled`` s, last ``silent`` s ago."""
    started = NOW - timedelta(seconds=settled)
    return NodeInfo(
        node_id,
        "jobs",
        "h",
        1,
        None,
        started,
        NOW - timedelta(seconds=silent),
        alive,
        False,
        version=version,
        eligible=eligible,
    )


def pick(nodes: list[NodeInfo], version: str | None = "1.0", settle: float = 10.0) -> str | None:
    heir = Look(nodes, "me", version, settle, NOW).successor()
    return None if heir is None else heir.node_id


def test_the_newest_settled_eligible_node_of_a_newer_version_is_the_heir() -> None:
    me = node("me", "1.0")
    assert pick([me, node("a", "1.1"), node("b", "1.2"), node("c", "1.0.1")]) == "b"
    assert pick([me, node("a", "1.10"), node("b", "1.9")]) == "a"  # PEP 440, not text
    assert pick([me, node("a", "2.0rc1"), node("b", "1.9")]) == "a"


def test_ties_go_to_the_longest_settled() -> None:
    me = node("me", "1.0")
    assert pick([me, node("a", "1.1", settled=20), node("b", "1.1", settled=40)]) == "b"


def test_no_move_for_older_equal_unversioned_unsettled_lost_or_ineligible_nodes() -> None:
    me = node("me", "1.0")
    assert pick([me, node("a", "0.9"), node("b", "1.0"), node("c", None)]) is None
    assert pick([me, node("a", "1.1", settled=9.9)]) is None  # not settled for 10 s
    assert pick([me, node("a", "1.1", alive=False)]) is None
    assert pick([me, node("a", "1.1", eligible=False)]) is None
    assert pick([me, node("a", "1.1", settled=0.5)], settle=0.0) == "a"


def test_a_holder_without_a_version_never_hands_over_for_one() -> None:
    assert pick([node("me", None), node("a", "9.0")], version=None) is None


def test_the_next_look_comes_when_a_newer_node_settles_else_every_half_settle() -> None:
    me = node("me", "1.0")
    # Nothing newer: half the settle, at most LOOK_AT_MOST, at least CHECK_INTERVAL.
    assert Look([me, node("a", "0.9")], "me", "1.0", 10.0, NOW).next_look() == 5.0
    assert Look([me], "me", "1.0", 60.0, NOW).next_look() == LOOK_AT_MOST
    assert Look([me], "me", "1.0", 0.2, NOW).next_look() == CHECK_INTERVAL
    # A newer node settles in 2 s: look then (an older or ineligible one does not count).
    newer = node("b", "1.1", settled=8.0)
    assert (
        Look(
            [me, newer, node("c", "1.2", settled=1, eligible=False)], "me", "1.0", 10.0, NOW
        ).next_look()
        == 2.0
    )
    # Settled already: the regular pace (the handover is asked for by this look).
    assert Look([me, node("b", "1.1", settled=30)], "me", "1.0", 10.0, NOW).next_look() == 5.0


def test_a_node_silent_since_the_term_began_is_no_heir() -> None:
    """The holder before this one, killed: still listed as alive for a node timeout,
    but it has not heartbeated since this term began, and would never take the lease."""
    me = node("me", "1.0")
    dead = node("dead", "2.0", silent=3)
    began = NOW - timedelta(seconds=1)
    assert Look([me, dead], "me", "1.0", 10.0, NOW, since=began).successor() is None
    assert Look([me, dead, node("live", "1.5")], "me", "1.0", 10.0, NOW, since=began).successor()
    assert Look([me, dead], "me", "1.0", 10.0, NOW).successor() is dead  # without the term's start


def test_a_version_that_is_not_pep_440_is_skipped_not_fatal() -> None:
    me = node("me", "1.0")
    assert pick([me, node("odd", "release-42"), node("b", "1.1")]) == "b"
    assert Look([me, node("odd", "release-42")], "me", "1.0", 10.0, NOW).next_look() == 5.0


def test_the_holder_looks_often_while_a_newer_node_has_not_heartbeated_this_term() -> None:
    me = node("me", "1.0")
    quiet = node("quiet", "2.0", silent=3)
    began = NOW - timedelta(seconds=1)
    assert Look([me, quiet], "me", "1.0", 10.0, NOW, since=began).next_look() == CHECK_INTERVAL
    assert Look([me, quiet], "me", "1.0", 10.0, NOW).next_look() == 5.0


def test_each_process_running_a_membership_is_a_run_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import rselection.members
    from rselection.memory import MemoryLease, MemoryMembership

    lease = MemoryLease(name="jobs")
    one, two = MemoryMembership(lease, "n"), MemoryMembership(lease, "n")
    assert one.incarnation != two.incarnation  # a node built anew: a new run
    before = one.incarnation
    # The same object in a worker forked from its builder (another pid): a new run.
    monkeypatch.setattr(rselection.members.os, "getpid", lambda: 4242)
    assert one.incarnation != before and one.incarnation.endswith("-4242")
