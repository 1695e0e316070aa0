"""Drained nodes on Redis: a set beside the lease's keys, and a ``drain:0`` message.

:func:`set_drained` adds a node id to (or removes it from) the lease's drains set
(:func:`~rselection.redis.keys.drains_key`) and publish ``drain:0`` on the lease's events
channel in one script; every node of the lease reads its own membership of the set again
(:func:`is_drained`) when the message comes, whoever sent it: anyone allowed to
``PUBLISH`` can send one, so it never says more than "look". A node reads it too each
time its leader (re)connects.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from ._conn import describe, unavailable
from .keys import drains_key, lease_keys

logger = logging.getLogger(__name__)

__all__ = ["drained_nodes", "is_drained", "set_drained"]

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


_refused: set[str] = set()  # the lease names whose drains this process may not read


def _may_not_read(name: str, exc: redis.RedisError) -> bool:
    """Whether ``exc`` is an ACL refusal (``NOPERM``): the node must lead all the same, as
    one that cannot be drained; said once per lease and process."""
    if not isinstance(exc, redis.exceptions.NoPermissionError):
        return False
    if name not in _refused:
        _refused.add(name)
        logger.warning(
            "lease %r: this node's Redis user may not read the drained nodes (%s): it cannot "
            "be drained until its ACL allows SISMEMBER and SMEMBERS on the lease's keys",
            name,
            exc,
        )
    return True


def is_drained(client: Any, name: str, node_id: str, key_prefix: str) -> bool:
    """Whether node ``node_id`` of lease ``name`` is drained (``False`` when the ACL does
    not let this node read it).

    Raises:
        BackendUnavailable: Redis could not be reached or refused otherwise.
    """
    try:
        return bool(client.sismember(drains_key(name, key_prefix), node_id))
    except redis.RedisError as exc:
        if _may_not_read(name, exc):
            return False
        raise unavailable("read the drained nodes", describe(client), exc) from exc


def drained_nodes(client: Any, name: str, key_prefix: str, *, node: bool = False) -> set[str]:
    """The drained nodes of lease ``name``; for a ``node`` (not an operator), none when
    the ACL does not let it read them.

    Raises:
        BackendUnavailable: Redis could not be reached or refused.
    """
    try:
        return {_text(found) for found in client.smembers(drains_key(name, key_prefix))}
    except redis.RedisError as exc:
        if node and _may_not_read(name, exc):
            return set()
        raise unavailable("read the drained nodes", describe(client), exc) from exc


def set_drained(client: Any, name: str, node_id: str, key_prefix: str, *, drained: bool) -> bool:
    """Record node ``node_id`` of lease ``name`` drained (``drained=True``) or not, and
    wake the lease's nodes; ``True`` when that changed something.

    Raises:
        BackendUnavailable: Redis could not be reached or refused.
    """
    channel = lease_keys(name, key_prefix)[2]
    try:
        reply = client.eval(
            _CHANGE, 1, drains_key(name, key_prefix), node_id, "1" if drained else "0", channel
        )
    except redis.RedisError as exc:
        what = "drain the node" if drained else "undrain the node"
        raise unavailable(what, describe(client), exc) from exc
    return int(reply) == 1
