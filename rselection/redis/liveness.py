"""One liveness beat per process and Redis server, for every lease the process holds there.

:class:`LivenessHub` does both sides of fast crash failover for one process, server and
key prefix: it beats for the leases the process holds (one signed message per process,
carrying an epoch that grows when a held lease's connection fails), times the holders
its leases follow and checks their connections (``CLIENT LIST ID``) when their beats
stop, and reads followed leases when they are due to expire. A beat only says when to
look: a forged, replayed or lost beat can delay a takeover, never cause one. One thread
and two connections per hub. See ``docs/explanation/redis.md`` ("How the lease works");
the wire format is :mod:`rselection.redis.messages`'.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import secrets
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import redis

from .. import clock, forks
from ..errors import first_line
from ..wakeup import Wakeup
from ._conn import ConnectionFactory
from ._scripts import HELD_FOR
from .holder import text
from .keys import liveness_channel
from .messages import Dropped, beat_sender, read_beat, sign_beat, unsigned_beat

__all__ = ["Follower", "LivenessHub"]

logger = logging.getLogger("rselection.redis.lease")

# Longest wait, seconds, between checks of a holder process that beat before and went
# silent (paused): a kill while it is paused is then noticed within about a second.
PROBE_CAP = 1.0
# Bound of one round trip of the hub's connections, seconds.
_IO_TIMEOUT = 2.0
# Seconds before a hub whose connection failed tries again.
_RETRY = 1.0
# The most messages one turn of the hub's thread reads (then beats and checks run).
_READ_LIMIT = 256
# Shortest wait, seconds, before a lease found about to expire is read again.
_REREAD_GAP = 0.005
# Seconds ahead of the first watched expiry due whose leases are read with it: leases
# renewed at scattered moments then share round trips (an early read costs nothing but
# the read: a lease still held is read again at its new expiry).
_GATHER = 0.5


class Follower(Protocol):
    """What the hub needs of a lease that follows a holder (a :class:`RedisLease`)."""

    name: str
    key: str  # the lease's key, read when the holder's lease is due to expire

    def holder_found_gone(self, seen: Any) -> None:
        """The hub found the connection of holder ``seen`` gone: take it over."""

    def probe_refused(self) -> None:
        """The server refused ``CLIENT LIST``: wait for expiry instead."""

    def lease_may_be_free(self, seen: Any) -> None:
        """Holder ``seen``'s lease expired or changed (or could not be read): attempt."""


@dataclass
class _Following:
    seen: Any  # the holder as the lease saw it: .client, .process, .secret
    limit: float  # the lease's liveness_interval
    cap: float  # the longest interval a beat may advertise to this lease (ttl / 4)


@dataclass
class _Expiry:
    """A followed holder's lease, read when it is due to expire."""

    seen: Any  # the holder as the lease saw it: .value, its lease value
    due: float  # monotonic time of the next read


@dataclass
class _Holder:
    """A holder process being timed, and the leases that follow it."""

    secret: str
    probe_at: float
    gap: float
    seq: int = -1  # the highest beat number taken
    epoch: int | None = None
    interval: float = 0.0  # advertised by its beats (0: unknown)
    beaten: bool = False  # a beat was heard
    suspect_until: float = 0.0  # after a new epoch: checked whatever its beats say
    leases: dict[Follower, _Following] = field(default_factory=dict)

    def limit(self) -> float:
        """How long it may go without a beat: the followers' shortest
        ``liveness_interval``, or its own if longer (up to their ttl / 4)."""
        own = min(f.limit for f in self.leases.values())
        cap = min(f.cap for f in self.leases.values())
        return max(own, min(self.interval, cap))

    def heard(self, now: float) -> None:
        self.gap = self.limit()
        self.probe_at = now + self.gap

    def probed(self, now: float) -> None:
        limit = self.limit()
        if not self.beaten:  # nothing says it beats at all: check at the plain interval
            self.gap = limit
        else:
            self.gap = min(max(2 * self.gap, limit), max(limit, PROBE_CAP))
        self.probe_at = now + self.gap


class LivenessHub:
    """This process's beats and checks on one Redis server, for one key prefix; get it
    with :meth:`of`. Every method is safe from any thread and never blocks on the
    server.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster`` whose settings the hub's
            connections copy.
        key: for a cluster, a key in a slot of the server (a lease's key).
        key_prefix: the leases' key prefix; beats go on ``<prefix>alive``.
        connect_timeout: bound of opening a connection, seconds.
    """

    _hubs: ClassVar[dict[tuple[str, str], LivenessHub]] = {}
    _hubs_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, client: Any, key: str, key_prefix: str, connect_timeout: float) -> None:
        self._factory = ConnectionFactory(
            client,
            key=key,
            socket_timeout=_IO_TIMEOUT,
            connect_timeout=connect_timeout,
            client_name="rselection:liveness",
        )
        self.process = secrets.token_hex(8)
        """This process's id in its beats and in the values of the leases it holds."""
        self._secret = secrets.token_hex(16)
        self.channel = liveness_channel(key_prefix)
        self._channel_bytes = self.channel.encode()
        self._lock = threading.Lock()
        self._wakeup = Wakeup()
        self._thread: threading.Thread | None = None
        # Leading: the held leases' liveness_interval, the next beat, its number, and
        # how many held leases' connections failed.
        self._held: dict[object, float] = {}
        self._beat_at = 0.0
        self._seq = 0
        self._epoch = 0
        # Following: holder processes by id ("" for holders that name no process).
        self._holders: dict[str, _Holder] = {}
        self._following: dict[Follower, str] = {}
        # Followed holders' leases by their next read (a heap; an entry whose _Expiry is
        # no longer the lease's, or whose due time changed, is stale).
        self._expiry: dict[Follower, _Expiry] = {}
        self._expiry_heap: list[tuple[float, int, Follower, _Expiry]] = []
        self._order = itertools.count()
        self._conn: Any = None
        self._listener: Any = None
        self._subscribed = False
        self._retry_at = 0.0
        self._listen_at = 0.0  # the listener failed: listen again from then on
        self._muted = False  # PUBLISH on the channel refused: no beats
        self._deaf = False  # SUBSCRIBE to the channel refused: every holder is polled
        self.dropped = Dropped(f"liveness on {self._factory.where}")
        """Beats dropped unread since the hub was made: forged, replayed or garbled."""

    @classmethod
    def of(
        cls, client: Any, key: str, where: str, key_prefix: str, connect_timeout: float
    ) -> LivenessHub:
        """The process's hub for server ``where`` and ``key_prefix`` (made on first use).

        Args:
            client: the lease's client (its settings are copied).
            key: the lease's key (routes a cluster's connections to its slot's server).
            where: the server, as the lease's connection factory names it.
            key_prefix: the lease's key prefix.
            connect_timeout: bound of opening a connection, seconds.
        """
        with cls._hubs_lock:
            hub = cls._hubs.get((where, key_prefix))
            if hub is None:
                hub = cls._hubs[(where, key_prefix)] = cls(client, key, key_prefix, connect_timeout)
            return hub

    @classmethod
    def reset_after_fork(cls) -> None:
        """In a forked child: the parent's hubs (their connections, threads and process
        id) are not the child's; it makes its own."""
        for hub in cls._hubs.values():
            forks.keep_inherited(hub._conn, hub._listener, hub._wakeup)
        cls._hubs = {}
        cls._hubs_lock = threading.Lock()

    @property
    def beacon(self) -> str:
        """``<process>:<secret>``, written into the value of each lease this process
        acquires on the server: how followers know whose beats to take."""
        return f"{self.process}:{self._secret}"

    # -- the leases' side -------------------------------------------------------------

    def hold(self, lease: object, interval: float) -> None:
        """``lease`` holds a term with fast failover: beat for it every ``interval / 2``."""
        with self._lock:
            if not self._held:
                self._beat_at = 0.0  # the first held lease: beat at once
            self._held[lease] = interval
            self._start()

    def unhold(self, lease: object) -> None:
        """``lease`` holds no term any more (beats stop with the last one)."""
        with self._lock:
            self._held.pop(lease, None)

    def connection_failed(self, lease: object) -> None:
        """A held lease's keeper connection failed: the next beat, at once, carries a new
        epoch, so that followers check its connection now."""
        with self._lock:
            if lease not in self._held:
                return
            self._epoch += 1
            self._beat_at = 0.0
        self._wakeup.wake()

    def follow(self, lease: Follower, seen: Any, limit: float, ttl: float) -> None:
        """Time holder ``seen`` for ``lease`` until :meth:`unfollow` or another ``seen``;
        when its connection is found gone, ``lease.holder_found_gone(seen)`` is called
        (on the hub's thread). Following a holder of the same process again keeps
        its timers.

        Args:
            lease: the follower.
            seen: the holder: ``.client`` (its connection id), ``.process`` and
                ``.secret`` (from its lease value; empty when it names none).
            limit: the lease's ``liveness_interval``, seconds.
            ttl: the lease's ttl (a beat's interval counts up to a quarter of it).
        """
        process = seen.process or ""
        with self._lock:
            if self._following.get(lease) == process:
                # The same holder process (each attempt reads the holder anew, and anyone
                # may PUBLISH a wake-up into an attempt): its timers and the beats taken
                # from it go on, so that a check that is due is never put off.
                self._holders[process].leases[lease] = _Following(seen, limit, ttl / 4)
                return
            self._forget(lease)
            holder = self._holders.get(process)
            now = clock.monotonic()
            if holder is None:
                holder = self._holders[process] = _Holder(seen.secret, now + limit, limit)
            elif not holder.leases:
                holder.probe_at = min(holder.probe_at, now + limit)
            holder.leases[lease] = _Following(seen, limit, ttl / 4)
            self._following[lease] = process
            self._start()

    def watch_expiry(self, lease: Follower, seen: Any, expires_at: float) -> None:
        """Read ``lease``'s key when holder ``seen``'s lease is due to expire (monotonic
        ``expires_at``), and again at each new expiry while ``seen.value`` holds it;
        once it does not (or the read fails), ``lease.lease_may_be_free(seen)`` is
        called (on the hub's thread) once, and nothing is read until the lease's next
        attempt gives a new ``seen``. Watching the same ``seen`` again (the same object:
        a watch begun anew, no attempt between) keeps the expiry its reads found, or
        the wake-up; :meth:`unfollow` ends the watch."""
        with self._lock:
            current = self._expiry.get(lease)
            if current is not None and current.seen is seen:
                return
            self._expiry[lease] = entry = _Expiry(seen, expires_at)
            heapq.heappush(self._expiry_heap, (expires_at, next(self._order), lease, entry))
            self._start()

    def unfollow(self, lease: Follower) -> None:
        """``lease`` follows nobody (it acquired, closed, or sees no holder): no
        timing of its holder, no watch of its expiry."""
        with self._lock:
            self._forget(lease)
            self._expiry.pop(lease, None)

    def stop_timing(self, lease: Follower) -> None:
        """Time no holder process for ``lease`` (its watch of the expiry goes on)."""
        with self._lock:
            self._forget(lease)

    def _forget(self, lease: Follower) -> None:
        process = self._following.pop(lease, None)
        if process is None:
            return
        holder = self._holders.get(process)
        if holder is not None:
            holder.leases.pop(lease, None)
            if not holder.leases:
                del self._holders[process]

    def _start(self) -> None:
        """Under the lock: run the hub's thread, or wake it to look at the change."""
        if self._thread is not None:
            self._wakeup.wake()
            return
        self._wakeup.open()
        thread = threading.Thread(target=self._run, name="rselection-liveness", daemon=True)
        thread.start()
        self._thread = thread

    # -- the hub's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._serve():
                pass
        finally:
            # Should the thread end on an error all the same, the next lease that needs
            # the hub starts it again.
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _serve(self) -> bool:
        """One turn of the hub's thread and the wait for the next; ``False`` once no
        lease needs the hub. Nothing ends the thread but that: every follower of the
        process relies on it to be woken at its holder's expiry."""
        with self._lock:
            self._wakeup.clear()
            if not self._held and not self._holders and not self._expiry:
                self._thread = None
                self._close()
                return False
            listen = bool(self._holders) and not self._deaf
            if not listen and self._listener is not None:
                self._drop_listener()
        try:
            now = clock.monotonic()
            if now >= self._retry_at:
                self._connect(listen)
                self._turn(now)
            else:
                # No connection: whose expiry is due attempts on its own connection.
                self._give_up_expiries(self._expiries_due(now))
        except (redis.RedisError, OSError) as exc:
            logger.debug("liveness on %s: %s", self._factory.where, first_line(exc))
            self._close()
            self._retry_at = clock.monotonic() + _RETRY
        except Exception:  # the thread serves every lease: survive anything
            logger.exception("liveness on %s: unexpected error", self._factory.where)
            self._close()
            self._retry_at = clock.monotonic() + _RETRY
        try:
            self._sleep()
        except (OSError, ValueError) as exc:  # out of file descriptors, a closed socket
            logger.debug("liveness on %s: %s", self._factory.where, first_line(exc))
            time.sleep(_RETRY)
        return True

    def _connect(self, listen: bool) -> None:
        if self._conn is None:
            self._conn = self._factory.connect()
            self._muted = self._deaf = False  # an ACL may have changed: try again
        if listen and self._listener is None and clock.monotonic() >= self._listen_at:
            self._listener = self._factory.connect()
            self._listener.send_command("SUBSCRIBE", self.channel)
            self._subscribed = False

    def _turn(self, now: float) -> None:
        """Beat when due, check the holders that are due, read the leases due to
        expire, then read what came (a flood on the channel never holds up the rest)."""
        with self._lock:
            beat = bool(self._held) and not self._muted and now >= self._beat_at
            if beat:
                interval = min(self._held.values())
                self._beat_at = now + interval / 2
                message = sign_beat(
                    self._secret, self.process, round(interval * 1000), self._epoch, self._seq
                )
                self._seq += 1
            due = [p for p, h in self._holders.items() if now >= h.probe_at]
        if beat:
            self._publish(message)
        for process in due:
            self._probe(process)
        expiring = self._expiries_due(clock.monotonic())
        if expiring:
            self._read_expiries(expiring)
        if self._listener is not None:
            try:
                self._read()
            except (redis.RedisError, OSError) as exc:
                # The server may drop a listener that a flood put over its output buffer
                # limit: listen again soon; beats and checks go on meanwhile.
                logger.debug("liveness on %s: %s", self._factory.where, first_line(exc))
                self._drop_listener()
                self._listen_at = clock.monotonic() + _RETRY

    def _sleep(self) -> None:
        """Wait for a message, a wake-up, or the next beat, check or read (at most a
        second)."""
        timeout = min(1.0, max(0.0, self._next_turn() - clock.monotonic()))
        with selectors.DefaultSelector() as sel:
            wake = self._wakeup.socket
            if wake is not None:
                sel.register(wake, selectors.EVENT_READ)
            sock = getattr(self._listener, "_sock", None)
            if sock is not None:
                sel.register(sock, selectors.EVENT_READ)
            sel.select(timeout)

    def _next_turn(self) -> float:
        """When the thread has something to do: the next beat or check (after a failed
        connection, not before its retry), or the next lease due to expire (then, with
        no connection, its follower is woken to attempt by itself)."""
        with self._lock:
            due = [holder.probe_at for holder in self._holders.values()]
            if self._held and not self._muted:
                due.append(self._beat_at)
            until = max(self._retry_at, min(due, default=math.inf))
            if self._expiry_heap:
                until = min(until, self._expiry_heap[0][0])
        return until

    def _read(self) -> None:
        listener = self._listener
        for _ in range(_READ_LIMIT):
            if not listener.can_read(0):
                return
            try:
                message = listener.read_response()
            except redis.ResponseError as exc:
                self._refused(exc)
                return
            if not isinstance(message, list) or len(message) != 3:
                continue
            kind, channel, payload = message
            if kind == b"subscribe":
                self._subscribed = True
            elif kind == b"message" and channel == self._channel_bytes:
                self._heard(payload)

    def _refused(self, exc: redis.ResponseError) -> None:
        """The server refused the SUBSCRIBE (an ACL without the channel): every holder
        is checked every ``liveness_interval`` instead; no term is affected."""
        if self._subscribed or not _refusal(exc):
            raise exc  # not a refused subscription: the connection is in doubt
        self._deaf = True
        self._drop_listener()
        logger.warning(
            "SUBSCRIBE to %r refused on %s (%s); followers check each holder's connection "
            "every liveness_interval instead (grant the channel, see the Redis how-to)",
            self.channel,
            self._factory.where,
            first_line(exc),
        )

    def _heard(self, payload: Any) -> None:
        """A message on the channel: a beat of a timed holder process, signed with its
        secret and numbered above every beat taken before, moves its check back (or
        brings it forward, when the epoch changed). Anything else changes nothing."""
        sender = beat_sender(payload)
        if sender is None:
            if not unsigned_beat(payload):
                self.dropped.drop(self.channel, payload)
            return
        now = clock.monotonic()
        with self._lock:
            holder = self._holders.get(sender)
            if holder is None:
                return  # a process none of our leases follows
            beat = read_beat(payload, holder.secret)
            if beat is None or beat.seq <= holder.seq:
                dropped = True
            else:
                dropped = False
                holder.seq, holder.interval, holder.beaten = beat.seq, beat.interval, True
                if holder.epoch is not None and beat.epoch != holder.epoch:
                    # A connection of one of its leases failed: check at once, and keep
                    # checking (waits doubling up to a second) for a lease period, since
                    # the holder may close that connection only once the term's tasks
                    # are joined, while the process beats on.
                    holder.gap, holder.probe_at = holder.limit(), now
                    holder.suspect_until = now + 4 * max(f.cap for f in holder.leases.values())
                elif now >= holder.suspect_until:
                    holder.heard(now)
                holder.epoch = beat.epoch
        if dropped:
            self.dropped.drop(self.channel, payload)

    def _publish(self, message: str) -> None:
        try:
            self._call("PUBLISH", self.channel, message)
        except redis.ResponseError as exc:
            if not _refusal(exc):
                raise  # BUSY, LOADING...: the connection is in doubt, and is made anew
            # An ACL that grants the leases' channels but not this one: a refused beat
            # says nothing about the terms, which go on; followers check every
            # liveness_interval instead.
            self._muted = True
            logger.warning(
                "PUBLISH on %r refused on %s (%s); no liveness beats from this process, "
                "followers check its connections every liveness_interval instead (grant "
                "the channel, see the Redis how-to)",
                self.channel,
                self._factory.where,
                first_line(exc),
            )

    def _probe(self, process: str) -> None:
        """Check the connections of every lease holder process ``process`` holds for our
        followers, in one round trip; wake the followers whose holder is gone.

        The server that answers must be the one the holders connected to (its
        ``run_id`` is in each lease value): client ids mean nothing on another server,
        and a cluster's slot may have moved since this hub connected.
        """
        with self._lock:
            holder = self._holders.get(process)
            if holder is None:
                return
            following = [(lease, f.seen) for lease, f in holder.leases.items()]
        clients = sorted({seen.client for _, seen in following}, key=int)
        conn = self._conn
        conn.send_command("CLIENT", "LIST", "ID", *clients)
        conn.send_command("INFO", "server")
        try:
            reply = conn.read_response(disconnect_on_error=False)
        except redis.ResponseError as exc:
            conn.read_response(disconnect_on_error=False)  # INFO's reply
            self._unanswered(process, following, exc)
            return
        info = text(conn.read_response(disconnect_on_error=False))
        run = next((ln[7:].strip() for ln in info.splitlines() if ln.startswith("run_id:")), "")
        alive = {line.split(" ", 1)[0].removeprefix("id=") for line in text(reply).splitlines()}
        gone = [(lease, seen) for lease, seen in following if seen.client not in alive]
        with self._lock:
            for lease, seen in gone:
                entry = holder.leases.get(lease)
                if entry is not None and entry.seen == seen and seen.run == run:
                    self._forget(lease)
            if holder.leases:
                holder.probed(clock.monotonic())
        for lease, seen in gone:
            if seen.run == run:
                lease.holder_found_gone(seen)
            else:
                logger.debug("liveness on %s: a holder of another server run", self._factory.where)

    def _expiries_due(self, now: float) -> list[tuple[Follower, _Expiry]]:
        """Take the watched expiries due by ``now`` off the heap (their reads decide),
        with those due within :data:`_GATHER` after the first."""
        due: list[tuple[Follower, _Expiry]] = []
        with self._lock:
            heap = self._expiry_heap
            if not heap or heap[0][0] > now:
                return due
            until = heap[0][0] + _GATHER
            while heap and heap[0][0] <= until:
                at, _, lease, entry = heapq.heappop(heap)
                if self._expiry.get(lease) is entry and entry.due == at:
                    due.append((lease, entry))
        return due

    def _read_expiries(self, due: list[tuple[Follower, _Expiry]]) -> None:
        """Read the lease keys of ``due`` in one round trip: a lease still held by the
        holder its follower saw is read again at its new expiry; the followers of the
        others are woken, and so are those left unread when the round trip fails (each
        attempts on its own connection; the error is raised)."""
        conn = self._conn
        answered = 0
        free: list[tuple[Follower, _Expiry]] = []
        try:
            conn.send_packed_command(
                conn.pack_commands(
                    [("EVAL", HELD_FOR, 1, lease.key, entry.seen.value) for lease, entry in due]
                )
            )
            for lease, entry in due:
                try:
                    reply = conn.read_response(disconnect_on_error=False)
                except redis.ResponseError:  # a moved cluster slot, a refused read...
                    reply = None
                answered += 1
                pttl = _held_for(reply)
                if pttl is None:
                    free.append((lease, entry))
                    continue
                with self._lock:
                    if self._expiry.get(lease) is entry:  # else an attempt came meanwhile
                        entry.due = clock.monotonic() + reread_after(pttl)
                        heapq.heappush(
                            self._expiry_heap, (entry.due, next(self._order), lease, entry)
                        )
        finally:
            self._give_up_expiries(free + due[answered:])

    def _give_up_expiries(self, due: list[tuple[Follower, _Expiry]]) -> None:
        """Wake the followers of ``due`` (unless an attempt came meanwhile): they
        attempt; nothing is read for them until then."""
        woken = []
        with self._lock:
            for lease, entry in due:
                if self._expiry.get(lease) is entry:
                    entry.due = math.inf  # woken: read no more until it attempts
                    woken.append((lease, entry))
        for lease, entry in woken:
            lease.lease_may_be_free(entry.seen)

    def _unanswered(
        self, process: str, following: list[tuple[Follower, Any]], exc: redis.ResponseError
    ) -> None:
        """``CLIENT LIST ID`` answered an error: refused (an ACL), the followers wait
        for expiry; anything else (a client id the server will not take) puts off this
        holder's next check only, never another's."""
        if _refusal(exc):
            logger.info("CLIENT LIST refused on %s (%s)", self._factory.where, exc)
            for lease, _ in following:
                self.stop_timing(lease)  # its expiry is still watched
                lease.probe_refused()
            return
        logger.warning(
            "CLIENT LIST ID on %s answered %s; the holder is checked again later",
            self._factory.where,
            first_line(exc),
        )
        with self._lock:
            holder = self._holders.get(process)
            if holder is not None:
                holder.probed(clock.monotonic())

    def _call(self, *args: Any) -> Any:
        conn = self._conn
        conn.send_command(*args)
        return conn.read_response(disconnect_on_error=False)

    def _drop_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.disconnect()

    def _close(self) -> None:
        self._drop_listener()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()


def _refusal(exc: redis.ResponseError) -> bool:
    """Whether an error reply is an ACL's refusal (which no retry changes)."""
    return isinstance(exc, redis.exceptions.NoPermissionError) or str(exc).startswith("NOPERM")


def reread_after(pttl: int) -> float:
    """Seconds until a lease found still held, ``pttl`` ms from expiry, is read again:
    at its expiry (``PTTL`` 0 expires within the millisecond), but not sooner than
    :data:`_REREAD_GAP`; a value without an expiry (-1, which no holder writes) once a
    second."""
    return 1.0 if pttl < 0 else max(pttl / 1000, _REREAD_GAP)


def _held_for(reply: Any) -> int | None:
    """The ``PTTL`` (ms) that ``HELD_FOR`` answered for a lease still holding the value
    its follower saw, else ``None`` (gone, changed, or an answer that is not one)."""
    return reply if isinstance(reply, int) and reply != -3 else None


forks.register(LivenessHub)
