"""What a leader needs to claim each scheduled fire, so it runs once across the fleet."""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol, runtime_checkable

from .errors import ConfigError
from .keys import lease_scoped

__all__ = [
    "MAX_FIRE_KEY_BYTES",
    "FireClaimer",
    "LeaseClaims",
    "MemoryClaimer",
    "MissedFireClaimer",
    "check_fire_key",
    "check_fire_keys",
    "claim_missed",
]


@runtime_checkable
class FireClaimer(Protocol):
    """Claims one fire of a scheduled task before it runs.

    :class:`rselection.postgres.PostgresClaimer` is one. A claim binds for ``ttl``
    seconds, also after the run ends, so a node that reaches the same fire later (after
    a handover, or with a late clock) does not run it again.
    """

    ttl: float
    """Seconds a claim binds; a task's ``misfire_grace`` must not exceed it."""

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """Claim ``fire_key``: ``True`` if this call won it, ``False`` if another holds it.

        Raises on a backend problem (the fire is then skipped: claims fail closed).
        """
        ...


@runtime_checkable
class MissedFireClaimer(FireClaimer, Protocol):
    """A :class:`FireClaimer` that also claims a task's missed fires in one call.

    A leader that starts looks back over the fires it may have missed; with this method
    it needs one round trip per task instead of one per fire.
    """

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim every key of ``fire_keys`` (one task's fires, oldest first) that is
        newer than the newest key already held; return the keys won, oldest first.

        Raises on a backend problem, as :meth:`claim`.
        """
        ...


MAX_FIRE_KEY_BYTES = 2600
"""Longest fire key a claimer accepts, in bytes as UTF-8.

A leader's claim key holds a lease name and a task name (each up to
:data:`~rselection.validation.MAX_NAME` characters) and the instant; the bound stays
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


class MemoryClaimer:
    """Claims kept in this process: one run per fire among leaders that share it.

    For tests, and for several leaders inside one process. Claims bind for ``ttl``
    seconds of this process's monotonic clock, like the Postgres claimer's server time.

    Args:
        ttl: seconds a claim binds (positive).
    """

    def __init__(self, *, ttl: float = 600.0) -> None:
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, int | float)
            or not math.isfinite(ttl)
            or ttl <= 0
        ):
            raise ConfigError(f"ttl must be a positive number of seconds, got {ttl!r}")
        self.ttl = float(ttl)
        self._claims: dict[str, tuple[float, int | None]] = {}
        self._lock = threading.Lock()

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim every key of ``fire_keys`` (oldest first) newer than the newest one
        already held; return those won, oldest first (see :class:`MissedFireClaimer`).

        Raises:
            ConfigError: a bad or repeated key (see :func:`check_fire_keys`).
        """
        fire_keys = check_fire_keys(fire_keys)
        now = time.monotonic()
        with self._lock:
            held = [i for i, key in enumerate(fire_keys) if self._holds(key, now)]
            newer = fire_keys[held[-1] + 1 :] if held else fire_keys
            for key in newer:
                self._claims[key] = (now + self.ttl, term)
            return list(newer)

    def _holds(self, key: str, now: float) -> bool:
        held = self._claims.get(key)
        return held is not None and held[0] > now

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """Claim ``fire_key`` unless an unexpired claim holds it.

        Raises:
            ConfigError: a bad key (see :func:`check_fire_key`).
        """
        check_fire_key(fire_key)
        now = time.monotonic()
        with self._lock:
            if self._holds(fire_key, now):
                return False
            self._claims[fire_key] = (now + self.ttl, term)
            return True

    def claims(self) -> dict[str, int | None]:
        """Unexpired claims: fire key -> the term that claimed it."""
        now = time.monotonic()
        with self._lock:
            return {key: term for key, (until, term) in self._claims.items() if until > now}


def claim_missed(claimer: FireClaimer, fire_keys: list[str], *, term: int | None) -> list[str]:
    """Claim the missed fires among ``fire_keys`` (oldest first); return those won.

    Uses the claimer's own ``claim_missed`` (one round trip) when it has one; else walks
    back from the newest key with :meth:`FireClaimer.claim` until a key is already held.

    Raises:
        ConfigError: a bad or repeated key (see :func:`check_fire_keys`).
    """
    fire_keys = check_fire_keys(fire_keys)
    if isinstance(claimer, MissedFireClaimer):
        return claimer.claim_missed(fire_keys, term=term)
    won: list[str] = []
    for key in reversed(fire_keys):
        if not claimer.claim(key, term=term):
            break
        won.append(key)
    return won[::-1]


class LeaseClaims:
    """A claimer seen through one lease: claim keys are ``"<lease name>/<fire key>"``.

    Every leader claims through one of these, so leases that share a claims table (or a
    Redis prefix) may have tasks of the same name and their fires still stay apart. The
    lease name is written as :func:`rselection.keys.lease_scoped` writes it: ``%`` and
    ``/`` in it become ``%25`` and ``%2F``, so lease ``a/b`` with task ``c`` and lease
    ``a`` with task ``b/c`` never claim the same key (a name without them is kept as is).
    Missed fires are claimed in one call when the claimer can (a
    :class:`MissedFireClaimer`), else fire by fire (see :func:`claim_missed`).

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

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim the missed fires among ``fire_keys`` (oldest first) under this lease;
        return the fire keys won, oldest first, without the prefix."""
        keys = [self.prefix + key for key in fire_keys]
        won = claim_missed(self.claimer, keys, term=term)
        return [key[len(self.prefix) :] for key in won]

    def __repr__(self) -> str:
        return f"LeaseClaims({self.claimer!r}, prefix={self.prefix!r})"
