"""``SharedKeeper``: one keeper session per process, connection string and lease table.

Every :class:`~rselection.postgres.PostgresLease` of a process that uses the same
connection string and lease table is a client of one :class:`SharedKeeper`
(:meth:`~SharedKeeper.attach`), and every node of a
:class:`~rselection.postgres.membership.PostgresMembership` heartbeats through it
(:meth:`~SharedKeeper.beat_through`); the last client to leave closes the session.
"""

from __future__ import annotations

import os
import threading
from typing import ClassVar

from ... import forks
from .heartbeats import HEARTBEAT_LIMIT, Heartbeat
from .pump import KeeperPump
from .session import KeptLease

__all__ = ["SharedKeeper"]


class SharedKeeper(KeeperPump):
    """The keeper session of one process, connection string and lease table.

    Get it with :meth:`attach`; every method is safe from any thread. Statements run one
    at a time on the session (a lock); renewals and attempts of many clients share one.
    """

    _registry: ClassVar[dict[tuple[int, str, str], SharedKeeper]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child (see :mod:`rselection.forks`): the registry's lock is made
        anew (a parent's thread may have held it). The parent's keepers stay in the
        registry, under its process id, and their clients forget them: their sessions
        are never used here, nor closed."""
        cls._registry_lock = threading.Lock()

    @classmethod
    def attach(cls, lease: KeptLease) -> SharedKeeper:
        """The keeper of ``lease``'s process, conninfo and table, with ``lease`` a client."""
        key = (os.getpid(), lease.conninfo, lease.table)
        with cls._registry_lock:
            keeper = cls._registry.get(key)
            if keeper is None:
                keeper = cls._registry[key] = SharedKeeper(lease.conninfo, lease.table)
            with keeper._state:
                keeper._clients.add(lease)
                keeper._want = max(keeper._want, lease.renew_deadline + lease.stop_grace)
                keeper._timeout = max(keeper._timeout, lease.connect_timeout)
        return keeper

    @classmethod
    def beat_through(cls, conninfo: str, table: str, node: Heartbeat) -> SharedKeeper:
        """Heartbeat ``node`` on the keeper session of this process, ``conninfo`` and
        lease ``table`` (its first heartbeat goes out as soon as the session is up)."""
        key = (os.getpid(), conninfo, table)
        with cls._registry_lock:
            keeper = cls._registry.get(key)
            if keeper is None:
                keeper = cls._registry[key] = SharedKeeper(conninfo, table)
            with keeper._state:
                keeper._beats[node] = 0.0
                keeper._beat_early = max(keeper._beat_early, node.heartbeat_interval / 4)
        keeper._wakeup.wake()
        return keeper

    def stop_beating(self, node: Heartbeat) -> None:
        """No more heartbeats of ``node``; the last client closes the session.

        Returns once a batch in flight, which may hold a heartbeat of ``node``, has ended
        (waited for as long as the batch may last): a row deleted after this call is not
        written back by it.
        """
        with self._registry_lock, self._state:
            self._beats.pop(node, None)
            last = self._last_client()
        if last:
            self._shut()
        elif self._beating.acquire(timeout=HEARTBEAT_LIMIT):
            self._beating.release()

    def _last_client(self) -> bool:
        """Under both locks: with no client left, leave the registry (then shut)."""
        if self._clients or self._beats or self._closed:
            return False
        self._registry.pop((os.getpid(), self._conninfo, self.table), None)
        self._closed = True
        return True

    def detach(self, lease: KeptLease) -> None:
        """``lease`` is closed: end its holds and stop listening on its channel unless
        another client listens there; the last client closes the session."""
        with self._registry_lock, self._state:
            self._clients.discard(lease)
            for channel, clients in list(self._by_channel.items()):
                clients.discard(lease)
                if not clients:
                    del self._by_channel[channel]
                    self._unlistens.add(channel)
            for key in [k for k in self._holds.holders() if k[0] is lease]:
                held = self._holds.take(key)
                if held is not None:
                    self._unlocks.append((held[1], held[0]))
            for key in [k for k in self._parked if k[0] is lease]:
                self._unpark(key)
            last = self._last_client()
            leave = bool(self._unlistens) and not last
        if last:
            self._shut()
        elif leave:
            self._wakeup.wake()  # the keeper's thread sends the UNLISTEN


forks.register(SharedKeeper)
