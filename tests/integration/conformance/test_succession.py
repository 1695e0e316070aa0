"""The newest version leads, on every backend: a holder hands over once to a newer node
that has heartbeated for ``settle`` seconds, and never for an older, an unversioned or
an ineligible one. Leaders in one process; the leadership changes are counted from the
nodes' ``elected`` signals and the terms' task activity.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from tests.support.backends import Backend
from tests.support.waiting import wait_until

FAST = {"ttl": 3, "renew_interval": 0.5, "renew_deadline": 2, "retry_interval": 0.5}
SETTLE = 1.0
# Handed over within a look (0.5 s) and a handover of the settled node; measured about
# 1.2 s after it settled on both backends. The bound is several times that.
HANDOVER_BOUND = SETTLE + 6.0


class Ledger:
    """Which node's task ran in each term, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[tuple[str, int]] = []

    def handler(self) -> rs.TaskHandler:
        tasks = rs.TaskHandler()

        @tasks.persistent(name="work")
        def work(ctx: rs.TaskContext) -> None:
            with self.lock:
                self.runs.append((ctx.node_id, ctx.term))
            ctx.cancelled.wait()

        return tasks

    def nodes(self) -> list[str]:
        with self.lock:
            return [node for node, _ in self.runs]


@pytest.fixture
def make(backend: Backend) -> Iterator[Callable[..., Any]]:
    name = f"v-{uuid.uuid4().hex[:8]}"
    made: list[Any] = []

    def build(node_id: str, ledger: Ledger, **kw: Any) -> Any:
        leader = backend.leader(
            ledger.handler(),
            name,
            node_id=node_id,
            heartbeat_interval=0.2,
            settle=SETTLE,
            **FAST,
            **backend.member_options,
            **kw,
        )
        made.append(leader)
        return leader

    yield build
    for leader in made:
        leader.stop(timeout=10)


def test_a_settled_newer_node_is_handed_the_lease_once(make: Callable[..., Any]) -> None:
    ledger = Ledger()
    old = make("old", ledger, version="1.4.2")
    old.start()
    assert old.wait_until_leader(10)
    new = make("new", ledger, version="1.5.0")
    started = time.monotonic()
    new.start()
    wait_until(lambda: new.is_leader, HANDOVER_BOUND, "the newer node to lead")
    took = time.monotonic() - started
    print(f"handed to the newer node {took:.2f} s after it started (settle {SETTLE} s)")
    assert took >= SETTLE  # not before it settled
    # Once: the old node does not take it back, nor the new one give it up.
    time.sleep(2.0)
    assert ledger.nodes() == ["old", "new"]
    assert new.is_leader and not old.is_leader


def test_no_move_to_an_older_unversioned_or_ineligible_node(make: Callable[..., Any]) -> None:
    ledger = Ledger()
    holder = make("holder", ledger, version="2.0")
    holder.start()
    assert holder.wait_until_leader(10)
    others = [
        make("older", ledger, version="1.9"),
        make("plain", ledger),
        make("canary", ledger, version="3.0", eligible=False),
    ]
    for other in others:
        other.start()
    wait_until(lambda: len(holder.nodes()) == 4, 10, "four heartbeats")
    # Settled and looked at several times over: nobody is handed the lease.
    time.sleep(SETTLE + 2.0)
    assert ledger.nodes() == ["holder"] and holder.is_leader


def test_a_holder_without_a_version_stays(make: Callable[..., Any]) -> None:
    ledger = Ledger()
    holder = make("holder", ledger)
    holder.start()
    assert holder.wait_until_leader(10)
    make("newer", ledger, version="9.0").start()
    time.sleep(SETTLE + 2.0)
    assert ledger.nodes() == ["holder"] and holder.is_leader
