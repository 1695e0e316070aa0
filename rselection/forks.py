"""What a forked child does with the objects it inherits from its parent.

A server that forks its workers (gunicorn ``--preload``, uvicorn ``--workers``,
``multiprocessing``) copies every object of the parent into each child: connections
whose sockets the parent still uses, and threads, locks and events that only the parent's
threads could ever release. One byte written by a child on an inherited socket corrupts
the parent's session (its lease with it), so an object that holds any of these registers
here, and in each forked child its ``reset_after_fork()`` runs before the child's
code runs again: the object forgets what it inherited, without closing it (closing a
connection sends on its socket), and opens its own on its next use. What it forgets is
kept referenced for the child's life (:data:`_INHERITED`), so no finaliser ever runs on
it either.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

logger = logging.getLogger(__name__)

FORK_ADVICE = (
    "build or start it in each worker: gunicorn's post_fork or post_worker_init hook, "
    "the application's lifespan (FastAPI, Starlette), or after multiprocessing starts"
)


@runtime_checkable
class ResetAfterFork(Protocol):
    """An object that holds sessions, sockets, threads or locks of its process."""

    def reset_after_fork(self) -> None:
        """In a forked child: forget what the parent holds (never close it, never send
        on it) and keep it with :func:`keep_inherited`; be usable again, or refuse
        clearly."""


_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()
_REGISTERED_LOCK = threading.Lock()
# Inherited connections, sockets and threads, kept so that no finaliser runs on them in
# the child (a psycopg connection's would terminate the parent's session).
_INHERITED: list[object] = []


def register(obj: ResetAfterFork) -> None:
    """Reset ``obj`` in every child forked from this process from now on (held weakly)."""
    with _REGISTERED_LOCK:
        _REGISTERED.add(obj)


def keep_inherited(*resources: object) -> None:
    """In a forked child: keep ``resources`` referenced for the process's life, unused."""
    _INHERITED.extend(r for r in resources if r is not None)


class PerProcess:
    """Base of the classes with one instance per process (the lease driver, the wait
    pump, the shared event loops): :meth:`shared` makes it on first use, and makes a new
    one in a forked child, where the parent's has none of its threads."""

    _shared: ClassVar[Any]
    _shared_pid: ClassVar[int]
    _shared_lock: ClassVar[threading.Lock]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._shared, cls._shared_pid, cls._shared_lock = None, 0, threading.Lock()
        register(cls)

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child: the lock is made anew (a parent's thread may have held
        it); :meth:`shared` makes the child's instance."""
        cls._shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> Self:
        """This process's instance (a new one after ``fork()``)."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared_pid != os.getpid():
                cls._shared = cls()
                cls._shared_pid = os.getpid()
            return cls._shared  # type: ignore[no-any-return]


def _after_fork_in_child() -> None:
    global _REGISTERED_LOCK
    # The parent's threads are gone in the child: a lock one of them held stays held.
    _REGISTERED_LOCK = threading.Lock()
    for obj in list(_REGISTERED):
        try:
            obj.reset_after_fork()
        except Exception:  # one object's failure must not leave the others inherited
            logger.exception("could not reset %r in a forked child", obj)


if hasattr(os, "register_at_fork"):  # pragma: no branch - every POSIX Python has it
    os.register_at_fork(after_in_child=_after_fork_in_child)
