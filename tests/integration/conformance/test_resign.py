"""Handover on request, on Postgres and Redis: ``rselection resign`` (``--dsn`` or
``--redis-url``) and the backend's ``request_handover``, ``cancel_handover`` and
``current_holder`` (``rselection.postgres.handover``, ``rselection.redis.handover``),
called the same way on both: ``f(conninfo_or_client, name, ...)``.

A request reserves the lease for the named node (or keeps only the old holder out)
until the next acquisition or the end of its ``valid_for``; it is for the current term
only, can be withdrawn, and wakes the leader, which hands over well under a second.
The command refuses what it cannot do (no holder, no other live node, a node that is
not live, an unreachable server) with a clear message and exit code.

Fleet tests run real node processes (``python -m rselection.commands.demo_fleet``) that
write a fenced ledger; each ends by checking that no write of an older term landed after
a write of a newer one. What only one backend has (Postgres: the table's schema
versions, ``--table``; Redis: stale request keys, ``live_nodes``) is tested in its own
suite.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from rselection.admin import Refused
from rselection.commands.demo_fleet import Fleet
from rselection.errors import BackendUnavailable, ConfigError
from tests.support.backends import Backend
from tests.support.resign_cli import cli, elected, seen_or_wait, took_ms
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


@pytest.fixture
def fleet3(backend: Backend) -> Iterator[tuple[Fleet, dict[str, Any]]]:
    """Three node processes at the default timings (renewals every 2 s): a fast
    handover can only come from the request's notification, not from a renewal falling
    due."""
    fleet = Fleet(backend.url, f"r-{uuid.uuid4().hex[:6]}", [*backend.fleet_args, "--ttl", "15"])
    try:
        with fleet:
            first = fleet.start(3)
            wait_until(lambda: len(backend.node_ids(fleet.name)) == 3, 15, "three live nodes")
            yield fleet, first
        assert backend.overlaps(fleet.name) == 0
        terms = backend.terms(fleet.name)
        assert terms and all(len(nodes) == 1 for nodes in terms.values())
    finally:
        backend.forget(fleet.name)


@pytest.fixture
def name(backend: Backend) -> Iterator[str]:
    """A lease name of this test's own (its Redis keys deleted after)."""
    lease = f"direct-{uuid.uuid4().hex[:6]}"
    yield lease
    backend.forget(lease)


@pytest.fixture
def make_lease(backend: Backend, name: str) -> Iterator[Callable[..., Any]]:
    """Factory of connected leases of lease ``name``, all closed after the test."""
    made: list[Any] = []

    def make(**kw: Any) -> Any:
        lease = backend.lease(name, **{"ttl": 3.0, "renew_deadline": 2.0, **kw})
        made.append(lease)
        return lease

    yield make
    for lease in made:
        lease.close()


# -- rselection resign, with a fleet ---------------------------------------------------------


def test_resign_hands_over_to_another_node_well_under_a_second(
    backend: Backend, fleet3: tuple[Fleet, dict[str, Any]]
) -> None:
    fleet, current = fleet3
    figures = []
    for _ in range(5):
        out = cli("resign", fleet.name, *backend.cli_args)
        assert out.returncode == 0, out.stdout + out.stderr
        figures.append(took_ms(out.stdout))
        heir = elected(fleet, 10, exclude=current["node"])
        assert heir["term"] == current["term"] + 1
        assert f"{heir['node']} leads {fleet.name!r} now with term {heir['term']}" in out.stdout
        demoted = seen_or_wait(fleet, 10, ev="demoted", node=current["node"], term=current["term"])
        assert demoted is not None and demoted["reason"] == "handover"
        current = heir
    print(
        f"{backend.kind} resign handover: median {statistics.median(figures):.0f} ms, "
        f"max {max(figures):.0f} ms over {len(figures)} rounds (renew_interval 2 s)"
    )
    assert max(figures) < 1000


def test_resign_to_picks_the_named_node(
    backend: Backend, fleet3: tuple[Fleet, dict[str, Any]]
) -> None:
    fleet, current = fleet3
    # Three rounds, each to a follower picked in turn: luck would pass all three only
    # one time in eight.
    for _ in range(3):
        target = sorted(set(fleet.procs) - {current["node"]})[0]
        out = cli("resign", fleet.name, *backend.cli_args, "--to", target)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"{target} leads {fleet.name!r} now" in out.stdout
        heir = elected(fleet, 10, exclude=current["node"])
        assert heir["node"] == target and heir["term"] == current["term"] + 1
        print(f"{backend.kind} resign --to {target}: {took_ms(out.stdout):.0f} ms")
        current = heir
    holder = backend.handover.current_holder(backend.url, fleet.name)
    assert holder is not None
    assert (holder.node_id, holder.term) == (current["node"], current["term"])
    assert not backend.handover_pending(fleet.name)  # the acquisition cleared the request


def test_resign_to_a_node_that_is_not_live_fails_clearly(
    backend: Backend, fleet3: tuple[Fleet, dict[str, Any]]
) -> None:
    fleet, current = fleet3
    out = cli("resign", fleet.name, *backend.cli_args, "--to", "no-such-node")
    assert out.returncode == 1
    assert "no-such-node is not a live node" in out.stderr
    followers = out.stderr.split("live followers:", 1)[1]
    assert all(f"n{i}" in followers for i in range(3) if f"n{i}" != current["node"])
    assert current["node"] not in followers
    same = cli("resign", fleet.name, *backend.cli_args, "--to", current["node"])
    assert same.returncode == 0 and "already leads" in same.stdout
    assert not backend.handover_pending(fleet.name)  # nothing was requested
    holder = backend.handover.current_holder(backend.url, fleet.name)
    assert holder is not None
    assert (holder.node_id, holder.term) == (current["node"], current["term"])


# -- rselection resign, edges -------------------------------------------------------------


def test_resign_times_out_when_no_leader_process_exists(backend: Backend, name: str) -> None:
    backend.fake_holder(name, "ghost-node", 4, seconds=60)
    began = time.monotonic()
    out = cli("resign", name, *backend.cli_args, "--timeout", "1")
    waited = time.monotonic() - began
    assert out.returncode == 1, out.stdout + out.stderr
    assert "asked ghost-node to hand" in out.stdout
    assert "no new term within 1s" in out.stderr
    assert f"ghost-node did not hand {name!r} over" in out.stderr
    assert waited < 15  # 1 s plus interpreter start-up, with a wide margin
    assert not backend.handover_pending(name)  # withdrawn
    holder = backend.handover.current_holder(backend.url, name)
    assert holder is not None and (holder.node_id, holder.term) == ("ghost-node", 4)


def test_resign_without_a_holder_fails_at_once(
    backend: Backend, name: str, make_lease: Callable[..., Any]
) -> None:
    backend.create_tables()
    out = cli("resign", name, *backend.cli_args, "--timeout", "30")  # never held
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"no lease {name!r}" in out.stderr, out.stderr  # not a lease without a leader
    lease = make_lease()
    got = lease.try_acquire("A")
    assert got.holder is not None
    lease.release("A", got.holder.term)
    out = cli("resign", name, *backend.cli_args, "--timeout", "30")  # released
    assert out.returncode == 1 and "has no leader" in out.stderr, out.stdout + out.stderr


def test_resign_on_an_unreachable_server_exits_3_and_hides_the_password(
    backend: Backend,
) -> None:
    url, port = backend.unreachable(password="hunter2")
    flag = "--redis-url" if backend.kind == "redis" else "--dsn"
    out = cli("resign", "any", flag, url)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "127.0.0.1" in out.stderr and str(port) in out.stderr
    assert "hunter2" not in out.stdout + out.stderr


def test_resign_of_a_lone_leader_is_refused(backend: Backend, name: str) -> None:
    leader = backend.leader(rs.TaskHandler(), name, node_id="lone", **FAST)
    leader.start()
    try:
        assert leader.wait_until_leader(10)
        wait_until(lambda: backend.node_ids(name) == ["lone"], 10, "the node to be listed")
        out = cli("resign", name, *backend.cli_args)
        assert out.returncode == 1
        assert "no other live node" in out.stderr
        assert leader.is_leader
    finally:
        leader.stop(timeout=10)
    assert backend.node_ids(name) == []  # a stopped node is no longer listed


def test_an_in_process_leader_hands_over_on_request_and_stays_out(
    backend: Backend, name: str
) -> None:
    slow = {**FAST, "ttl": 15.0, "renew_interval": 2.0, "renew_deadline": 10.0}
    leaders = [backend.leader(rs.TaskHandler(), name, node_id=f"p{i}", **slow) for i in range(2)]
    try:
        leaders[0].start()
        assert leaders[0].wait_until_leader(10)
        leaders[1].start()
        term = leaders[0].term
        assert term is not None
        wait_until(lambda: backend.node_ids(name) == ["p0", "p1"], 10, "both nodes listed")
        began = time.monotonic()
        asked = backend.handover.request_handover(backend.url, name, valid_for=10)
        assert asked is not None and (asked.node_id, asked.term) == ("p0", term)
        assert leaders[1].wait_until_leader(5)
        took = time.monotonic() - began
        assert leaders[1].term == term + 1 and not leaders[0].is_leader
        print(f"in-process {backend.kind} handover on request: {took * 1000:.0f} ms")
        assert took < 1.5  # the renewal is due only every 2 s: the request woke it
        time.sleep(0.5)
        assert not leaders[0].is_leader
    finally:
        for leader in leaders:
            leader.stop(timeout=10)


# -- request_handover, cancel_handover, current_holder on a lease --------------------------


def test_current_holder_names_the_live_holder_only(
    backend: Backend, name: str, make_lease: Callable[..., Any]
) -> None:
    handover = backend.handover
    a = make_lease()  # creates the tables, where the backend has any
    assert handover.current_holder(backend.url, name) is None  # never held
    got = a.try_acquire("A")
    assert got.acquired and got.holder is not None
    holder = handover.current_holder(backend.url, name)
    assert holder is not None
    assert (holder.node_id, holder.term) == ("A", got.holder.term)
    assert holder.acquired_at <= holder.expires_at
    a.release("A", got.holder.term)
    assert handover.current_holder(backend.url, name) is None  # released
    again = a.try_acquire("A")
    assert again.holder is not None
    backend.expire(name)
    assert handover.current_holder(backend.url, name) is None  # expired


def test_a_request_when_nobody_holds_the_lease_asks_nobody(
    backend: Backend, name: str, make_lease: Callable[..., Any]
) -> None:
    a = make_lease()
    assert backend.handover.request_handover(backend.url, name, valid_for=5) is None
    got = a.try_acquire("A")
    assert got.holder is not None
    a.release("A", got.holder.term)
    assert backend.handover.request_handover(backend.url, name, to="B", valid_for=5) is None
    assert not backend.handover_pending(name)
    assert a.try_acquire("A").acquired  # nothing reserved


def test_a_request_reserves_the_lease_for_the_named_node_until_its_timeout_ends(
    backend: Backend, name: str, make_lease: Callable[..., Any]
) -> None:
    handover = backend.handover
    a, b, c = make_lease(), make_lease(), make_lease()
    first = a.try_acquire("A")
    assert first.acquired and first.holder is not None
    term = first.holder.term
    asked = handover.request_handover(backend.url, name, to="C", valid_for=1.0)
    assert asked is not None and (asked.node_id, asked.term) == ("A", term)
    assert a.renew("A", term)
    request = a.handover_requested()
    assert request is not None and request.term == term and request.to == "C"
    assert 0 < request.valid_for <= 1.0
    assert a.handover_requested() is None  # reported once
    a.release("A", term)

    held_back = b.try_acquire("B")
    assert not held_back.acquired and held_back.holder is None
    assert 0 < held_back.expires_in <= 1.0  # how long the reservation lasts
    assert not a.try_acquire("A").acquired
    taken = c.try_acquire("C")
    assert taken.acquired and taken.holder is not None and taken.holder.term == term + 1
    assert not backend.handover_pending(name)  # the acquisition cleared the request

    # A reservation nobody uses ends with its valid_for.
    asked = handover.request_handover(backend.url, name, to="D", valid_for=0.5)
    assert asked is not None and asked.node_id == "C"
    assert c.renew("C", term + 1) and c.handover_requested() is not None
    c.release("C", term + 1)
    asked_at = time.monotonic()
    assert not b.try_acquire("B").acquired
    wait_until(lambda: b.try_acquire("B").acquired, 5, "the reservation to end")
    assert time.monotonic() - asked_at > 0.2


def test_without_a_named_node_only_the_old_holder_is_kept_out(
    backend: Backend, name: str, make_lease: Callable[..., Any]
) -> None:
    a, b = make_lease(), make_lease()
    first = a.try_acquire("A")
    assert first.holder is not None
    term = first.holder.term
    assert backend.handover.request_handover(backend.url, name, valid_for=5.0) is not None
    assert a.renew("A", term)
    request = a.handover_requested()
    assert request is not None and request.to is None
    a.release("A", term)
    again = a.try_acquire("A")
    assert not again.acquired and again.holder is None and again.expires_in > 0
    taken = b.try_acquire("B")
    assert taken.acquired and taken.holder is not None and taken.holder.term == term + 1
    assert not backend.handover_pending(name)


def test_a_request_binds_until_the_next_acquisition_also_after_the_term_expired(
    backend: Backend, name: str, make_lease: Callable[..., Any]
) -> None:
    a, b = make_lease(), make_lease()
    got = a.try_acquire("A")
    assert got.holder is not None
    term = got.holder.term
    assert backend.handover.request_handover(backend.url, name, to="A", valid_for=10) is not None
    backend.expire(name)  # the holder's lease ran out without a handover
    assert not b.try_acquire("B").acquired  # reserved for A while the request lasts
    took = a.try_acquire("A")
    assert took.acquired and took.holder is not None and took.holder.term == term + 1
    assert not backend.handover_pending(name)


def test_a_withdrawn_or_lapsed_request_is_not_reported(
    backend: Backend, name: str, make_lease: Callable[..., Any]
) -> None:
    handover = backend.handover
    a = make_lease()
    got = a.try_acquire("A")
    assert got.holder is not None
    a.release("A", got.holder.term)
    got = a.try_acquire("A")  # a second term, so that term - 1 is a term too
    assert got.holder is not None
    term = got.holder.term
    asked = handover.request_handover(backend.url, name, valid_for=10)
    assert asked is not None and asked.term == term
    assert not handover.cancel_handover(backend.url, name, term - 1)  # not this term's
    assert handover.cancel_handover(backend.url, name, term)
    assert not handover.cancel_handover(backend.url, name, term)  # withdrawn already
    assert a.renew("A", term) and a.handover_requested() is None
    # A request whose valid_for passed is not reported either.
    assert handover.request_handover(backend.url, name, valid_for=0.2) is not None
    time.sleep(0.4)
    assert a.renew("A", term) and a.handover_requested() is None
    assert not make_lease().try_acquire("B").acquired  # A still holds it


# -- input and failure ----------------------------------------------------------------


def test_bad_arguments_are_refused_before_any_io(backend: Backend) -> None:
    url, _ = backend.unreachable()
    handover = backend.handover
    for valid_for in (0, -1, 0.0009, float("nan"), float("inf"), True, "10"):
        with pytest.raises(ConfigError, match="valid_for"):
            handover.request_handover(url, "lease", valid_for=valid_for)
    for to in ("", "  ", "x\x00", "x" * 1001, 3):
        with pytest.raises(ConfigError, match="node_id"):
            handover.request_handover(url, "lease", to=to)
    for call in (
        lambda bad: handover.request_handover(url, bad),
        lambda bad: handover.cancel_handover(url, bad, 1),
        lambda bad: handover.current_holder(url, bad),
    ):
        for bad in ("", "   ", None, 5, "x" * 1001):
            with pytest.raises(ConfigError, match="lease name"):
                call(bad)
    for term in (0, -1, True, "1", 1.5, None):
        with pytest.raises(ConfigError, match="term"):
            handover.cancel_handover(url, "lease", term)


def test_an_unreachable_server_raises_and_hides_the_password(backend: Backend) -> None:
    url, port = backend.unreachable(password="s3cret-pw")
    handover = backend.handover
    for call in (
        lambda: handover.request_handover(url, "lease"),
        lambda: handover.cancel_handover(url, "lease", 1),
        lambda: handover.current_holder(url, "lease"),
    ):
        with pytest.raises(BackendUnavailable) as info:
            call()
        message = str(info.value)
        assert "127.0.0.1" in message and str(port) in message
        assert "s3cret-pw" not in message


def test_resign_to_an_ineligible_node_is_refused_and_requests_nothing(
    backend: Backend, name: str
) -> None:
    main = backend.leader(rs.TaskHandler(), name, node_id="main", **FAST)
    canary = backend.leader(rs.TaskHandler(), name, node_id="canary", eligible=False, **FAST)
    main.start()
    canary.start()
    try:
        assert main.wait_until_leader(10)
        wait_until(lambda: len(main.nodes()) == 2, 10, "both nodes' heartbeats")
        out = cli("resign", name, *backend.cli_args, "--to", "canary")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "canary may not lead" in out.stderr and "eligible=False" in out.stderr
        # Without --to: the canary is no other node to hand over to.
        out = cli("resign", name, *backend.cli_args)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "no other live node" in out.stderr
        # The admin API refuses as the command does.
        with backend.admin() as admin:
            with pytest.raises(Refused, match="canary may not lead"):
                admin.request_handover(name, to="canary")
            with pytest.raises(Refused, match=r"no other live node of lease .* may lead"):
                admin.request_handover(name)  # to any other node: none may lead
        assert not backend.handover_pending(name)
        assert main.is_leader and not canary.is_leader
    finally:
        canary.stop(timeout=10)
        main.stop(timeout=10)
