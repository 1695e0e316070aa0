"""Fenced writes in Redis: run a command only while a term still holds the lease.

``ctx.term`` is the fencing token. :class:`RedisFence` runs one Redis command inside a
Lua script that first checks the lease key::

    fence = RedisFence(client, name="billing")
    fence.call(ctx.term, "HSET", "{billing}:state", "cursor", cursor)

Only writes to the same Redis are fenced, and in a Redis Cluster their keys must be in
the lease's hash slot. See ``docs/how-to/fencing.md``.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio

from ..errors import BackendUnavailable, ConfigError, StaleLeaderError
from ..validation import check_name, check_term
from ._conn import ClientUser, describe, unavailable
from .keys import DEFAULT_KEY_PREFIX, check_key_prefix, lease_keys

__all__ = ["RedisFence", "afenced_call", "fenced_call"]

FENCED = """
local cur = redis.call('GET', KEYS[1])
local ok, h = false, nil
if cur then ok, h = pcall(cjson.decode, cur) end
if not ok or type(h) ~= 'table' or h.term ~= ARGV[1] then
  return {0, cur or ''}
end
if #ARGV < 2 then return {1, ''} end
return {1, redis.call(unpack(ARGV, 2))}
"""


class RedisFence(ClientUser):
    """Runs Redis commands only while a term still holds a :class:`RedisLease`.

    Thread-safe (uses the client's pool). ``ctx.fence(client)`` in a
    :class:`~rselection.redis.RedisLeader`'s task checks the term with the same script,
    without a write.

    Args:
        client: a ``redis.Redis``, a ``RedisCluster`` or a ``redis://`` URL (a client
            made from a URL is closed by :meth:`close`); it must reach the Redis that
            holds the lease. Give it a ``socket_timeout`` shorter than the leader's
            ``stop_grace``: a task blocked in a fenced call on a Redis that does not
            answer cannot see its cancellation, and is reported stuck.
        name: the lease name.
        key_prefix: the lease's key prefix.

    Raises:
        ConfigError: bad arguments.
    """

    def __init__(self, client: Any, *, name: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.name = check_name(name, "lease name")
        self.key_prefix = check_key_prefix(key_prefix)
        self.key = lease_keys(self.name, self.key_prefix)[0]
        self._use_client(client, "RedisFence")
        self._script = self._client.register_script(FENCED)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, {describe(self._client)})"

    def call(self, term: int, *command: Any) -> Any:
        """Run ``command`` (e.g. ``"SET", key, value``) only if ``term`` holds the lease.

        With no command, only checks the term. Returns the command's reply, raw (bytes
        for strings).

        Raises:
            StaleLeaderError: ``term`` no longer holds the lease; nothing was written.
            BackendUnavailable: Redis could not be reached or refused the script.
            redis.ResponseError: the command itself failed (it ran in the script; Redis
                does not roll earlier commands back, but a single command fails whole).
        """
        check_term(term)
        try:
            ok, reply = self._script(keys=[self.key], args=[str(term), *command])
        except redis.RedisError as exc:
            if (lost := _unavailable(exc, self._client)) is None:
                raise
            raise lost from exc
        return _outcome(ok, reply, term, self.name)

    def check(self, term: int) -> None:
        """Raise :class:`StaleLeaderError` unless ``term`` holds the lease right now.

        A point-in-time check: a write made after it is not fenced. Use :meth:`call`
        for writes.
        """
        self.call(term)


def _unavailable(exc: redis.RedisError, client: Any) -> BackendUnavailable | None:
    """What a failed fenced script means: Redis unavailable, or (``None``) the command's
    own error, to propagate as it is."""
    if isinstance(exc, redis.ResponseError):
        text = str(exc)
        if not ("NOSCRIPT" in text or "NOPERM" in text or "READONLY" in text):
            return None
    return unavailable("run a fenced write", describe(client), exc)


def _outcome(ok: Any, reply: Any, term: int, name: str) -> Any:
    if int(ok) != 1:
        raise StaleLeaderError(
            f"term {term} no longer holds lease {name!r}: the write was not made; "
            "stop and let the new leader do it"
        )
    return reply


def fenced_call(
    client: Any, name: str, term: int, *command: Any, key_prefix: str = DEFAULT_KEY_PREFIX
) -> Any:
    """Run one Redis command only if ``term`` still holds lease ``name``.

    Shorthand for ``RedisFence(client, name=name, key_prefix=...).call(term, *command)``; a
    client made from a URL is closed after the call.

    Raises:
        StaleLeaderError: the term no longer holds the lease; nothing was written.
        BackendUnavailable: Redis could not be reached.
    """
    with RedisFence(client, name=name, key_prefix=key_prefix) as fence:
        return fence.call(term, *command)


async def afenced_call(
    client: Any, name: str, term: int, *command: Any, key_prefix: str = DEFAULT_KEY_PREFIX
) -> Any:
    """Async :func:`fenced_call` for a ``redis.asyncio`` client (``Redis`` or
    ``RedisCluster``): runs ``command`` only if ``term`` still holds lease ``name``.

    With no command, only checks the term at this moment.

    Raises:
        StaleLeaderError: the term no longer holds the lease; nothing was written.
        BackendUnavailable: Redis could not be reached or refused the script.
        ConfigError: bad arguments, or a blocking client (use :func:`fenced_call`).
    """
    if not isinstance(client, redis.asyncio.Redis | redis.asyncio.RedisCluster):
        raise ConfigError(
            "afenced_call() takes a redis.asyncio client (Redis or RedisCluster), got "
            f"{type(client).__name__}: with a blocking client use fenced_call()"
        )
    check_name(name, "lease name")
    key = lease_keys(name, check_key_prefix(key_prefix))[0]
    check_term(term)
    script = client.register_script(FENCED)
    try:
        ok, reply = await script(keys=[key], args=[str(term), *command])
    except redis.RedisError as exc:
        if (lost := _unavailable(exc, client)) is None:
            raise
        raise lost from exc
    return _outcome(ok, reply, term, name)
