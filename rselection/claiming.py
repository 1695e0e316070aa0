"""What a leader needs to claim each scheduled fire, so it runs once across the fleet."""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol, runtime_checkable

from .errors import ConfigError

__all__ = ["FireClaimer", "MemoryClaimer"]


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

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """Claim ``fire_key`` unless an unexpired claim holds it."""
        if not isinstance(fire_key, str) or not fire_key:
            raise ConfigError(f"fire_key must be a non-empty string, got {fire_key!r}")
        now = time.monotonic()
        with self._lock:
            held = self._claims.get(fire_key)
            if held is not None and held[0] > now:
                return False
            self._claims[fire_key] = (now + self.ttl, term)
            return True

    def claims(self) -> dict[str, int | None]:
        """Unexpired claims: fire key -> the term that claimed it."""
        now = time.monotonic()
        with self._lock:
            return {key: term for key, (until, term) in self._claims.items() if until > now}
