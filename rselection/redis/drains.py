"""Drained nodes on Redis: a set beside the lease's keys, and a ``drain:0`` message.

``drain`` and ``undrain`` add a node id to (or remove it from) the lease's drains set
(:func:`~rselection.redis.keys.drains_key`) and publish ``drain:0`` on the lease's events
channel in one script; every node of the lease reads its own membership of the set again
(:func:`is_drained`) when the message comes, whoever sent it: anyone allowed to
``PUBLISH`` can send one, so it never says more than "look". A node reads it too each
time its leader (re)connects.
"""

from __future__ import annotations

from typing import Any

import redis

from ._conn import describe, unavailable
from .keys import drains_key, lease_keys

__all__ = ["drain", "drained_nodes", "is_drained", "undrain"]

#: Add (ARGV[2] "1") or remove a node id (ARGV[1]) of the drains set (KEYS[1]) and
#: publish ``drain:0`` on the lease's channel (ARGV[3]), also when nothing changed (a
#: node that missed the first message reads its state again). Returns 1 when changed.
_CHANGE = """
local changed
if ARGV[2] == '1' then
  changed = redis.call('SADD', KEYS[1], ARGV[1])
else
  changed = redis.call('SREM', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', ARGV[3], 'drain:0')
return changed
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def is_drained(client: Any, name: str, node_id: str, key_prefix: str) -> bool:
    """Whether node ``node_id`` of lease ``name`` is drained.

    Raises:
        BackendUnavailable: Redis could not be reached or refused.
    """
    try:
        return bool(client.sismember(drains_key(name, key_prefix), node_id))
    except redis.RedisError as exc:
        raise unavailable("read the drained nodes", describe(client), exc) from exc


def drained_nodes(client: Any, name: str, key_prefix: str) -> set[str]:
    """The drained nodes of lease ``name``.

    Raises:
        BackendUnavailable: Redis could not be reached or refused.
    """
    try:
        return {_text(node) for node in client.smembers(drains_key(name, key_prefix))}
    except redis.RedisError as exc:
        raise unavailable("read the drained nodes", describe(client), exc) from exc


def _change(client: Any, name: str, node_id: str, key_prefix: str, add: bool) -> bool:
    channel = lease_keys(name, key_prefix)[2]
    try:
        reply = client.eval(
            _CHANGE, 1, drains_key(name, key_prefix), node_id, "1" if add else "0", channel
        )
    except redis.RedisError as exc:
        what = "drain the node" if add else "undrain the node"
        raise unavailable(what, describe(client), exc) from exc
    return int(reply) == 1


def drain(client: Any, name: str, node_id: str, key_prefix: str) -> bool:
    """Record node ``node_id`` of lease ``name`` drained and wake the lease's nodes;
    ``True`` when it was not drained before.

    Raises:
        BackendUnavailable: Redis could not be reached or refused.
    """
    return _change(client, name, node_id, key_prefix, True)


def undrain(client: Any, name: str, node_id: str, key_prefix: str) -> bool:
    """Remove node ``node_id`` of lease ``name`` from the drained and wake the lease's
    nodes; ``True`` when it was drained.

    Raises:
        BackendUnavailable: Redis could not be reached or refused.
    """
    return _change(client, name, node_id, key_prefix, False)
