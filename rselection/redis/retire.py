"""Retire a Redis lease no service uses any more (what ``rselection forget`` does).

The lease's term key stays; its retired key (:func:`~rselection.redis.keys.retired_key`)
is set to the term. The term never restarts, and the next acquisition (a new term)
brings the lease back with nothing to undo.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from ..admin import Refused, Retirement
from ._conn import describe, unavailable
from ._scripts import RETIRE
from .handover import live_nodes
from .keys import drains_key, history_key, lease_keys, retired_key

__all__ = ["retire_lease"]


def _held(name: str, raw: Any, pttl_ms: int) -> Refused:
    """The refusal for a lease held by the lease value ``raw``."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        value = json.loads(text)
        holder, term = str(value["node"]), str(value["term"])
    except (ValueError, TypeError, KeyError):
        holder, term = "a node", "?"
    return Refused.held(name, holder, term, pttl_ms / 1000)


def retire_lease(client: Any, name: str, *, key_prefix: str, check_nodes: bool) -> Retirement:
    """Retire lease ``name`` unless its lease key is held (present and not expired).

    One script checks and marks. Before it, with ``check_nodes``, refuses while a keeper
    of the lease is connected.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster``.
        name: the lease name.
        key_prefix: the leaders' ``key_prefix``.
        check_nodes: also refuse while a keeper of the lease is connected.

    Raises:
        Refused: no such lease (it never had a term), a live holder, or live nodes.
        BackendUnavailable: Redis cannot be reached or failed.
    """
    lease_key, term_key, _ = lease_keys(name, key_prefix)
    marker = retired_key(name, key_prefix)
    try:
        if check_nodes:
            pipe = client.pipeline(transaction=False)
            pipe.get(lease_key)
            pipe.pttl(lease_key)
            raw, pttl = pipe.execute()
            if raw is not None:
                raise _held(name, raw, int(pttl))
            nodes = live_nodes(client, name, key_prefix=key_prefix)
            if nodes:
                raise Refused.busy(name, nodes, "their keepers are connected")
        history, drains = history_key(name, key_prefix), drains_key(name, key_prefix)
        reply = client.eval(RETIRE, 5, lease_key, term_key, marker, history, drains)
    except redis.RedisError as exc:
        raise unavailable("retire the lease", describe(client), exc) from exc
    outcome = int(reply[0])
    if outcome == -1:
        raise Refused(f"no lease {name!r} under key prefix {key_prefix!r}: nothing to forget")
    if outcome == 0:
        raise _held(name, reply[1], int(reply[2]))
    return Retirement(name, int(reply[1]), outcome == 2, marker)
