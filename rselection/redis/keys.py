"""Where the Redis backend keeps things: the key prefix every key starts with (not public
API).

Every object of the backend takes ``key_prefix`` (``"rselection:"`` by default), so that
several applications can share one Redis; the leases' own keys are laid out in
:mod:`rselection.redis.lease`, their members' keys here (:func:`membership_keys`).
"""

from __future__ import annotations

from ..errors import ConfigError
from ..validation import MAX_NAME

__all__ = ["DEFAULT_KEY_PREFIX", "check_key_prefix", "liveness_channel", "membership_keys"]

DEFAULT_KEY_PREFIX = "rselection:"
"""The ``key_prefix`` of every Redis object unless told otherwise."""


def check_key_prefix(value: object) -> str:
    """Return ``value`` if it is a usable key prefix, else raise :class:`ConfigError`.

    A key prefix is a string of at most :data:`~rselection.validation.MAX_NAME`
    characters; it may be empty and is used verbatim (never trimmed).

    Args:
        value: the prefix to check.
    """
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise ConfigError(
            f"key_prefix must be a string of at most {MAX_NAME} characters, got {value!r:.60}"
        )
    return value


def membership_keys(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> tuple[str, str]:
    """The keys of lease ``name``'s members: heartbeats and node info.

    ``<prefix>{<name>}:nodes`` is a sorted set of node ids scored by their last heartbeat
    (server time, ms); ``<prefix>{<name>}:nodeinfo`` a hash of node id to a JSON document
    (host, pid, address, first heartbeat). The lease name is their hash tag, as for the
    lease's own keys, so a Redis Cluster keeps them all in one slot (one script reads the
    members and the holder).

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    base = f"{key_prefix}{{{name}}}"
    return f"{base}:nodes", f"{base}:nodeinfo"


def liveness_channel(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The channel on which every process publishes its liveness beats: ``<prefix>alive``.

    One channel per key prefix, apart from the leases' events channels, so that a
    follower that does not listen to beats is never woken by them; a process sends one
    beat for all the leases it holds (see :mod:`rselection.redis.liveness`).

    Args:
        key_prefix: prefix of every key.
    """
    return f"{key_prefix}alive"
