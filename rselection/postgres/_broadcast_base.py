"""What the threads of :class:`~rselection.postgres.PostgresBroadcaster` share.

Not public API. The broadcaster is assembled from :class:`BroadcastBase` (its
configuration, the state its threads and its public methods coordinate through, and how
connections are opened), :class:`~rselection.postgres._broadcast_writer.BroadcastWriter`
(the writer thread) and :class:`~rselection.postgres._broadcast_listener.BroadcastListener`
(the listener thread). :mod:`rselection.postgres.broadcast` explains the design.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import psycopg

from ..broadcast import Broadcaster
from ..errors import BackendUnavailable
from ._broadcast_conn import Deadlines, first_line
from ._outbox import Outbox, create_outbox

__all__ = ["BroadcastBase", "Pending"]


@dataclass
class Pending:
    """A message waiting for the writer."""

    seq: int
    channel: str
    payload: bytes  # the message as UTF-8 JSON
    inline: int  # upper bound of its bytes in an inline NOTIFY

    @property
    def size(self) -> int:
        """Bytes of JSON."""
        return len(self.payload)


class BroadcastBase(Broadcaster):
    """Configuration and shared state of a :class:`~rselection.postgres.PostgresBroadcaster`.

    ``PostgresBroadcaster.__init__`` validates and sets the configuration, then calls
    :meth:`_init_shared` and the listener's and writer's own ``_init_*`` methods, and
    starts both threads.
    """

    # Configuration, set by PostgresBroadcaster.__init__.
    retention: float
    probe_interval: float
    timeout: float
    max_message_bytes: int
    create_tables: bool
    synchronous_commit: bool
    _outbox: Outbox
    _conninfo: str
    _where: str

    def _init_shared(self) -> None:
        """Create the state the public methods, the writer and the listener share."""
        # State shared by the publisher, the writer and close(); guarded by _cond.
        self._cond = threading.Condition()
        self._pending: deque[Pending] = deque()
        self._seq = 0  # seq of the last message accepted by publish()
        self._committed = 0  # seq of the last message committed
        self._committed_count = 0  # messages committed
        self._closing = False
        self._stop = threading.Event()

        # Connections other threads may need to abort on close.
        self._conn_lock = threading.Lock()
        self._listen_conn: psycopg.Connection[Any] | None = None
        self._write_conn: psycopg.Connection[Any] | None = None
        self._watchdog = Deadlines(min(0.5, self.timeout / 4))

    def _connect(self, what: str, *, listen: bool) -> psycopg.Connection[Any]:
        """Open an autocommit connection with keepalives and timeouts, tables ready."""
        bound = self.probe_interval + self.timeout if listen else self.timeout
        try:
            conn = psycopg.Connection.connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=max(2, math.ceil(self.timeout)),
                application_name="rselection:broadcast",
                # Publish parameters are sent as UTF-8 bytes (see BroadcastWriter._write).
                client_encoding="UTF8",
                # A silent network ends a blocked call within about `bound` seconds even
                # where the watchdog is not armed (the listener's idle wait).
                keepalives=1,
                keepalives_idle=max(1, math.ceil(bound / 2)),
                keepalives_interval=1,
                keepalives_count=3,
                tcp_user_timeout=math.ceil(self.timeout * 1000) + 1000,
            )
        except psycopg.Error as exc:
            raise BackendUnavailable(
                f"cannot {what}: cannot connect ({self._where}): {first_line(exc, self._conninfo)}"
            ) from exc
        try:
            with self._watchdog.guard(conn, self.timeout):
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, false),"
                    " set_config('idle_session_timeout', '0', false),"
                    " set_config('synchronous_commit', %s, false)",
                    (
                        f"{math.ceil(self.timeout * 1000)}ms",
                        "on" if self.synchronous_commit else "off",
                    ),
                )
                if self.create_tables:
                    create_outbox(conn, self._outbox)
        except BaseException:
            conn.close()
            raise
        return conn

    def _has_any_readers(self) -> bool:
        """Whether this node has an open subscription or a connected receiver."""
        with self._lock:
            return any(self._subs.values()) or any(
                signal.receivers for signal in self._signals.values()
            )
