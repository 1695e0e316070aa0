"""Node membership in Redis: every node of a lease heartbeats into a sorted set.

A node is alive while its last heartbeat (scored by the server's ``TIME``) is younger
than ``node_timeout``. The heartbeats of every membership on one Redis server are sent
by one thread of their own, those due together in one pipeline. See
``docs/explanation/redis.md`` ("How the lease works", Membership) for the keys, the
purge and the retries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Hashable
from datetime import UTC, datetime
from typing import Any, NamedTuple, Unpack

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry

from .. import forks
from ..backoff import backoff
from ..errors import BackendUnavailable
from ..members import MembershipArgs, MembershipBase, NodeInfo
from ._conn import describe, unavailable
from ._scripts import HEARTBEAT, LEAVE, NODES
from .keys import DEFAULT_KEY_PREFIX, check_key_prefix, membership_keys

__all__ = ["RedisMembership", "read_nodes"]

logger = logging.getLogger(__name__)

_PURGE_AFTER_MS = 86_400_000  # a lost node is kept this long for operators to see
_KEEP_MS = 2 * _PURGE_AFTER_MS  # the keys' expiry, renewed by every purging heartbeat
_PURGE_EVERY = 3600.0  # seconds between a node's purging heartbeats
_RETRY = 1.0  # a failed heartbeat is first retried this soon, then twice as late each time
_LEAVE_WAIT = 5.0  # a stop waits this long, plus two socket timeouts, for its removal
_WINDOW = 1.0  # heartbeats due within this long (or a tenth of the interval) go together
_BATCH = 1000  # the most heartbeats (or removals) in one pipeline
# Keyword arguments of a pool that are state of its client, not settings of a connection.
_PER_CLIENT = ("retry_on_", "maint_notifications", "oss_cluster_maint", "himport_registry")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode(), usedforsecurity=False).hexdigest()


_SCRIPTS = {_sha(HEARTBEAT): HEARTBEAT, _sha(LEAVE): LEAVE}
_HEARTBEAT_SHA, _LEAVE_SHA = _SCRIPTS


class _Settings(NamedTuple):
    """How to open a connection like a client's, and a key equal for equal settings."""

    key: Hashable
    connection_class: type[Any]
    kwargs: dict[str, Any]


class _Same:
    """A setting that is not a plain value: equal to itself only."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _setting_key(value: Any) -> Hashable:
    """``value`` as a hashable key: plain values (and containers and dataclasses of them)
    compared by value, any other object by identity."""
    if value is None or isinstance(value, str | bytes | int | float):
        return value
    if isinstance(value, tuple | list):
        return (type(value), tuple(_setting_key(v) for v in value))
    if isinstance(value, dict):
        return (dict, frozenset((_setting_key(k), _setting_key(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value), tuple(_setting_key(getattr(value, f.name)) for f in fields))
    return _Same(value)


def _bounded_settings(client: Any, timeout: float) -> _Settings | None:
    """``client``'s connection settings with round trips bounded by ``timeout`` and no
    retries, or ``None`` for a cluster client or a pool of a kind we cannot copy
    (Sentinel)."""
    pool = getattr(client, "connection_pool", None)
    if type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return None
    assert pool is not None
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if not k.startswith(_PER_CLIENT)}
    # One attempt per heartbeat: the next heartbeat is the retry.
    kwargs.update(socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=0)
    for name in ("orig_socket_timeout", "orig_socket_connect_timeout"):
        if name in kwargs:  # what redis-py restores the timeouts to after a relaxation
            kwargs[name] = timeout
    key = (
        pool.connection_class,
        frozenset((name, _setting_key(value)) for name, value in kwargs.items() if name != "retry"),
    )
    kwargs["retry"] = Retry(NoBackoff(), 0)
    return _Settings(key, pool.connection_class, kwargs)


def _bounded_client(settings: _Settings | None, client: Any) -> tuple[Any, bool]:
    """A client for heartbeats sent by :meth:`RedisMembership.beat` itself: a small
    pool of ``settings``, and whether it was made here; ``client`` as it is without
    settings."""
    if settings is None:
        return client, False
    own = redis.ConnectionPool(
        connection_class=settings.connection_class, max_connections=2, **settings.kwargs
    )
    return redis.Redis(connection_pool=own), True


def _host(addr: str) -> str | None:
    """The host of a ``CLIENT INFO`` address (none for a Unix socket)."""
    host = addr.rsplit(":", 1)[0]
    return None if not host or host.startswith("/") else host


def _ms_to_utc(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def read_nodes(
    client: Any, name: str, *, key_prefix: str, node_timeout: float, lease_key: str
) -> list[NodeInfo]:
    """Every node listed for lease ``name``, oldest first; lost ones have ``alive=False``.

    One script reads the members, their info and the lease holder (server time).

    Args:
        client: a ``redis.Redis`` or ``RedisCluster``.
        name: the lease name.
        key_prefix: the leaders' ``key_prefix``.
        node_timeout: a node not seen for this long is lost, seconds.
        lease_key: the lease's key (to flag the leader).

    Raises:
        BackendUnavailable: Redis could not be reached or refused the read.
    """
    nodes_key, info_key = membership_keys(name, key_prefix)
    try:
        reply = client.eval(NODES, 3, nodes_key, info_key, lease_key)
    except redis.RedisError as exc:
        raise unavailable("list the nodes", describe(client), exc) from exc
    now = int(_text(reply[0]))
    seen, info, raw_lease = reply[1], reply[2], _text(reply[3])
    holder = ""
    if raw_lease:
        try:
            holder = str(json.loads(raw_lease).get("node", ""))
        except (ValueError, AttributeError):
            holder = ""  # not an rselection lease: nobody leads as far as we can tell
    docs: dict[str, dict[str, Any]] = {}
    for i in range(0, len(info) - 1, 2):
        try:
            doc = json.loads(_text(info[i + 1]))
        except ValueError:
            continue
        if isinstance(doc, dict):
            docs[_text(info[i])] = doc
    timeout_ms = node_timeout * 1000
    nodes = []
    for i in range(0, len(seen) - 1, 2):
        node_id, last = _text(seen[i]), float(_text(seen[i + 1]))
        doc = docs.get(node_id, {})
        started = doc.get("started", last)
        version = doc.get("version")
        nodes.append(
            NodeInfo(
                node_id=node_id,
                name=name,
                hostname=str(doc.get("host", "")),
                pid=int(doc.get("pid", 0) or 0),
                client_addr=doc.get("addr") or None,
                started_at=_ms_to_utc(float(started)),
                last_seen=_ms_to_utc(last),
                alive=now - last <= timeout_ms,
                is_leader=holder == node_id,
                # A node of a release that recorded neither is eligible, of no version.
                version=version if isinstance(version, str) else None,
                eligible=doc.get("eligible") is not False,
            )
        )
    nodes.sort(key=lambda n: (n.started_at, n.node_id))
    return nodes


class RedisMembership(MembershipBase):
    """Heartbeats of one node in Redis, and the list of a lease's nodes.

    Args:
        client: the leader's ``redis.Redis`` or ``RedisCluster`` (its settings serve
            the heartbeats, its pool the reads).
        key_prefix: the lease's key prefix.
        lease_key: the lease's key, to flag the leader in :meth:`nodes`.
        node: the node's lease name, id, heartbeats, version and eligibility (see
            :class:`~rselection.members.MembershipArgs`).

    Raises:
        ConfigError: bad arguments (the message says which and why).
    """

    def __init__(
        self,
        client: Any,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        lease_key: str,
        **node: Unpack[MembershipArgs],
    ) -> None:
        super().__init__(**node)
        self.key_prefix = check_key_prefix(key_prefix)
        self.keys = membership_keys(self.name, key_prefix)
        self._lease_key = lease_key
        self._client = client
        # The server (host, port, db) whose heartbeat thread sends this node's.
        self._server = describe(client)
        self._bound = min(self.heartbeat_interval, self.node_timeout / 3)
        self._window = min(_WINDOW, self.heartbeat_interval / 10)
        # How its heartbeat thread connects (None: one by one on the client as it is).
        self._settings = _bounded_settings(client, self._bound)
        # The thread's connection for every membership with these settings (set by it).
        self._group: _Group | None = None
        self._beats_client, self._owns_beats_client = _bounded_client(self._settings, client)
        self._heartbeat = self._beats_client.register_script(HEARTBEAT)
        self._leave = self._beats_client.register_script(LEAVE)
        self._failures = 0  # heartbeats failed in a row
        self._lock = threading.Lock()  # start() and stop() may race at shutdown
        self._started = self._stopped = False
        self._fresh = True  # (re)write the node's info with the next heartbeat
        self._via = 0  # the connection of its last heartbeat (a _Group's number; 0: own)
        self._purge_due = 0.0  # monotonic time of the next purging heartbeat
        self._addr: str | None = None
        self._about: tuple[Any, ...] | None = None  # what self._info says
        self._info = ""
        self._last_packed: tuple[tuple[Any, ...], bytes] = ((), b"")  # a heartbeat's
        self._left = False  # its removal was sent (or tried) by its heartbeat thread
        self._leave_error: Exception | None = None
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): heartbeats started in the
        parent are the parent's node's; the child neither sends them nor removes the
        node. Not started yet, it heartbeats normally once started here."""
        self._lock = threading.Lock()
        if self._started:
            self._started, self._stopped = False, True

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (this node no longer heartbeats)."""
        return self._stopped

    def start(self) -> None:
        """Heartbeat now and then every ``heartbeat_interval`` until :meth:`stop`.

        Does nothing once stopped.
        """
        with self._lock:
            if self._stopped or self._started:
                return
            self._started = True
            # Under the lock: a stop() racing this one removes what this added.
            _BEATS.add(self)

    def stop(self) -> None:
        """Stop heartbeating and remove this node from the membership (best effort); a
        second call does nothing.

        Bounded: a batch of heartbeats in flight and the removal (sent by the heartbeat
        thread after it) each take at most the heartbeats' socket timeout (see the
        module docstring). Once it returns no heartbeat of this node lands, unless the
        server did not answer in time (logged); the removal comes after it even then.
        """
        with self._lock:
            again, self._stopped = self._stopped, True
            started = self._started
        if not started or again:  # never heartbeated, or removed (or tried to) already
            return
        wait = _LEAVE_WAIT + 2 * self._bound
        try:
            if not _BEATS.leave(self, wait):
                logger.warning(
                    "node %s: not removed after %g s (%s does not answer); leaving anyway",
                    self.node_id,
                    wait,
                    self._server,
                )
            elif self._leave_error is not None:
                logger.info(
                    "node %s left without removing its heartbeat: %s",
                    self.node_id,
                    self._leave_error,
                )
        finally:
            if self._owns_beats_client:
                with contextlib.suppress(Exception):
                    self._beats_client.connection_pool.disconnect()

    def set_eligible(self, eligible: bool) -> None:
        """Record ``eligible`` with this node's next heartbeats: they write the node's
        info again."""
        super().set_eligible(eligible)
        self._fresh = True

    def beat(self) -> None:
        """Record one heartbeat of this node (server time), on a connection of this
        membership's own (its heartbeat thread sends them in batches on its own).

        Raises:
            BackendUnavailable: Redis could not be reached or refused it.
        """
        keys_args, purge = self._prepare(0, self._address)
        try:
            self._heartbeat(keys=keys_args[:2], args=keys_args[2:])
        except redis.RedisError as exc:
            self._beaten(0, purge, ok=False)
            raise unavailable("record a heartbeat", describe(self._client), exc) from exc
        self._beaten(0, purge, ok=True)

    def _prepare(self, via: int, address: Callable[[], str | None]) -> tuple[list[Any], bool]:
        """The keys and arguments of this node's next heartbeat, sent on connection
        ``via`` whose address is ``address()``, and whether it purges."""
        fresh = self._fresh or via != self._via  # new, failed, or on another connection
        purge = fresh or time.monotonic() >= self._purge_due
        if fresh:
            self._addr = address()
        # Sent every time (a few dozen bytes): a node found missing (purged by mistake,
        # a restarted server) is written back whole.
        host, pid, run = socket.gethostname(), os.getpid(), self.incarnation
        about = (host, pid, self._addr, self.version, self.eligible, run)
        if about != self._about:
            self._about = about
            self._info = json.dumps(
                {
                    **{"host": host, "pid": pid, "addr": self._addr},
                    **{"version": self.version, "eligible": self.eligible, "inc": run},
                }
            )
        args = [self.node_id, self._info, "1" if fresh else "0", "1" if purge else "0"]
        return [*self.keys, *args, _PURGE_AFTER_MS, _KEEP_MS], purge

    def _packed(self, command: tuple[Any, ...], pack: Callable[[tuple[Any, ...]], bytes]) -> bytes:
        """``command`` packed by ``pack``: the same as last time, most of the time."""
        if self._last_packed[0] != command:
            self._last_packed = (command, pack(command))
        return self._last_packed[1]

    def _beaten(self, via: int, purge: bool, *, ok: bool) -> None:
        """Count a heartbeat prepared by :meth:`_prepare` as recorded (``ok``) or failed."""
        if not ok:
            self._fresh = True  # a new connection may have a new address
            self._failures += 1
            return
        self._fresh, self._via, self._failures = False, via, 0
        if purge:
            self._purge_due = time.monotonic() + _PURGE_EVERY

    def _address(self) -> str | None:
        """This membership's own client's address as the server sees it (``CLIENT
        INFO``), if allowed."""
        try:
            return _host(_text(self._beats_client.client_info().get("addr", "")))
        except (redis.RedisError, AttributeError):
            return None  # an ACL without CLIENT: the address only helps operators

    def due_in(self, ok: bool) -> float:
        """Seconds until the next heartbeat after one that succeeded (``ok``) or failed
        (then 1 s, doubling with each failure in a row, up to ``heartbeat_interval``)."""
        if ok:
            return self.heartbeat_interval
        return backoff(self._failures, first=_RETRY, cap=self.heartbeat_interval, jitter=False)

    def nodes(self) -> list[NodeInfo]:
        """Every node listed for this lease, oldest first; lost ones have ``alive=False``.

        Raises:
            BackendUnavailable: Redis could not be reached.
        """
        return read_nodes(
            self._client,
            self.name,
            key_prefix=self.key_prefix,
            node_timeout=self.node_timeout,
            lease_key=self._lease_key,
        )

    def __repr__(self) -> str:
        return f"RedisMembership(name={self.name!r}, node_id={self.node_id!r})"


def _round_trip(
    conn: Any, commands: list[tuple[Any, ...]], packed: list[bytes] | None = None
) -> list[Any]:
    """Send ``commands`` (or them ``packed``) at once on ``conn`` and read their replies
    (an error reply as its ``ResponseError``); any other error leaves the connection
    unusable."""
    data = [b"".join(packed)] if packed is not None else conn.pack_commands(commands)
    conn.send_packed_command(data, check_health=False)
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(conn.read_response())
        except redis.ResponseError as exc:
            replies.append(exc)
    return replies


class _Group:
    """The connection on which a :class:`_Beats` thread sends the heartbeats (and
    removals) of its memberships with the same settings; only that thread uses it."""

    _numbers = itertools.count(1)  # one per connection opened, so never 0 (beat()'s)

    def __init__(self, settings: _Settings) -> None:
        self._settings = settings
        self.key = settings.key
        self.members = 0  # started and not yet removed
        self._conn: Any = None
        self.number = 0  # of the connection open now
        self.addr: str | None = None  # its address as the server sees it

    def connect(self) -> None:
        """Have a connection open (a new one when the server closed the last one)."""
        if self._conn is not None:
            try:
                if not self._conn.can_read(timeout=0):
                    return
            except (redis.RedisError, OSError):
                pass
            self.close()  # closed by the server (a restart, its idle timeout), or out of step
        conn = self._settings.connection_class(**self._settings.kwargs)
        try:
            conn.connect()
            conn.send_command("CLIENT", "INFO")
            try:
                info = _text(conn.read_response())
                addr = next((w[5:] for w in info.split() if w.startswith("addr=")), "")
            except redis.ResponseError:  # an ACL without CLIENT: the address only helps operators
                addr = ""
        except BaseException:
            with contextlib.suppress(Exception):
                conn.disconnect()
            raise
        self._conn, self.number, self.addr = conn, next(self._numbers), _host(addr)

    def pack(self, command: tuple[Any, ...]) -> bytes:
        """``command`` as sent on the connection open now (its encoding)."""
        return b"".join(self._conn.pack_command(*command))

    def send(self, commands: list[tuple[Any, ...]], packed: list[bytes] | None = None) -> list[Any]:
        """Run ``commands`` (``EVALSHA`` of :data:`_SCRIPTS`; or them ``packed`` by
        :meth:`pack`) in one round trip on the connection :meth:`connect` opened: their
        replies, an error reply as its ``ResponseError``. Scripts the server lost (a
        restart, ``SCRIPT FLUSH``) are loaded and their commands sent again, in one more
        round trip.

        Raises:
            redis.RedisError, OSError: the connection failed (and is closed).
        """
        conn = self._conn
        try:
            if conn is None:
                raise redis.ConnectionError("not connected")
            replies = _round_trip(conn, commands, packed)
            lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if lost:
                shas = dict.fromkeys(commands[i][1] for i in lost)
                loads = [("SCRIPT", "LOAD", _SCRIPTS[sha]) for sha in shas]
                again = _round_trip(conn, [*loads, *(commands[i] for i in lost)])
                for i, reply in zip(lost, again[len(loads) :], strict=True):
                    replies[i] = reply
        except BaseException:
            self.close()
            raise
        return replies

    def close(self) -> None:
        conn, self._conn, self.number = self._conn, None, 0
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.disconnect()


class _Beats:
    """The thread that sends the heartbeats of every membership on one Redis server.

    It runs while any of them is started or has its removal to send, and ends when the
    last one has left.
    """

    def __init__(self, where: str) -> None:
        self._where = where
        self._cond = threading.Condition()
        self._due: dict[RedisMembership, float] = {}
        # The due times as a heap (an entry whose time is no longer the member's in
        # _due is stale): the next of 1,000 memberships in O(log n), not a scan of all.
        self._heap: list[tuple[float, int, RedisMembership]] = []
        self._order = itertools.count()
        self._leaving: dict[RedisMembership, None] = {}  # stopped, in order, not removed yet
        self._groups: dict[Hashable, _Group] = {}  # by the members' settings key
        self._thread: threading.Thread | None = None

    def _schedule(self, member: RedisMembership, at: float) -> None:
        """Under the lock: ``member``'s next heartbeat is due at ``at``."""
        self._due[member] = at
        heapq.heappush(self._heap, (at, next(self._order), member))

    def _start(self) -> None:
        """Under the lock: have the thread running."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"rselection-redis-heartbeats-{self._where}", daemon=True
            )
            self._thread.start()

    def add(self, member: RedisMembership) -> None:
        with self._cond:
            if member._settings is not None:
                key = member._settings.key
                group = self._groups.get(key)
                if group is None:
                    group = self._groups[key] = _Group(member._settings)
                group.members += 1
                member._group = group
            self._schedule(member, time.monotonic())
            self._start()
            self._cond.notify_all()

    def leave(self, member: RedisMembership, timeout: float) -> bool:
        """Stop ``member``'s heartbeats and remove its node, after any batch of
        heartbeats with it in flight, so that none lands after; wait up to ``timeout``
        for the removal (then it is still sent). Whether it was sent (or tried)."""
        with self._cond:
            self._due.pop(member, None)
            self._leaving[member] = None
            self._start()
            self._cond.notify_all()
            return self._cond.wait_for(lambda: member._left, timeout)

    def idle(self) -> bool:
        """No membership left and no thread running."""
        with self._cond:
            return not self._due and not self._leaving and self._thread is None

    def _next(self) -> tuple[bool, list[RedisMembership]] | None:
        """The next batch, of removals (``True``) or heartbeats, waiting until one is
        due; ``None`` when no membership is left (the thread ends)."""
        with self._cond:
            while True:
                if self._leaving:
                    group = next(iter(self._leaving))._group
                    leaving = [m for m in self._leaving if m._group is group]
                    batch = leaving[:_BATCH] if group is not None else leaving[:1]
                    for member in batch:
                        del self._leaving[member]
                    return True, batch
                if not self._due:
                    self._thread = None
                    self._heap.clear()
                    return None
                at, _, member = self._heap[0]
                if self._due.get(member) != at:
                    heapq.heappop(self._heap)  # stale: stopped, or due at another time
                    continue
                now = time.monotonic()
                if at > now:
                    self._cond.wait(at - now)
                    continue
                heapq.heappop(self._heap)
                return False, self._gather(member, now)

    def _gather(self, first: RedisMembership, now: float) -> list[RedisMembership]:
        """Under the lock: ``first`` and every other membership of its group due within
        its window (taken off the heap; they stay in _due while in flight)."""
        group = first._group
        batch = [first]
        if group is None:
            return batch
        aside = []
        while self._heap and self._heap[0][0] <= now + _WINDOW and len(batch) < _BATCH:
            entry = heapq.heappop(self._heap)
            at, _, member = entry
            if self._due.get(member) != at:
                continue  # stale
            if member._group is group and at <= now + member._window:
                batch.append(member)
            else:
                aside.append(entry)
        for entry in aside:
            heapq.heappush(self._heap, entry)
        return batch

    def _run(self) -> None:
        while (work := self._next()) is not None:
            leaving, batch = work
            group = batch[0]._group
            oks = [False] * len(batch)
            try:
                if leaving:
                    self._remove(group, batch)
                else:
                    oks = self._beat(group, batch)
            except Exception as exc:  # the thread serves every membership: survive anything
                logger.exception("unexpected error in the heartbeats on %s", self._where)
                for member in batch if leaving else ():
                    member._leave_error = exc
            closing = None
            with self._cond:
                if leaving:
                    for member in batch:
                        member._left = True
                    if group is not None:
                        group.members -= len(batch)
                        if group.members <= 0 and self._groups.get(group.key) is group:
                            del self._groups[group.key]
                            closing = group  # its last membership left
                else:
                    now = time.monotonic()
                    for member, ok in zip(batch, oks, strict=True):
                        if member in self._due:  # not stopped meanwhile
                            self._schedule(member, now + member.due_in(ok))
                self._cond.notify_all()
            if closing is not None:
                closing.close()

    def _beat(self, group: _Group | None, batch: list[RedisMembership]) -> list[bool]:
        """Send one heartbeat of each of ``batch``; whether each was recorded."""
        if group is None:  # a cluster client or a Sentinel pool: on the client, alone
            (member,) = batch
            try:
                member.beat()
                return [True]
            except BackendUnavailable as exc:
                logger.warning("node %s: heartbeat failed (%s); retrying", member.node_id, exc)
            except Exception:
                if member.stopped:  # its client closed under it at stop: nothing went wrong
                    logger.debug("node %s: heartbeat cut short by stop", member.node_id)
                else:
                    logger.exception("node %s: unexpected error in a heartbeat", member.node_id)
            return [False]
        try:
            group.connect()
            prepared = [member._prepare(group.number, lambda: group.addr) for member in batch]
            commands = [("EVALSHA", _HEARTBEAT_SHA, 2, *a) for a, _ in prepared]
            packed = [m._packed(c, group.pack) for m, c in zip(batch, commands, strict=True)]
            replies = group.send(commands, packed)
        except (redis.RedisError, OSError) as exc:  # the connection failed: all of them did
            for member in batch:
                member._beaten(0, False, ok=False)
            what = f"record {len(batch)} heartbeat(s)"
            logger.warning("%s; retrying", unavailable(what, self._where, exc))
            return [False] * len(batch)
        oks = []
        for member, (_, purge), reply in zip(batch, prepared, replies, strict=True):
            ok = not isinstance(reply, redis.ResponseError)
            member._beaten(group.number, purge, ok=ok)
            if not ok:
                logger.warning(
                    "node %s: heartbeat failed (%s); retrying",
                    member.node_id,
                    unavailable("record a heartbeat", self._where, reply),
                )
            oks.append(ok)
        return oks

    def _remove(self, group: _Group | None, batch: list[RedisMembership]) -> None:
        """Remove the node of each of ``batch`` (an error kept for its stop())."""
        commands = [("EVALSHA", _LEAVE_SHA, 2, *m.keys, m.node_id) for m in batch]
        replies: list[Any]
        try:
            if group is None:
                (member,) = batch
                replies = [member._leave(keys=list(member.keys), args=[member.node_id])]
            else:
                group.connect()
                replies = group.send(commands)
        except (redis.RedisError, OSError, ValueError) as exc:
            replies = [exc] * len(batch)
        for member, reply in zip(batch, replies, strict=True):
            member._leave_error = reply if isinstance(reply, Exception) else None


class _Servers:
    """One :class:`_Beats` per Redis server (its address: host, port and database)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beats: dict[str, _Beats] = {}

    def reset_after_fork(self) -> None:
        """In a forked child: the heartbeat threads, their connections and the
        memberships they serve are the parent's; the child's memberships get threads
        (and connections) of their own."""
        forks.keep_inherited(*self._beats.values())
        self._lock = threading.Lock()
        self._beats = {}

    def add(self, member: RedisMembership) -> None:
        server = member._server
        with self._lock:
            for key, idle in list(self._beats.items()):
                if idle.idle():  # its last membership left
                    del self._beats[key]
            beats = self._beats.setdefault(server, _Beats(server))
            beats.add(member)

    def leave(self, member: RedisMembership, timeout: float) -> bool:
        with self._lock:
            beats = self._beats.get(member._server)
        return True if beats is None else beats.leave(member, timeout)


_BEATS = _Servers()
forks.register(_BEATS)
