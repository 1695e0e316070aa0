"""The public face of the broadcast package: :class:`PostgresBroadcaster`.

It checks the configuration, starts its :class:`~.writer.Writer` and
:class:`~.listener.Listener`, and holds the public API; :mod:`rselection.postgres.broadcast`
explains the design.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import psycopg

from ... import forks
from ...broadcast import Broadcaster, BroadcastStats, OverflowHook, Receiver, Subscription
from ...errors import BackendUnavailable, ConfigError, RSelectionError
from ...json_text import strict_json
from .listener import GapHook, Listener
from .listening import ListeningSession
from .outbox import BROADCAST_TABLE, Outbox
from .sessions import Sessions
from .settings import Settings
from .writer import Writer

__all__ = ["MessageEncodeError", "PostgresBroadcastStats", "PostgresBroadcaster"]

logger = logging.getLogger(__name__)


class MessageEncodeError(ConfigError, TypeError):
    """A message cannot be published: it has no JSON form (or not one Postgres can store).

    A :class:`~rselection.errors.ConfigError` (so a ``ValueError``) and a ``TypeError``.
    """


@dataclass(frozen=True)
class PostgresBroadcastStats(BroadcastStats):
    """A snapshot of a :class:`PostgresBroadcaster` (see :meth:`PostgresBroadcaster.stats`).

    Adds to :class:`~rselection.broadcast.BroadcastStats`:

    :param published: messages this node committed to the outbox.
    :param pending: messages published here and not committed yet.
    :param received: outbox rows this node's listener read (every channel).
    :param gaps: gaps reported (see :class:`Gap`); 0 unless a listener fell behind by more
        than the retention.
    :param missed: upper bound of the messages lost in those gaps.
    :param resets: times the outbox's ids went back (the table created again, its
        sequence reset, a restore from a backup) and the listener resynchronised on the
        new ids, each reported as a :class:`Gap` with ``reset=True``.
    :param reconnects: times the listener lost its connection and connected again (closing
        it when the process's last reader has gone is not counted).
    :param ignored_notifies: NOTIFYs on the table's channel whose payload was not an
        outbox id, ignored (no broadcaster sends one: another client of the database
        did, see the warning log); a NOTIFY is only ever a wake-up, and what is
        delivered is read from the outbox table.
    :param listening: whether the listener LISTENs (this node has readers) from a known
        position: every message committed from then on is delivered (a backlog is
        fetched a page per turn of the listening thread, so it may still be catching up).
    :param last_id: the outbox id of the last message delivered.
    :param listener_pid: the backend pid of the process's listening session, to find it
        in ``pg_stat_activity``; ``None`` while it is disconnected, which it is while no
        broadcaster of the process on this connection string has readers.
    """

    published: int = 0
    pending: int = 0
    received: int = 0
    gaps: int = 0
    missed: int = 0
    resets: int = 0
    reconnects: int = 0
    ignored_notifies: int = 0
    listening: bool = False
    last_id: int = 0
    listener_pid: int | None = None


class PostgresBroadcaster(Broadcaster):
    """A :class:`~rselection.Broadcaster` whose messages reach every node on the database.

    ``publish(channel, message)`` on any node delivers ``message`` to the subscriptions
    and receivers of ``channel`` on every node with a broadcaster on the same table (this
    one included, once), in the same order everywhere. Local fan-out is the
    :class:`~rselection.Broadcaster`'s: bounded per-subscription buffers, overflow counted
    and reported, a slow subscriber never holds up the others. Receivers connected with
    :meth:`connect` run in the listener thread, which every broadcaster of the process
    on the same connection string shares: keep them short. See
    ``docs/explanation/broadcaster.md`` for how delivery, ordering, catch-up and gaps
    work.

    Publishes hold no session of their own: each batch borrows one of the process's
    pooled sessions (at most 2 per connection string, shared with claims, checkpoints
    and membership), or a connection of the pool given as ``conninfo``. The listener
    holds a session only while the process has subscriptions or receivers (one per
    process and connection string, however many broadcasters and readers), and closes
    it as soon as the last of them has gone: a node that only publishes never listens.
    :meth:`subscribe` and :meth:`connect` return once the listener knows where it starts
    (connecting, and a round trip or two, when it is not listening yet; at most
    ``io_timeout`` seconds), so every message committed after they return is delivered.

    Args:
        conninfo: a libpq connection string or URI, a ``psycopg.Connection`` or a pool
            (``psycopg_pool.ConnectionPool``). With a string or a connection, publishes
            borrow the process's pooled sessions for that string (for a connection: the
            parameters it connected with; the connection itself is never used). With a
            pool, publishes and purges borrow its connections (one in autocommit mode or
            not; its settings are left as they were). The listening session, which LISTEN
            needs kept for it (a pool cannot lend that), and the table check at
            construction use the same parameters (a pool's ``conninfo`` and libpq
            ``kwargs``), which resolve ``table`` to the ``schema.table`` every statement
            on the pool's connections names (their ``search_path`` does not matter).
            An async pool is refused.
            Publishes through a pooler in transaction or statement mode are refused
            (:meth:`publish` raises ``ConfigError``).
        table: outbox table, optionally schema-qualified (``"ops.broadcast"``); every
            node that should hear each other uses the same one. Without a schema, the
            first schema of the search path of the broadcaster's own sessions (read
            once) that holds it; the writer and the listener follow it there when that
            changes (see :mod:`rselection.postgres.broadcast.location`).
        retention: seconds a message stays in the outbox (server time), i.e. how long a
            node may be disconnected and still catch up without a gap. Default 600.
        create_tables: create the tables on first connect; else run
            :func:`~rselection.postgres.migrate` (or ``rselection migrate``) once with a
            role that may run DDL.
        probe_interval: seconds of silence after which the listener polls the outbox,
            which also checks that its connection is alive (a shared listening session
            polls after the shortest of its broadcasters').
        io_timeout: bound of one round trip (connect, write, fetch, probe), seconds; a
            connection that overruns it is dropped and reconnected (a shared listening
            session uses the longest of its broadcasters').
        max_message_bytes: largest message accepted, as UTF-8 JSON (default 1 MiB).
        max_pending: messages that may wait for the writer; when that many wait,
            :meth:`publish` waits for room, and raises
            :class:`~rselection.errors.BackendUnavailable` after ``io_timeout`` seconds.
        synchronous_commit: wait for the WAL flush on every publish. Off by default: a
            Postgres crash may then lose the last fraction of a second of messages
            (NOTIFY itself keeps nothing across a crash), and publishes are about twice
            as fast. Disconnected listeners never lose messages either way.
        close_timeout: seconds :meth:`close` waits for pending messages to be written.
        on_overflow: see :class:`~rselection.Broadcaster`.
        on_gap: optional ``hook(gap)`` called in the listener thread for each
            :class:`Gap`; an exception it raises is logged and ignored.

    Raises:
        ConfigError: a bad ``conninfo`` (an async pool among them), unsafe table name,
            non-positive or non-finite timings, bad limits, or hooks that are not
            callable.
    """

    def __init__(
        self,
        conninfo: str | Any,
        *,
        table: str = BROADCAST_TABLE,
        retention: float = 600.0,
        create_tables: bool = True,
        probe_interval: float = 5.0,
        io_timeout: float = 10.0,
        max_message_bytes: int = 1024 * 1024,
        max_pending: int = 10_000,
        synchronous_commit: bool = False,
        close_timeout: float = 5.0,
        on_overflow: OverflowHook | None = None,
        on_gap: GapHook | None = None,
    ) -> None:
        outbox = Outbox(table)  # validates the name
        settings = Settings(
            retention=retention,
            probe_interval=probe_interval,
            io_timeout=io_timeout,
            close_timeout=close_timeout,
            max_message_bytes=max_message_bytes,
            max_pending=max_pending,
            synchronous_commit=synchronous_commit,
            create_tables=create_tables,
        )
        if on_gap is not None and not callable(on_gap):
            raise ConfigError(f"on_gap must be callable or None, got {on_gap!r}")
        super().__init__(on_overflow=on_overflow)
        self.table = table
        self.settings = settings
        """The checked configuration (retention, timeouts, limits)."""
        self._sessions = Sessions(conninfo, outbox, settings)  # validates conninfo
        self._listener = Listener(self._sessions, self.has_readers, self._deliver_here, on_gap)
        self._writer = Writer(self._sessions, self._listener, self.has_readers)
        self._flush_warned = False  # flush() was called in the listener thread
        # Set in a forked child: the next call starts a writer and a listener there.
        self._restart = False
        self._restart_lock = threading.Lock()
        self._pool_inherited = False  # in a forked child: the pool given is the parent's
        self._listener.start()
        self._writer.start()

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): the writer's and the
        listener's threads and sessions are the parent's. What the parent published and
        had not written yet stays the parent's to write; the child's next call starts a
        writer of its own and attaches its listener to the child's listening session
        (which starts from the newest message, as for a new reader)."""
        super().reset_after_fork()
        self._sessions.reset_after_fork()
        self._listener.reset_after_fork()
        self._restart_lock = threading.Lock()
        self._restart = True
        self._pool_inherited = self._sessions.user_pool

    def _here(self) -> None:
        """After a fork, start this process's writer and listener (once)."""
        if not self._restart:
            return
        with self._restart_lock:
            if not self._restart:
                return
            if not self._writer.closing:  # one closed in the parent stays closed here
                self._writer = Writer(self._sessions, self._listener, self.has_readers)
                self._listener.start()
                self._writer.start()
                self._listener.resume()
            self._restart = False

    def _deliver_here(self, channel: str, message: object) -> object:
        """Hand a message read from the outbox to this node's readers."""
        return super().publish(channel, message)

    # -- public API -----------------------------------------------------------------

    @property
    def retention(self) -> float:
        """Seconds a message stays in the outbox (server time)."""
        return self.settings.retention

    @property
    def io_timeout(self) -> float:
        """Bound of one round trip, seconds."""
        return self.settings.io_timeout

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (publishing is refused from that moment)."""
        return self._writer.closing or super().closed

    def publish(self, channel: str, message: object) -> int:
        """Publish ``message`` on ``channel`` to every node, this one included.

        Encodes the message as JSON now and returns without waiting for Postgres (unless
        ``max_pending`` messages already wait); the writer thread commits it shortly (see
        :meth:`flush`). Subscribers receive the decoded JSON: tuples come back as lists,
        and dict keys must be strings to come back unchanged.

        :param channel: a non-empty str of any length (no NUL characters: Postgres text
            cannot hold them).
        :param message: anything :func:`json.dumps` encodes (no NaN or infinities).
        :returns: how many messages of this broadcaster wait to be written, this one
            included (local deliveries happen later, when the message comes back from
            Postgres).
        :raises ConfigError: bad channel, the message is larger than
            ``max_message_bytes``, or the sessions publishes ride on go through a pooler
            in transaction or statement mode.
        :raises MessageEncodeError: the message has no JSON form.
        :raises BroadcasterClosed: the broadcaster is closed.
        :raises RSelectionError: in a process forked from the one that built the
            broadcaster with a pool: the pool is that process's.
        :raises BackendUnavailable: ``max_pending`` messages have waited ``io_timeout``
            seconds for the writer (Postgres is unreachable or too slow); nothing is
            queued. Never raised for a message that fits: publishing never blocks on
            Postgres round trips.
        """
        self._check_pg_channel(channel)
        self._here()
        if self.closed:
            raise self._closed_error("publish")
        if self._pool_inherited:
            raise RSelectionError(
                f"PostgresBroadcaster was given a pool in the process this one "
                f"({os.getpid()}) was forked from: its connections are that process's, "
                f"and a publish on one would run in its sessions; {forks.FORK_ADVICE}"
            )
        payload = self._encode(channel, message)
        data = payload.encode()
        size = len(data)
        limit = self.settings.max_message_bytes
        if size > limit:
            raise ConfigError(
                f"message on channel {channel!r:.80} is {size} bytes as JSON, more than "
                f"max_message_bytes={limit}: send less (a key to the data rather than the "
                "data), or raise the limit"
            )
        return self._writer.submit(channel, data)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message published so far is committed to the outbox.

        Called from a listener thread (in a receiver or an ``on_gap`` hook), it does not
        wait, whatever ``timeout``: it returns at once whether they are committed
        already, as ``flush(0)`` would (logged once per broadcaster). That thread
        delivers the messages of every broadcaster of the process on its connection
        string; waiting there for a commit would hold all of them up (forever with
        ``timeout=None`` while Postgres is unreachable). The messages are written all
        the same; flush from another thread to wait for them.

        :param timeout: seconds to wait at most; ``None`` waits as long as it takes.
        :returns: ``True`` when they are committed, ``False`` on timeout, when the
            broadcaster closed with messages unwritten, or, in a listener thread, when
            they are not committed yet.
        """
        self._here()
        if ListeningSession.in_a_thread():
            if not self._flush_warned:
                self._flush_warned = True
                logger.warning(
                    "PostgresBroadcaster.flush() called in the listener thread (a "
                    "receiver) does not wait: it returns whether the messages are "
                    "written already; flush from another thread to wait for them"
                )
            return self._writer.flush(0)
        return self._writer.flush(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the broadcaster has reached Postgres once (its tables checked, on a
        pooled session) and, while this node has subscriptions or receivers, until its
        listener LISTENs. A node that only publishes never waits for a listening session.

        Subscribing needs no ``wait_ready()`` first: :meth:`subscribe` itself waits
        until messages published from then on are delivered.

        Called from a listener thread (in a receiver or an ``on_gap`` hook), it does not
        wait, whatever ``timeout``: it returns at once whether the broadcaster is ready
        (see :meth:`flush`).

        :param timeout: seconds to wait at most; ``None`` waits as long as it takes.
        :returns: whether the broadcaster is ready.
        """
        self._here()
        if ListeningSession.in_a_thread():
            return self._writer.ready.is_set() and (
                not self.has_readers() or self._listener.positioned.is_set()
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._writer.ready.wait(timeout):
            return False
        if not self.has_readers():
            return True
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._listener.positioned.wait(remaining)

    def subscribe(self, channel: str, *, maxsize: int = 1000) -> Subscription:
        """Open a subscription to ``channel``: the messages published on it by every node.

        Same as :meth:`rselection.Broadcaster.subscribe`, except that when this node's
        listener is not LISTENing yet (no subscription or receiver before), it waits
        until the listener knows where it starts: every message committed after this
        returns is delivered. That takes a round trip or two, plus connecting the
        listening session when no broadcaster of the process had readers; closing the
        process's last subscription or receiver closes that session again. While
        Postgres cannot be reached it waits at most
        ``io_timeout`` seconds, logs a warning and returns, and messages are then delivered
        from the moment the listener connects. Later calls do not wait while the
        listener LISTENs.

        :raises ConfigError: bad ``channel`` or ``maxsize``.
        :raises BroadcasterClosed: the broadcaster is closed.
        """
        self._here()
        sub = super().subscribe(channel, maxsize=maxsize)
        self._listener.await_position("subscribe")
        return sub

    def connect(self, channel: str, receiver: Receiver) -> Callable[[], None]:
        """Call ``receiver(channel, message)`` in the listener thread for each message.

        Same as :meth:`rselection.Broadcaster.connect`; like :meth:`subscribe`, it
        starts the listener and waits until it knows where it starts.
        """
        self._here()
        disconnect = super().connect(channel, receiver)
        self._listener.await_position("connect")

        def disconnect_and_release() -> None:
            disconnect()
            self._listener.reader_left()

        return disconnect_and_release

    def purge(self) -> int:
        """Delete the messages older than ``retention`` now; return how many.

        The writer does this on its own every ``retention / 10`` seconds (1 to 60 s) once
        it has published, on a borrowed session; call it to purge from a node that never
        publishes.

        :raises BackendUnavailable: the database could not be reached.
        """
        self._here()
        try:
            with self._sessions.borrow("purge the broadcast table") as conn:
                return self._writer.purge(conn)
        except psycopg.Error as exc:
            raise BackendUnavailable(
                f"cannot purge the broadcast table {self.table!r} ({self._sessions.where}): "
                f"{self._sessions.error_text(exc)}"
            ) from exc

    def _discard(self, sub: Subscription) -> None:
        """Forget a subscription that closed itself; the last reader of the process
        releases the listening session."""
        super()._discard(sub)
        self._listener.reader_left()

    def stats(self) -> PostgresBroadcastStats:
        """Return local fan-out counts plus the cross-node counters (see the class)."""
        self._here()
        base = super().stats()
        common = {f.name: getattr(base, f.name) for f in fields(BroadcastStats)}
        common["closed"] = self.closed
        listener = self._listener
        return PostgresBroadcastStats(
            **common,
            published=self._writer.published,
            pending=self._writer.pending,
            received=listener.received,
            gaps=listener.gaps,
            missed=listener.missed,
            resets=listener.resets,
            reconnects=listener.reconnects,
            ignored_notifies=listener.ignored,
            listening=listener.listening,
            last_id=listener.last_id,
            listener_pid=listener.pid,
        )

    def close(self) -> None:
        """Write what is pending (up to ``close_timeout``), stop, close every subscription.

        Calling it again does nothing. Messages whose commit was not confirmed within
        ``close_timeout`` are given up with a warning log that says how many: those not
        sent are never written, but a batch whose round trip close() cut may still
        commit on the server.
        """
        self._here()
        if not self._writer.begin_close():
            return
        close_timeout = self.settings.close_timeout
        if not self._writer.flush(close_timeout):
            lost = self._writer.pending
            if lost:
                logger.warning(
                    "broadcaster closed with %d message(s) not confirmed written to %s "
                    "within close_timeout=%s s; they may not have been written (a batch "
                    "in flight may still commit)",
                    lost,
                    self._sessions.where,
                    close_timeout,
                )
        self._writer.stop()
        self._listener.stop()
        for part in (self._listener, self._writer):
            part.join(self.settings.io_timeout + 5.0)
        self._sessions.close()
        super().close()

    def __repr__(self) -> str:
        listener = self._listener
        state = "closed" if self.closed else ("listening" if listener.listening else "connecting")
        return (
            f"<PostgresBroadcaster {self.table!r} {state} {self._sessions.where} "
            f"last_id={listener.last_id}>"
        )

    # -- validation -------------------------------------------------------------------

    @staticmethod
    def _check_pg_channel(channel: object) -> None:
        if not isinstance(channel, str) or not channel:
            raise ConfigError(f"channel must be a non-empty str, got {channel!r:.80}")
        if "\x00" in channel:
            raise ConfigError(
                f"channel {channel!r:.80} holds a NUL character, which Postgres text "
                "cannot store; use another name"
            )
        try:
            channel.encode()
        except UnicodeEncodeError as exc:
            raise ConfigError(
                f"channel {channel!r:.80} is not valid Unicode (a lone surrogate): {exc}"
            ) from None

    @staticmethod
    def _encode(channel: str, message: object) -> str:
        subject = f"message on channel {channel!r:.80} cannot be sent"
        refused = MessageEncodeError
        text = strict_json(message, subject, type_error=refused, value_error=refused)
        try:
            text.encode()
        except UnicodeEncodeError:
            # A lone surrogate has no UTF-8 form; JSON can still carry it as an escape.
            text = strict_json(message, subject, ensure_ascii=True)
        return text


# Public as rselection.postgres.broadcast.*: named so in reprs, pickles and docs.
for _public in (MessageEncodeError, PostgresBroadcastStats, PostgresBroadcaster):
    _public.__module__ = "rselection.postgres.broadcast"
