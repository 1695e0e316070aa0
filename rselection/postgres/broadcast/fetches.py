"""The fetches of a broadcaster's listener, prepared on the listening session's connection.

A listener reads every message it delivers from the outbox table (a NOTIFY is only a
wake-up, see :mod:`.wakeups`), so at a steady pace it fetches once per message, and the
fetch is on the way of every message from its publisher to a subscriber. Like the
publishes (:mod:`.statements`), the two fetch statements of :class:`~.outbox.Outbox`
are prepared once per connection and run through libpq with text parameters: no cursor,
no adaptation, no row conversion but the few values read, which takes about half the
time of the same statement through a psycopg cursor.

Notifications that arrive while a fetch runs wait in libpq; :meth:`Fetches.run` hands
them to psycopg at once, as its own statements do, so the session's wait for the next
NOTIFY sees them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import psycopg
from psycopg import pq

from .location import Location, Locator

__all__ = ["Fetches", "Row"]

Row = tuple[int, int, int, int | None, str, str]
"""``(purged_through, newest id, table oid, id, channel, payload)``; ``id`` is ``None``
(and the channel and payload empty) in the one row of a fetch that found nothing new."""


def _name(text: bytes) -> bytes:
    """A statement's name, after its text (the listeners of one table on a connection
    share it; no two texts share one)."""
    return b"rselection_bcl_" + hashlib.blake2b(text, digest_size=10).hexdigest().encode()


def _decoded(value: bytes | None) -> str:
    # The session's client_encoding is UTF8; what a role with rights on the table put
    # there is text, and never raises here even on a server that does not check it.
    return "" if value is None else bytes(value).decode("utf-8", "replace")


class Fetches:
    """A listener's two fetch statements on one connection of the listening session.

    Args:
        conn: the connection (the session's, used only from its thread).
        location: where the table was found.
        locator: how it was found (the search path and name the full fetch checks).
    """

    def __init__(self, conn: psycopg.Connection[Any], location: Location, locator: Locator) -> None:
        """Compose the statements (prepared on first use)."""
        self._conn = conn
        self._statements = {
            woken: (_name(text), text)
            for woken, text in (
                (False, location.outbox.fetch().as_bytes(conn)),
                (True, location.outbox.fetch_next().as_bytes(conn)),
            )
        }
        self._finds = [locator.path_param, locator.name.encode()]
        self._prepared: set[bytes] = set()

    def run(self, last_id: int, rows: int, size: int, *, woken: bool) -> list[Row]:
        """The page after ``last_id``: at most ``rows`` rows and about ``size`` bytes.

        Args:
            last_id: the last id delivered.
            rows: the row limit.
            size: the byte limit (see :meth:`~.outbox.Outbox.fetch_next`).
            woken: run :meth:`~.outbox.Outbox.fetch_next` (after a wake-up), else
                :meth:`~.outbox.Outbox.fetch`.

        Raises:
            psycopg.Error: the statement failed, or the connection did.
        """
        name, text = self._statements[woken]
        params = [str(last_id).encode(), str(rows).encode(), str(size).encode()]
        if not woken:
            params += self._finds
        pgconn = self._conn.pgconn
        for attempt in (1, 2):
            if name not in self._prepared:
                self._prepare(name, text)
            result = pgconn.exec_prepared(name, params)
            self._take_notifies()
            if result.status == pq.ExecStatus.TUPLES_OK:
                return [self._row(result, i) for i in range(result.ntuples)]
            error = psycopg.errors.error_from_result(result, encoding="utf-8")
            if attempt == 1 and isinstance(error, psycopg.errors.InvalidSqlStatementName):
                self._prepared.clear()  # deallocated behind the listener's back
                continue
            raise error
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _row(result: pq.abc.PGresult, i: int) -> Row:
        value = result.get_value
        row_id = value(i, 3)
        return (
            int(value(i, 0) or 0),
            int(value(i, 1) or 0),
            int(value(i, 2) or 0),
            None if row_id is None else int(row_id),
            _decoded(value(i, 4)),
            _decoded(value(i, 5)),
        )

    def _prepare(self, name: bytes, text: bytes) -> None:
        result = self._conn.pgconn.prepare(name, text)
        self._take_notifies()
        if result.status != pq.ExecStatus.COMMAND_OK:
            error = psycopg.errors.error_from_result(result, encoding="utf-8")
            # Another listener of the same table prepared it on this connection first.
            if not isinstance(error, psycopg.errors.DuplicatePreparedStatement):
                raise error
        self._prepared.add(name)

    def _take_notifies(self) -> None:
        """Hand the notifications libpq received during a statement to psycopg, which
        keeps them for the session's next ``notifies()``."""
        pgconn = self._conn.pgconn
        while (note := pgconn.notifies()) is not None:
            handler = pgconn.notify_handler
            if handler is not None:
                handler(note)
