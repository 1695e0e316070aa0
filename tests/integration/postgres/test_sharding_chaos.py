"""Sharded leadership under chaos: kills, pauses beyond the ttl and graceful stops.

Four ``shard_node`` processes share 16 shards; each round does one thing to one node
(``kill -9`` and a replacement, SIGSTOP past the ttl then SIGCONT, or a graceful stop
and a replacement), then waits until the fleet is balanced again. At the end, per shard,
no task of a term ran while one of another term did (the activity ledger, frozen
windows cut out) and no fenced write of a term committed after a newer term's.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest

from tests.support.shard_fleet import (
    ARGS,
    TTL,
    ShardFleet,
    assert_fenced_ledger_per_shard,
    assert_no_overlap_per_shard,
    balanced,
)
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SHARDS = 16
# Every kind of fault more than once, the coordinator's node among the killed.
ACTIONS = ["kill-coordinator", "pause", "stop", "kill", "pause", "stop", "kill", "pause"]
BALANCE_BOUND = 30.0  # balanced again after a round (measured 1-5 s, a pause's ttl included)


def test_kills_pauses_and_stops_never_let_two_terms_of_a_shard_run_at_once(
    pg_dsn: str,
) -> None:
    rng = random.Random(15)
    name = f"chaos-{uuid.uuid4().hex[:6]}"
    with ShardFleet(pg_dsn, name, SHARDS, ARGS) as fleet:
        live = [f"c{i}" for i in range(4)]
        for node in live:
            fleet.add(node)
        for process in fleet.nodes.values():
            process.ready()
        wait_until(lambda: balanced(fleet, live), BALANCE_BOUND, "the first balance", 0.1)
        spare = 0
        for action in ACTIONS:
            victim = rng.choice(live)
            if action == "kill-coordinator":
                action, victim = "kill", fleet.coordinator() or victim
            if action == "pause":
                process = fleet.nodes[victim]
                process.pause()
                time.sleep(TTL + 1.0)  # its leases expire and pass on meanwhile
                process.resume()
            else:
                if action == "kill":
                    fleet.nodes[victim].kill()
                else:
                    fleet.nodes[victim].stop()
                live.remove(victim)
                spare += 1
                replacement = f"r{spare}"
                fleet.add(replacement).ready()
                live.append(replacement)
            wait_until(
                lambda: balanced(fleet, live),
                BALANCE_BOUND,
                f"balance after {action} of {victim}",
                0.1,
            )
            time.sleep(0.5)
    runs = assert_no_overlap_per_shard(fleet, resume_grace=1.0)
    assert runs > SHARDS
    assert_fenced_ledger_per_shard(pg_dsn, SHARDS)
