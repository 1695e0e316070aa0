"""``RedisLease``: a :class:`~rselection.abc.LeaseBackend` over one Redis key.

Each lease has a key, a term counter and a pub/sub channel, all with the lease name as
hash tag, so a cluster keeps them in one slot. Acquire, renew and release are one Lua
script each: the term and the key change in one atomic step, a renewal never extends
someone else's key, and expiry is Redis's own (``PX``). Terms stay larger across a
failover to a replica or a lost counter; a handover request wakes the leader; a
follower takes a crashed holder's lease over as soon as its keeper connection is gone.

The lease's value is read in :mod:`.holder`; the beats while it holds and the holder
it follows while it waits are :mod:`.lease_liveness`'s. See
``docs/explanation/redis.md`` ("How the lease works", "Terms across a failover",
"Handover on request") for the keys, the scripts and why each step is safe.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

import redis

from .. import clock, forks
from ..closeable import Closeable
from ..errors import BackendUnavailable, ConfigError, first_line
from ..history import HISTORY_LIMIT, TermEnding, check_history_limit
from ..lease import Acquisition, HandoverRequest, LeaderInfo
from ..session_hold import SessionHold
from ..validation import check_name, check_node_id, check_optional_seconds, check_seconds
from ..versions import check_version
from ..wakeup import Wakeup
from ._conn import MIN_TTL, ConnectionFactory, check_client, client_name, unavailable
from ._scripts import ACQUIRE, READ, RELEASE, RENEW
from ._scripts import CANCEL_HANDOVER as CANCEL_HANDOVER  # re-exported
from ._scripts import REQUEST_HANDOVER as REQUEST_HANDOVER  # re-exported
from .holder import Seen, parse_holder, text
from .keepalive import keepalive_refusal
from .keys import DEFAULT_KEY_PREFIX, check_key_prefix, history_key
from .keys import handover_key as handover_key  # re-exported
from .keys import lease_keys as lease_keys  # re-exported
from .keys import node_channel as node_channel  # re-exported
from .keys import term_origin_key as term_origin_key  # re-exported
from .lease_liveness import LeaseLiveness
from .liveness import LivenessHub
from .messages import Dropped, event_kind, unsigned_beat

__all__ = ["RedisLease", "handover_key", "lease_keys", "node_channel", "term_origin_key"]

logger = logging.getLogger(__name__)

# Shortest time, seconds, between two wake-ups caused by messages: anyone allowed to
# PUBLISH can send them, and each costs an attempt (or a renewal) round trip. A release
# or a handover request is still acted on within this.
_WAKE_GAP = 0.05
# The most messages one step of a wait reads: the rest is read in the next step, after
# the steps of other leases that were ready (a flooded channel starves nobody).
_STEP_MESSAGES = 64


class RedisLease(Closeable):
    """A lease kept in one Redis key, with ``PX`` expiry, fencing terms and fast failover.

    One instance is used by one caller at a time (:meth:`connect`, :meth:`try_acquire`,
    :meth:`renew`, :meth:`release`, :meth:`wait_for_change` or the steps of a
    :meth:`watch_for_change`, :meth:`close`: a leader's driven keeper, and the steps of
    its wait on the process's wait pump in between, see :mod:`rselection.wait_pump`);
    :meth:`current` and :meth:`interrupt` are safe from any thread. Keeper methods raise
    :class:`~rselection.errors.BackendUnavailable` on any connection or server error;
    the keeper connections are then closed (once no term acquired through them may still
    run, see :meth:`term_ended`) and the next call reconnects. ``with RedisLease(...) as
    lease:`` connects and closes on exit. The module docstring explains the protocol.

    Args:
        client: a ``redis://`` URL, a ``redis.Redis`` or a
            ``redis.cluster.RedisCluster``. Its settings (host, password, TLS, db) are
            copied for the keeper's own connections; the client itself serves
            :meth:`current`.
        name: the lease name; nodes with the same name and prefix compete. Not blank,
            at most 1,000 bytes as UTF-8, used as given (never trimmed).
        key_prefix: prefix of the lease's keys and channel.
        ttl: lease length on the server, seconds.
        renew_deadline: the leader's renew deadline, seconds (``< ttl``).
        liveness_interval: how long a waiting follower goes without a liveness beat of
            the holder before it checks that the holder's connection still exists
            (``CLIENT LIST ID``), seconds; a holder publishes its beats every half of
            it. A holder never heard to beat is checked this often. ``None`` turns fast
            crash failover off (takeover then waits for expiry).
        connect_timeout: bound of opening a connection, seconds.
        version: the node's version (PEP 440), recorded with each term it takes.
        history_limit: terms of the lease's leadership history to keep in its stream
            (see :mod:`rselection.redis.history`); an acquisition trims the older ones.

    Raises:
        ConfigError: bad arguments (the message says which and why).
    """

    def __init__(
        self,
        client: Any,
        *,
        name: str = "default",
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl: float = 15.0,
        renew_deadline: float = 10.0,
        liveness_interval: float | None = 0.5,
        connect_timeout: float = 5.0,
        version: str | None = None,
        history_limit: int = HISTORY_LIMIT,
    ) -> None:
        check_name(name, "lease name")
        check_key_prefix(key_prefix)
        self.version = check_version(version)
        self.history_limit = check_history_limit(history_limit)
        self._ending = TermEnding()  # why the term ending now ends, for its record
        # Redis expiries are whole milliseconds.
        self.ttl = check_seconds(ttl, "ttl", minimum=MIN_TTL)
        self.renew_deadline = check_seconds(renew_deadline, "renew_deadline", minimum=MIN_TTL)
        if self.renew_deadline >= self.ttl:
            raise ConfigError(
                f"renew_deadline must be shorter than ttl, got renew_deadline "
                f"{renew_deadline} >= ttl {ttl}: the leader must stop before its lease "
                "can expire on the server"
            )
        self.liveness_interval = check_optional_seconds(
            liveness_interval, "liveness_interval", minimum=0.01
        )
        self.connect_timeout = check_seconds(connect_timeout, "connect_timeout", minimum=0.01)
        self.name = name
        self.key_prefix = key_prefix
        self.key, self.term_key, self.channel = lease_keys(name, key_prefix)
        self.handover_key = handover_key(name, key_prefix)
        self.origin_key = term_origin_key(name, key_prefix)
        self.history_key = history_key(name, key_prefix)
        self._client, self._owns_client = check_client(client, "RedisLease")
        self._factory = ConnectionFactory(
            self._client,
            key=self.key,
            socket_timeout=self.renew_deadline,
            connect_timeout=self.connect_timeout,
            client_name=client_name(name),
        )
        self._ttl_ms = max(1, round(self.ttl * 1000))
        self._read = self._client.register_script(READ)

        self._conn: Any = None
        self._listener: Any = None
        self._client_id = ""
        self._eviction_checked = False  # warned (or found safe) about maxmemory-policy
        self._leading: tuple[str, int] | None = None  # (token, term) while we hold it
        # From an acquisition until term_ended()/release()/close(): the term's tasks may
        # run, so an error never closes the keeper connection (see term_ended()).
        self._hold = SessionHold()
        self._presence: str | None = None  # the node id whose channel the listener joined
        self._handover_hint = False  # a request was announced since the last renewal
        self._handover: HandoverRequest | None = None
        self._on_drain: Callable[[str | None], None] | None = None  # see on_drain
        self._on_tasks: Callable[[], None] | None = None  # see on_tasks

        self._wakeup = Wakeup()
        # Beats while it holds, the holder it follows while it waits (once connected).
        self._liveness = LeaseLiveness(
            name, self.key, self.ttl, self.liveness_interval, self.interrupt
        )
        # The listener reads raw bytes (see ConnectionFactory): channels as bytes.
        self._events_channel = self.channel.encode()
        self._wake_after = 0.0  # a message may wake the keeper again from then on
        self._dropped = Dropped(f"lease {name!r}")
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): the keeper and listener
        connections and the wake-up pair are the parent's (a command on them would run
        in the parent's connection, and the parent's listener would lose its messages
        to the child). Forget them, unused, and hold nothing: the next keeper call
        connects anew. redis-py's pool gives :meth:`current` connections of the child."""
        forks.keep_inherited(self._conn, self._listener, self._wakeup)
        self._conn = self._listener = None
        self._client_id = ""
        self._leading = None
        self._hold = SessionHold()
        self._presence = None
        self._handover_hint = False
        self._handover = None
        self._wakeup = Wakeup()
        self._liveness.reset_after_fork()

    def _enter_block(self) -> None:
        """Connect; the ``with`` block closes the lease on exit."""
        self.connect()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, key={self.key!r}, "
            f"{self._factory.where}, connected={self._conn is not None})"
        )

    @property
    def client_id(self) -> int | None:
        """The keeper connection's ``CLIENT ID``, or ``None`` when not connected."""
        return int(self._client_id) if self._conn is not None and self._client_id else None

    @property
    def fast_failover(self) -> bool:
        """Whether this node's leases let followers take over when its connection is gone."""
        return self._liveness.fast

    @property
    def server(self) -> str:
        """The server this lease waits on (host, port and database, or a cluster's
        node): its leader's waits share that server's workers (see
        :class:`rselection.abc.Watchable`)."""
        return self._factory.where

    @property
    def holder_gone(self) -> bool:
        """Whether a wait found the holder's connection gone since the last attempt (the
        next attempt may then take the lease over at once)."""
        return self._liveness.holder_gone

    # -- connections ------------------------------------------------------------------

    def connect(self) -> None:
        """Open the keeper and listener connections and read the server's settings.

        Raises:
            BackendUnavailable: the server cannot be reached or refused (the message
                names host and port, never the password).
        """
        self._drop()
        self._wakeup.open()
        try:
            conn = self._factory.connect()
        except (redis.RedisError, OSError) as exc:
            raise unavailable("connect to the lease server", self._factory.where, exc) from exc
        self._conn = conn
        try:
            try:
                self._client_id = text(self._call("CLIENT", "ID", expected=(redis.ResponseError,)))
            except redis.ResponseError as exc:
                # An ACL without CLIENT: followers cannot probe us; they wait for expiry.
                logger.info("lease %r: CLIENT ID refused (%s)", self.name, exc)
                self._client_id = ""
            info = text(self._call("INFO", "server"))
            run_id = next(
                (
                    ln.split(":", 1)[1].strip()
                    for ln in info.splitlines()
                    if ln.startswith("run_id:")
                ),
                "",
            )
            with contextlib.suppress(redis.ResponseError):  # Redis < 7
                self._call("CLIENT", "NO-EVICT", "on", expected=(redis.ResponseError,))
            self._check_eviction()
            fast = bool(self._client_id) and self._server_keeps_live_connections()
            can_probe = bool(self._client_id) and self._probe_allowed()
            listener = self._factory.connect()
            self._listener = listener
            listener.send_command("SUBSCRIBE", self.channel)
            listener.read_response()
            liveness = self._liveness
            liveness.run_id, liveness.fast, liveness.can_probe = run_id, fast, can_probe
            if self.liveness_interval is not None:
                liveness.hub = LivenessHub.of(
                    self._client,
                    self.key,
                    self._factory.where,
                    self.key_prefix,
                    self.connect_timeout,
                )
        except (redis.RedisError, OSError) as exc:
            self._drop()
            raise unavailable("prepare the keeper connection", self._factory.where, exc) from exc
        except BackendUnavailable:
            self._drop()
            raise
        self._lead(None)
        self._follow(None)
        logger.debug(
            "lease %r: keeper connected (%s, client %s, fast failover %s)",
            self.name,
            self._factory.where,
            self._client_id,
            "on" if self._liveness.fast else "off",
        )

    def _server_keeps_live_connections(self) -> bool:
        """True when Redis will not close a silent leader's connection before its deadline."""
        if self.liveness_interval is None:
            return False
        try:
            timeout = self._config("timeout")
            keepalive = self._config("tcp-keepalive")
        except redis.ResponseError as exc:
            logger.info(
                "lease %r: cannot read the server's timeout settings (%s); crash failover "
                "waits for the ttl",
                self.name,
                first_line(exc),
            )
            return False
        # A leader cut off from the server has joined its tasks by renew_deadline +
        # stop_grace + 0.5 s <= ttl after its last renewal: the server must keep its
        # connection at least that long.
        bound = self.ttl
        if timeout and timeout <= bound:
            logger.warning(
                "lease %r: the server closes idle clients after %s s (<= ttl); crash "
                "failover waits for the ttl",
                self.name,
                timeout,
            )
            return False
        refusal = keepalive_refusal(keepalive, bound)
        if refusal is not None:
            logger.warning("lease %r: %s; crash failover waits for the ttl", self.name, refusal)
            return False
        return True

    def _config(self, name: str) -> int:
        return int(self._configtext(name) or 0)

    def _configtext(self, name: str) -> str:
        reply = self._call("CONFIG", "GET", name, expected=(redis.ResponseError,))
        values = [text(v) for v in reply]
        return values[1] if len(values) >= 2 else ""

    def _check_eviction(self) -> None:
        """Warn (once per lease) when the server may evict the lease key under memory
        pressure: another node could then acquire while the holder still runs its tasks,
        until its next renewal finds the key gone."""
        if self._eviction_checked:
            return
        try:
            maxmemory = self._config("maxmemory")
            policy = self._configtext("maxmemory-policy")
        except redis.ResponseError as exc:
            logger.debug("lease %r: cannot read the eviction policy (%s)", self.name, exc)
            return
        self._eviction_checked = True
        if maxmemory > 0 and policy.startswith(("allkeys-", "volatile-")):
            logger.warning(
                "lease %r: the server evicts keys under memory pressure (maxmemory %s, "
                "maxmemory-policy %s): an evicted lease key lets another node lead while "
                "the holder still runs its tasks; set maxmemory-policy noeviction on the "
                "lease's server",
                self.name,
                maxmemory,
                policy,
            )

    def _probe_allowed(self) -> bool:
        if self.liveness_interval is None:
            return False
        try:
            self._call("CLIENT", "LIST", "ID", self._client_id, expected=(redis.ResponseError,))
        except redis.ResponseError as exc:
            logger.info(
                "lease %r: CLIENT LIST is not allowed (%s); this node takes over only when "
                "a lease expires",
                self.name,
                first_line(exc),
            )
            return False
        return True

    def _drop(self) -> None:
        conns, self._conn, self._listener = (self._conn, self._listener), None, None
        if self._leading is not None:
            # The term goes with its connection, unreleased: followers check it now.
            self._liveness.connection_failed()
        self._lead(None)
        self._follow(None)
        self._hold.reset()
        self._presence = None
        for conn in conns:
            if conn is not None:
                try:
                    conn.disconnect()
                except Exception:  # closing a broken connection is best effort
                    logger.debug("lease %r: error closing a connection", self.name, exc_info=True)

    def _keeper(self) -> Any:
        if self._hold.stale:
            self._drop()  # its failure was reported; the hold is over: start afresh
        elif self._hold.broken:
            raise BackendUnavailable(
                f"the keeper connection to the lease server ({self._factory.where}) "
                "failed; it is closed once the term's tasks are joined"
            )
        if self._conn is None:
            self.connect()
        assert self._conn is not None
        return self._conn

    def _fail(self) -> None:
        """The keeper connection failed: close it, unless it holds a term whose tasks may
        still run; then it stays open (broken) until :meth:`term_ended` or :meth:`close`."""
        if self._hold.fail():
            self._drop()
        else:
            self._liveness.connection_failed()  # its followers check the connection now

    def _lead(self, leading: tuple[str, int] | None) -> None:
        """Set the (token, term) this keeper holds; while it holds one with fast
        takeover, the process beats for it (see :mod:`.liveness`)."""
        self._leading = leading
        self._liveness.lead(leading is not None)

    def _follow(self, seen: Seen | None, expires: float = 0.0) -> None:
        """Set the holder the last attempt saw (``None``: nobody, or this keeper); a
        wait times it (:meth:`watch_for_change`)."""
        self._liveness.follow(seen, expires)

    def expiry_watched(self) -> bool:
        """Lease ability ``"watches_expiry"``: whether a wait ends when the lease of the
        holder the last attempt saw expires (the liveness hub reads it then), so that
        the keeper need not attempt at that expiry."""
        return self._liveness.expiry_watched(self._leading is not None)

    def term_ended(self, term: int) -> None:
        """The leader ended ``term`` and joined its tasks: the connection may close now.

        Until then an error leaves the keeper connection open (only marked broken),
        because Redis forgets a closed connection's client id at once and a follower then
        takes the lease over. Safe from any thread.

        Args:
            term: the term that ended.
        """
        self._hold.end(term)

    def _call(self, *args: Any, expected: tuple[type[Exception], ...] = ()) -> Any:
        """One command on the keeper; errors other than ``expected`` fail the connection
        (see :meth:`_fail`)."""
        conn = self._keeper()
        try:
            conn.send_command(*args)
            # Never let the client close the connection itself: while a term is held,
            # that would let a follower take over before the term's tasks are joined.
            reply = conn.read_response(disconnect_on_error=False)
        except expected:
            raise
        except redis.TimeoutError as exc:
            self._fail()
            raise BackendUnavailable(
                f"cannot {text(args[0]).lower()} on the lease server ({self._factory.where}): "
                f"no answer within {self.renew_deadline:g} s; reconnecting"
            ) from exc
        except (redis.RedisError, OSError) as exc:
            self._fail()
            raise unavailable(
                f"run {text(args[0])} on the lease server", self._factory.where, exc
            ) from exc
        return reply

    # -- the lease --------------------------------------------------------------------

    def try_acquire(self, node_id: str) -> Acquisition:
        """Take the lease when it is free, expired, or its holder's connection is gone.

        One round trip (the last wait may have found the holder's connection gone; that
        is rechecked by the script). A successful acquisition increments the term.

        Args:
            node_id: this node's id (non-empty, at most 1,000 bytes as UTF-8).

        Raises:
            BackendUnavailable: connection problem.
        """
        check_node_id(node_id)
        self._keeper()
        self._join(node_id)
        dead = self._liveness.take_gone()
        self._lead(None)
        self._handover_hint = False
        self._handover = None
        token = secrets.token_hex(16)
        reply = self._call(
            "EVAL",
            ACQUIRE,
            5,
            self.key,
            self.term_key,
            self.handover_key,
            self.origin_key,
            self.history_key,
            token,
            node_id,
            self._ttl_ms,
            self._client_id,
            "1" if self._liveness.fast else "0",
            dead.client if dead else "",
            dead.term if dead else "",
            self._liveness.run_id,
            self.channel,
            self._liveness.beacon,
            self.version or "",
            socket.gethostname(),
            os.getpid(),
            2 * self.history_limit,  # a beginning and an end per term
        )
        acquired = int(reply[0]) == 1
        if not acquired and not text(reply[1]):
            # Free, but a handover request reserves it for another node this long.
            self._follow(None)
            reserved = max(0.0, int(reply[2]) / 1000)
            logger.debug("lease %r: reserved by a handover request for %.3f s", self.name, reserved)
            return Acquisition(False, None, reserved)
        info, doc = parse_holder(reply[1], reply[2], reply[3])
        if info is None:
            # Someone else's value under our key: waiting it out (with the keeper's
            # backoff) beats spinning on a lease that looks free but cannot be taken.
            raise BackendUnavailable(
                f"key {self.key!r} holds a value that is not an rselection lease "
                f"({text(reply[1])!r:.60}); use another key_prefix or lease name"
            )
        if acquired:
            self._hold.begin(info.term)
            self._lead((token, info.term))
            self._follow(None)
            logger.debug("lease %r: acquired by %s, term %s", self.name, node_id, info.term)
            if dead is not None:
                logger.info(
                    "lease %r: took over term %s: its holder's connection is gone",
                    self.name,
                    dead.term,
                )
        else:
            expires = clock.monotonic() + max(0, int(reply[2])) / 1000
            self._follow(Seen.of(doc, reply[1]), expires)
        return Acquisition(acquired, info, max(0.0, int(reply[2]) / 1000))

    def renew(self, node_id: str, term: int) -> bool:
        """Extend this node's lease by the ttl; ``False`` when ``term`` no longer holds it.

        Raises:
            BackendUnavailable: connection problem (the term is lost as well).
        """
        self._handover_hint = False
        self._handover = None
        leading = self._leading
        if leading is None or leading[1] != term:
            return False
        reply = self._call(
            "EVAL", RENEW, 2, self.key, self.handover_key, leading[0], str(term), self._ttl_ms
        )
        if isinstance(reply, list) and int(reply[0]) == 1:
            if int(reply[1]) == 1:
                to = text(reply[2])
                self._handover = HandoverRequest(term, to or None, max(0, int(reply[3])) / 1000)
            return True
        logger.debug("lease %r: renewal of term %s by %s refused", self.name, term, node_id)
        self._lead(None)
        return False

    def on_drain(self, callback: Callable[[str | None], None] | None) -> None:
        """Call ``callback(None)`` when a message says the drained nodes of this lease
        changed, from the thread that reads the channel: it must not block. ``None``
        stops the calls. A message is anyone's: the callback reads the drain state from
        the server, never from the message."""
        self._on_drain = callback

    def _drain_hint(self) -> None:
        callback = self._on_drain
        if callback is not None:
            try:
                callback(None)
            except Exception:  # the channel's reader goes on
                logger.exception("lease %r: error reading a drain message", self.name)

    def on_tasks(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` when a message says the task controls of this lease
        changed, from the thread that reads the channel: it must not block. ``None``
        stops the calls. A message is anyone's: the callback reads the controls from
        the server, never from the message."""
        self._on_tasks = callback

    def _tasks_hint(self) -> None:
        callback = self._on_tasks
        if callback is not None:
            try:
                callback()
            except Exception:  # the channel's reader goes on
                logger.exception("lease %r: error reading a tasks message", self.name)

    def handover_hinted(self) -> bool:
        """True when a message on the channel announced a handover request since the
        last renewal: renew now to see whether it is for this term."""
        return self._handover_hint

    def handover_requested(self) -> HandoverRequest | None:
        """The handover request the last successful :meth:`renew` found, once.

        A request is for one term and lapses when its key expires (server ``PX``); see
        :func:`rselection.redis.request_handover`.
        """
        request, self._handover = self._handover, None
        return request

    def term_ending(self, term: int, reason: str, by: str | None) -> None:
        """Ability ``"records_history"``: remember why ``term`` ends, for the record its
        release writes (see :mod:`rselection.history`)."""
        self._ending.note(term, reason, by)

    def release(self, node_id: str, term: int) -> None:
        """Give the lease up (key deleted, term counter kept) and wake the followers.

        Does nothing unless this keeper holds ``term``.

        Raises:
            BackendUnavailable: connection problem (the lease then expires after ttl, or
                followers see the connection gone).
        """
        leading = self._leading
        if leading is None or leading[1] != term:
            return
        reason, by = self._ending.of(term)
        reply = self._call(
            "EVAL",
            RELEASE,
            3,
            self.key,
            self.handover_key,
            self.history_key,
            leading[0],
            str(term),
            self.channel,
            reason,
            by or "",
        )
        self._lead(None)
        self._hold.end(term)
        self._follow(None)
        logger.debug(
            "lease %r: %s released term %s%s",
            self.name,
            node_id,
            term,
            "" if int(reply) == 1 else " (it no longer held it)",
        )

    def current(self) -> LeaderInfo | None:
        """The live holder, or ``None``; safe from any thread (uses the client's pool).

        Raises:
            BackendUnavailable: connection problem.
        """
        try:
            raw, pttl, now = self._read(keys=[self.key])
        except redis.RedisError as exc:
            raise unavailable("read the lease holder", self._factory.where, exc) from exc
        return parse_holder(raw, pttl, now)[0]

    # -- waiting ----------------------------------------------------------------------

    def wait_for_change(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until the holder may have changed.

        Returns on a publish on the lease channel, on :meth:`interrupt` (also one that
        came just before the call), or, while following, when the holder's connection
        is found gone. A follower does not poll for that: the process's liveness hub
        (:mod:`.liveness`) times the holder's process by its beats and checks the
        connection (``CLIENT LIST ID``) only after ``liveness_interval`` without one.

        Raises:
            BackendUnavailable: a keeper connection broke.
        """
        try:
            self._keeper()  # a broken keeper connection raises at once
            if self._wakeup.pending or not timeout > 0:
                return
            watch = self.watch_for_change()
            deadline = time.monotonic() + timeout
            with selectors.DefaultSelector() as sel:
                for sock in watch.sockets:
                    sel.register(sock, selectors.EVENT_READ)
                while (remaining := deadline - time.monotonic()) > 0:
                    step = min(remaining, max(0.0, watch.due() - time.monotonic()))
                    ready = frozenset(key.fileobj for key, _ in sel.select(step))
                    if watch.step(ready):
                        return
        finally:
            self._wakeup.clear()

    def watch_for_change(self) -> _LeaseWatch:
        """Begin a wait of :meth:`wait_for_change` in steps that another thread takes
        (:class:`rselection.abc.Watchable`): the sockets to watch, when it is due,
        and what a readable socket or a due time does (see
        :class:`rselection.wait_pump.Watch`). The caller holds the lease (no other call
        runs) until it stops stepping the watch. May reconnect, as
        :meth:`wait_for_change` does.

        Raises:
            BackendUnavailable: a keeper connection broke.
        """
        conn = self._keeper()  # raises when broken
        listener = self._listener
        assert listener is not None
        self._liveness.watch(self._leading is not None)
        wake = self._wakeup.socket
        assert wake is not None
        return _LeaseWatch(self, conn, listener, wake)

    def _keeper_readable(self, conn: Any) -> None:
        # Nothing is due on an idle keeper: readable means closed (or garbage).
        try:
            data = conn.can_read(0) and conn.read_response(disconnect_on_error=False)
        except (redis.RedisError, OSError) as exc:
            self._fail()
            raise unavailable("keep the lease connection", self._factory.where, exc) from exc
        self._fail()
        raise BackendUnavailable(
            f"the keeper connection to the lease server ({self._factory.where}) sent "
            f"something unexpected: {data!r:.80}"
        )

    def _join(self, node_id: str) -> None:
        """Keep the listener subscribed to this node's presence channel."""
        if self._presence == node_id or self._listener is None:
            return
        listener = self._listener
        try:
            if self._presence is not None:
                listener.send_command(
                    "UNSUBSCRIBE", node_channel(self.name, self._presence, self.key_prefix)
                )
            # The confirmation is read (and skipped) with the channel's messages.
            listener.send_command("SUBSCRIBE", node_channel(self.name, node_id, self.key_prefix))
        except (redis.RedisError, OSError) as exc:
            self._fail()
            raise unavailable("listen for lease changes", self._factory.where, exc) from exc
        self._presence = node_id

    def _drain(self, listener: Any, limit: int | None = None) -> tuple[bool, bool]:
        """Read the channels' messages, at most ``limit`` of them; whether one may
        concern this keeper, and whether more are there to read.

        Anyone allowed to PUBLISH can send anything here: a message is only a wake-up
        (the keeper then reads the lease itself); anything else is dropped and counted
        (see :mod:`.messages`). A handover request sets the hint; it wakes only a leader
        (a follower has nothing to do until the leader releases).
        """
        got = False
        read = 0
        try:
            while listener.can_read(0):
                if limit is not None and read >= limit:
                    return got, True
                read += 1
                message = listener.read_response()
                if not isinstance(message, list) or len(message) != 3:
                    continue
                kind, channel, payload = message
                if kind != b"message" or channel != self._events_channel:
                    continue  # a confirmation, or a node's presence channel
                event = event_kind(payload)
                if event is None:
                    if not unsigned_beat(payload):
                        self._dropped.drop(channel, payload)
                    continue
                if event == "drain":
                    # Only a wake-up, from anyone allowed to PUBLISH: the node reads its
                    # drain state from the server.
                    self._drain_hint()
                    continue
                if event == "tasks":
                    self._tasks_hint()  # a wake-up too: the leader reads the controls
                    continue
                if event == "resign":
                    self._handover_hint = True
                    if self._leading is None:
                        continue
                got = True
        except (redis.RedisError, OSError) as exc:
            self._fail()
            raise unavailable("listen for lease changes", self._factory.where, exc) from exc
        return got, False

    @property
    def dropped_messages(self) -> int:
        """Messages dropped unread since construction: malformed ones on the lease's
        events channel, and beats on the liveness channel whose signature or number did
        not check out, as this process's hub for the lease's server counted them
        (forged or replayed by a client allowed to PUBLISH; see
        :mod:`rselection.redis.messages`)."""
        return self._dropped.count + self._liveness.dropped

    def interrupt(self) -> None:
        """Wake the thread blocked in :meth:`wait_for_change`; safe from any thread.

        Sticky: an interrupt that arrives just before the wait makes it return at once.
        """
        self._wakeup.wake()

    def close(self) -> None:
        """Close the keeper connections (and the client, if made from a URL); idempotent.

        :meth:`connect` may be called again later.
        """
        self._drop()
        if self._owns_client:
            # Idle connections only: a current() under way on another thread keeps its
            # connection (closing it under the read would raise out of redis-py); it
            # goes back to the pool, which the next close() empties.
            with contextlib.suppress(Exception):
                self._client.connection_pool.disconnect(inuse_connections=False)
        self._wakeup.close()


class _LeaseWatch:
    """One wait of a :class:`RedisLease` for a change, in steps (a
    :class:`rselection.wait_pump.Watch`): :meth:`RedisLease.wait_for_change` is a loop
    over them, and the process's wait pump takes them for many leases.

    The stepping thread watches :attr:`sockets` for reading, and calls :meth:`step`
    with the readable ones whenever one is, or when :meth:`due` has come.
    """

    def __init__(self, lease: RedisLease, conn: Any, listener: Any, wake: socket.socket) -> None:
        self._lease = lease
        self._conn = conn
        self._listener = listener
        self._woken = False  # a message asked for a wake-up
        self._more = False  # the last step left messages unread
        self.sockets = (_sock(conn), _sock(listener), wake)
        """The keeper's and the listener's sockets, and the lease's wake-up (the
        liveness hub wakes it when the holder's connection is gone)."""

    def due(self) -> float:
        """The monotonic time of the next wake-up (``inf``: none; ``-inf`` when messages
        are left to read)."""
        if self._more:
            return -math.inf
        return self._lease._wake_after if self._woken else math.inf

    def step(self, readable: frozenset[Any]) -> bool:
        """Read what ``readable`` holds of :attr:`sockets` (at most
        :data:`_STEP_MESSAGES` messages); ``True`` when the wait ends (the holder may
        have changed).

        Raises:
            BackendUnavailable: a keeper connection broke.
        """
        lease = self._lease
        keeper, listening, wake = self.sockets
        if keeper in readable:
            lease._keeper_readable(self._conn)
        if wake in readable:
            lease._wakeup.clear()
            return True  # interrupted, or the holder's connection is gone: take it over
        if listening in readable or self._more:
            got, self._more = lease._drain(self._listener, _STEP_MESSAGES)
            self._woken = self._woken or got
        now = time.monotonic()
        if self._woken and now >= lease._wake_after:
            lease._wake_after = now + _WAKE_GAP
            return True
        return False


def _sock(conn: Any) -> socket.socket:
    sock: socket.socket | None = getattr(conn, "_sock", None)
    if sock is None:
        raise BackendUnavailable("the lease server connection is closed")
    return sock
