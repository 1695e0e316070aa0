"""Every public entry point that takes a fencing term answers a bad one the same way.

DESIGN's vocabulary has one rule for a term (an ``int`` from 1 to 2**63 - 1, ``bool``
refused; ``None`` where no term applies) and one check for every class
(:func:`rselection.validation.check_term`). Each entry point below is named, so that
one that checks its own way (or not at all) fails here. All refuse before any I/O: the
servers named are never reached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

import rselection as rs
from rselection import postgres as pg
from rselection import redis as rr
from rselection.errors import ConfigError
from rselection.postgres.handover import request_handovers
from rselection.task_checkpoint import TaskCheckpoint

_NOWHERE_PG = "postgresql://nobody@127.0.0.1:9/none?connect_timeout=1"
_NOWHERE_REDIS = "redis://127.0.0.1:9/0"

_BAD = [0, -1, 2**63, True, False, 1.0, "1"]


def _claims(owner: str, claimer: Any) -> Iterator[tuple[str, Callable[[Any], object]]]:
    """The claim methods of a claimer (every claimer has the same four)."""
    yield f"{owner}.claim", lambda t: claimer.claim("f", term=t)
    yield f"{owner}.claim_many", lambda t: claimer.claim_many(["f"], term=t)
    yield f"{owner}.claim_missed", lambda t: claimer.claim_missed(["f"], term=t)
    yield f"{owner}.claim_missed_many", lambda t: claimer.claim_missed_many([["f"]], term=t)


def _entry_points() -> Iterator[tuple[str, Callable[[Any], object]]]:
    """(name, call with a term) of every public entry point that takes one."""
    memory_store, memory_claimer = rs.MemoryCheckpointStore(), rs.MemoryClaimer()
    yield "MemoryCheckpointStore.save", lambda t: memory_store.save("k", 1, term=t)
    yield "MemoryCheckpointStore.delete", lambda t: memory_store.delete("k", term=t)
    yield from _claims("MemoryClaimer", memory_claimer)
    yield "TaskCheckpoint", lambda t: TaskCheckpoint(memory_store, "task", t, "lease")

    pg_store, pg_claimer = pg.PostgresCheckpointStore(_NOWHERE_PG), pg.PostgresClaimer(_NOWHERE_PG)
    yield "postgres.PostgresCheckpointStore.save", lambda t: pg_store.save("k", 1, term=t)
    yield "postgres.PostgresCheckpointStore.delete", lambda t: pg_store.delete("k", term=t)
    yield from _claims("postgres.PostgresClaimer", pg_claimer)
    yield "postgres.fenced", lambda t: pg.fenced(None, "lease", t)  # type: ignore[arg-type]
    yield (
        "postgres.afenced",
        lambda t: asyncio.run(pg.afenced(None, "lease", t)),  # type: ignore[arg-type]
    )
    yield "postgres.cancel_handover", lambda t: pg.cancel_handover(_NOWHERE_PG, "lease", t)
    yield (
        "postgres.request_handovers(fence=)",
        lambda t: request_handovers(_NOWHERE_PG, {"lease": "node"}, fence=("lease", t)),
    )

    client = redis.Redis.from_url(_NOWHERE_REDIS)
    redis_claimer, fence = rr.RedisClaimer(client), rr.RedisFence(client, name="lease")
    yield from _claims("redis.RedisClaimer", redis_claimer)
    yield "redis.RedisFence.call", lambda t: fence.call(t, "GET", "k")
    yield "redis.RedisFence.check", lambda t: fence.check(t)
    yield "redis.fenced_call", lambda t: rr.fenced_call(client, "lease", t, "GET", "k")
    yield (
        "redis.afenced_call",
        lambda t: asyncio.run(
            rr.afenced_call(redis.asyncio.Redis.from_url(_NOWHERE_REDIS), "lease", t)
        ),
    )
    yield "redis.cancel_handover", lambda t: rr.cancel_handover(client, "lease", t)


def _message(call: Callable[[Any], object], term: object) -> str:
    with pytest.raises(ConfigError) as caught:
        call(term)
    return str(caught.value)


@pytest.mark.parametrize("term", _BAD)
def test_every_entry_point_refuses_a_bad_term_with_the_same_error(term: object) -> None:
    answers = {name: _message(call, term) for name, call in _entry_points()}
    expected = f"term must be an int from 1 to 2**63 - 1 (ctx.term), got {term!r:.40}"
    assert answers == dict.fromkeys(answers, expected)


def test_where_no_term_applies_none_is_taken() -> None:
    memory_store, memory_claimer = rs.MemoryCheckpointStore(), rs.MemoryClaimer()
    assert memory_store.save("k", 1, term=None).version == 1
    assert memory_claimer.claim("f", term=None)
