"""What a leader needs to claim each scheduled fire, so it runs once across the fleet."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["FireClaimer"]


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
