"""The roles a backend plays, in one file: what to implement to bring your own backend.

A leader works through five roles: the lease (:class:`LeaseBackend`), the fire claimer
(:class:`FireClaimer`), the checkpoint store (:class:`CheckpointStore`), the membership
(:class:`Membership`) and the transaction fence (:class:`TransactionFence`); a sixth,
the task store (:class:`TaskStore`), keeps its tasks' controls and run history. A role is a
protocol of its required members; its optional *abilities* do the same work with fewer
round trips or threads. A role's base class (:class:`LeaseBase`, :class:`ClaimerBase`,
:class:`CheckpointStoreBase`) gives every ability a safe default; ask whether an object
has an ability with :func:`lease_ability`, :func:`claimer_ability` or
:func:`store_ability`, never ``isinstance``. :class:`TaskStoreBase` makes a task
store's operator changes on one write of the store's own.

How to write a backend, with the in-memory backends as examples and the conformance
checks: ``docs/how-to/backends.md``. Why the roles are spelt so:
``docs/explanation/how-it-works.md``, "The roles a backend plays".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Literal,
    Protocol,
    TypeAlias,
    overload,
    runtime_checkable,
)

from .task_runs import TaskControlChange, Trigger, new_trigger_key

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .checkpoints import Key, Snapshot
    from .lease import Acquisition, HandoverRequest, LeaderInfo, ReleaseOutcome, RenewOutcome
    from .members import NodeInfo
    from .task_runs import RunRecord, TaskControls, TaskEntry, TaskInfo

__all__ = [
    "AnnouncesHolder",
    "BatchFireClaimer",
    "BatchFireHistory",
    "BatchMissedFireClaimer",
    "CheckpointStore",
    "CheckpointStoreBase",
    "ClaimerAbility",
    "ClaimerBase",
    "CleanupClaimer",
    "FireClaimer",
    "FireHistory",
    "LeaseAbility",
    "LeaseBackend",
    "LeaseBase",
    "LeaseFencedStore",
    "Membership",
    "MissedFireClaimer",
    "NonBlockingLease",
    "NonBlockingRelease",
    "NextFires",
    "NotifiesChanges",
    "SharedSchedule",
    "StoreAbility",
    "SupportsHandover",
    "TaskStore",
    "TaskStoreBase",
    "TransactionFence",
    "Watch",
    "RecordsHistory",
    "Watchable",
    "WatchesExpiry",
    "claimer_ability",
    "lease_ability",
    "store_ability",
]


# --------------------------------------------------------------------------- the lease


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

    Optional abilities (see :class:`LeaseBase` and :func:`lease_ability`): handing over
    on request, a schedule shared by many leases, round trips that do not block a
    thread, holders announced by notifications, and releases that do not block.
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
    """Lease ability ``"handover"``: operators can ask the leader to hand over.

    The leader uses it when its lease has it (:class:`~rselection.postgres.PostgresLease`
    and :class:`~rselection.redis.RedisLease` do); see :func:`lease_ability`.
    """

    def handover_hinted(self) -> bool:
        """True when a notification says a request may be waiting: renew now to see."""

    def handover_requested(self) -> HandoverRequest | None:
        """The request the last successful renewal found for its term, once; else ``None``."""


@runtime_checkable
class SharedSchedule(Protocol):
    """Lease ability ``"shared_schedule"``: leases that share one session, and so one
    schedule.

    With it, the leader renews on the backend's renewal grid (never later than its own
    ``renew_interval``) and, following, attempts on its attempt grid (never more than
    half a ``retry_interval`` after it would have), so that the round trips of many
    leases go out together (:class:`~rselection.postgres.PostgresLease` has it). Times
    are :func:`rselection.clock.monotonic`.
    """

    def renewal_slot(self, due: float, interval: float, after: float) -> float:
        """The time to renew a lease due at ``due``: at or before it, after ``after``."""

    def attempt_slot(self, due: float, interval: float) -> float:
        """The time to attempt a lease due at ``due``: at or after it, within ``interval``."""


@runtime_checkable
class NonBlockingLease(Protocol):
    """Lease ability ``"non_blocking"``: round trips that start without blocking a thread.

    A leader over such a lease has no thread of its own (a blocking lease has one,
    waiting in :meth:`LeaseBackend.wait_for_change`): one driver thread per process
    (:mod:`rselection.driver`) starts the renewals and attempts of every such leader,
    and the backend sends them together (one statement for all that are due, on
    :class:`~rselection.postgres.PostgresLease`). Everything else (connecting,
    releasing, ending terms) still goes through the blocking methods of
    :class:`LeaseBackend`, on a thread of a shared pool.
    """

    def renew_soon(self, node_id: str, term: int, done: Callable[[RenewOutcome], None]) -> bool:
        """Start :meth:`LeaseBackend.renew`; ``done(outcome)`` is called once, from any
        thread, with its :data:`~rselection.lease.RenewOutcome`. ``False`` (nothing
        started, ``done`` never called) when the round trip cannot start without
        blocking: call :meth:`~LeaseBackend.renew`."""

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
    """Lease ability ``"announces_holder"`` (of a :class:`NonBlockingLease`):
    notifications that name a new holder.

    A follower woken only by another node's acquisition then learns the new holder from
    the notification (``leader_changed``), with no attempt of its own; in a fleet that
    moves many leases at once, those attempts would compete for the rows.
    """

    def take_announced(self) -> LeaderInfo | None:
        """The holder a notification announced since the last call, when nothing else
        woke the lease since its last attempt (else ``None``: attempt); forgets it."""


@runtime_checkable
class NonBlockingRelease(Protocol):
    """Lease ability ``"non_blocking_release"`` (of a :class:`NonBlockingLease`):
    releases that start without blocking a thread.

    The driver then releases the leases of leaders stopping together in one round trip,
    and no worker thread waits for a release in flight (one whose row is locked, say).
    """

    def release_soon(self, node_id: str, term: int, done: Callable[[ReleaseOutcome], None]) -> bool:
        """Start :meth:`LeaseBackend.release` of ``term`` (its tasks joined); ``done``
        is called once, from any thread, with its :data:`~rselection.lease.ReleaseOutcome`.
        ``False`` (nothing started, ``done`` never called) when it cannot start without
        blocking: call :meth:`LeaseBackend.release`."""


class Watch(Protocol):
    """One wait for a change in steps, of a :class:`Watchable` lease (see
    :mod:`rselection.wait_pump`). Its methods are called one at a time, never on the
    pump's thread."""

    sockets: tuple[Any, ...]
    """The sockets to watch for reading (fixed for the watch's life)."""

    def due(self) -> float:
        """The monotonic time at which :meth:`step` is due even with nothing to read
        (``inf``: never; a time passed: at once, after the others ready now)."""

    def step(self, readable: frozenset[Any]) -> bool:
        """Read a bounded amount from the ``readable`` sockets, do what is due; ``True``
        when the wait ended (the lease may have changed). Raises what the lease's
        ``wait_for_change`` would raise."""


@runtime_checkable
class Watchable(Protocol):
    """Lease ability ``"watchable"`` (of a lease whose calls block): its wait for a
    change can be taken in steps, so that the process's one wait pump
    (:mod:`rselection.wait_pump`) watches it instead of a thread of its leader's own (a
    Redis lease).
    """

    def watch_for_change(self) -> Watch:
        """Begin one wait of ``wait_for_change`` in steps; may block (it may reconnect),
        and raises what ``wait_for_change`` would raise.

        A watchable lease may also have a ``server`` attribute (any hashable value
        naming the server it waits on): the steps of leases of one server run on
        workers of their own, so that steps stuck on a hung server hold up the leases
        of that server only."""


@runtime_checkable
class NotifiesChanges(Protocol):
    """Lease ability ``"notifies_changes"`` (of a lease whose calls block): it calls
    back on every change, so that its leader needs no thread waiting in
    :meth:`~LeaseBackend.wait_for_change` (a memory lease: the changes happen in this
    process).
    """

    def subscribe_changes(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` after every change of the holder (an acquisition, a release,
        an expiry seen, a revocation) and on :meth:`~LeaseBackend.interrupt`, from the
        thread that made it, quickly and holding no lock of the lease; return a function
        that ends the calls. A change a leader made itself calls it too."""


@runtime_checkable
class WatchesExpiry(Protocol):
    """Lease ability ``"watches_expiry"``: its wait also ends when the lease of the
    holder that its last attempt saw expires (or changes), so that its leader need not
    attempt at each expiry of a live holder's lease (a Redis lease: its process reads
    the leases due to expire in one round trip). The leader then attempts when woken,
    and only every :data:`rselection.leadership.EXPIRY_BACKSTOP` lease periods by
    itself.
    """

    def expiry_watched(self) -> bool:
        """Whether the expiry of the holder's lease that the last attempt saw is
        watched (asked after each attempt that saw another holder)."""


@runtime_checkable
class RecordsHistory(Protocol):
    """Lease ability ``"records_history"``: a lease that keeps its terms' history
    (:mod:`rselection.history`) learns why each of its terms ends.

    The release that follows records it (a term whose release never comes is closed by
    the next acquisition, as one whose holder crashed).
    """

    def term_ending(self, term: int, reason: str, by: str | None) -> None:
        """``term`` is ending for ``reason`` (an ``end_reason`` of
        :data:`rselection.history.END_REASONS`), ended by ``by`` (``"operator"`` or
        ``None``); called before its release, from any thread. Never blocks."""


class LeaseBase(ABC):
    """A base for a lease of your own: every member of :class:`LeaseBackend`, and every
    optional ability with a default that the leader treats as absent.

    Implement the abstract methods, set ``name`` and ``ttl`` (in ``__init__``), and
    override the abilities your backend has; :func:`lease_ability` finds those. Each
    default answers as a lease without the ability would be used: no handover is ever
    requested, slots are the due times, no round trip starts without blocking, no holder
    is announced. Inheriting is optional: a class with the members of
    :class:`LeaseBackend` is a lease all the same.
    """

    name: str
    """The lease name (one lease per name)."""

    ttl: float
    """Seconds the lease lasts on the server after an acquisition or renewal."""

    concurrent_calls: ClassVar[bool] = False
    """Whether calls may run while another thread waits in :meth:`wait_for_change`
    (then the leader does not interrupt that wait for each call)."""

    @abstractmethod
    def connect(self) -> None:
        """See :meth:`LeaseBackend.connect`."""

    @abstractmethod
    def try_acquire(self, node_id: str) -> Acquisition:
        """See :meth:`LeaseBackend.try_acquire`."""

    @abstractmethod
    def renew(self, node_id: str, term: int) -> bool:
        """See :meth:`LeaseBackend.renew`."""

    @abstractmethod
    def release(self, node_id: str, term: int) -> None:
        """See :meth:`LeaseBackend.release`."""

    @abstractmethod
    def current(self) -> LeaderInfo | None:
        """See :meth:`LeaseBackend.current`."""

    @abstractmethod
    def wait_for_change(self, timeout: float) -> None:
        """See :meth:`LeaseBackend.wait_for_change`."""

    @abstractmethod
    def interrupt(self) -> None:
        """See :meth:`LeaseBackend.interrupt`."""

    def term_ended(self, term: int) -> None:  # noqa: B027 - a default that does nothing
        """See :meth:`LeaseBackend.term_ended`; by default nothing to do (a backend
        whose timers can end a session must hold them off until this call)."""

    @abstractmethod
    def close(self) -> None:
        """See :meth:`LeaseBackend.close`."""

    def handover_hinted(self) -> bool:
        """Ability ``"handover"`` (:class:`SupportsHandover`); by default never."""
        return False

    def handover_requested(self) -> HandoverRequest | None:
        """Ability ``"handover"`` (:class:`SupportsHandover`); by default none."""
        return None

    def renewal_slot(self, due: float, interval: float, after: float) -> float:
        """Ability ``"shared_schedule"`` (:class:`SharedSchedule`); by default ``due``."""
        return due

    def attempt_slot(self, due: float, interval: float) -> float:
        """Ability ``"shared_schedule"`` (:class:`SharedSchedule`); by default ``due``."""
        return due

    def renew_soon(self, node_id: str, term: int, done: Callable[[RenewOutcome], None]) -> bool:
        """Ability ``"non_blocking"`` (:class:`NonBlockingLease`); by default ``False``:
        nothing started, call :meth:`renew`."""
        return False

    def acquire_soon(
        self, node_id: str, done: Callable[[Acquisition | BaseException], None]
    ) -> bool:
        """Ability ``"non_blocking"`` (:class:`NonBlockingLease`); by default ``False``:
        nothing started, call :meth:`try_acquire`."""
        return False

    def on_wake(self, waker: Callable[[], None] | None) -> None:  # noqa: B027 - a default that does nothing
        """Ability ``"non_blocking"`` (:class:`NonBlockingLease`); by default nothing
        (the leader waits in :meth:`wait_for_change` instead).

        A non-blocking lease must override it together with :meth:`renew_soon` and
        :meth:`acquire_soon`: the leader of a non-blocking lease waits in no thread, so
        this is the only way it learns of a change. A lease that overrides only the
        other two is taken for a blocking one (:func:`lease_ability` answers ``None``).
        """

    def take_announced(self) -> LeaderInfo | None:
        """Ability ``"announces_holder"`` (:class:`AnnouncesHolder`); by default
        ``None``: attempt."""
        return None

    def release_soon(self, node_id: str, term: int, done: Callable[[ReleaseOutcome], None]) -> bool:
        """Ability ``"non_blocking_release"`` (:class:`NonBlockingRelease`); by default
        ``False``: nothing started, call :meth:`release`."""
        return False

    def subscribe_changes(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Ability ``"notifies_changes"`` (:class:`NotifiesChanges`); by default never
        calls back (the leader waits in :meth:`wait_for_change` instead)."""
        return lambda: None

    def expiry_watched(self) -> bool:
        """Ability ``"watches_expiry"`` (:class:`WatchesExpiry`); by default ``False``:
        the leader attempts when the holder's lease may have expired."""
        return False

    def term_ending(self, term: int, reason: str, by: str | None) -> None:  # noqa: B027
        """Ability ``"records_history"`` (:class:`RecordsHistory`); by default no
        history is kept."""


LeaseAbility = Literal[
    "handover",
    "shared_schedule",
    "non_blocking",
    "announces_holder",
    "non_blocking_release",
    "notifies_changes",
    "watchable",
    "watches_expiry",
    "records_history",
]
"""The optional abilities of a lease (see :func:`lease_ability`)."""

_LEASE_ABILITIES: dict[str, tuple[type, tuple[str, ...]]] = {
    "handover": (SupportsHandover, ("handover_hinted", "handover_requested")),
    "shared_schedule": (SharedSchedule, ("renewal_slot", "attempt_slot")),
    "non_blocking": (NonBlockingLease, ("renew_soon", "acquire_soon", "on_wake")),
    "announces_holder": (AnnouncesHolder, ("take_announced",)),
    "non_blocking_release": (NonBlockingRelease, ("release_soon",)),
    "notifies_changes": (NotifiesChanges, ("subscribe_changes",)),
    "watchable": (Watchable, ("watch_for_change",)),
    "watches_expiry": (WatchesExpiry, ("expiry_watched",)),
    "records_history": (RecordsHistory, ("term_ending",)),
}


@overload
def lease_ability(lease: object, ability: Literal["handover"]) -> SupportsHandover | None: ...
@overload
def lease_ability(lease: object, ability: Literal["shared_schedule"]) -> SharedSchedule | None: ...
@overload
def lease_ability(lease: object, ability: Literal["non_blocking"]) -> NonBlockingLease | None: ...
@overload
def lease_ability(
    lease: object, ability: Literal["announces_holder"]
) -> AnnouncesHolder | None: ...
@overload
def lease_ability(
    lease: object, ability: Literal["non_blocking_release"]
) -> NonBlockingRelease | None: ...
@overload
def lease_ability(
    lease: object, ability: Literal["notifies_changes"]
) -> NotifiesChanges | None: ...
@overload
def lease_ability(lease: object, ability: Literal["watchable"]) -> Watchable | None: ...
@overload
def lease_ability(lease: object, ability: Literal["watches_expiry"]) -> WatchesExpiry | None: ...
@overload
def lease_ability(lease: object, ability: Literal["records_history"]) -> RecordsHistory | None: ...
def lease_ability(lease: object, ability: LeaseAbility) -> Any:
    """``lease``, typed as having the optional ``ability``, or ``None`` if it has not.

    It has it when it has the ability's methods (see the ability's protocol) and they
    are not :class:`LeaseBase`'s defaults.

    Args:
        lease: a lease.
        ability: ``"handover"`` (:class:`SupportsHandover`), ``"shared_schedule"``
            (:class:`SharedSchedule`), ``"non_blocking"`` (:class:`NonBlockingLease`),
            ``"announces_holder"`` (:class:`AnnouncesHolder`),
            ``"non_blocking_release"`` (:class:`NonBlockingRelease`),
            ``"notifies_changes"`` (:class:`NotifiesChanges`), ``"watchable"``
            (:class:`Watchable`), ``"watches_expiry"`` (:class:`WatchesExpiry`) or
            ``"records_history"`` (:class:`RecordsHistory`).
    """
    return _ability(lease, _LEASE_ABILITIES, LeaseBase, ability)


# -------------------------------------------------------------------- the fire claimer


@runtime_checkable
class FireClaimer(Protocol):
    """Claims one fire of a scheduled task before it runs.

    :class:`rselection.postgres.PostgresClaimer` is one. A claim binds for ``ttl``
    seconds, also after the run ends, so a node that reaches the same fire later (after
    a handover, or with a late clock) does not run it again.

    Optional abilities (see :class:`ClaimerBase` and :func:`claimer_ability`): missed
    fires in one call, many fires in one call, missed fires of many tasks in one call,
    a clean-up of expired claims, and a history of the fires claimed before.
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
    """Claimer ability ``"claim_missed"``: a task's missed fires in one call.

    A leader that starts looks back over the fires it may have missed; with this method
    it needs one round trip per task instead of one per fire.
    """

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim every key of ``fire_keys`` (one task's fires, oldest first) that is
        newer than the newest key already held; return the keys won, oldest first.

        Raises on a backend problem, as :meth:`~FireClaimer.claim`.
        """
        ...


@runtime_checkable
class BatchFireClaimer(FireClaimer, Protocol):
    """Claimer ability ``"claim_many"``: many fires in one call.

    A leader claims every fire due at one instant together: with this method one round
    trip per instant, instead of one per fire. The three claimers of rselection have
    it; a claimer without it is called fire by fire (see
    :func:`~rselection.claiming.claim_each`).
    """

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        """Claim each of ``fire_keys`` (distinct fires, any tasks) as
        :meth:`~FireClaimer.claim` would, all in one call; return the keys this call won.

        A key is won when no unexpired claim holds it; the others are held by another
        claim. Raises on a backend problem (then no fire of the call may run: claims
        fail closed, although some may have been made), or
        :class:`~rselection.claiming.ClaimsPartlyFailed` when only some claims failed
        and it knows which (then the keys it won may run).
        """
        ...


@runtime_checkable
class BatchMissedFireClaimer(MissedFireClaimer, Protocol):
    """Claimer ability ``"claim_missed_many"`` (of a :class:`MissedFireClaimer`): the
    missed fires of many tasks in one call.

    A leader that starts looks back over every task's missed fires: with this method in
    one round trip, instead of one per task (see
    :func:`~rselection.claiming.claim_missed_each`).
    """

    def claim_missed_many(
        self, fire_keys: list[list[str]], *, term: int | None = None
    ) -> list[list[str]]:
        """:meth:`~MissedFireClaimer.claim_missed` of each list of ``fire_keys`` (one
        task's fires each, oldest first; no key in two lists), all in one call; return
        the keys won of each list, in the same order.

        Raises on a backend problem (then no fire of the call may run).
        """
        ...


@runtime_checkable
class CleanupClaimer(FireClaimer, Protocol):
    """Claimer ability ``"cleanup"``: expired claims stay until deleted (a table, a dict).

    A leader that claims through one deletes the expired claims itself, in batches of
    :data:`~rselection.claiming.CLEANUP_BATCH`, at least once per claim ttl. What
    :class:`FireHistory` needs stays (:class:`~rselection.postgres.PostgresClaimer`
    keeps the newest claim of each task, each :func:`~rselection.claiming.series_of`).
    """

    def cleanup(self, *, batch: int | None = None) -> int:
        """Delete expired claims, at most ``batch`` of them (all with ``None``, batch
        by batch); return how many. Never deletes a claim that still binds.

        Raises on a backend problem.
        """
        ...


@runtime_checkable
class FireHistory(Protocol):
    """Claimer ability ``"ran_before"``: whether a task's fires were claimed before, at
    any time.

    A leader that starts asks it first: a task that never ran anywhere has missed
    nothing, so its first term starts at its next instant, with no catch-up and no fire
    reported skipped.
    """

    def ran_before(self, series: str) -> bool:
        """Whether fires of ``series`` (a task's fire keys without the instant, such
        as ``"billing/purge@"``) were claimed or scheduled before, here or on another
        node; the answer does not expire with the claims' ttl.

        Raises on a backend problem.
        """
        ...


@runtime_checkable
class BatchFireHistory(FireHistory, Protocol):
    """Claimer ability ``"ran_before_many"`` (of a :class:`FireHistory`): the history
    of many tasks in one call."""

    def ran_before_many(self, series: list[str]) -> set[str]:
        """Those of ``series`` whose fires were claimed or scheduled before (see
        :meth:`FireHistory.ran_before`), all in one call.

        Raises on a backend problem.
        """
        ...


def claim_back(claimer: FireClaimer, fire_keys: list[str], *, term: int | None) -> list[str]:
    """Claim the missed fires among ``fire_keys`` (oldest first) key by key: walk back
    from the newest with :meth:`FireClaimer.claim` until one is already held; return
    the keys won, oldest first: ``claim_missed`` for a claimer without the ability.
    """
    won: list[str] = []
    for key in reversed(fire_keys):
        if not claimer.claim(key, term=term):
            break
        won.append(key)
    return won[::-1]


class ClaimerBase(ABC):
    """A base for a fire claimer of your own: :class:`FireClaimer`'s ``claim``, and every
    optional ability with a default that the leader treats as absent.

    Implement :meth:`claim`, set ``ttl`` (in ``__init__``), and override the abilities
    your backend has; :func:`claimer_ability` finds those. Each default does what the
    leader does without the ability: claims key by key through :meth:`claim`, deletes
    nothing, and cannot tell whether a task ran before (so missed fires are looked for).
    Inheriting is optional: a class with ``claim`` and ``ttl`` is a claimer all the same.
    """

    ttl: float
    """Seconds a claim binds; a task's ``misfire_grace`` must not exceed it."""

    @abstractmethod
    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """See :meth:`FireClaimer.claim`."""

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Ability ``"claim_missed"`` (:class:`MissedFireClaimer`); by default walks back
        from the newest key with :meth:`claim` until one is already held."""
        return claim_back(self, fire_keys, term=term)

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        """Ability ``"claim_many"`` (:class:`BatchFireClaimer`); by default :meth:`claim`
        of each key in turn (an error stops the call, as the ability's contract says)."""
        return {key for key in fire_keys if self.claim(key, term=term)}

    def claim_missed_many(
        self, fire_keys: list[list[str]], *, term: int | None = None
    ) -> list[list[str]]:
        """Ability ``"claim_missed_many"`` (:class:`BatchMissedFireClaimer`); by default
        :meth:`claim_missed` of each list in turn."""
        return [self.claim_missed(keys, term=term) for keys in fire_keys]

    def cleanup(self, *, batch: int | None = None) -> int:
        """Ability ``"cleanup"`` (:class:`CleanupClaimer`); by default 0: claims expire
        by themselves."""
        return 0

    def ran_before(self, series: str) -> bool:
        """Ability ``"ran_before"`` (:class:`FireHistory`); by default ``True``: cannot
        tell, so missed fires are looked for."""
        return True

    def ran_before_many(self, series: list[str]) -> set[str]:
        """Ability ``"ran_before_many"`` (:class:`BatchFireHistory`); by default
        :meth:`ran_before` of each series in turn."""
        return {one for one in series if self.ran_before(one)}


ClaimerAbility = Literal[
    "claim_missed", "claim_many", "claim_missed_many", "cleanup", "ran_before", "ran_before_many"
]
"""The optional abilities of a fire claimer (see :func:`claimer_ability`)."""

_CLAIMER_ABILITIES: dict[str, tuple[type, tuple[str, ...]]] = {
    "claim_missed": (MissedFireClaimer, ("claim_missed",)),
    "claim_many": (BatchFireClaimer, ("claim_many",)),
    "claim_missed_many": (BatchMissedFireClaimer, ("claim_missed_many",)),
    "cleanup": (CleanupClaimer, ("cleanup",)),
    "ran_before": (FireHistory, ("ran_before",)),
    "ran_before_many": (BatchFireHistory, ("ran_before_many",)),
}


@overload
def claimer_ability(
    claimer: object, ability: Literal["claim_missed"]
) -> MissedFireClaimer | None: ...
@overload
def claimer_ability(claimer: object, ability: Literal["claim_many"]) -> BatchFireClaimer | None: ...
@overload
def claimer_ability(
    claimer: object, ability: Literal["claim_missed_many"]
) -> BatchMissedFireClaimer | None: ...
@overload
def claimer_ability(claimer: object, ability: Literal["cleanup"]) -> CleanupClaimer | None: ...
@overload
def claimer_ability(claimer: object, ability: Literal["ran_before"]) -> FireHistory | None: ...
@overload
def claimer_ability(
    claimer: object, ability: Literal["ran_before_many"]
) -> BatchFireHistory | None: ...
def claimer_ability(claimer: object, ability: ClaimerAbility) -> Any:
    """``claimer``, typed as having the optional ``ability``, or ``None`` if it has not.

    It has it when it has the ability's methods (see the ability's protocol) and the
    ability's own method is not :class:`ClaimerBase`'s default.

    Args:
        claimer: a fire claimer.
        ability: ``"claim_missed"`` (:class:`MissedFireClaimer`), ``"claim_many"``
            (:class:`BatchFireClaimer`), ``"claim_missed_many"``
            (:class:`BatchMissedFireClaimer`), ``"cleanup"`` (:class:`CleanupClaimer`),
            ``"ran_before"`` (:class:`FireHistory`) or ``"ran_before_many"``
            (:class:`BatchFireHistory`).
    """
    return _ability(claimer, _CLAIMER_ABILITIES, ClaimerBase, ability)


# ---------------------------------------------------------------- the checkpoint store


@runtime_checkable
class CheckpointStore(Protocol):
    """Where ``ctx.checkpoint`` keeps task state: snapshots by key, saves fenced by term.

    :class:`~rselection.postgres.PostgresCheckpointStore` and
    :class:`~rselection.MemoryCheckpointStore` are two. A store of your own must keep their rules:
    ``save(key, state, term=T, name=lease_name)`` commits only while term ``T`` holds the
    lease called ``lease_name``, atomically with the write (a takeover never lands
    between the check and the write), else raises
    :class:`~rselection.errors.StaleLeaderError` and writes nothing; without ``term`` the
    save is not fenced.

    Optional ability (see :class:`CheckpointStoreBase` and :func:`store_ability`):
    fencing against the lease objects it is given.
    """

    def load(self, key: Key) -> Snapshot | None:
        """The last saved snapshot of ``key``, or ``None`` (never saved, or deleted)."""
        ...

    def save(
        self, key: Key, state: Any, *, term: int | None = None, name: str = "default"
    ) -> Snapshot:
        """Store ``state`` as the new snapshot of ``key``; with ``term``, only while that
        term holds the lease called ``name`` (else
        :class:`~rselection.errors.StaleLeaderError`).

        Args:
            key: a string or a tuple of strings.
            state: a JSON-encodable value.
            term: the fencing term the write is fenced to; ``None``: not fenced.
            name: the name of the lease whose term fences the write (a leader's ``name``).
        """
        ...

    def delete(self, key: Key, *, term: int | None = None, name: str = "default") -> bool:
        """Delete the snapshot of ``key`` (fenced like :meth:`save`); ``True`` if one
        existed. The key's version counter is kept: versions never repeat.

        Args:
            key: a string or a tuple of strings.
            term: the fencing term the delete is fenced to; ``None``: not fenced.
            name: the name of the lease whose term fences the delete.
        """
        ...


@runtime_checkable
class LeaseFencedStore(CheckpointStore, Protocol):
    """Checkpoint store ability ``"add_lease"``: fences against lease objects it is given.

    A leader built with such a store hands it its lease at construction (the Postgres
    store needs no such step: it reads the lease table).
    """

    def add_lease(self, lease: LeaseBackend) -> None:
        """Fence saves of ``lease.name`` against ``lease`` from now on.

        Raises:
            ConfigError: the store cannot fence against ``lease``, or already fences
                another lease object of the same name (a second leader of that name:
                its terms would be taken for the first one's).
        """
        ...


class CheckpointStoreBase(ABC):
    """A base for a checkpoint store of your own: :class:`CheckpointStore`'s methods, and
    its optional ability with a default that the leader treats as absent.

    Implement the abstract methods; override :meth:`add_lease` if the store fences
    against lease objects (:func:`store_ability` finds it). Inheriting is optional: a
    class with ``load``, ``save`` and ``delete`` is a store all the same.
    """

    @abstractmethod
    def load(self, key: Key) -> Snapshot | None:
        """See :meth:`CheckpointStore.load`."""

    @abstractmethod
    def save(
        self, key: Key, state: Any, *, term: int | None = None, name: str = "default"
    ) -> Snapshot:
        """See :meth:`CheckpointStore.save`."""

    @abstractmethod
    def delete(self, key: Key, *, term: int | None = None, name: str = "default") -> bool:
        """See :meth:`CheckpointStore.delete`."""

    def add_lease(self, lease: LeaseBackend) -> None:  # noqa: B027 - a default that does nothing
        """Ability ``"add_lease"`` (:class:`LeaseFencedStore`); by default nothing: the
        store fences by itself (as the Postgres store reads the lease table).

        Args:
            lease: the lease whose terms fence saves under its name.
        """


StoreAbility = Literal["add_lease"]
"""The optional abilities of a checkpoint store (see :func:`store_ability`)."""

_STORE_ABILITIES: dict[str, tuple[type, tuple[str, ...]]] = {
    "add_lease": (LeaseFencedStore, ("add_lease",)),
}


def store_ability(store: object, ability: StoreAbility) -> LeaseFencedStore | None:
    """``store``, typed as having the optional ``ability``, or ``None`` if it has not.

    It has it when it has the ability's methods and they are not
    :class:`CheckpointStoreBase`'s defaults.

    Args:
        store: a checkpoint store.
        ability: ``"add_lease"`` (:class:`LeaseFencedStore`).
    """
    found: LeaseFencedStore | None = _ability(store, _STORE_ABILITIES, CheckpointStoreBase, ability)
    return found


# ----------------------------------------------------------------------- the membership


@runtime_checkable
class Membership(Protocol):
    """One node's heartbeats, and the list of the nodes of its lease (``ctx.nodes()``).

    A leader with a membership starts it when it starts and stops it when it stops:
    between the two it heartbeats every ``heartbeat_interval`` seconds, and a node is
    alive while its last heartbeat is younger than ``node_timeout``.
    :class:`~rselection.postgres.PostgresMembership` (a table),
    :class:`~rselection.redis.RedisMembership` (a sorted set) and
    :class:`~rselection.MemoryMembership` (this process) are three.
    """

    name: str
    """The name of the lease the node competes for."""

    node_id: str
    """This node's id (a leader sets it again in a forked child)."""

    heartbeat_interval: float
    """Seconds between heartbeats."""

    node_timeout: float
    """A node not seen for this long is lost (``alive=False``)."""

    def start(self) -> None:
        """Heartbeat now and then every ``heartbeat_interval`` until :meth:`stop`; does
        nothing once stopped."""
        ...

    def stop(self) -> None:
        """Stop heartbeating and remove this node from the list (best effort)."""
        ...

    def beat(self) -> None:
        """Record one heartbeat of this node.

        Raises:
            BackendUnavailable: the server could not be reached.
        """
        ...

    def nodes(self) -> list[NodeInfo]:
        """Every node listed for this lease, oldest first; lost ones have ``alive=False``
        and the holder of the lease ``is_leader=True``.

        Raises:
            BackendUnavailable: the server could not be reached.
        """
        ...


# ------------------------------------------------------------------------ the fence


@runtime_checkable
class TransactionFence(Protocol):
    """Fences a caller's open transaction to a term: what ``ctx.fence`` and
    ``ctx.afence`` call.

    A lease backend that can hold a takeover back until a transaction ends (Postgres:
    the lease row locked ``FOR KEY SHARE``) offers one; a leader without one refuses
    ``ctx.fence`` with a :class:`~rselection.errors.ConfigError` instead of pretending.
    """

    def fence(self, conn: Any, term: int) -> None:
        """Make the open transaction on ``conn`` fail unless ``term`` still holds the lease.

        Raises:
            StaleLeaderError: ``term`` no longer holds the lease; roll back.
            ConfigError: the wrong kind of connection, or no transaction open.
        """
        ...

    async def afence(self, conn: Any, term: int) -> None:
        """:meth:`fence` for an async connection."""
        ...


# ------------------------------------------------------------------------ the task store


@runtime_checkable
class TaskStore(Protocol):
    """Where the task controls, task lists and run histories of leases live
    (``rselection task``, see :mod:`rselection.task_runs`).

    A leader reads its lease's controls (:meth:`read_controls`) before its first fire
    and whenever woken, publishes its list of tasks when a term begins
    (:meth:`publish_tasks`), writes its runs in batches (:meth:`write_runs`, one round
    trip each, never on the renewal path) and drops the triggers it took
    (:meth:`drop_triggers`). An operator reads and changes them with the other methods;
    a change wakes the lease's leader (a notification on the lease's channel, on the
    servers; :class:`~rselection.MemoryTaskStore` calls back). Postgres keeps them in
    tables beside the lease table, Redis in keys of the lease's hash slot,
    :class:`~rselection.MemoryTaskStore` in memory.

    Every method raises :class:`~rselection.errors.BackendUnavailable` when the server
    cannot be reached or fails.
    """

    def read_controls(self, name: str) -> TaskControls:
        """The paused tasks and pending triggers of lease ``name`` (none where nothing
        was ever stored)."""
        ...

    def publish_tasks(self, name: str, node_id: str, term: int, tasks: Sequence[TaskEntry]) -> None:
        """Record ``tasks`` as the tasks of lease ``name``, run by ``node_id`` in
        ``term`` (a task not among them is listed no more; its controls and runs stay)."""
        ...

    def write_runs(self, runs: Sequence[RunRecord], *, next_fires: NextFires, limit: int) -> None:
        """Append ``runs`` (oldest first, of any leases) to their tasks' run histories,
        keep the newest ``limit`` of each task, and record the next fire of each
        (lease, task) of ``next_fires``; in one round trip."""
        ...

    def drop_triggers(self, name: str, fire_keys: Sequence[str]) -> None:
        """Forget the triggers ``fire_keys`` of lease ``name`` (taken, or refused)."""
        ...

    def read_tasks(self, name: str, *, last_run: bool = True) -> list[TaskInfo]:
        """The tasks of lease ``name`` as its leader last published them, sorted by
        name, each with its controls and newest run (empty: never published; without
        ``last_run``, the newest runs may be left out: a check that needs no run)."""
        ...

    def read_runs(self, name: str, task: str, limit: int) -> list[RunRecord]:
        """The newest ``limit`` runs of task ``task`` of lease ``name``, newest first."""
        ...

    def set_paused(self, name: str, task: str, paused: bool) -> TaskControlChange:
        """Pause (or resume) task ``task`` of lease ``name`` and wake its leader."""
        ...

    def add_trigger(self, name: str, task: str) -> Trigger:
        """Ask for one extra fire of task ``task`` of lease ``name`` and wake its leader."""
        ...


NextFires: TypeAlias = Mapping[tuple[str, str], datetime | None]
"""The next fire of each ``(lease, task)`` (``None``: none) that
:meth:`TaskStore.write_runs` records with a batch of runs."""


class TaskStoreBase(ABC):
    """A base for a task store: :class:`TaskStore`'s operator changes, each made of one
    write of the store's own.

    :meth:`set_paused` and :meth:`add_trigger` make their answers (and a trigger's fire
    key) here; a store implements :meth:`_change_paused`, :meth:`_record_trigger` and
    the rest of :class:`TaskStore`.
    """

    def set_paused(self, name: str, task: str, paused: bool) -> TaskControlChange:
        """See :meth:`TaskStore.set_paused`."""
        return TaskControlChange(name, task, paused, self._change_paused(name, task, paused))

    def add_trigger(self, name: str, task: str) -> Trigger:
        """See :meth:`TaskStore.add_trigger`."""
        fire_key = new_trigger_key(task)
        return Trigger(name, task, fire_key, self._record_trigger(name, task, fire_key))

    @abstractmethod
    def _change_paused(self, name: str, task: str, paused: bool) -> bool:
        """Pause (or resume) task ``task`` of lease ``name`` and wake its leader; whether
        that changed it."""

    @abstractmethod
    def _record_trigger(self, name: str, task: str, fire_key: str) -> datetime:
        """Record the fire ``fire_key`` of task ``task`` of lease ``name`` as asked for,
        and wake its leader; when it was asked for (the store's clock)."""


_NO_DEFAULT = object()


def _ability(
    obj: object, table: dict[str, tuple[type, tuple[str, ...]]], base: type, ability: str
) -> Any:
    """``obj`` if it has ``ability`` of ``table`` (an ability protocol it satisfies, whose
    own methods are not ``base``'s defaults), else ``None``."""
    try:
        kind, own = table[ability]
    except KeyError:
        raise ValueError(f"no such ability {ability!r}: one of {', '.join(table)}") from None
    if not isinstance(obj, kind):
        return None
    cls = type(obj)
    # Looked up on the class, as the protocol check of Python 3.12 does: a subclass of
    # the base that did not override the method still has the base's function.
    # An ability the base has no default for (a watchable wait) is the object's own.
    if any(getattr(cls, name, None) is getattr(base, name, _NO_DEFAULT) for name in own):
        return None
    return obj
