"""Node membership in Redis: every node of a lease heartbeats into a sorted set.

Each :class:`~rselection.RedisLeader` (leader and followers alike) records a heartbeat
every ``heartbeat_interval`` seconds with one script that scores its node id in
``<prefix>{<name>}:nodes`` by the server's ``TIME`` (milliseconds): the script, ``TIME``
and ``ZADD`` are all the commands of a heartbeat, so a follower's heartbeats stay well
inside its budget of one command per second. What changes rarely (host, pid, the address
the server sees, the first heartbeat) is kept in the hash ``<prefix>{<name>}:nodeinfo``
and written only when a node is new or has reconnected. Both keys carry the lease name as
hash tag, like the lease's own keys, so one script lists the members and the holder in
one slot of a Redis Cluster.

A node is *alive* while its last heartbeat is younger than ``node_timeout`` by the
server's clock; no client clock is compared. A node that stops gracefully removes itself
at once; nodes lost for more than a day are purged by the others' heartbeats (on each
node's first heartbeat, then about once an hour), which also keep the two keys from
expiring (two days after the last such heartbeat, a fleet gone for good leaves nothing).

The heartbeats of every membership on one Redis server (host, port and database) are
sent by one thread of their own, so threads grow with servers, not with leases, and a
server that hangs never delays another server's heartbeats. Each membership sends its
heartbeats on a small pool of its own with the leader's settings and a socket timeout of
``min(heartbeat_interval, node_timeout / 3)``, so one heartbeat (and the removal on stop)
is bounded, and a node on a hung server delays the others of that server by at most that
much. Heartbeats go on through outages (a failed one is retried after 1 s, then 2, 4 and
so on up to ``heartbeat_interval``) until the leader stops. The node id, not the client
address, identifies a node.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import os
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .. import forks
from ..backoff import backoff
from ..errors import BackendUnavailable, ConfigError
from ..members import NodeInfo
from ..validation import check_name, check_node_id, check_seconds
from ._conn import describe, unavailable
from ._scripts import HEARTBEAT, LEAVE, NODES
from .keys import DEFAULT_KEY_PREFIX, check_key_prefix, membership_keys

__all__ = ["RedisMembership", "read_nodes"]

logger = logging.getLogger(__name__)

_PURGE_AFTER_MS = 86_400_000  # a lost node is kept this long for operators to see
_KEEP_MS = 2 * _PURGE_AFTER_MS  # the keys' expiry, renewed by every purging heartbeat
_PURGE_EVERY = 3600.0  # seconds between a node's purging heartbeats
_RETRY = 1.0  # a failed heartbeat is first retried this soon, then twice as late each time
_LEAVE_WAIT = 5.0  # longest a stop waits for this node's heartbeat in flight


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bounded_client(client: Any, timeout: float) -> tuple[Any, bool]:
    """A client for one membership's heartbeats: ``client``'s settings on a small pool of
    its own whose round trips are bounded by ``timeout``, and whether it was made here.

    A cluster client, or a pool of a kind we cannot copy (Sentinel), serves as it is.
    """
    pool = getattr(client, "connection_pool", None)
    if type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return client, False
    assert pool is not None
    kwargs = dict(pool.connection_kwargs)
    for name in list(kwargs):
        if name.startswith(("retry_on_", "maint_notifications", "oss_cluster_maint")):
            del kwargs[name]
    # One attempt per heartbeat: the next heartbeat is the retry.
    kwargs.update(
        socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )
    own = redis.ConnectionPool(connection_class=pool.connection_class, max_connections=2, **kwargs)
    return redis.Redis(connection_pool=own), True


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
            )
        )
    nodes.sort(key=lambda n: (n.started_at, n.node_id))
    return nodes


class RedisMembership:
    """Heartbeats of one node in Redis, and the list of a lease's nodes.

    Args:
        client: the leader's ``redis.Redis`` or ``RedisCluster`` (its pool serves the
            heartbeats and reads).
        name: the name of the lease the node competes for.
        node_id: this node's id.
        key_prefix: the lease's key prefix.
        lease_key: the lease's key, to flag the leader in :meth:`nodes`.
        heartbeat_interval: seconds between heartbeats.
        node_timeout: a node not seen for this long is lost.

    Raises:
        ConfigError: bad arguments (the message says which and why).
    """

    def __init__(
        self,
        client: Any,
        *,
        name: str,
        node_id: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        lease_key: str,
        heartbeat_interval: float,
        node_timeout: float,
    ) -> None:
        heartbeat_interval = check_seconds(heartbeat_interval, "heartbeat_interval")
        node_timeout = check_seconds(node_timeout, "node_timeout")
        if not node_timeout > heartbeat_interval:
            raise ConfigError(
                f"node_timeout ({node_timeout:g} s) must be longer than heartbeat_interval "
                f"({heartbeat_interval:g} s), which must be positive: a node would be lost "
                "between two of its own heartbeats"
            )
        self.name = check_name(name, "lease name")
        self.node_id = check_node_id(node_id)
        self.key_prefix = check_key_prefix(key_prefix)
        self.heartbeat_interval = heartbeat_interval
        self.node_timeout = node_timeout
        self.keys = membership_keys(name, key_prefix)
        self._lease_key = lease_key
        self._client = client
        # The server (host, port, db) whose heartbeat thread sends this node's.
        self._server = describe(client)
        bound = min(heartbeat_interval, node_timeout / 3)
        self._beats_client, self._owns_beats_client = _bounded_client(client, bound)
        self._heartbeat = self._beats_client.register_script(HEARTBEAT)
        self._leave = self._beats_client.register_script(LEAVE)
        self._failures = 0  # heartbeats failed in a row
        self._lock = threading.Lock()  # start() and stop() may race at shutdown
        self._started = self._stopped = False
        self._fresh = True  # (re)write the node's info with the next heartbeat
        self._purge_due = 0.0  # monotonic time of the next purging heartbeat
        self._addr: str | None = None
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
        _BEATS.add(self)

    def stop(self) -> None:
        """Stop heartbeating and remove this node from the membership (best effort); a
        second call does nothing.

        Bounded: a heartbeat in flight and the removal each take at most the heartbeats'
        socket timeout (see the module docstring).
        """
        with self._lock:
            again, self._stopped = self._stopped, True
            started = self._started
        if not started or again:  # never heartbeated, or removed (or tried to) already
            return
        _BEATS.remove(self, _LEAVE_WAIT)
        try:
            self._leave(keys=list(self.keys), args=[self.node_id])
        except (redis.RedisError, OSError, ValueError) as exc:
            logger.info("node %s left without removing its heartbeat: %s", self.node_id, exc)
        finally:
            if self._owns_beats_client:
                with contextlib.suppress(Exception):
                    self._beats_client.connection_pool.disconnect()

    def beat(self) -> None:
        """Record one heartbeat of this node (server time).

        Raises:
            BackendUnavailable: Redis could not be reached or refused it.
        """
        fresh = self._fresh
        purge = fresh or time.monotonic() >= self._purge_due
        if fresh:
            self._addr = self._address()
        # Sent every time (a few dozen bytes): a node found missing (purged by mistake,
        # a restarted server) is written back whole.
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "addr": self._addr})
        try:
            self._heartbeat(
                keys=list(self.keys),
                args=[
                    self.node_id,
                    info,
                    "1" if fresh else "0",
                    "1" if purge else "0",
                    _PURGE_AFTER_MS,
                    _KEEP_MS,
                ],
            )
        except redis.RedisError as exc:
            self._fresh = True  # a new connection may have a new address
            self._failures += 1
            raise unavailable("record a heartbeat", describe(self._client), exc) from exc
        self._fresh = False
        self._failures = 0
        if purge:
            self._purge_due = time.monotonic() + _PURGE_EVERY

    def _address(self) -> str | None:
        """This client's address as the server sees it (``CLIENT INFO``), if allowed."""
        try:
            addr = _text(self._beats_client.client_info().get("addr", ""))
        except (redis.RedisError, AttributeError):
            return None  # an ACL without CLIENT: the address only helps operators
        host = addr.rsplit(":", 1)[0]
        return None if not host or host.startswith("/") else host  # Unix socket: none

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


class _Beats:
    """The thread that sends the heartbeats of every membership on one Redis server.

    It runs while any of them is started, and ends when the last one stops.
    """

    def __init__(self, where: str) -> None:
        self._where = where
        self._cond = threading.Condition()
        self._due: dict[RedisMembership, float] = {}
        # The due times as a heap (an entry whose time is no longer the member's in
        # _due is stale): the next of 1,000 memberships in O(log n), not a scan of all.
        self._heap: list[tuple[float, int, RedisMembership]] = []
        self._order = itertools.count()
        self._busy: RedisMembership | None = None
        self._thread: threading.Thread | None = None

    def _schedule(self, member: RedisMembership, at: float) -> None:
        """Under the lock: ``member``'s next heartbeat is due at ``at``."""
        self._due[member] = at
        heapq.heappush(self._heap, (at, next(self._order), member))

    def add(self, member: RedisMembership) -> None:
        with self._cond:
            self._schedule(member, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"rselection-redis-heartbeats-{self._where}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def remove(self, member: RedisMembership, timeout: float) -> None:
        """Stop ``member``'s heartbeats; wait (up to ``timeout``) for one in flight, so that
        no heartbeat lands after the node left."""
        with self._cond:
            self._due.pop(member, None)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._busy is not member, timeout):
                logger.warning(
                    "node %s: a heartbeat still in flight after %g s; leaving anyway",
                    member.node_id,
                    timeout,
                )

    def idle(self) -> bool:
        """No membership left and no thread running."""
        with self._cond:
            return not self._due and self._thread is None

    def _next(self) -> RedisMembership | None:
        """The next membership due (waiting until it is), or ``None`` when none is left."""
        with self._cond:
            while True:
                if not self._due:
                    self._thread = None
                    self._heap.clear()
                    return None
                at, _, member = self._heap[0]
                if self._due.get(member) != at:
                    heapq.heappop(self._heap)  # stale: stopped, or due at another time
                    continue
                wait = at - time.monotonic()
                if wait <= 0:
                    heapq.heappop(self._heap)
                    self._busy = member
                    return member
                self._cond.wait(wait)

    def _run(self) -> None:
        while (member := self._next()) is not None:
            ok = False
            try:
                member.beat()
                ok = True
            except BackendUnavailable as exc:
                logger.warning("node %s: heartbeat failed (%s); retrying", member.node_id, exc)
            except Exception:  # the thread serves every membership: survive anything
                if member.stopped:  # its pool closed under it at stop: nothing went wrong
                    logger.debug("node %s: heartbeat cut short by stop", member.node_id)
                else:
                    logger.exception("node %s: unexpected error in a heartbeat", member.node_id)
            finally:
                with self._cond:
                    self._busy = None
                    if member in self._due:
                        self._schedule(member, time.monotonic() + member.due_in(ok))
                    self._cond.notify_all()


class _Servers:
    """One :class:`_Beats` per Redis server (its address: host, port and database)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beats: dict[str, _Beats] = {}

    def reset_after_fork(self) -> None:
        """In a forked child: the heartbeat threads (and the memberships they serve) are
        the parent's; the child's memberships get threads of their own."""
        forks.keep_inherited(*self._beats.values())
        self._lock = threading.Lock()
        self._beats = {}

    def add(self, member: RedisMembership) -> None:
        server = member._server
        with self._lock:
            for key, idle in list(self._beats.items()):
                if idle.idle():  # its last membership stopped
                    del self._beats[key]
            beats = self._beats.setdefault(server, _Beats(server))
            beats.add(member)

    def remove(self, member: RedisMembership, timeout: float) -> None:
        with self._lock:
            beats = self._beats.get(member._server)
        if beats is not None:
            beats.remove(member, timeout)


_BEATS = _Servers()
forks.register(_BEATS)
