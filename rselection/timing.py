"""Lease timings and the rules that keep two nodes from ever leading at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["STOP_GRACE_CAP", "STOP_GRACE_MARGIN", "Timings"]

STOP_GRACE_CAP = 5.0
"""Longest ``stop_grace`` chosen when a handler leaves it to the timings (``None``)."""

STOP_GRACE_MARGIN = 0.5
"""Seconds between the end of a paused leader's wind-down and the expiry of its lease."""


MAX_TIMING = 86400.0
"""The longest timing accepted, seconds (a day): a lease server computes expiries from
it, and a value that overflows its timestamps would fail every renewal of the process."""


def _seconds(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number of seconds, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    if value > MAX_TIMING:
        raise ConfigError(f"{what} must be at most {MAX_TIMING:g} s (a day), got {value:g}")
    return float(value)


@dataclass(frozen=True)
class Timings:
    """Validated lease timings, in seconds.

    Rules (checked at construction; the error shows the math):

    - ``renew_interval < renew_deadline``: several renewals are tried before giving up;
    - ``ttl - renew_deadline >= max(1 s, 10% of ttl)``: the leader stops at its deadline,
      measured from when its last successful renewal was *sent*, so it has stopped
      before the server lets the lease expire and another node take over;
    - ``renew_deadline + stop_grace + 0.5 s <= ttl`` (:meth:`check_stop_grace`): a paused
      or cut-off leader's lease passes on by expiry, so its tasks must be cancelled and
      joined (or reported stuck, and with ``on_stuck="exit"`` the process gone) before
      the lease can expire.

    Args:
        ttl: lease length on the server.
        renew_interval: time between renewals.
        renew_deadline: the leader steps down if no renewal succeeded for this long.
        retry_interval: a follower's polling period (jittered).
    """

    ttl: float = 15.0
    renew_interval: float = 2.0
    renew_deadline: float = 10.0
    retry_interval: float = 2.0

    def __post_init__(self) -> None:
        for what in ("ttl", "renew_interval", "renew_deadline", "retry_interval"):
            object.__setattr__(self, what, _seconds(what, getattr(self, what)))
        if self.renew_interval >= self.renew_deadline:
            raise ConfigError(
                f"renew_interval ({self.renew_interval:g}s) must be less than renew_deadline "
                f"({self.renew_deadline:g}s), so several renewals are tried before stepping down"
            )
        margin = self.ttl - self.renew_deadline
        need = self.safety_margin_needed(self.ttl)
        if margin < need:
            raise ConfigError(
                f"ttl - renew_deadline = {self.ttl:g} - {self.renew_deadline:g} = {margin:g}s, "
                f"but it must be >= max(1s, 10% of ttl) = {need:g}s so the leader always "
                f"stops before its lease can expire; lower renew_deadline to at most "
                f"{self.ttl - need:g}s or raise ttl"
            )

    @staticmethod
    def safety_margin_needed(ttl: float) -> float:
        """The smallest allowed ``ttl - renew_deadline`` for a given ``ttl``."""
        return max(1.0, 0.1 * ttl)

    @property
    def margin(self) -> float:
        """``ttl - renew_deadline``: how long after the leader's deadline the lease lasts."""
        return self.ttl - self.renew_deadline

    def stop_grace(self, requested: float | None) -> float:
        """The ``stop_grace`` a leader with these timings uses.

        ``None`` means as long as the timings allow: ``ttl - renew_deadline - 0.5 s``, at
        most :data:`STOP_GRACE_CAP`. An explicit value is checked by
        :meth:`check_stop_grace` and used as given.
        """
        if requested is None:
            return min(STOP_GRACE_CAP, self.margin - STOP_GRACE_MARGIN)
        self.check_stop_grace(requested)
        return requested

    def check_stop_grace(self, stop_grace: float) -> None:
        """Refuse a ``stop_grace`` that could outlive the lease of a paused leader."""
        total = self.renew_deadline + stop_grace + STOP_GRACE_MARGIN
        if total > self.ttl + 1e-9:
            raise ConfigError(
                f"renew_deadline + stop_grace + 0.5 = {self.renew_deadline:g} + {stop_grace:g} "
                f"+ 0.5 = {total:g}s exceeds ttl = {self.ttl:g}s: a leader cut off from the "
                "lease server must have cancelled and joined its tasks before its lease "
                f"expires and another node starts; lower stop_grace to at most "
                f"{self.margin - STOP_GRACE_MARGIN:g}s (or leave it None), lower "
                "renew_deadline, or raise ttl"
            )
