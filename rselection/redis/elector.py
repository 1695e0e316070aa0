"""``RedisElector``: "am I the leader?", renewed on each call, without a thread.

The Redis twin of :class:`~rselection.postgres.PostgresElector`::

    elector = RedisElector(redis.Redis(), name="reports", ttl=30)

    def job() -> None:
        if elector.is_leader():
            send_reports()

Each call is one script on the election's keys (Redis expiry, a term that never
decreases); leadership lasts ``ttl`` from the last successful call, and backend errors
fail closed. See ``docs/how-to/claims.md`` ("Redis").
"""

from __future__ import annotations

from typing import Any

import redis

from ..electing import Elector
from ..validation import check_name
from ._conn import describe, unavailable
from .keys import DEFAULT_KEY_PREFIX
from .keys import elector_keys as elector_keys  # re-exported
from .node_keys import NodeKeys

__all__ = ["RedisElector"]

#: Acquire or renew election KEYS[1] (term hash KEYS[2]) for node ARGV[1], ttl ARGV[2]
#: (ms). Returns the term as a string while leading, else -1. A new holder's term is the
#: hash's ``HINCRBY``, except when there is no term or the hash's ``origin`` is not this
#: server's replication id (a promoted replica, a restart, a moved slot): then it is at
#: least the server's ``TIME`` in microseconds, as for the lease's terms
#: (:mod:`rselection.redis.lease`); the same holder gets a new term then too. Terms are
#: computed as strings, exact to 2^63 - 1. Refused with a ``READONLY`` error on a replica.
ELECT = """
local repl = redis.call('INFO', 'replication')
if string.find(repl, 'role:slave', 1, true) then
  -- A writable replica (replica-read-only no) would count terms its primary never sees.
  return redis.error_reply('READONLY this server is a replica: elections run on its primary')
end
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return redis.call('HGET', KEYS[2], 'term') or '0'
end
if cur then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
local id = string.match(repl, 'master_replid:(%x+)') or ''
local h = redis.call('HMGET', KEYS[2], 'term', 'holder', 'origin')
-- No term (a new election, or one evicted, deleted, lost in a restart) or one written
-- under another replication id may lack terms issued before: start from the clock.
local foreign = not h[1] or (id ~= '' and h[3] ~= id)
if not foreign and h[2] == ARGV[1] then return h[1] end
redis.call('HSET', KEYS[2], 'holder', ARGV[1])
if id ~= '' and h[3] ~= id then redis.call('HSET', KEYS[2], 'origin', id) end
redis.call('HINCRBY', KEYS[2], 'term', 1)
local term = redis.call('HGET', KEYS[2], 'term')
if foreign then
  local t = redis.call('TIME')
  local floor = t[1] .. string.format('%06d', tonumber(t[2]))
  local below = string.sub(term, 1, 1) == '-' or #term < #floor
    or (#term == #floor and term < floor)
  if below then
    term = floor
    redis.call('HSET', KEYS[2], 'term', floor)
  end
end
return term
"""

RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('HDEL', KEYS[2], 'holder')
  return 1
end
return 0
"""


class RedisElector(NodeKeys, Elector):
    """Leader election that acquires or renews on each :meth:`is_leader` call.

    See the module docstring. Thread-safe; one instance is one candidate (its
    :attr:`node_id`). The ``with`` block resigns if leading, then closes; :meth:`close`
    alone does not resign (an elector that leads keeps the key until its ttl).

    Args:
        client: a ``redis.Redis``, a ``redis.cluster.RedisCluster`` or a ``redis://``
            URL (a client made from a URL is closed by :meth:`close`).
        name: the election's name; electors with the same name and key prefix compete.
        key_prefix: prefix of the election's keys.
        ttl: seconds a call keeps the leadership (at least 1 ms; default 30).
        node_id: this candidate's node id; unique per instance by default (and taken
            anew in a process forked from this one, which is another candidate).

    Raises:
        ConfigError: a bad client, name, key prefix or node id, or a ttl below 1 ms.
    """

    def __init__(
        self,
        client: Any,
        *,
        name: str = "default",
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl: float = 30.0,
        node_id: str | None = None,
    ) -> None:
        self.name = check_name(name, "name")
        self._keep_keys(client, "RedisElector", key_prefix, ttl, node_id)
        self.key, self.term_key = elector_keys(self.name, self.key_prefix)
        self._elect = self._client.register_script(ELECT)
        self._resign = self._client.register_script(RESIGN)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, key={self.key!r}, {self._describe()})"

    def is_leader(self) -> bool:
        """Acquire or renew the leadership; ``True`` while this elector holds it.

        Sets :attr:`term` (``None`` unless leading).

        Raises:
            BackendUnavailable: Redis cannot be reached or failed; treat it as "not
                leader" (the key may still be held and expires after ttl).
        """
        self.term = None
        try:
            term = int(
                self._elect(keys=[self.key, self.term_key], args=[self.node_id, self._ttl_ms])
            )
        except redis.RedisError as exc:
            raise unavailable(f"run election {self.name!r}", describe(self._client), exc) from exc
        if term < 0:
            return False
        self.term = term
        return True

    def resign(self) -> bool:
        """Give the leadership up at once; ``True`` if this elector held it.

        The term counter is kept; the next holder gets the next term.

        Raises:
            BackendUnavailable: Redis cannot be reached (the key then expires after ttl).
        """
        self.term = None
        try:
            done = int(self._resign(keys=[self.key, self.term_key], args=[self.node_id]))
        except redis.RedisError as exc:
            raise unavailable(
                f"resign from election {self.name!r}", describe(self._client), exc
            ) from exc
        return done == 1
