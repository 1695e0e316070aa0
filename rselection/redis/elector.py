"""``RedisElector``: "am I the leader?", renewed on each call, without a thread.

The Redis twin of :class:`~rselection.postgres.PostgresElector`::

    elector = RedisElector(redis.Redis(), key="reports:leader", ttl=30)

    def job() -> None:
        if elector.is_leader():
            send_reports()

How it works
------------

:meth:`RedisElector.is_leader` is one Lua script on the election key: when the key holds
this elector's identity it extends it (``PEXPIRE``); when the key does not exist it
``SET``\\ s it ``NX PX ttl`` and, for a new holder, increments the term (a hash in the same
slot: ``<key>:term``, or ``{<key>}:term`` for a key without a hash tag); otherwise it
changes nothing and returns ``False``. Expiry is Redis's own. The term (kept in a hash
with the last holder) never decreases and grows on every change of holder: a holder
whose key expired while nobody else took it keeps its term; a re-acquisition after
:meth:`~RedisElector.resign` gets a new one. :meth:`~RedisElector.resign` deletes the key only
if this elector holds it.

There is no background thread: leadership lasts ``ttl`` seconds from the last
successful call. Call :meth:`~RedisElector.is_leader` more often than ``ttl`` and
finish the work a ``True`` allows within ``ttl`` of the call; work that may run longer
needs :class:`~rselection.redis.RedisLeader`, which cancels it when leadership ends.
Backend errors raise :class:`~rselection.errors.BackendUnavailable` (fail closed).
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

import redis

from ..errors import ConfigError
from ..validation import check_seconds
from ._conn import MIN_TTL, check_client, describe, hash_slot_key, unavailable

__all__ = ["RedisElector", "random_identity"]

logger = logging.getLogger(__name__)

_MAX_KEY_BYTES = 2000

ELECT = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('HGET', KEYS[2], 'term') or '0')
end
if cur then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
if redis.call('HGET', KEYS[2], 'holder') == ARGV[1] then
  return tonumber(redis.call('HGET', KEYS[2], 'term') or '0')
end
redis.call('HSET', KEYS[2], 'holder', ARGV[1])
return redis.call('HINCRBY', KEYS[2], 'term', 1)
"""

RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('HDEL', KEYS[2], 'holder')
  return 1
end
return 0
"""


def random_identity() -> str:
    """A random identity for this process: ``"<host>:<pid>:<8 hex digits>"``."""
    import os
    import secrets
    import socket

    host = socket.gethostname() or "host"
    return f"{host[:200]}:{os.getpid()}:{secrets.token_hex(4)}"


def check_key(value: object, label: str) -> str:
    """Return ``value`` trimmed of surrounding whitespace; refuse empty or odd keys.

    Args:
        value: a string; empty after trimming is refused.
        label: the parameter's name, for the message.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{label} must be a string, got {value!r:.80}")
    trimmed = value.strip()
    if not trimmed:
        raise ConfigError(f"{label} must not be empty, got {value!r:.80}")
    if len(trimmed.encode(errors="replace")) > _MAX_KEY_BYTES:
        raise ConfigError(f"{label} is longer than {_MAX_KEY_BYTES} bytes: {trimmed[:40]!r}...")
    return trimmed


class RedisElector:
    """Leader election that acquires or renews on each :meth:`is_leader` call.

    See the module docstring. Thread-safe; one instance is one candidate (its
    :attr:`identity`).

    Args:
        client: a ``redis.Redis``, a ``redis.cluster.RedisCluster`` or a ``redis://``
            URL (a client made from a URL is closed by :meth:`close`).
        key: the election key, trimmed of surrounding whitespace; not empty.
        ttl: seconds a call keeps the leadership (at least 1 ms; default 30).
        identity: this candidate's identity; random per instance by default.

    Raises:
        ConfigError: a bad client, an empty key or identity, a ttl below 1 ms.
    """

    def __init__(
        self,
        client: Any,
        *,
        key: str = "rselection:leader",
        ttl: float = 30.0,
        identity: str | None = None,
    ) -> None:
        self.key = check_key(key, "key")
        self.term_key = hash_slot_key(self.key, ":term")
        self.ttl = check_seconds(ttl, "ttl", minimum=MIN_TTL)
        self.identity: str = (
            random_identity() if identity is None else check_key(identity, "identity")
        )
        """This candidate's identity, stored as the key's value."""
        self.term: int | None = None
        """The term this elector leads with after a ``True`` from :meth:`is_leader`, else None."""
        self._client, self._owned = check_client(client, "RedisElector")
        self._ttl_ms = max(1, round(self.ttl * 1000))
        self._elect = self._client.register_script(ELECT)
        self._resign = self._client.register_script(RESIGN)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key={self.key!r}, ttl={self.ttl}, "
            f"identity={self.identity!r}, {describe(self._client)})"
        )

    def __enter__(self) -> RedisElector:
        """Return the elector; the ``with`` block resigns and closes on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Resign if leading (errors are logged, not raised), then close."""
        try:
            if self.term is not None:
                self.resign()
        except Exception as err:  # the key then simply expires after ttl
            logger.warning("elector %r: resign on exit failed: %s", self.key, err)
        finally:
            self.close()

    def close(self) -> None:
        """Close the client if it was made from a URL; a client passed in is left open."""
        if self._owned:
            try:
                self._client.close()
            except Exception as exc:  # best effort
                logger.debug("elector %r: error closing the client: %s", self.key, exc)

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
                self._elect(keys=[self.key, self.term_key], args=[self.identity, self._ttl_ms])
            )
        except redis.RedisError as exc:
            raise unavailable(f"run election {self.key!r}", describe(self._client), exc) from exc
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
            done = int(self._resign(keys=[self.key, self.term_key], args=[self.identity]))
        except redis.RedisError as exc:
            raise unavailable(f"resign from {self.key!r}", describe(self._client), exc) from exc
        return done == 1
