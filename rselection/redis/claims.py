"""``RedisClaimer``: at most one run per fire across a fleet, claims kept in Redis.

The Redis twin of :class:`~rselection.postgres.PostgresClaimer`::

    claimer = RedisClaimer(redis.Redis())
    if claimer.claim(format_fire_key("purge", scheduled_at)):
        purge()

A claim is one ``SET <prefix><fire key> <value> NX PX <ttl>``: it succeeds when no
unexpired claim exists. The value is JSON recording the holder, the fencing term (when
given), the fire-key format and the server time. Expiry is Redis's own; a claim binds
until its ttl, also after the run ends, so a node that reaches the same fire later does
not run it again; ``ttl`` must therefore exceed the latest a fire may start anywhere.

**Fail closed.** :meth:`RedisClaimer.claim` returns ``False`` only when another claim
holds the key. Any backend problem raises :class:`~rselection.errors.BackendUnavailable`.
In a Redis Cluster each claim is one key, so claims need no hash tag.
"""

from __future__ import annotations

import json
import logging
from types import TracebackType
from typing import Any

import redis

from ..errors import ConfigError
from ..validation import check_seconds
from ._conn import MIN_TTL, check_client, describe, unavailable
from .elector import check_key, random_identity

__all__ = ["FIRE_KEY_FORMAT", "RedisClaimer"]

logger = logging.getLogger(__name__)

FIRE_KEY_FORMAT = 1
"""Format of the fire keys this release writes (see :func:`rselection.format_fire_key`)."""

_MAX_TERM = 2**63 - 1

CLAIM = """
local t = redis.call('TIME')
local v = cjson.encode({holder = ARGV[1], term = ARGV[2], format = ARGV[3],
  at = tostring(t[1] * 1000 + math.floor(t[2] / 1000))})
if redis.call('SET', KEYS[1], v, 'NX', 'PX', ARGV[4]) then return 1 end
return 0
"""


class RedisClaimer:
    """Claims each fire of a schedule in Redis, so a fleet runs it once.

    A :class:`~rselection.claiming.FireClaimer`. Thread-safe (uses the client's pool).

    Args:
        client: a ``redis.Redis``, a ``redis.cluster.RedisCluster`` or a ``redis://``
            URL (a client made from a URL is closed by :meth:`close`).
        prefix: prefix of every claim key.
        ttl: seconds a claim binds (at least 1 ms; default 600).
        holder: who claims, recorded in each claim; a random process identity by
            default.

    Raises:
        ConfigError: a bad client, prefix, ttl or holder.
    """

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "rselection:claim:",
        ttl: float = 600.0,
        holder: str | None = None,
    ) -> None:
        if not isinstance(prefix, str):
            raise ConfigError(f"prefix must be a string, got {prefix!r:.80}")
        self.prefix = prefix
        self.ttl = check_seconds(ttl, "ttl", minimum=MIN_TTL)
        self.holder: str = random_identity() if holder is None else check_key(holder, "holder")
        """Who this claimer claims as."""
        self._client, self._owned = check_client(client, "RedisClaimer")
        self._ttl_ms = max(1, round(self.ttl * 1000))
        self._claim = self._client.register_script(CLAIM)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(prefix={self.prefix!r}, ttl={self.ttl}, "
            f"holder={self.holder!r}, {describe(self._client)})"
        )

    def __enter__(self) -> RedisClaimer:
        """Return the claimer; the ``with`` block closes it."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the claimer."""
        self.close()

    def close(self) -> None:
        """Close the client if it was made from a URL; a client passed in is left open."""
        if self._owned:
            try:
                self._client.close()
            except Exception as exc:  # best effort
                logger.debug("claimer %r: error closing the client: %s", self.prefix, exc)

    def key(self, fire_key: str) -> str:
        """The Redis key of a fire's claim."""
        return self.prefix + fire_key

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """Claim ``fire_key``: ``True`` if this call won it, ``False`` if a claim holds it.

        Args:
            fire_key: the fire (``format_fire_key(task, scheduled_at)``); non-empty.
            term: the fencing term the claim is made under, recorded in the claim.

        Raises:
            ConfigError: a bad fire key or term (before any I/O).
            BackendUnavailable: Redis cannot be reached or failed (fail closed).
        """
        if not isinstance(fire_key, str) or not fire_key:
            raise ConfigError(f"fire_key must be a non-empty string, got {fire_key!r:.80}")
        if term is not None and (
            isinstance(term, bool) or not isinstance(term, int) or not 0 <= term <= _MAX_TERM
        ):
            raise ConfigError(f"term must be None or an int in [0, 2**63), got {term!r:.40}")
        args = [self.holder, "" if term is None else str(term), FIRE_KEY_FORMAT, self._ttl_ms]
        try:
            won = int(self._claim(keys=[self.key(fire_key)], args=args))
        except redis.RedisError as exc:
            raise unavailable(f"claim {fire_key!r:.80}", describe(self._client), exc) from exc
        return won == 1

    def holder_of(self, fire_key: str) -> dict[str, Any] | None:
        """The unexpired claim of ``fire_key`` (holder, term, format, at), or ``None``.

        Raises:
            BackendUnavailable: Redis cannot be reached.
        """
        try:
            raw = self._client.get(self.key(fire_key))
        except redis.RedisError as exc:
            raise unavailable(f"read claim {fire_key!r:.80}", describe(self._client), exc) from exc
        if raw is None:
            return None
        doc: dict[str, Any] = json.loads(raw)
        if doc.get("term"):
            doc["term"] = int(doc["term"])
        else:
            doc["term"] = None
        return doc
