"""Every key and channel name of the Redis backend, built here and nowhere else.

Every object of the backend takes ``key_prefix`` (:data:`DEFAULT_KEY_PREFIX` by default)
so that several applications can share one Redis. The keys of a lease are
``<prefix>{<name>}:<what>``: the lease name is their hash tag, so a Redis Cluster keeps
them in one slot and one script may touch them all. Claims are ``<prefix>claim:<fire
key>``, one key each.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..validation import MAX_NAME

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "check_key_prefix",
    "claim_key",
    "claims_prefix",
    "drains_key",
    "elector_keys",
    "handover_key",
    "history_key",
    "lease_keys",
    "lease_name_of",
    "lease_name_patterns",
    "liveness_channel",
    "membership_keys",
    "node_channel",
    "retired_key",
    "shards_record_key",
    "task_keys",
    "task_runs_key",
    "term_origin_key",
]

DEFAULT_KEY_PREFIX = "rselection:"
"""The ``key_prefix`` of every Redis object unless told otherwise."""

# Keys that every lease that ever had a term, or has members, has: what finds them.
_TERM = ":term"
_NODES = ":nodes"


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


def _base(name: str, key_prefix: str) -> str:
    return f"{key_prefix}{{{name}}}"


def lease_keys(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> tuple[str, str, str]:
    """The lease key, term key and pub/sub channel of lease ``name``.

    All three carry ``{name}`` as hash tag, so a Redis Cluster keeps the keys in one
    slot (and the fenced-write script may touch both).

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    base = _base(name, key_prefix)
    return f"{base}:lease", f"{base}{_TERM}", f"{base}:events"


def handover_key(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The key holding a pending handover request of lease ``name`` (same hash slot).

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    return f"{_base(name, key_prefix)}:resign"


def drains_key(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The set of the node ids of lease ``name`` an operator drained (``rselection
    drain``); same hash slot as the lease's other keys, and no expiry: a drain lasts
    until undrained.

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    return f"{_base(name, key_prefix)}:drained"


def retired_key(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The key marking lease ``name`` retired: it holds the term it was retired at.

    Same hash slot as the lease's other keys, so one script checks the lease and marks it.

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    return f"{_base(name, key_prefix)}:retired"


def history_key(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The stream holding lease ``name``'s leadership history (same hash slot, so the
    scripts that acquire, release and retire the lease write it; see
    :mod:`rselection.redis.history`).

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    return f"{_base(name, key_prefix)}:history"


def task_keys(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> tuple[str, str, str, str]:
    """The hashes of lease ``name``'s task controls and list of tasks (same hash slot):
    the tasks its leader published (``:tasks``, task to JSON), the paused ones
    (``:paused``, task to when), the fires operators asked for (``:triggers``, fire key
    to JSON) and each task's next fire (``:next_fires``, task to ms). No expiry: a pause
    lasts until resumed. See :mod:`rselection.redis.task_runs`.

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    base = _base(name, key_prefix)
    return f"{base}:tasks", f"{base}:paused", f"{base}:triggers", f"{base}:next_fires"


def task_runs_key(name: str, task: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The list of task ``task``'s newest runs of lease ``name``, newest first (same hash
    slot as the lease's keys: the lease's name is the first ``{...}`` of the key).

    Args:
        name: the lease name.
        task: the task's name.
        key_prefix: prefix of every key.
    """
    return f"{_base(name, key_prefix)}:runs:{task}"


def term_origin_key(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The key holding the replication id of the server that last wrote the term counter.

    The acquire script compares it with the server's ``master_replid``: a mismatch means
    the counter may lack terms issued on another server (a promoted replica), so the next
    term jumps (see :mod:`rselection.redis.lease`). Same hash slot as the lease's keys.

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    return f"{_base(name, key_prefix)}:origin"


def node_channel(name: str, node_id: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The channel a node of lease ``name`` stays subscribed to while its keeper runs.

    Nothing is published on it: ``PUBSUB NUMSUB`` on it tells whether node ``node_id``
    is connected (``rselection resign --to`` checks it).

    Args:
        name: the lease name.
        node_id: the node's id.
        key_prefix: prefix of every key.
    """
    return f"{_base(name, key_prefix)}:node:{node_id}"


def membership_keys(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> tuple[str, str]:
    """The keys of lease ``name``'s members: heartbeats and node info.

    ``<prefix>{<name>}:nodes`` is a sorted set of node ids scored by their last heartbeat
    (server time, ms); ``<prefix>{<name>}:nodeinfo`` a hash of node id to a JSON document
    (host, pid, address, first heartbeat). Same hash slot as the lease's own keys, so
    one script reads the members and the holder.

    Args:
        name: the lease name.
        key_prefix: prefix of every key.
    """
    base = _base(name, key_prefix)
    return f"{base}{_NODES}", f"{base}:nodeinfo"


def shards_record_key(name: str, record: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The key of the record ``record`` of sharded name ``name`` (its number of shards).

    It shares the coordinator lease's hash slot, so that its write is fenced by the
    coordinator's term in one script.

    Args:
        name: the sharded name (its coordinator lease's name).
        record: the record's name (:data:`rselection.sharded.SHARDS_RECORD`).
        key_prefix: prefix of every key.
    """
    return f"{_base(name, key_prefix)}:{record}"


def elector_keys(name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> tuple[str, str]:
    """The election key and the term key of election ``name`` (same hash slot).

    Args:
        name: the election's name.
        key_prefix: prefix of every key.
    """
    base = f"{_base(name, key_prefix)}:elector"
    return base, f"{base}:term"


def claims_prefix(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The ``key_prefix`` of the fire claims of the leaders of ``key_prefix``.

    Args:
        key_prefix: the leaders' key prefix.
    """
    return f"{key_prefix}claim:"


def claim_key(fire_key: str, key_prefix: str) -> str:
    """The key of a fire's claim: ``key_prefix + fire_key``.

    Args:
        fire_key: the fire key (``"<lease>/<task>@<instant>"``, see
            :func:`rselection.format_fire_key`).
        key_prefix: the claimer's key prefix (the leaders': :func:`claims_prefix`).
    """
    return key_prefix + fire_key


def liveness_channel(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The channel on which every process publishes its liveness beats: ``<prefix>alive``.

    One channel per key prefix, apart from the leases' events channels, so that a
    follower that does not listen to beats is never woken by them; a process sends one
    beat for all the leases it holds (see :mod:`rselection.redis.liveness`).

    Args:
        key_prefix: prefix of every key.
    """
    return f"{key_prefix}alive"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def lease_name_patterns(key_prefix: str = DEFAULT_KEY_PREFIX) -> tuple[str, ...]:
    """``SCAN`` patterns matching the keys every lease that ever had a term, or has
    members, has: its term key and its heartbeats key (see :func:`lease_name_of`).

    Args:
        key_prefix: the leaders' key prefix.
    """
    head = _glob_escape(key_prefix + "{")
    return tuple(f"{head}*}}{suffix}" for suffix in (_TERM, _NODES))


def lease_name_of(key: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str | None:
    """The lease name in a key :func:`lease_name_patterns` matched, else ``None``.

    Args:
        key: the key found.
        key_prefix: the leaders' key prefix.
    """
    head = key_prefix + "{"
    for suffix in (_TERM, _NODES):
        tail = "}" + suffix
        if key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail):
            return key[len(head) : -len(tail)]
    return None
