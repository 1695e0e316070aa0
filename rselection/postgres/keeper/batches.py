"""Renewals, acquisition attempts and releases, batched on the keeper session.

Each is queued as a :class:`Queued` entry and sent by the keeper's thread in one
statement with every other of its kind due now (group commit): the leader aligns its
renewals on :meth:`KeeperBatches.renewal_slot` and its attempts on
:meth:`KeeperBatches.attempt_slot`, so a process sends about one renewal statement per
``renew_interval`` whatever its number of leases. A takeover skips a row it would have
to wait for (``SKIP LOCKED``) and tries again soon; a release never waits for a row
lock (it is sent again with later batches, for :data:`LOCK_BOUND` seconds): no renewal
waits behind either. A batch the server refuses is sent again in halves, so that only
a row at fault fails.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ... import clock
from ...errors import BackendUnavailable, first_line
from .._lease_sql import (
    AcquireRequest,
    ReleaseRequest,
    RenewRequest,
    acquire_batch_sql,
    bounded_sql,
    give_back_sql,
    new_lock_key,
    release_batch_sql,
    release_sql,
    renew_batch_sql,
    unlock_next_terms_sql,
)
from ..ring import ring_class
from .session import KeeperSession, KeptLease

__all__ = [
    "GATHER",
    "LOCK_BOUND",
    "RELEASE_REFUSED",
    "RENEWAL_SKIPPED",
    "Attempt",
    "KeeperBatches",
    "Queued",
]

logger = logging.getLogger(__name__)

GATHER = 0.01
"""Most seconds the keeper waits, before sending a batch, for more of its clients'
renewals, attempts and releases that are due at the same moment (only when it has
several clients)."""

GATHER_QUIET = 0.001
"""The keeper stops gathering once this many seconds passed with nothing more queued: a
few leases due together go out at once, a thousand stepped by the driver in one pass
still go in one batch."""

RENEWAL_SKIPPED = ("skipped",)
"""What :meth:`SharedKeeper.renew` returns for a term still held whose row another
transaction holds locked: not renewed this time; try again (the deadline counts from the
last renewal that went through)."""

RELEASE_REFUSED = ("refused",)
"""A batch's answer when the server refused the whole batch (a trigger, say): each
release is sent in a round trip of its own, so that only a row at fault fails."""

RELEASE_RETRY = 0.05
"""Seconds between two tries of a release whose row is locked."""

LOCK_BOUND = 1.0
"""Seconds an acquisition or a release may wait for a lock on the keeper session before
the server cancels it (renewals queue behind it; a release that fails leaves the lease
to expire)."""


@dataclass
class Queued:
    """A client's renewal or attempt waiting for the next batch."""

    lease: KeptLease
    node_id: str
    term: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    """Set by :meth:`fill`, or by the client giving up (then ``filled`` stays false)."""
    result: Any = None
    error: BaseException | None = None
    filled: bool = False
    on_done: Callable[[Queued], None] | None = None
    """Called once, after ``done`` is set, by whoever settles the entry first (a batch's
    answer, or the client giving up): how a non-blocking caller learns of it."""
    give_up_at: float = 0.0
    """A release whose row is locked is sent again with later batches until this
    :func:`rselection.clock.monotonic` time, then answered with an error."""
    _settled: threading.Lock = field(default_factory=threading.Lock)

    def fill(self, result: Any = None, error: BaseException | None = None) -> None:
        """The batch's answer for this entry; wakes its client (once: a client that gave
        up first keeps its own answer)."""
        if not self._settled.acquire(blocking=False):
            return
        self.result, self.error, self.filled = result, error, True
        self._finish()

    def give_up(self, error: BaseException) -> None:
        """The client stops waiting: ``error`` is its answer unless the batch's came first."""
        if not self._settled.acquire(blocking=False):
            return
        self.error = error
        self._finish()

    def _finish(self) -> None:
        self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # the sender goes on with the rest of its batch
                logger.exception("keeper: error handing over the answer of %r", self.lease.name)


@dataclass(frozen=True)
class Attempt:
    """What one acquisition attempt found: the lease's row as the node saw it."""

    acquired: bool
    row: tuple[Any, ...] | None
    """``STATE_COLUMNS`` of :mod:`._lease_sql`, or ``None`` when the row is missing."""


class KeeperBatches(KeeperSession):
    """The keeper session's renewals, attempts and releases, batched (see the module)."""

    def __init__(self, conninfo: str, table: str) -> None:
        super().__init__(conninfo, table)
        self._renewals: list[Queued] = []
        self._attempts: list[Queued] = []
        self._releases: list[Queued] = []
        self._retries: list[tuple[float, Queued]] = []  # locked releases: when to resend
        self._phase = clock.monotonic()  # renewal and attempt slots count from here

    def _shut(self) -> None:
        with self._state:
            queued = self._renewals + self._attempts + self._releases
            queued += [item for _, item in self._retries]
            self._renewals, self._attempts, self._releases, self._retries = [], [], [], []
        for item in queued:  # nobody sends them any more
            item.give_up(self._lost())
        super()._shut()

    # -- the queues ----------------------------------------------------------------------

    def _batch(
        self,
        queue: list[Queued],
        item: Queued,
        send: Callable[[list[Queued]], None],
    ) -> Any:
        """Queue ``item`` for the keeper's thread and wait until a batch sent it.

        The keeper's own thread sends every batch (it is idle otherwise): the callers
        wait on their own entry, never on the statement lock, so a round of a thousand
        renewals wakes each waiting thread once. A client that sets ``item.done`` itself
        gives up (``BackendUnavailable``): a batch in flight goes on for the others, and
        its answer for ``item`` is dropped.
        """
        self._enqueue(queue, item)
        while not item.done.wait(1.0):
            with self._state:
                gone = self._closed or self._pump is None or not self._pump.is_alive()
            if gone and not item.done.is_set():
                raise self._lost()
        if not item.filled:
            with self._state:
                if item in queue:
                    queue.remove(item)
            raise BackendUnavailable(
                f"lease {item.lease.name!r}: interrupted while the shared keeper session "
                f"({self.where}) was busy with a round trip"
            )
        if item.error is not None:
            raise item.error
        return item.result

    def _enqueue(self, queue: list[Queued], item: Queued) -> None:
        """Queue ``item`` for the keeper's thread, which sends it with the next batch."""
        with self._state:
            closed = self._closed
            if not closed:
                queue.append(item)
        if closed:
            item.give_up(self._lost())
            return
        self._wakeup.wake()

    def _send_queued(self) -> None:
        """Send the queued renewals, then the queued attempts, in as few batches as the
        one-entry-per-lease rule allows (on the keeper's thread)."""
        with self._state:
            now = clock.monotonic()
            # Locked releases whose next try is due join this round (unless given up).
            self._releases += [q for at, q in self._retries if at <= now and not q.done.is_set()]
            self._retries = [(at, q) for at, q in self._retries if at > now]
            if not (self._renewals or self._attempts or self._releases):
                return
            several = len(self._clients) > 1
        if several:
            self._gather()  # let the others due now join these batches
        for queue, send in (
            (self._renewals, self._send_renewals),
            (self._releases, self._send_releases),
            (self._attempts, self._send_attempts),
        ):
            while True:
                with self._state:
                    batch, queue[:] = _one_per_lease(queue)
                if not batch:
                    break
                try:
                    with self._lock:
                        send(batch)
                except BaseException as exc:  # every caller in the batch learns of it
                    for queued in batch:
                        if not queued.done.is_set():
                            queued.fill(error=exc)

    def _gather(self) -> None:
        """Wait while more round trips are being queued (see :data:`GATHER_QUIET`), at
        most :data:`GATHER` seconds."""
        deadline = clock.monotonic() + GATHER
        seen = -1
        while True:
            with self._state:
                queued = len(self._renewals) + len(self._attempts) + len(self._releases)
            if queued == seen or clock.monotonic() >= deadline:
                return
            seen = queued
            time.sleep(GATHER_QUIET)

    # -- renewals ------------------------------------------------------------------------

    def renew(
        self,
        lease: KeptLease,
        node_id: str,
        term: int,
        *,
        done: threading.Event | None = None,
    ) -> tuple[Any, ...] | None:
        """Renew ``term``; the row (name, term, handover columns), ``None`` when lost, or
        :data:`RENEWAL_SKIPPED`.

        Only the client that took ``term`` for ``node_id`` through this session renews it
        (not another client of the same lease and node, and not after its term ended).
        ``done``: the event the call waits on; a client that sets it gives up waiting
        (see :meth:`_batch`).
        """
        self.ensure(lease)
        with self._state:
            if self._holds.term_of((lease, node_id)) != term:
                return None
        queued = Queued(lease, node_id, term, done=done or threading.Event())
        row: tuple[Any, ...] | None = self._batch(self._renewals, queued, self._send_renewals)
        return row

    def renew_soon(
        self, lease: KeptLease, node_id: str, term: int, on_done: Callable[[Queued], None]
    ) -> Queued | None:
        """Queue a renewal of ``term`` without waiting: ``on_done(entry)`` is called once
        with its answer (as :meth:`renew` returns or raises it). ``None`` (nothing
        queued) when the session is not ready (see :meth:`ready`) or ``term`` is not held
        through it for ``node_id`` (the blocking :meth:`renew` answers that)."""
        if not self.ready(lease):
            return None
        with self._state:
            if self._holds.term_of((lease, node_id)) != term:
                return None
        queued = Queued(lease, node_id, term, on_done=on_done)
        self._enqueue(self._renewals, queued)
        return queued

    def _send_renewals(self, batch: list[Queued]) -> None:
        requests = [RenewRequest(q.lease.name, q.node_id, q.term, q.lease.ttl) for q in batch]
        try:
            results = self._run(
                renew_batch_sql(self._ident, requests, server=self._server),
                "renew the leases",
                limit=max(q.lease.renew_deadline for q in batch),
                tolerate=True,
            )
        except psycopg.Error as exc:
            # The statement failed on a healthy session: it renewed nothing. One row at
            # fault (a trigger, a constraint): halves are sent again until that lease is
            # alone, so that only its renewal fails. Otherwise (cancelled by hand, a
            # deadlock) every renewal of the batch is refused: those terms end.
            if len(batch) > 1 and _row_at_fault(exc):
                self._split(batch, self._send_renewals)
                return
            for queued in batch:
                logger.warning(
                    "lease %r: the server refused its renewal (%s); its term is lost",
                    queued.lease.name,
                    first_line(exc),
                )
                queued.fill(None)
            return
        renewed = {(row[0], row[1]): row for row in results[0] or []}
        for queued in batch:
            row = renewed.get((queued.lease.name, queued.term))
            queued.fill(RENEWAL_SKIPPED if row is not None and row[5] else row)

    @staticmethod
    def _split(batch: list[Queued], send: Callable[[list[Queued]], None]) -> None:
        middle = len(batch) // 2
        send(batch[:middle])
        send(batch[middle:])

    # -- attempts ------------------------------------------------------------------------

    def acquire(self, lease: KeptLease, node_id: str) -> Attempt:
        """Attempt ``lease`` for ``node_id`` (batched with the other attempts due)."""
        self.ensure(lease)
        attempt: Attempt = self._batch(self._attempts, Queued(lease, node_id), self._send_attempts)
        return attempt

    def acquire_soon(
        self, lease: KeptLease, node_id: str, on_done: Callable[[Queued], None]
    ) -> Queued | None:
        """Queue an attempt without waiting, as :meth:`renew_soon` does (its answer is
        an :class:`Attempt`)."""
        if not self.ready(lease):
            return None
        queued = Queued(lease, node_id, on_done=on_done)
        self._enqueue(self._attempts, queued)
        return queued

    def _listening(self, lease: KeptLease) -> None:
        """Under the statement lock: have ``lease`` listen on the session as it is.

        Never waits for an opening of the session, as :meth:`ensure` does: the opening's
        thread takes this lock to adopt the session, so a wait under it would never end.

        Raises:
            BackendUnavailable: the session is down (its opening has begun): try again.
        """
        if self.ready(lease):
            return
        if self._opening_needed(lease) is not None:
            raise BackendUnavailable(
                f"cannot acquire lease {lease.name!r} now: the keeper session is being "
                "opened again; trying again later"
            )
        self._listen(lease)

    def _send_attempts(self, batch: list[Queued]) -> None:
        with self._state:
            for q in batch:
                # A lease object that asks again while it holds a term gives that term
                # up (its leader attempts only once the term ended): its lock is freed
                # first in this round trip, so the attempt takes a fresh term. Another
                # object's hold of the same lease keeps its lock, and the lease, held.
                held = self._holds.take((q.lease, q.node_id))
                if held is not None:
                    self._unlocks.append((held[1], held[0]))
                self._unpark((q.lease, q.node_id))  # an ended term it did not release
        for q in batch[:]:
            try:
                self._listening(q.lease)
            except BackendUnavailable as exc:
                batch.remove(q)
                q.fill(error=exc)
        if not batch:
            return
        assert self._found is not None
        # No other round trip runs from here to the attempt's, and the reasons of ended
        # terms are read with the locks this round trip frees: a term whose lock it frees
        # is one whose reason it carries, should an attempt here take that term over.
        with self._lock:
            with self._state:
                endings = {q.lease.name: self._endings.get(q.lease.name) for q in batch}
                unlocks = self._take_unlocks()
            requests = []
            for q in batch:
                assert q.lease.channel is not None
                requests.append(
                    AcquireRequest(
                        q.lease.name,
                        q.node_id,
                        q.lease.ttl,
                        new_lock_key(),  # nobody can know the next term's lock beforehand
                        q.lease.channel,
                        create=not q.lease.row_seen,
                        version=q.lease.version,
                        history_limit=q.lease.history_limit,
                        ended=endings[q.lease.name],
                    )
                )
            try:
                results = self._run(
                    sql.SQL("{}; {}").format(
                        # A wait for a row another node inserts, or for a lock another
                        # session left, must not hold up the renewals queued behind.
                        bounded_sql(LOCK_BOUND, statement=False),
                        acquire_batch_sql(
                            self._ident,
                            requests,
                            server=self._server,
                            ring=ring_class(self._found.oid),
                            history=self._history,
                            process=(socket.gethostname(), os.getpid()),
                        ),
                    ),
                    "acquire the leases",
                    limit=max(q.lease.connect_timeout + q.lease.renew_deadline for q in batch),
                    tolerate=True,
                    undo=lambda pid: give_back_sql(self._ident, requests, pid),
                    unlocks=unlocks,
                )
            except psycopg.Error as exc:
                # Failed on a healthy session: nothing was taken, but the locks of the new
                # terms it took before the error stay (a rollback does not free them).
                self._free_next_terms(requests)
                if len(batch) > 1 and _row_at_fault(exc):
                    self._split(batch, self._send_attempts)
                    return
                for queued in batch:
                    queued.fill(
                        error=BackendUnavailable(
                            f"cannot acquire lease {queued.lease.name!r}: the server refused "
                            f"({first_line(exc)}); trying again later"
                        )
                    )
                return
        # Each term taken locked the key it drew, now its row's: freed when the term ends.
        # A row locked but not taken (its new lock held by another session) has no term.
        taken = {
            row[0]: (int(row[1]), int(row[2])) for row in results[-2] or [] if row[1] is not None
        }
        states = {row[0]: row for row in results[-1] or []}
        with self._state:
            for q in batch:
                if q.lease.name in taken:
                    self._holds.hold((q.lease, q.node_id), *taken[q.lease.name])
                    self._endings.pop(q.lease.name, None)  # that term's record is closed
        for q in batch:
            q.fill(Attempt(q.lease.name in taken, states.get(q.lease.name)))

    def _free_next_terms(self, requests: list[AcquireRequest]) -> None:
        """Free the next-term locks a failed acquisition may have taken (bounded: under a
        table lock they stay, which only keeps those leases held until the session
        ends, never frees one early)."""
        with self._state:
            held = [(key, term) for term, key in self._holds.terms()]
        try:
            self._run(
                sql.SQL("{}; {}").format(
                    bounded_sql(LOCK_BOUND), unlock_next_terms_sql(self._ident, requests, held)
                ),
                "free the locks of a failed acquisition",
                limit=LOCK_BOUND + 1.0,
                tolerate=True,
            )
        except psycopg.Error as exc:
            logger.warning(
                "keeper: could not free the locks of a failed acquisition: %s", first_line(exc)
            )

    # -- releases ------------------------------------------------------------------------

    def release(self, lease: KeptLease, node_id: str, term: int) -> bool:
        """Give ``term`` back (row cleared, followers notified, its lock freed); ``True``
        when the row was still ours.

        Sent with the other releases queued now (a process stopping a thousand leaders
        releases them in a few round trips). A row another transaction holds locked is
        skipped, not waited for, and tried again with the next batches for up to
        ``LOCK_BOUND`` seconds: the session never waits for a row lock, so no renewal
        waits behind a release.

        Raises:
            BackendUnavailable: the session broke, or the row stayed locked (the lease
                then passes on at the latest when it expires).
        """
        self.ensure(lease)
        queued = Queued(lease, node_id, term, give_up_at=clock.monotonic() + LOCK_BOUND)
        outcome = self._batch(self._releases, queued, self._send_releases)
        if outcome is RELEASE_REFUSED:
            return self._release_alone(lease, node_id, term)
        released: bool = outcome
        return released

    def release_soon(
        self, lease: KeptLease, node_id: str, term: int, on_done: Callable[[Queued], None]
    ) -> Queued | None:
        """Queue a release without waiting, as :meth:`renew_soon` does: ``on_done`` gets
        the entry once it is settled (a bool, :data:`RELEASE_REFUSED`, or an error; a
        locked row is retried by the keeper's thread meanwhile, as for :meth:`release`).
        """
        if not self.ready(lease):
            return None
        queued = Queued(
            lease, node_id, term, on_done=on_done, give_up_at=clock.monotonic() + LOCK_BOUND
        )
        self._enqueue(self._releases, queued)
        return queued

    def _lock_key(self, lease: KeptLease, node_id: str, term: int) -> int | None:
        """Under ``_state``: the key of the advisory lock that ``term`` of ``lease`` holds
        through the session (the one its acquisition locked; kept after the term ended,
        for its release), or ``None`` when it holds none any more (its unlock is queued
        already): nothing to free then."""
        for held in (self._holds.get((lease, node_id)), self._parked.get((lease, node_id))):
            if held is not None and held[0] == term:
                return held[1]
        return None

    def _released(self, lease: KeptLease, node_id: str, term: int) -> None:
        with self._state:
            self._holds.end_term((lease, node_id), term)
            parked = self._parked.get((lease, node_id))
            if parked is not None and parked[0] == term:
                del self._parked[(lease, node_id)]  # the release freed its lock
            ending = self._endings.get(lease.name)
            if ending is not None and ending.term == term:
                del self._endings[lease.name]  # its release closed its record
        self._io.recheck()

    def _send_releases(self, batch: list[Queued]) -> None:
        with self._state:
            requests = []
            for q in batch[:]:
                channel = q.lease.channel
                if channel is None:  # the session that held the term is gone
                    batch.remove(q)
                    q.fill(error=self._lost())
                    continue
                key = self._lock_key(q.lease, q.node_id, q.term)
                reason, by = q.lease.ending(q.term)
                requests.append(
                    ReleaseRequest(q.lease.name, q.node_id, q.term, channel, key, reason, by)
                )
        if not batch:
            return
        try:
            results = self._run(
                sql.SQL("{}; {}").format(
                    bounded_sql(LOCK_BOUND),
                    release_batch_sql(self._ident, requests, history=self._history),
                ),
                "release the leases",
                limit=max(q.lease.renew_deadline for q in batch),
                tolerate=True,
            )
        except psycopg.Error as exc:
            # Refused on a healthy session (a trigger, say): nothing was released, and no
            # lock freed; each is sent alone, so that only a row at fault fails.
            logger.debug("keeper: a batch of releases was refused (%s)", first_line(exc))
            for queued in batch:
                queued.fill(RELEASE_REFUSED)
            return
        answers = {row[0]: (bool(row[1]), bool(row[2])) for row in results[-1] or []}
        for q in batch:
            released, skipped = answers.get(q.lease.name, (False, False))
            if skipped:
                now = clock.monotonic()
                with self._state:
                    closed = self._closed
                    if not closed and now < q.give_up_at:
                        # Sent again with a later round: nobody waits for it meanwhile.
                        self._retries.append((now + RELEASE_RETRY, q))
                        continue
                with self._state:
                    self._unpark((q.lease, q.node_id), q.term)  # no release is coming
                if closed:
                    q.fill(error=self._lost())
                else:
                    q.fill(
                        error=BackendUnavailable(
                            f"cannot release lease {q.lease.name!r}: its row stayed locked by "
                            f"another transaction for {LOCK_BOUND:g} s; it passes on at the "
                            "latest when it expires"
                        )
                    )
                continue
            self._released(q.lease, q.node_id, q.term)
            q.fill(released)

    def _release_alone(self, lease: KeptLease, node_id: str, term: int) -> bool:
        """:meth:`release` in a round trip of its own (after a refused batch)."""
        channel = lease.channel
        if channel is None:  # the session that held the term is gone
            raise self._lost()
        with self._state:
            key = self._lock_key(lease, node_id, term)
        request = ReleaseRequest(lease.name, node_id, term, channel, key, *lease.ending(term))
        try:
            results = self._run(
                sql.SQL("{}; {}").format(
                    bounded_sql(LOCK_BOUND, statement=False),
                    release_sql(self._ident, request, history=self._history),
                ),
                "release the lease",
                limit=lease,
                tolerate=True,
            )
        except psycopg.Error as exc:
            # Refused on a healthy session (its row locked past LOCK_BOUND, a trigger):
            # this lease only; the session and every other lease's term go on, and this
            # one passes on by expiry.
            with self._state:
                self._unpark((lease, node_id), term)  # no release is coming
            raise BackendUnavailable(
                f"cannot release lease {lease.name!r}: the server refused "
                f"({first_line(exc)}); it passes on when it expires"
            ) from exc
        self._released(lease, node_id, term)
        return bool(results[-2])

    # -- slots ---------------------------------------------------------------------------

    def renewal_slot(self, due: float, interval: float, after: float) -> float:
        """The latest tick of the shared renewal grid (period ``interval``) at or before
        ``due`` and after ``after``; ``due`` itself when there is none."""
        ticks = math.floor((due - self._phase) / interval)
        slot = self._phase + ticks * interval
        return slot if slot > after else due

    def attempt_slot(self, due: float, interval: float) -> float:
        """The first tick of the shared attempt grid (period ``interval``) at or after
        ``due``."""
        ticks = math.ceil((due - self._phase) / interval)
        return self._phase + ticks * interval


def _row_at_fault(exc: psycopg.Error) -> bool:
    """Whether ``exc`` may come from one row of a batch (a trigger, a constraint, a value
    out of range), so that sending the rows apart isolates it; not a lock or statement
    timeout, a cancel or a deadlock, which say nothing about a row and would only
    repeat."""
    transient = (
        psycopg.errors.LockNotAvailable,
        psycopg.errors.QueryCanceled,
        psycopg.errors.DeadlockDetected,
        psycopg.errors.SerializationFailure,
    )
    return not isinstance(exc, transient)


def _one_per_lease(queue: list[Queued]) -> tuple[list[Queued], list[Queued]]:
    """Split the queue: at most one entry per lease name in a batch, the rest wait."""
    batch: list[Queued] = []
    rest: list[Queued] = []
    names: set[str] = set()
    for queued in queue:
        if queued.lease.name in names:
            rest.append(queued)
        else:
            names.add(queued.lease.name)
            batch.append(queued)
    return batch, rest
