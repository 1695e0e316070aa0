"""The hold on a lease keeper's session: never closed while a term taken through it may run.

Followers take a lease over the moment its holder's session is gone (Postgres frees the
holder's advisory lock, Redis forgets its client id). So from an acquisition until the
leader reports the term over (:meth:`~rselection.lease.LeaseBackend.term_ended`, once
the term's tasks are joined), or the backend releases the term or is closed, a backend
must not close that session, whatever fails: an error only marks the session broken,
every later call reports it (``BackendUnavailable``), and the session is closed once the
hold is over. :class:`SessionHold` keeps that state, once for every backend.
"""

from __future__ import annotations

import threading

__all__ = ["SessionHold"]


class SessionHold:
    """Whether a keeper session holds a term and whether it failed; safe from any thread.

    A backend calls :meth:`begin` when it acquires a term through the session,
    :meth:`end` from ``term_ended`` and ``release``, :meth:`fail` on every error of the
    session (and closes the session only when it returns true), :meth:`reset` when it
    closed the session, and checks :attr:`stale` and :attr:`broken` before using it.
    """

    def __init__(self) -> None:
        """Create the state of a session that holds nothing and has not failed."""
        self._lock = threading.Lock()
        self._term: int | None = None
        self._broken = False

    @property
    def holding(self) -> bool:
        """True from :meth:`begin` until :meth:`end` of that term (or :meth:`reset`)."""
        with self._lock:
            return self._term is not None

    @property
    def term(self) -> int | None:
        """The term the session holds, or ``None``."""
        with self._lock:
            return self._term

    @property
    def broken(self) -> bool:
        """True once the session failed (see :meth:`fail`), until :meth:`reset`."""
        with self._lock:
            return self._broken

    @property
    def stale(self) -> bool:
        """True when the session failed and holds nothing any more: close it, start afresh."""
        with self._lock:
            return self._broken and self._term is None

    def begin(self, term: int) -> None:
        """A term was acquired through the session: hold the session until it ends.

        Args:
            term: the acquired term.
        """
        with self._lock:
            self._term = term

    def end(self, term: int) -> None:
        """``term`` is over (its tasks joined, or it was released): let the session go.

        A call for another term than the held one changes nothing: a newer term the
        session holds is still held.

        Args:
            term: the term that ended.
        """
        with self._lock:
            if self._term == term:
                self._term = None

    def fail(self) -> bool:
        """The session failed: return true when the caller must close it now.

        While it holds a term the session is only marked broken (and false returned):
        it is closed once the hold is over.
        """
        with self._lock:
            if self._term is not None:
                self._broken = True
                return False
            return True

    def reset(self) -> None:
        """The session was closed: it holds nothing and a new one has not failed."""
        with self._lock:
            self._term = None
            self._broken = False
