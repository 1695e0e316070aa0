"""What a lease backend hands a leader: holders, acquisitions, handover requests.

The lease role itself, :class:`~rselection.abc.LeaseBackend`, and its optional
abilities (:class:`~rselection.abc.SupportsHandover`, ...) live in :mod:`rselection.abc`
with the other roles; this module holds the values they exchange. A backend only knows how to
acquire, renew, release and observe one named lease (and, optionally, how to pass on an
operator's request to hand over). Everything about leading (deadlines, terms, cancelling
tasks) lives in :mod:`rselection.leader`, so every backend gets the same safety rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "Acquisition",
    "HandoverRequest",
    "LeaderInfo",
    "ReleaseOutcome",
    "RenewOutcome",
]


@dataclass(frozen=True)
class LeaderInfo:
    """Who holds a lease: node id, fencing term and the server's times (aware UTC)."""

    node_id: str
    term: int
    acquired_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class Acquisition:
    """Result of one :meth:`LeaseBackend.try_acquire` call.

    ``acquired`` is true when the caller now holds the lease (``holder`` is then the
    caller, with its new term). ``holder`` is the holder after the attempt, or ``None``
    when nobody holds the lease. ``expires_in`` is how long, in seconds measured by the
    lease server, until that holder's lease expires (0 when there is no holder); a
    follower may sleep that long on its own monotonic clock before trying again,
    because the server re-checks expiry when it tries.
    """

    acquired: bool
    holder: LeaderInfo | None
    expires_in: float


@dataclass(frozen=True)
class HandoverRequest:
    """An operator's request that the leader of ``term`` hand over (``rselection resign``).

    Attributes:
        term: the term asked to hand over; a request for any other term is ignored.
        to: the node the lease is reserved for, or ``None`` for any other node.
        valid_for: seconds (server measured) the request stays valid; until then, or
            until another node takes the lease, the backend keeps the asked node (and,
            with ``to``, every node but ``to``) from taking the lease.
    """

    term: int
    to: str | None
    valid_for: float


RenewOutcome = bool | None | BaseException
"""What a non-blocking renewal reports: ``True`` renewed, ``False`` the term is lost,
``None`` not renewed this time but still held (try again soon; the deadline counts from
the last renewal that went through), or the exception the blocking call would raise."""


ReleaseOutcome = bool | None | BaseException
"""What a non-blocking release reports: ``True`` released, ``False`` the term was no
longer held (nothing to release), ``None`` not done: call the blocking
:meth:`~rselection.abc.LeaseBackend.release`, or the exception the blocking call would raise."""
