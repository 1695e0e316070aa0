"""The lease backend contract and the in-memory lease used by the single-node leader.

A backend only knows how to acquire, renew, release and observe one named lease (and,
optionally, how to pass on an operator's request to hand over). Everything about
leading (deadlines, terms, cancelling tasks) lives in :mod:`rselection.leader`, so every
backend gets the same safety rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

__all__ = [
    "AnnouncesHolder",
    "Acquisition",
    "HandoverRequest",
    "LeaderInfo",
    "LeaseBackend",
    "NonBlockingLease",
    "NonBlockingRelease",
    "ReleaseOutcome",
    "RenewOutcome",
    "SharedSchedule",
    "SupportsHandover",
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
        timeout: seconds (server measured) the request stays valid; until then, or until
            another node takes the lease, the backend keeps the asked node (and, with
            ``to``, every node but ``to``) from taking the lease.
    """

    term: int
    to: str | None
    timeout: float


@runtime_checkable
class LeaseBackend(Protocol):
    """What a leader needs from a lease server.

    Every method except :meth:`current`, :meth:`interrupt` and :meth:`term_ended` is
    called by one thread at a time: the process's driver workers, in turn, and between
    their calls one waiting thread of the leader's, in :meth:`wait_for_change` (each
    call first interrupts that wait and lets it return). A backend whose calls may run
    while another thread waits in it says so with a class attribute
    ``concurrent_calls = True`` (:class:`~rselection.MemoryLease` does); its waits are
    then not interrupted. Connection problems raise
    :class:`~rselection.errors.BackendUnavailable`; the keeper reconnects with backoff.
    """

    name: str
    """The lease name (one lease per name)."""

    @property
    def ttl(self) -> float:
        """Seconds the lease lasts on the server after an acquisition or renewal (a plain
        attribute will do; a :class:`~datetime.timedelta` is read in seconds).

        The leader checks its own timings against it: a lease that expires sooner than
        the leader's deadline and ``stop_grace`` allow is refused, since another node
        could then lead while this one still does.
        """

    def connect(self) -> None:
        """Open (or re-open) the keeper's connection; raise ``BackendUnavailable`` on failure."""

    def try_acquire(self, node_id: str) -> Acquisition:
        """Take the lease when it is free, expired, or its holder's session is gone.

        A successful acquisition increments the term (it never decreases, also across
        release and re-acquire).
        """

    def renew(self, node_id: str, term: int) -> bool:
        """Extend this node's lease by the ttl; ``False`` when ``term`` no longer holds it."""

    def release(self, node_id: str, term: int) -> None:
        """Give the lease up (holder cleared, term kept) and wake waiting followers."""

    def current(self) -> LeaderInfo | None:
        """The live holder, or ``None``; safe to call from any thread."""

    def wait_for_change(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until the holder may have changed.

        Returns early on :meth:`interrupt`, on a release notification, or when the
        holder's session ended. A change that came after this node's last call (a
        release between its ``try_acquire`` and this wait) counts: return at once then,
        or the follower sleeps through it until the holder's ttl would have run out.
        While leading, raise ``BackendUnavailable`` at once if the keeper's connection
        breaks: that is how a leader learns of a dead session without waiting for its
        next renewal.
        """

    def interrupt(self) -> None:
        """Wake a thread blocked in :meth:`wait_for_change`; safe from any thread.

        The wake-up must not be lost when no thread is waiting yet: the next
        :meth:`wait_for_change` then returns at once. Otherwise a ``stop()`` or
        ``step_down()`` that races with the keeper going back to sleep would wait for
        the keeper's next timeout (up to ``renew_interval``).
        """

    def term_ended(self, term: int) -> None:
        """The leader ended ``term`` and joined its tasks (or reported them stuck).

        Until this call (or :meth:`release` or :meth:`close`) a backend never closes,
        drops or lets its own timers end the session through which it acquired ``term``:
        an error only marks that session broken (the call raises ``BackendUnavailable``)
        and the leader closes it once the term's tasks are joined, because a follower may
        take over the moment the session is gone. From this call on, the backend may break
        off a round trip stuck on a silent server. Safe from any thread.
        """

    def close(self) -> None:
        """Close every connection; the backend may be connected again later."""


@runtime_checkable
class SupportsHandover(Protocol):
    """A lease backend through which operators can ask the leader to hand over.

    Optional: the leader uses it when its backend has these methods
    (:class:`~rselection.postgres.PostgresLease` and
    :class:`~rselection.redis.RedisLease` do).
    """

    def handover_hinted(self) -> bool:
        """True when a notification says a request may be waiting: renew now to see."""

    def handover_requested(self) -> HandoverRequest | None:
        """The request the last successful renewal found for its term, once; else ``None``."""


@runtime_checkable
class SharedSchedule(Protocol):
    """A lease backend whose leases share one session, and so one schedule.

    Optional: with it, the leader renews on the backend's renewal grid (never later than
    its own ``renew_interval``) and, following, attempts on its attempt grid (never more
    than half a ``retry_interval`` after it would have), so that the round trips of
    many leases go out together (:class:`~rselection.postgres.PostgresLease` has it).
    Times are :func:`rselection.clock.monotonic`.
    """

    def renewal_slot(self, due: float, interval: float, after: float) -> float:
        """The time to renew a lease due at ``due``: at or before it, after ``after``."""

    def attempt_slot(self, due: float, interval: float) -> float:
        """The time to attempt a lease due at ``due``: at or after it, within ``interval``."""


RenewOutcome = bool | None | BaseException
"""What a non-blocking renewal reports: ``True`` renewed, ``False`` the term is lost,
``None`` not renewed this time but still held (try again soon; the deadline counts from
the last renewal that went through), or the exception the blocking call would raise."""


@runtime_checkable
class NonBlockingLease(Protocol):
    """A lease backend whose round trips can be started without blocking a thread.

    Optional. A leader over such a backend has no thread of its own (a blocking lease
    has one, waiting in :meth:`LeaseBackend.wait_for_change`): one driver thread per
    process (:mod:`rselection.driver`) starts the renewals and attempts of every such
    leader, and the backend sends them together (one statement for all that are due, on
    :class:`~rselection.postgres.PostgresLease`). Everything else (connecting, releasing,
    ending terms) still goes through the blocking methods
    of :class:`LeaseBackend`, on a thread of a shared pool.
    """

    def renew_soon(self, node_id: str, term: int, done: Callable[[RenewOutcome], None]) -> bool:
        """Start :meth:`LeaseBackend.renew`; ``done(outcome)`` is called once, from any
        thread, with its :data:`RenewOutcome`. ``False`` (nothing started, ``done`` never
        called) when the round trip cannot start without blocking: call :meth:`renew`."""

    def acquire_soon(
        self, node_id: str, done: Callable[[Acquisition | BaseException], None]
    ) -> bool:
        """Start :meth:`LeaseBackend.try_acquire`, as :meth:`renew_soon` does."""

    def on_wake(self, waker: Callable[[], None] | None) -> None:
        """Call ``waker`` (from any thread, quickly) whenever :meth:`wait_for_change`
        would return early: a notification, a broken session, :meth:`interrupt`.
        ``None`` stops the calls."""


@runtime_checkable
class AnnouncesHolder(Protocol):
    """A :class:`NonBlockingLease` whose notifications can name a new holder.

    Optional: a follower woken only by another node's acquisition then learns the new
    holder from the notification (``leader_changed``), with no attempt of its own; in a
    fleet that moves many leases at once, those attempts would compete for the rows.
    """

    def take_announced(self) -> LeaderInfo | None:
        """The holder a notification announced since the last call, when nothing else
        woke the lease since its last attempt (else ``None``: attempt); forgets it."""


ReleaseOutcome = bool | None | BaseException
"""What a non-blocking release reports: ``True`` released, ``False`` the term was no
longer held (nothing to release), ``None`` not done: call the blocking
:meth:`LeaseBackend.release`, or the exception the blocking call would raise."""


@runtime_checkable
class NonBlockingRelease(Protocol):
    """A :class:`NonBlockingLease` that can also start a release without blocking.

    Optional: the driver then releases the leases of leaders stopping together in one
    round trip, and no worker thread waits for a release in flight (one whose row is
    locked, say).
    """

    def release_soon(self, node_id: str, term: int, done: Callable[[ReleaseOutcome], None]) -> bool:
        """Start :meth:`LeaseBackend.release` of ``term`` (its tasks joined); ``done``
        is called once, from any thread, with its :data:`ReleaseOutcome`. ``False``
        (nothing started, ``done`` never called) when it cannot start without blocking:
        call :meth:`LeaseBackend.release`."""
