"""``RedisClaimer``: at most one run per fire across a fleet, claims kept in Redis.

The Redis twin of :class:`~rselection.postgres.PostgresClaimer`::

    claimer = RedisClaimer(redis.Redis())
    if claimer.claim(format_fire_key("purge", scheduled_at)):
        purge()

A claim is one ``SET NX PX`` of the fire key (server expiry; claims fail closed). See
``docs/how-to/claims.md`` ("Redis") for the batch calls, ``ran_before`` and how claims
spread over a Redis Cluster.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from redis.cluster import RedisCluster

from ..claiming import ClaimsPartlyFailed, check_fire_key, check_fire_keys
from ..validation import check_optional_term
from ._conn import describe, unavailable
from .keys import DEFAULT_KEY_PREFIX, claim_key
from .node_keys import NodeKeys

__all__ = ["FIRE_KEY_FORMAT", "RedisClaimer"]

logger = logging.getLogger(__name__)

FIRE_KEY_FORMAT = 1
"""Format of the fire keys this release writes (see :func:`rselection.format_fire_key`)."""

#: KEYS: the claim key. ARGV: node id, term ('' for none), fire-key format, ttl (ms).
#: Returns 1 when claimed, 0 when an unexpired claim holds the key.
CLAIM = """
local t = redis.call('TIME')
local v = cjson.encode({node_id = ARGV[1], term = ARGV[2], format = ARGV[3],
  at = tostring(t[1] * 1000 + math.floor(t[2] / 1000))})
if redis.call('SET', KEYS[1], v, 'NX', 'PX', ARGV[4]) then return 1 end
return 0
"""

#: KEYS: one task's claim keys, oldest fire first. ARGV: as CLAIM. Claims every key after
#: the newest one an unexpired claim holds; returns the (1-based) positions won.
CLAIM_MISSED = """
local held = 0
for i = #KEYS, 1, -1 do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    held = i
    break
  end
end
local won = {}
if held == #KEYS then return won end
local t = redis.call('TIME')
local v = cjson.encode({node_id = ARGV[1], term = ARGV[2], format = ARGV[3],
  at = tostring(t[1] * 1000 + math.floor(t[2] / 1000))})
for i = held + 1, #KEYS do
  if redis.call('SET', KEYS[i], v, 'NX', 'PX', ARGV[4]) then won[#won + 1] = i end
end
return won
"""

#: KEYS: claim keys of distinct fires. ARGV: as CLAIM. Claims each key no unexpired
#: claim holds; returns the (1-based) positions won.
CLAIM_MANY = """
local t = redis.call('TIME')
local v = cjson.encode({node_id = ARGV[1], term = ARGV[2], format = ARGV[3],
  at = tostring(t[1] * 1000 + math.floor(t[2] / 1000))})
local won = {}
for i = 1, #KEYS do
  if redis.call('SET', KEYS[i], v, 'NX', 'PX', ARGV[4]) then won[#won + 1] = i end
end
return won
"""


class RedisClaimer(NodeKeys):
    """Claims each fire of a schedule in Redis, so a fleet runs it once.

    A :class:`~rselection.claiming.MissedFireClaimer` and a
    :class:`~rselection.claiming.BatchFireClaimer`. Thread-safe (uses the client's
    pool). :meth:`close` leaves the claims made: they bind until their ttl.

    Args:
        client: a ``redis.Redis``, a ``redis.cluster.RedisCluster`` or a ``redis://``
            URL (a client made from a URL is closed by :meth:`close`).
        key_prefix: prefix of every claim key (used verbatim; may be empty).
        ttl: seconds a claim binds (at least 1 ms; default 600).
        node_id: who claims, recorded in each claim; unique per instance by default (and
            taken anew in a process forked from this one).

    Raises:
        ConfigError: a bad client, key prefix, ttl or node id.
    """

    key_prefix: str
    """The prefix of every claim key."""
    ttl: float
    """Seconds a claim binds."""
    node_id: str
    """Who this claimer claims as."""

    def __init__(
        self,
        client: Any,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX + "claim:",
        ttl: float = 600.0,
        node_id: str | None = None,
    ) -> None:
        self._keep_keys(client, "RedisClaimer", key_prefix, ttl, node_id)
        self._cluster = isinstance(self._client, RedisCluster)
        self._claim = self._client.register_script(CLAIM)
        self._claim_missed = self._client.register_script(CLAIM_MISSED)
        self._claim_many = self._client.register_script(CLAIM_MANY)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key_prefix={self.key_prefix!r}, {self._describe()})"

    def key(self, fire_key: str) -> str:
        """The Redis key of a fire's claim: ``key_prefix + fire_key``."""
        return claim_key(fire_key, self.key_prefix)

    def _args(self, term: int | None) -> list[Any]:
        return [self.node_id, "" if term is None else str(term), FIRE_KEY_FORMAT, self._ttl_ms]

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """Claim ``fire_key``: ``True`` if this call won it, ``False`` if a claim holds it.

        One script: wins when the key was never claimed or its last claim expired.

        Args:
            fire_key: the fire (``format_fire_key(task, scheduled_at)``); not blank,
                at most :data:`~rselection.claiming.MAX_FIRE_KEY_BYTES` bytes as UTF-8.
            term: the fencing term the claim is made under, recorded in the claim.

        Raises:
            ConfigError: a bad fire key or term (before any I/O).
            BackendUnavailable: Redis cannot be reached or failed (fail closed).
        """
        check_fire_key(fire_key)
        check_optional_term(term)
        try:
            won = int(self._claim(keys=[self.key(fire_key)], args=self._args(term)))
        except redis.RedisError as exc:
            raise unavailable(f"claim {fire_key!r:.80}", describe(self._client), exc) from exc
        return won == 1

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim the missed fires among ``fire_keys`` in one round trip; return those won.

        ``fire_keys`` are one task's fires, oldest first. Every key newer than the newest
        one that an unexpired claim already holds is claimed (that claim marks how far
        the fleet got; an expired claim counts as none and is taken again); the keys won
        come back oldest first. A leader that starts calls this once per task, instead
        of one :meth:`claim` per missed fire. Same semantics as
        :meth:`rselection.postgres.PostgresClaimer.claim_missed`.

        Args:
            fire_keys: the fires, oldest first; each a name, as in :meth:`claim`.
            term: the fencing term the claims are made under, recorded in each.

        Raises:
            ConfigError: a bad fire key or term (before any I/O).
            BackendUnavailable: Redis cannot be reached or failed (fail closed: then
                nothing may run, although some claims may have been made).
        """
        fire_keys = check_fire_keys(fire_keys)
        check_optional_term(term)
        if not fire_keys:
            return []
        keys = [self.key(k) for k in fire_keys]
        what = f"claim {len(fire_keys)} missed fires from {fire_keys[0]!r:.80}"
        try:
            if self._cluster and len({self._client.keyslot(k) for k in keys}) > 1:
                won = self._claim_missed_across_slots(keys, term)
            else:
                won = [int(i) - 1 for i in self._claim_missed(keys=keys, args=self._args(term))]
        except redis.RedisError as exc:
            raise unavailable(what, describe(self._client), exc) from exc
        logger.debug("%s: won %d", what, len(won))
        return [fire_keys[i] for i in won]

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        """Claim many fires in one round trip; return the keys this call won.

        Each key is claimed as by :meth:`claim` (``SET NX PX``: won when no unexpired
        claim holds it): one script when the keys share a hash slot (always, outside a
        cluster), else one ``TIME`` and one pipeline (a round trip per master). A leader
        claims every fire due at one instant this way.

        Args:
            fire_keys: distinct fires (of any tasks); each a name, as in :meth:`claim`.
            term: the fencing term the claims are made under, recorded in each.

        Raises:
            ConfigError: a bad or repeated key, or a bad term (before any I/O).
            ClaimsPartlyFailed: in a cluster, the claims on some masters failed (run
                only its ``won`` keys; the failed ones are skipped: fail closed).
            BackendUnavailable: Redis cannot be reached or failed (fail closed: run
                none of the fires, although some claims may have been made).
        """
        fire_keys = check_fire_keys(fire_keys)
        check_optional_term(term)
        if not fire_keys:
            return set()
        keys = [self.key(k) for k in fire_keys]
        what = f"claim {len(fire_keys)} fires from {fire_keys[0]!r:.80}"
        failed: dict[int, Exception] = {}
        try:
            if self._cluster and len({self._client.keyslot(k) for k in keys}) > 1:
                won, failed = self._set_each(keys, term)
            else:
                won = [int(i) - 1 for i in self._claim_many(keys=keys, args=self._args(term))]
        except redis.RedisError as exc:
            raise unavailable(what, describe(self._client), exc) from exc
        logger.debug("%s: won %d, failed %d", what, len(won), len(failed))
        if failed:
            # Some masters answered: what they claimed may run, the others' fires not.
            first = next(iter(failed.values()))
            error = unavailable(what, describe(self._client), first)
            raise ClaimsPartlyFailed(
                f"{error} ({len(failed)} of {len(fire_keys)} claims failed)",
                won={fire_keys[i] for i in won},
                failed={
                    fire_keys[i]: unavailable(
                        f"claim {fire_keys[i]!r:.80}", describe(self._client), exc
                    )
                    for i, exc in failed.items()
                },
            ) from first
        return {fire_keys[i] for i in won}

    def _value(self, term: int | None) -> tuple[str, int]:
        """The JSON value of a claim made now (server time), and the ttl in ms."""
        seconds, micros = self._client.time()
        node_id, term_text, fmt, ttl_ms = self._args(term)
        value = json.dumps(
            {
                "node_id": node_id,
                "term": term_text,
                "format": str(fmt),
                "at": str(int(seconds) * 1000 + int(micros) // 1000),
            }
        )
        return value, ttl_ms

    def _set_each(
        self, keys: list[str], term: int | None
    ) -> tuple[list[int], dict[int, Exception]]:
        """``SET NX PX`` of each key in one pipeline (keys in several hash slots of a
        cluster): the positions won, and those whose ``SET`` failed with its error (a
        master that is down fails its keys only)."""
        value, ttl_ms = self._value(term)
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, value, nx=True, px=ttl_ms)
        won: list[int] = []
        failed: dict[int, Exception] = {}
        for i, result in enumerate(pipe.execute(raise_on_error=False)):
            if isinstance(result, Exception):
                failed[i] = result
            elif result:
                won.append(i)
        return won, failed

    def _claim_missed_across_slots(self, keys: list[str], term: int | None) -> list[int]:
        """:meth:`claim_missed` on a cluster where the keys lie in several hash slots: the
        positions won."""
        client: Any = self._client
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        held = [i for i, n in enumerate(pipe.execute()) if int(n)]
        first = held[-1] + 1 if held else 0
        if first == len(keys):
            return []
        won, failed = self._set_each(keys[first:], term)
        if failed:  # a missed fire after a failed claim could run out of order: none runs
            raise next(iter(failed.values()))
        return [first + i for i in won]

    def ran_before(self, series: str) -> bool:
        """Whether a leader scheduled the fires of ``series`` (a task's fire keys without
        the instant, such as ``"billing/purge@"``) before; records that one does now.

        One ``SET <key_prefix><series> ... NX`` without expiry: claims expire by
        themselves, so the series keeps this one key (per task and lease) to tell a
        task that never ran anywhere (nothing missed) from one whose fires were missed.

        Raises:
            ConfigError: a bad ``series``.
            BackendUnavailable: Redis cannot be reached or failed.
        """
        check_fire_key(series)
        value = json.dumps({"node_id": self.node_id, "format": str(FIRE_KEY_FORMAT)})
        try:
            first = self._client.set(self.key(series), value, nx=True)
        except redis.RedisError as exc:
            raise unavailable(
                f"record the series {series!r:.80}", describe(self._client), exc
            ) from exc
        return not first

    def ran_before_many(self, series: list[str]) -> set[str]:
        """Those of ``series`` that :meth:`ran_before` says ran before, recording each
        as it does: one pipeline (a round trip, per master in a cluster).

        Raises:
            ConfigError: a bad series.
            BackendUnavailable: Redis cannot be reached or failed.
        """
        series = check_fire_keys(series)
        if not series:
            return set()
        value = json.dumps({"node_id": self.node_id, "format": str(FIRE_KEY_FORMAT)})
        try:
            pipe = self._client.pipeline(transaction=False)
            for one in series:
                pipe.set(self.key(one), value, nx=True)
            first = pipe.execute()
        except redis.RedisError as exc:
            raise unavailable(
                f"record {len(series)} series from {series[0]!r:.80}", describe(self._client), exc
            ) from exc
        return {one for one, new in zip(series, first, strict=True) if not new}

    def claim_missed_many(
        self, fire_keys: list[list[str]], *, term: int | None = None
    ) -> list[list[str]]:
        """:meth:`claim_missed` of each list (one task's fires each, oldest first);
        return the keys won of each list. One pipeline of the script (one round trip);
        in a cluster, one :meth:`claim_missed` per list.

        Raises:
            ConfigError: a bad key, a key given twice, or a bad term (before any I/O).
            BackendUnavailable: as :meth:`claim_missed`.
        """
        check_fire_keys([key for keys in fire_keys for key in keys])
        check_optional_term(term)
        if self._cluster:
            return [self.claim_missed(keys, term=term) for keys in fire_keys]
        groups = [keys for keys in fire_keys if keys]
        if not groups:
            return [[] for _ in fire_keys]
        what = f"claim the missed fires of {len(groups)} tasks from {groups[0][0]!r:.80}"
        try:
            pipe = self._client.pipeline(transaction=False)
            for keys in groups:
                self._claim_missed(
                    keys=[self.key(k) for k in keys], args=self._args(term), client=pipe
                )
            answers = iter(pipe.execute())
        except redis.RedisError as exc:
            raise unavailable(what, describe(self._client), exc) from exc
        return [[keys[int(i) - 1] for i in next(answers)] if keys else [] for keys in fire_keys]

    def holder_of(self, fire_key: str) -> dict[str, Any] | None:
        """The unexpired claim of ``fire_key`` (``node_id``, ``term``, ``format``,
        ``at``), or ``None``.

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
        doc["term"] = int(doc["term"]) if doc.get("term") else None
        return doc
