"""How a leader claims each scheduled fire, so it runs once across the fleet.

The claimer role, :class:`~rselection.abc.FireClaimer`, and its optional abilities
(:class:`~rselection.abc.MissedFireClaimer`, ...) live in :mod:`rselection.abc` with the
other roles; they stay importable from here. This module checks fire keys and claims
through a claimer, with each ability it has (see :func:`~rselection.abc.claimer_ability`)
or without.
"""

from __future__ import annotations

import re

# The claimer role and its abilities moved to one module; their names stay importable here.
from .abc import (
    BatchFireClaimer,
    BatchFireHistory,
    BatchMissedFireClaimer,
    CleanupClaimer,
    FireClaimer,
    FireHistory,
    MissedFireClaimer,
    claim_back,
    claimer_ability,
)
from .errors import BackendUnavailable, ConfigError
from .keys import lease_scoped

__all__ = [
    "CLEANUP_BATCH",
    "BatchFireClaimer",
    "BatchFireHistory",
    "BatchMissedFireClaimer",
    "MAX_FIRE_KEY_BYTES",
    "ClaimsPartlyFailed",
    "CleanupClaimer",
    "FireClaimer",
    "FireHistory",
    "LeaseClaims",
    "MissedFireClaimer",
    "check_fire_key",
    "check_fire_keys",
    "claim_each",
    "claim_missed",
    "claim_missed_each",
    "ran_before_each",
    "series_of",
]


class ClaimsPartlyFailed(BackendUnavailable):
    """A claim of many fires in one call failed for some of them only.

    :meth:`BatchFireClaimer.claim_many` raises it when it knows which claims were made
    and which failed (keys spread over the masters of a Redis Cluster, one of which is
    down). The keys won may run; those failed may not (claims fail closed); the others
    are held by another claim. A caller that only catches
    :class:`~rselection.errors.BackendUnavailable` runs none, which is safe too.

    Args:
        message: what failed, and where.
        won: the keys this call won.
        failed: the keys whose claim failed, each with its error.
    """

    def __init__(self, message: str, *, won: set[str], failed: dict[str, Exception]) -> None:
        super().__init__(message)
        self.won = won
        """The keys this call won."""
        self.failed = failed
        """The keys whose claim failed, each with its error."""


CLEANUP_BATCH = 1000
"""Most expired claims one statement of a leader's clean-up deletes."""

_INSTANT = re.compile(r"@\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{9}Z\Z")


def series_of(fire_key: str) -> str | None:
    """The series of a fire key: the key without its instant (``"purge@"`` for
    ``"purge@2026-11-30T02:40:00.000000000Z"``), or ``None`` for a key that
    :func:`~rselection.format_fire_key` did not write."""
    found = _INSTANT.search(fire_key)
    return None if found is None else fire_key[: found.start() + 1]


MAX_FIRE_KEY_BYTES = 2600
"""Longest fire key a claimer accepts, in bytes as UTF-8.

A leader's claim key holds a lease name and a task name (each up to
:data:`~rselection.validation.MAX_NAME` bytes) and the instant; the bound stays
below what a Postgres btree index can hold.
"""


def check_fire_key(value: object) -> str:
    """Return ``value`` if it is a usable fire key, else raise :class:`ConfigError`.

    A fire key is a string that is not blank, has no NUL character, no lone surrogate
    and at most :data:`MAX_FIRE_KEY_BYTES` bytes as UTF-8. It is used verbatim.

    Args:
        value: the fire key.
    """
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise ConfigError(f"fire_key must be a non-blank string without NUL, got {value!r:.80}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise ConfigError(f"fire_key must be valid Unicode text, got {value!r:.80}") from exc
    if size > MAX_FIRE_KEY_BYTES:
        raise ConfigError(f"fire_key is longer than {MAX_FIRE_KEY_BYTES} bytes: {value[:40]!r}...")
    return value


def check_fire_keys(values: object) -> list[str]:
    """Return ``values`` as a list of checked fire keys (see :func:`check_fire_key`).

    A single string is refused rather than taken as a sequence of one-character keys,
    and so is a key given twice: the keys are one task's fires, oldest first, each once.

    Args:
        values: a list (or other iterable) of fire keys.
    """
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise ConfigError(f"fire_keys must be a list of fire keys, got {values!r:.80}")
    keys: list[str] = []
    seen: set[str] = set()
    for value in values:
        key = check_fire_key(value)
        if key in seen:
            raise ConfigError(
                f"fire_keys must name each fire once (oldest first); {key!r:.80} is given twice"
            )
        seen.add(key)
        keys.append(key)
    return keys


def claim_missed(claimer: FireClaimer, fire_keys: list[str], *, term: int | None) -> list[str]:
    """Claim the missed fires among ``fire_keys`` (oldest first); return those won.

    Uses the claimer's own ``claim_missed`` (one round trip) when it has one; else walks
    back from the newest key with :meth:`FireClaimer.claim` until a key is already held.

    Raises:
        ConfigError: a bad or repeated key (see :func:`check_fire_keys`).
    """
    fire_keys = check_fire_keys(fire_keys)
    missed = claimer_ability(claimer, "claim_missed")
    if missed is not None:
        return missed.claim_missed(fire_keys, term=term)
    return claim_back(claimer, fire_keys, term=term)


def claim_each(
    claimer: FireClaimer, fire_keys: list[str], *, term: int | None
) -> tuple[set[str], dict[str, Exception]]:
    """Claim every key of ``fire_keys``; return the keys won, and the keys whose claim
    failed with its error (the others are held by another claim).

    Uses the claimer's own ``claim_many`` when it has one (one round trip; an error
    there fails every key, except the keys a :class:`ClaimsPartlyFailed` tells were won
    or held), else :meth:`FireClaimer.claim` key by key (an error fails
    that key only, and the others are still claimed). A key that is not a usable fire
    key (see :func:`check_fire_key`) fails with its :class:`ConfigError`, and only that
    one: the others are claimed.

    Raises:
        ConfigError: ``fire_keys`` is not a list of keys, or names a key twice.
    """
    fire_keys, failed = _split_bad(fire_keys)
    if not fire_keys:
        return set(), failed
    batch = claimer_ability(claimer, "claim_many")
    if batch is not None:
        try:
            return batch.claim_many(fire_keys, term=term), failed
        except ClaimsPartlyFailed as exc:
            return exc.won & set(fire_keys), failed | exc.failed
        except Exception as exc:
            return set(), failed | dict.fromkeys(fire_keys, exc)
    won: set[str] = set()
    for key in fire_keys:
        try:
            if claimer.claim(key, term=term):
                won.add(key)
        except Exception as exc:
            failed[key] = exc
    return won, failed


def _split_bad(values: object) -> tuple[list[str], dict[str, Exception]]:
    """The usable fire keys of ``values``, and the others with the error that refuses
    each (see :func:`check_fire_key`).

    Raises:
        ConfigError: ``values`` is not a list of keys, or names a key twice.
    """
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise ConfigError(f"fire_keys must be a list of fire keys, got {values!r:.80}")
    good: list[str] = []
    bad: dict[str, Exception] = {}
    seen: set[object] = set()
    for value in values:
        if value in seen:
            raise ConfigError(f"fire_keys must name each fire once; {value!r:.80} is given twice")
        seen.add(value)
        try:
            good.append(check_fire_key(value))
        except ConfigError as exc:
            bad[str(value)] = exc
    return good, bad


def claim_missed_each(
    claimer: FireClaimer, fire_keys: list[list[str]], *, term: int | None
) -> list[list[str]]:
    """:func:`claim_missed` of each list of ``fire_keys`` (one task's fires each, oldest
    first); the keys won of each list. One call for all when the claimer has
    ``claim_missed_many``, else one per list.

    Raises:
        ConfigError: a bad key, or a key given twice.
    """
    check_fire_keys([key for keys in fire_keys for key in keys])
    if not fire_keys:
        return []
    batch = claimer_ability(claimer, "claim_missed_many")
    if batch is not None:
        return batch.claim_missed_many(fire_keys, term=term)
    return [claim_missed(claimer, keys, term=term) for keys in fire_keys]


def ran_before_each(claimer: object, series: list[str]) -> set[str]:
    """Those of ``series`` that ran before (see :class:`FireHistory`): one call when the
    claimer has ``ran_before_many``, else one per series; all of them when it cannot
    tell (so that missed fires are looked for as ever)."""
    if not series:
        return set()
    batch = claimer_ability(claimer, "ran_before_many")
    if batch is not None:
        return batch.ran_before_many(series)
    history = claimer_ability(claimer, "ran_before")
    if history is not None:
        return {one for one in series if history.ran_before(one)}
    return set(series)


class LeaseClaims:
    """A claimer seen through one lease: claim keys are ``"<lease name>/<fire key>"``.

    Every leader claims through one of these, so leases that share a claims table (or a
    Redis prefix) may have tasks of the same name and their fires still stay apart. The
    lease name is written as :func:`rselection.keys.lease_scoped` writes it: ``%`` and
    ``/`` in it become ``%25`` and ``%2F``, so lease ``a/b`` with task ``c`` and lease
    ``a`` with task ``b/c`` never claim the same key (a name without them is kept as is).
    Missed fires are claimed in one call when the claimer can (a
    :class:`MissedFireClaimer`), else fire by fire (see :func:`claim_missed`); so are
    the fires due at one instant (a :class:`BatchFireClaimer`, see :func:`claim_each`).

    Args:
        claimer: the claimer to claim through.
        lease: the lease name.
    """

    def __init__(self, claimer: FireClaimer, lease: str) -> None:
        self.claimer = claimer
        self.ttl = claimer.ttl
        self.prefix = lease_scoped(lease, "")

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """Claim ``"<lease>/<fire_key>"`` (see :meth:`FireClaimer.claim`; the lease name
        encoded as in the class description)."""
        return self.claimer.claim(self.prefix + fire_key, term=term)

    def claim_each(
        self, fire_keys: list[str], *, term: int | None = None
    ) -> tuple[set[str], dict[str, Exception]]:
        """Claim ``fire_keys`` under this lease, in one round trip when the claimer can
        (see :func:`claim_each`); return the fire keys won and those that failed with
        their errors, without the prefix."""
        prefix = self.prefix
        cut = len(prefix)
        won, failed = claim_each(self.claimer, [prefix + key for key in fire_keys], term=term)
        return {key[cut:] for key in won}, {key[cut:]: exc for key, exc in failed.items()}

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim the missed fires among ``fire_keys`` (oldest first) under this lease;
        return the fire keys won, oldest first, without the prefix."""
        keys = [self.prefix + key for key in fire_keys]
        won = claim_missed(self.claimer, keys, term=term)
        return [key[len(self.prefix) :] for key in won]

    def cleanup(self, *, batch: int | None = None) -> int:
        """Delete expired claims through the claimer (of every lease: it is safe from any
        node); 0 when its claims expire by themselves (see :class:`CleanupClaimer`)."""
        cleaning = claimer_ability(self.claimer, "cleanup")
        if cleaning is not None:
            return cleaning.cleanup(batch=batch)
        return 0

    def ran_before_many(self, series: list[str]) -> set[str]:
        """Those of ``series`` that ran before under this lease, in one call when the
        claimer can (see :func:`ran_before_each`)."""
        prefix = self.prefix
        found = ran_before_each(self.claimer, [prefix + one for one in series])
        return {one[len(prefix) :] for one in found}

    def claim_missed_many(
        self, fire_keys: list[list[str]], *, term: int | None = None
    ) -> list[list[str]]:
        """Claim the missed fires of many tasks under this lease, in one call when the
        claimer can (see :func:`claim_missed_each`); the fire keys won of each list."""
        prefix = self.prefix
        cut = len(prefix)
        groups = [[prefix + key for key in keys] for keys in fire_keys]
        won = claim_missed_each(self.claimer, groups, term=term)
        return [[key[cut:] for key in keys] for keys in won]

    def ran_before(self, series: str) -> bool:
        """Whether fires of ``series`` ran before under this lease (see
        :class:`FireHistory`); ``True`` when the claimer cannot tell, so that missed
        fires are looked for as ever."""
        history = claimer_ability(self.claimer, "ran_before")
        if history is not None:
            return history.ran_before(self.prefix + series)
        return True

    def __repr__(self) -> str:
        return f"LeaseClaims({self.claimer!r}, prefix={self.prefix!r})"
