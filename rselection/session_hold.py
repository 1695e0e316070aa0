"""The hold on a lease keeper's session: never closed while a term taken through it may run.

Followers take a lease over the moment its holder's session is gone (Postgres frees the
holder's advisory lock, Redis forgets its client id). So from an acquisition until the
leader reports the term over (:meth:`~rselection.abc.LeaseBackend.term_ended`, once
the term's tasks are joined), or the backend releases the term or is closed, a backend
must not close that session, whatever fails: an error only marks the session broken,
every later call reports it (``BackendUnavailable``), and the session is closed once the
hold is over. :class:`SessionHolds` keeps that state, once for every backend: the
Postgres keeper session holds the terms of many leases (one per lease and node), a Redis
lease's session one term (:class:`SessionHold`).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["SessionHold", "SessionHolds"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SessionHolds(Generic[K, V]):
    """The terms a keeper session holds, by key, and whether it failed; safe from any thread.

    A backend calls :meth:`hold` when it acquires a term through the session (with a
    value of its own: the Postgres keeper's lock key), :meth:`end_term` when it is over
    (``term_ended``, ``release``), :meth:`fail` on every error of the session (and closes
    the session only when it returns true), :meth:`reset` when it closed the session, and
    checks :attr:`stale` and :attr:`broken` before using it. A key holds one term at a
    time: a newer term of the key replaces the older one.
    """

    def __init__(self) -> None:
        """Create the state of a session that holds nothing and has not failed."""
        self._lock = threading.Lock()
        self._held: dict[K, tuple[int, V]] = {}
        self._broken = False

    @property
    def holding(self) -> bool:
        """True while any term is held (from :meth:`hold` until its :meth:`end_term`)."""
        with self._lock:
            return bool(self._held)

    @property
    def broken(self) -> bool:
        """True once the session failed (see :meth:`fail`), until :meth:`reset`."""
        with self._lock:
            return self._broken

    @property
    def stale(self) -> bool:
        """True when the session failed and holds nothing any more: close it, start afresh."""
        with self._lock:
            return self._broken and not self._held

    def get(self, key: K) -> tuple[int, V] | None:
        """The term ``key`` holds and its value, or ``None``."""
        with self._lock:
            return self._held.get(key)

    def term_of(self, key: K) -> int | None:
        """The term ``key`` holds, or ``None``."""
        with self._lock:
            held = self._held.get(key)
        return held[0] if held is not None else None

    def holders(self) -> list[K]:
        """The keys that hold a term now."""
        with self._lock:
            return list(self._held)

    def terms(self) -> list[tuple[int, V]]:
        """Each held term with its value."""
        with self._lock:
            return list(self._held.values())

    def hold(self, key: K, term: int, value: V) -> None:
        """``term`` was acquired for ``key`` through the session: hold the session until
        it ends (a term ``key`` held before is not held any more).

        Args:
            key: what holds the term (the Postgres keeper's: its lease and node).
            term: the acquired term.
            value: kept with the term (the Postgres keeper's: the term's lock key).
        """
        with self._lock:
            self._held[key] = (term, value)

    def end_term(self, key: K, term: int) -> tuple[int, V] | None:
        """``term`` of ``key`` is over (its tasks joined, or it was released): let the
        session go as far as that term goes; return what was held, or ``None``.

        A call for another term than the one ``key`` holds changes nothing: a newer
        term is still held.
        """
        with self._lock:
            held = self._held.get(key)
            if held is None or held[0] != term:
                return None
            del self._held[key]
            return held

    def take(self, key: K) -> tuple[int, V] | None:
        """Stop holding whatever term ``key`` holds; return it with its value, or ``None``."""
        with self._lock:
            return self._held.pop(key, None)

    def fail(self) -> bool:
        """The session failed: mark it broken; return true when the caller must close it
        now (it holds nothing), then :meth:`reset` it.

        While it holds a term the session stays open, broken (false is returned): it is
        closed once the hold is over (:attr:`stale`). It counts as broken until
        :meth:`reset` either way, so no caller takes it for a usable session meanwhile.
        """
        with self._lock:
            self._broken = True
            return not self._held

    def reset(self) -> None:
        """The session was closed: it holds nothing and a new one has not failed."""
        with self._lock:
            self._held = {}
            self._broken = False


class SessionHold(SessionHolds[None, None]):
    """:class:`SessionHolds` of a session that holds one term at a time (a Redis lease's).

    A backend calls :meth:`begin` when it acquires a term through the session,
    :meth:`end` from ``term_ended`` and ``release``, and the rest as
    :class:`SessionHolds` says.
    """

    @property
    def term(self) -> int | None:
        """The term the session holds, or ``None``."""
        return self.term_of(None)

    def begin(self, term: int) -> None:
        """A term was acquired through the session: hold the session until it ends.

        Args:
            term: the acquired term.
        """
        self.hold(None, term, None)

    def end(self, term: int) -> None:
        """``term`` is over (its tasks joined, or it was released): let the session go.

        A call for another term than the held one changes nothing: a newer term the
        session holds is still held.

        Args:
            term: the term that ended.
        """
        self.end_term(None, term)
