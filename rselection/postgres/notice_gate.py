"""What a notification may make the keeper's clients do: whom to believe, and how often.

The keeper believes what a notice says only when its backend pid is its own session's
or a *member of the ring* (a session holding a ring lock of the lease table whose role
may update it, see :mod:`.ring`); anything else is a wake-up, rate-limited per channel
(a burst of :data:`BURST`, then one each :data:`SPACING` seconds, those held back
delivered together). The members are read at most once each :data:`MEMBERS_EVERY`
seconds. See ``docs/explanation/security.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from .. import clock

__all__ = ["BURST", "MEMBERS_EVERY", "SPACING", "NoticeGate"]

BURST = 4
"""Wake-ups unproven notices on one channel may cause at once."""

SPACING = 0.25
"""Seconds between two wake-ups of unproven notices on one channel, past the burst."""

MEMBERS_EVERY = 0.5
"""Seconds between two reads of the ring's members."""


class _Budget:
    """A token bucket: :data:`BURST` tokens, one more each :data:`SPACING` seconds."""

    def __init__(self, now: float) -> None:
        self._tokens = float(BURST)
        self._at = now

    def take(self, now: float) -> bool:
        self._tokens = min(float(BURST), self._tokens + (now - self._at) / SPACING)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def next_at(self) -> float:
        """When a token is there again."""
        return self._at + max(0.0, 1.0 - self._tokens) * SPACING


class NoticeGate:
    """The keeper's rules for notifications: its own pid, the ring's members, and a
    budget of wake-ups per channel. Safe from any thread."""

    def __init__(self) -> None:
        """No session yet: nothing proven."""
        self._lock = threading.Lock()
        self._own = 0
        self._members: frozenset[int] = frozenset()
        self._read_due = False
        self._read_at = 0.0  # monotonic: the next read of the members, not before
        self._budgets: dict[str, _Budget] = {}
        # channel -> when its wake-up is due, and the kinds of the notices held back
        self._deferred: dict[str, tuple[float, frozenset[str]]] = {}

    def connected(self, pid: int) -> None:
        """A new keeper session (backend ``pid``): read the members again."""
        with self._lock:
            self._own = pid
            self._members = frozenset()
            self._read_due = True
            self._read_at = 0.0

    def is_own(self, sender: int) -> bool:
        """True when ``sender`` is the keeper's own session."""
        with self._lock:
            return sender == self._own

    def proven(self, sender: int) -> bool:
        """True when ``sender`` is the keeper's own session or a member of the ring."""
        with self._lock:
            return sender == self._own or sender in self._members

    def joined(self) -> None:
        """A keeper announced ``up``, or a session not known yet announced itself a
        holder (it may be a keeper that just joined): read the members soon."""
        with self._lock:
            self._read_due = True

    def admit(self, channel: str, proven: bool, kind: str) -> bool:
        """Whether a notice of ``kind`` on ``channel`` may wake its clients now; if
        not, a wake-up is deferred to when the budget allows one (see :meth:`due`).
        Proven notices always may."""
        if proven:
            return True
        now = clock.monotonic()
        with self._lock:
            budget = self._budgets.get(channel)
            if budget is None:
                budget = self._budgets[channel] = _Budget(now)
            deferred = self._deferred.get(channel)
            if deferred is None and budget.take(now):
                return True
            at, kinds = deferred or (budget.next_at(), frozenset())
            self._deferred[channel] = (at, kinds | {kind})
            return False

    def due(self) -> list[tuple[str, frozenset[str]]]:
        """The channels whose deferred wake-up is due now (each spends its token), with
        the kinds of the notices it stands for."""
        now = clock.monotonic()
        with self._lock:
            ready = [(c, kinds) for c, (at, kinds) in self._deferred.items() if at <= now]
            woken = []
            for channel, kinds in ready:
                budget = self._budgets[channel]
                if budget.take(now):
                    del self._deferred[channel]
                    woken.append((channel, kinds))
                else:
                    self._deferred[channel] = (budget.next_at(), kinds)
            return woken

    def next_due(self, *, reading: bool) -> float | None:
        """When :meth:`due` or, if ``reading`` (the session can read the members now),
        a read of the members is next due (monotonic), if ever."""
        with self._lock:
            times = [at for at, _ in self._deferred.values()]
            if reading and self._read_due:
                times.append(self._read_at)
        return min(times, default=None)

    def read_now(self) -> bool:
        """True when the members should be read now; the caller then reports with
        :meth:`members_read` (or :meth:`read_failed`)."""
        now = clock.monotonic()
        with self._lock:
            if not self._read_due or now < self._read_at:
                return False
            self._read_due = False
            self._read_at = now + MEMBERS_EVERY
            return True

    def members_read(self, pids: Iterable[int]) -> None:
        """The members, as read on the keeper session."""
        with self._lock:
            self._members = frozenset(pids)

    def read_failed(self) -> None:
        """The read failed: try again at the next chance."""
        with self._lock:
            self._read_due = True

    def forget(self, channels: Iterable[str]) -> None:
        """No client listens on ``channels`` any more: drop their budgets."""
        with self._lock:
            for channel in channels:
                self._budgets.pop(channel, None)
                self._deferred.pop(channel, None)
