"""The publish statements of a broadcaster's writer, on sessions it borrows.

The writer holds no session of its own (see :mod:`.writer`): per lent session, and for
every writer of the process, this module remembers the session's identity and which
publish statements are prepared on it (named after their text). Every statement names
the tables with the schema the broadcaster's :class:`~.location.Locator` found, and
each publish checks that the name still finds that table. See
``docs/explanation/broadcaster.md``.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import pq

from ... import forks
from .._conn import IoWatchdog
from .location import Location, Locator
from .outbox import Outbox
from .sessions import query_one

__all__ = ["MANY", "ONE", "LentSession", "PublishStatements"]

#: The two publish statements (see :class:`~.outbox.Outbox`): a lone message, a batch.
ONE = "one"
MANY = "many"


@dataclass
class LentSession:
    """What the process knows of a session it borrows: asked once per session."""

    identity: tuple[int, Any]
    """``(backend pid, backend_start)``, to end the backend after a cut."""
    prepared: set[bytes] = field(default_factory=set)
    """Names of the publish statements prepared on it."""


# Per session lent to any writer of the process (the pooled sessions are shared, and a
# session is lent to one writer at a time); forgotten with the session.
_LENT: weakref.WeakKeyDictionary[psycopg.Connection[Any], LentSession] = weakref.WeakKeyDictionary()
_LENT_LOCK = threading.Lock()


class PublishStatements:
    """One writer's publish statements: resolved once, prepared once per lent session.

    A publish runs one of them through libpq with text parameters: no statement to
    compose, no parameter adaptation, no parsing or planning per publish, which saves
    more time than the server spends on the statement's extra work.

    Args:
        outbox: the outbox table.
        locator: finds it (the same for the broadcaster's listener).
        origin: the writer's origin (a parameter of every publish).
        synchronous_commit: the publishes' ``synchronous_commit``, set per transaction.
        deadlines: bounds each round trip.
        io_timeout: the bound, seconds.
    """

    def __init__(
        self,
        outbox: Outbox,
        locator: Locator,
        origin: int,
        synchronous_commit: bool,
        deadlines: IoWatchdog,
        io_timeout: float,
    ) -> None:
        """Nothing resolved yet (see :meth:`resolve`)."""
        self._outbox = outbox
        self._locator = locator
        self._origin = origin
        self._sync = b"on" if synchronous_commit else b"off"
        self._deadlines = deadlines
        self._io_timeout = io_timeout
        self._fixed: list[bytes] = []  # origin, NOTIFY channel, sync, the table
        self._named: dict[str, tuple[bytes, bytes]] = {}  # kind -> (name, text)
        self.outbox = outbox
        """The outbox with its tables schema-qualified once resolved (:meth:`resolve`):
        what every statement on a lent session uses."""
        self.location: Location | None = None
        """Where the table was found (:meth:`resolve`)."""

    @property
    def resolved(self) -> bool:
        """Whether :meth:`resolve` ran."""
        return bool(self._named)

    def forget(self) -> None:
        """The table is not where it was found (a publish found another, or none): find
        it again before the next publish."""
        self._named = {}

    def resolve(self, conn: psycopg.Connection[Any]) -> None:
        """Find the table (see :class:`~.location.Locator`: its schema and NOTIFY
        channel) and name the statements; once, and again after :meth:`forget`.

        Raises:
            ConfigError: the table does not exist.
            psycopg.Error: the round trip failed.
        """
        if self._named:
            return
        with self._deadlines.guard(conn, self._io_timeout):
            self._locator.read_path(conn)  # on a session of the broadcaster's own first
            location = self._locator.find(conn)
            pinned = location.outbox
            # Publishes lock the state table's row (see .outbox), and insert nothing
            # without it: a row deleted by hand is put back.
            present = query_one(conn, pinned.state_row())
            if present is not None and not present[0]:
                conn.execute(pinned.add_state_row())
        self._fixed = [
            str(self._origin).encode(),
            location.channel.encode(),
            self._sync,
            self._locator.path_param,
            self._locator.name.encode(),
            str(location.oid).encode(),
        ]
        named: dict[str, tuple[bytes, bytes]] = {}
        for kind, statement in ((ONE, pinned.insert_one()), (MANY, pinned.insert_many())):
            text = statement.as_bytes(conn)
            name = b"rselection_bc_" + hashlib.blake2b(text, digest_size=10).hexdigest().encode()
            named[kind] = (name, text)
        self.outbox = pinned
        self.location = location
        self._named = named

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child (see :mod:`rselection.forks`): the lock of what the process
        knows of its lent sessions is made anew (a parent's writer may have held it)."""
        global _LENT_LOCK
        _LENT_LOCK = threading.Lock()

    def lent(self, conn: psycopg.Connection[Any]) -> LentSession:
        """What the process knows of ``conn``, asking its identity on first use.

        Raises:
            psycopg.Error: the round trip failed.
        """
        with _LENT_LOCK:
            known = _LENT.get(conn)
        if known is not None:
            return known
        with self._deadlines.guard(conn, self._io_timeout):
            row = query_one(
                conn, "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            )
        identity = (conn.info.backend_pid, None) if row is None else (int(row[0]), row[1])
        with _LENT_LOCK:
            return _LENT.setdefault(conn, LentSession(identity))

    def run(
        self, conn: psycopg.Connection[Any], kind: str, params: Sequence[bytes]
    ) -> pq.abc.PGresult:
        """Run publish statement ``kind`` with the message parameters ``params``,
        preparing it on ``conn`` first if needed; return its one-row result.

        Raises:
            psycopg.Error: the statement failed (nothing was committed unless the
                connection broke after sending it).
        """
        self.resolve(conn)
        name, text = self._named[kind]
        lent = self.lent(conn)
        for attempt in (1, 2):
            if name not in lent.prepared:
                self._prepare(conn, lent, name, text)
            with self._deadlines.guard(conn, self._io_timeout):
                result = conn.pgconn.exec_prepared(name, [*self._fixed, *params])
            if result.status == pq.ExecStatus.TUPLES_OK:
                return result
            error = psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
            if attempt == 1 and isinstance(error, psycopg.errors.InvalidSqlStatementName):
                # Deallocated behind this process's back (DEALLOCATE ALL): nothing ran.
                lent.prepared.clear()
                continue
            raise error
        raise AssertionError("unreachable")  # pragma: no cover

    def _prepare(
        self, conn: psycopg.Connection[Any], lent: LentSession, name: bytes, text: bytes
    ) -> None:
        with self._deadlines.guard(conn, self._io_timeout):
            result = conn.pgconn.prepare(name, text)
        if result.status != pq.ExecStatus.COMMAND_OK:
            error = psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
            # Another writer of the process prepared it on this session first.
            if not isinstance(error, psycopg.errors.DuplicatePreparedStatement):
                raise error
        lent.prepared.add(name)


forks.register(PublishStatements)
