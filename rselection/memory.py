"""The in-memory backends: a lease, a fire claimer, a checkpoint store, a membership and
a task store that live in this process.

They keep the rules of the Postgres and Redis backends (terms, expiry, fencing, claims
that bind for a ``ttl``), so that :class:`~rselection.SingleNodeLeader` runs tasks in
local development exactly as a fleet would, and tests exercise every path of the
leadership machine without a server. Several leaders of one process may share one of
each, to hold elections among themselves.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from .abc import LeaseBackend, NextFires, TaskStoreBase
from .checkpoints import (
    DEFAULT_MAX_STATE_BYTES,
    Key,
    Snapshot,
    check_key,
    decode_state,
    encode_state,
    key_of,
)
from .claiming import check_fire_key, check_fire_keys, series_of
from .errors import ConfigError, StaleLeaderError
from .lease import Acquisition, LeaderInfo
from .members import MembershipBase, NodeInfo
from .task_runs import RunRecord, TaskControls, TaskEntry, TaskInfo, Trigger
from .validation import (
    check_name,
    check_optional_term,
    check_seconds,
    check_term,
)

__all__ = [
    "MemoryCheckpointStore",
    "MemoryClaimer",
    "MemoryLease",
    "MemoryMembership",
    "MemoryTaskStore",
]


class MemoryLease:
    """A lease kept in process memory, for :class:`~rselection.SingleNodeLeader` and tests.

    Several leaders in one process may share one ``MemoryLease`` to exercise elections
    without a database. Time is this process's wall clock (one process, one clock).
    """

    concurrent_calls = True
    """Its calls may run while another thread waits in :meth:`wait_for_change` (they
    take one lock each): the leader does not interrupt a wait for each call."""

    def __init__(self, *, name: str = "default", ttl: float = 15.0) -> None:
        """Create an empty lease called ``name`` whose holder expires after ``ttl`` seconds.

        Raises:
            ConfigError: a blank or overlong name, or a ttl that is not a positive number.
        """
        self.name = check_name(name, "lease name")
        self.ttl = check_seconds(ttl, "ttl")
        self._cond = threading.Condition()
        self._holder: LeaderInfo | None = None
        self._expires_mono = 0.0
        self._term = 0
        self._generation = 0
        self._interrupted = False
        # The generation each keeper thread last saw: a change between its call and its
        # next wait_for_change() must wake that wait (leaders may share this object).
        self._seen = threading.local()
        # Called after every change (see subscribe_changes): a leader needs no thread
        # waiting in wait_for_change.
        self._subscribers: dict[int, Callable[[], None]] = {}
        self._next_subscriber = 0

    def connect(self) -> None:
        """Nothing to connect: the lease lives in memory."""

    def _live_holder(self) -> LeaderInfo | None:
        if self._holder is not None and time.monotonic() >= self._expires_mono:
            self._holder = None
            self._generation += 1
        self._seen.generation = self._generation
        return self._holder

    def _changed(self) -> None:
        self._generation += 1
        self._seen.generation = self._generation  # this thread's own change
        self._cond.notify_all()

    def try_acquire(self, node_id: str) -> Acquisition:
        """Take the lease if nobody holds it or the holder's ttl ran out."""
        with self._notifying(), self._cond:
            holder = self._live_holder()
            if holder is None:
                self._term += 1
                now = datetime.now(UTC)
                holder = LeaderInfo(node_id, self._term, now, now + timedelta(seconds=self.ttl))
                self._holder = holder
                self._expires_mono = time.monotonic() + self.ttl
                self._changed()
                return Acquisition(True, holder, self.ttl)
            return Acquisition(False, holder, max(0.0, self._expires_mono - time.monotonic()))

    def renew(self, node_id: str, term: int) -> bool:
        """Extend the lease when ``node_id`` still holds ``term``."""
        with self._notifying(), self._cond:
            holder = self._live_holder()
            if holder is None or holder.node_id != node_id or holder.term != term:
                return False
            expires_at = datetime.now(UTC) + timedelta(seconds=self.ttl)
            self._holder = LeaderInfo(node_id, term, holder.acquired_at, expires_at)
            self._expires_mono = time.monotonic() + self.ttl
            return True

    def release(self, node_id: str, term: int) -> None:
        """Clear the holder when it is ``node_id`` at ``term``; the term counter is kept."""
        with self._notifying(), self._cond:
            holder = self._live_holder()
            if holder is not None and holder.node_id == node_id and holder.term == term:
                self._holder = None
                self._changed()

    def revoke(self) -> None:
        """Drop the current holder at once, as if its session died (for tests)."""
        with self._notifying(), self._cond:
            self._holder = None
            self._changed()

    def current(self) -> LeaderInfo | None:
        """The live holder, or ``None``."""
        with self._notifying(), self._cond:
            return self._live_holder()

    def wait_for_change(self, timeout: float) -> None:
        """Wait until the holder changes, :meth:`interrupt` is called, or ``timeout``.

        A change since this thread's last call, or an interrupt that came while nobody
        waited, makes this return at once. With
        several leaders on one lease, any one waiter may consume it (an early return
        only makes a keeper look again).
        """
        with self._cond:
            generation = getattr(self._seen, "generation", self._generation)
            self._cond.wait_for(
                lambda: self._interrupted or self._generation != generation, timeout
            )
            self._interrupted = False
            self._seen.generation = self._generation

    def interrupt(self) -> None:
        """Wake every waiter, or the next one if nobody is waiting now."""
        with self._notifying(), self._cond:
            self._interrupted = True
            self._changed()

    def subscribe_changes(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` after every change of the holder and every
        :meth:`interrupt`, from the thread that made it, holding no lock of the lease;
        return a function that ends the calls. A leader over this lease then needs no
        thread waiting in :meth:`wait_for_change`."""
        with self._cond:
            key = self._next_subscriber
            self._next_subscriber += 1
            self._subscribers[key] = callback

        def unsubscribe() -> None:
            with self._cond:
                self._subscribers.pop(key, None)

        return unsubscribe

    @contextmanager
    def _notifying(self) -> Iterator[None]:
        """Call the subscribers after the block, when it changed the generation (an
        expiry seen counts: the holder changed)."""
        before = self._generation
        try:
            yield
        finally:
            with self._cond:
                changed = self._generation != before
                callbacks = list(self._subscribers.values()) if changed else []
            for callback in callbacks:
                callback()

    def term_ended(self, term: int) -> None:
        """Nothing to do: a memory lease has no session to keep."""

    def close(self) -> None:
        """Nothing to close."""


class MemoryClaimer:
    """Claims kept in this process: one run per fire among leaders that share it.

    For tests, and for several leaders inside one process. Claims bind for ``ttl``
    seconds of this process's monotonic clock, like the Postgres claimer's server time.

    Args:
        ttl: seconds a claim binds (positive).
    """

    def __init__(self, *, ttl: float = 600.0) -> None:
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, int | float)
            or not math.isfinite(ttl)
            or ttl <= 0
        ):
            raise ConfigError(f"ttl must be a positive number of seconds, got {ttl!r}")
        self.ttl = float(ttl)
        self._claims: dict[str, tuple[float, int | None]] = {}
        self._series: set[str] = set()  # every series ever claimed: see ran_before()
        self._lock = threading.Lock()

    def _record(self, key: str, until: float, term: int | None) -> None:
        self._claims[key] = (until, term)
        series = series_of(key)
        if series is not None:
            self._series.add(series)

    def ran_before(self, series: str) -> bool:
        """Whether a fire of ``series`` was claimed here before (see :class:`FireHistory`)."""
        with self._lock:
            return series in self._series

    def ran_before_many(self, series: list[str]) -> set[str]:
        """Those of ``series`` claimed here before (see :class:`BatchFireHistory`)."""
        with self._lock:
            return {one for one in series if one in self._series}

    def claim_missed_many(
        self, fire_keys: list[list[str]], *, term: int | None = None
    ) -> list[list[str]]:
        """:meth:`claim_missed` of each list, at once (see :class:`BatchMissedFireClaimer`).

        Raises:
            ConfigError: a bad key, or a key given twice (see :func:`check_fire_keys`).
        """
        check_fire_keys([key for keys in fire_keys for key in keys])
        check_optional_term(term)
        with self._lock:
            return [self._claim_missed(keys, term) for keys in fire_keys]

    def cleanup(self, *, batch: int | None = None) -> int:
        """Forget expired claims, at most ``batch`` of them; return how many (see
        :class:`CleanupClaimer`; the series stay known, so nothing is kept for them)."""
        now = time.monotonic()
        with self._lock:
            expired = [key for key, (until, _) in self._claims.items() if until <= now]
            for key in expired[:batch]:
                del self._claims[key]
            return len(expired[:batch])

    def claim_missed(self, fire_keys: list[str], *, term: int | None = None) -> list[str]:
        """Claim every key of ``fire_keys`` (oldest first) newer than the newest one
        already held; return those won, oldest first (see :class:`MissedFireClaimer`).

        Raises:
            ConfigError: a bad or repeated key (see :func:`check_fire_keys`).
        """
        fire_keys = check_fire_keys(fire_keys)
        check_optional_term(term)
        with self._lock:
            return self._claim_missed(fire_keys, term)

    def _claim_missed(self, fire_keys: list[str], term: int | None) -> list[str]:
        now = time.monotonic()
        held = [i for i, key in enumerate(fire_keys) if self._holds(key, now)]
        newer = fire_keys[held[-1] + 1 :] if held else fire_keys
        for key in newer:
            self._record(key, now + self.ttl, term)
        return list(newer)

    def _holds(self, key: str, now: float) -> bool:
        held = self._claims.get(key)
        return held is not None and held[0] > now

    def claim(self, fire_key: str, *, term: int | None = None) -> bool:
        """Claim ``fire_key`` unless an unexpired claim holds it.

        Raises:
            ConfigError: a bad key (see :func:`check_fire_key`).
        """
        check_fire_key(fire_key)
        check_optional_term(term)
        now = time.monotonic()
        with self._lock:
            if self._holds(fire_key, now):
                return False
            self._record(fire_key, now + self.ttl, term)
            return True

    def claim_many(self, fire_keys: list[str], *, term: int | None = None) -> set[str]:
        """Claim each of ``fire_keys`` unless an unexpired claim holds it, at once;
        return the keys won (see :class:`BatchFireClaimer`).

        Raises:
            ConfigError: a bad or repeated key (see :func:`check_fire_keys`).
        """
        fire_keys = check_fire_keys(fire_keys)
        check_optional_term(term)
        now = time.monotonic()
        with self._lock:
            won = {key for key in fire_keys if not self._holds(key, now)}
            for key in won:
                self._record(key, now + self.ttl, term)
            return won

    def claims(self) -> dict[str, int | None]:
        """Unexpired claims: fire key -> the term that claimed it."""
        now = time.monotonic()
        with self._lock:
            return {key: term for key, (until, term) in self._claims.items() if until > now}


class MemoryCheckpointStore:
    """Checkpoints kept in this process, with the rules of the Postgres store.

    The default store of :class:`~rselection.SingleNodeLeader`, so ``ctx.checkpoint``
    works in local development and tests. States are stored as JSON text and come back
    as Postgres ``jsonb`` returns them (:func:`decode_state`), so a task sees what it
    would see from Postgres: tuples come back as lists, ``1e16`` as an int, ``-0.0`` as
    ``0.0``, dict keys in ``jsonb`` order, and a state JSON cannot encode is refused at
    the save; versions grow by one on every save and delete and
    are never reused; ``save(key, state, term=T, name=lease_name)`` commits only while
    ``T`` is the live holder's term of the lease called ``lease_name``, checked and written under
    one lock, so a save of an ended term is refused with
    :class:`~rselection.errors.StaleLeaderError`. Thread-safe.

    Args:
        leases: the leases fenced saves are checked against, one per name (a leader
            built with this store adds its own lease; see :meth:`add_lease`).
        max_state_bytes: largest encoded state :meth:`save` accepts (UTF-8 bytes of the
            JSON text).

    Raises:
        ConfigError: a bad lease or limit, or two lease objects of one name.
    """

    def __init__(
        self,
        *,
        leases: Iterable[LeaseBackend] = (),
        max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
    ) -> None:
        if (
            isinstance(max_state_bytes, bool)
            or not isinstance(max_state_bytes, int)
            or max_state_bytes <= 0
        ):
            raise ConfigError(f"max_state_bytes must be a positive int, got {max_state_bytes!r}")
        self.max_state_bytes = max_state_bytes
        self._lock = threading.Lock()
        self._leases: dict[str, LeaseBackend] = {}
        # key parts -> (JSON text or None once deleted, version, term, updated_at)
        self._rows: dict[tuple[str, ...], tuple[str | None, int, int | None, datetime]] = {}
        for lease in leases:
            self.add_lease(lease)

    def add_lease(self, lease: LeaseBackend) -> None:
        """Fence saves of ``lease.name`` against ``lease`` from now on.

        One lease object per name: adding the same object again does nothing, another
        object of a name the store already fences is refused (its terms would be taken
        for the first one's, so an ended term could pass and a live one be refused).

        Raises:
            ConfigError: ``lease`` is not a :class:`~rselection.LeaseBackend`, or the
                store already fences another lease object of the same name.
        """
        if not isinstance(lease, LeaseBackend):
            raise ConfigError(
                f"a MemoryCheckpointStore fences against a LeaseBackend, got {type(lease).__name__}"
            )
        name = check_name(lease.name, "lease name")
        with self._lock:
            known = self._leases.setdefault(name, lease)
        if known is not lease:
            raise ConfigError(
                f"this MemoryCheckpointStore already fences lease {name!r} against another "
                f"lease object ({type(known).__name__}), and one store fences one lease per "
                "name: give each leader sharing the store its own name=, or give each its "
                "own store"
            )

    def load(self, key: Key) -> Snapshot | None:
        """The last saved snapshot of ``key``, or ``None`` (see
        :meth:`~rselection.abc.CheckpointStore.load`)."""
        parts = check_key(key)
        with self._lock:
            row = self._rows.get(tuple(parts))
        if row is None:
            return None
        text, version, term, updated_at = row
        if text is None:
            return None
        return Snapshot(key_of(parts), decode_state(text), version, term, updated_at)

    def save(
        self, key: Key, state: Any, *, term: int | None = None, name: str = "default"
    ) -> Snapshot:
        """Store ``state`` as the new snapshot of ``key`` (see
        :meth:`~rselection.abc.CheckpointStore.save`); fenced against the leases this
        store was given (:meth:`add_lease`)."""
        parts = check_key(key)
        text = encode_state(key_of(parts), state, self.max_state_bytes)
        with self._lock:
            self._fence(term, name)
            version = self._next_version(parts)
            now = datetime.now(UTC)
            self._rows[tuple(parts)] = (text, version, term, now)
        return Snapshot(key_of(parts), decode_state(text), version, term, now)

    def delete(self, key: Key, *, term: int | None = None, name: str = "default") -> bool:
        """Delete the snapshot of ``key``, keeping its version counter (see
        :meth:`~rselection.abc.CheckpointStore.delete`); fenced like :meth:`save`."""
        parts = check_key(key)
        with self._lock:
            self._fence(term, name)
            row = self._rows.get(tuple(parts))
            if row is None or row[0] is None:
                return False
            self._rows[tuple(parts)] = (None, row[1] + 1, term, datetime.now(UTC))
            return True

    def _next_version(self, parts: list[str]) -> int:
        row = self._rows.get(tuple(parts))
        return 1 if row is None else row[1] + 1

    def _fence(self, term: int | None, name: str) -> None:
        """Refuse unless ``term`` is the live holder's term of the lease called ``name``
        (under the lock, so no save lands after a check that a later term would fail)."""
        if term is None:
            return
        number = check_term(term)
        backend = self._leases.get(name)
        if backend is None:
            known = ", ".join(repr(other) for other in self._leases) or "none"
            raise ConfigError(
                f"this MemoryCheckpointStore cannot fence against lease {name!r} (it knows "
                f"{known}): build it with MemoryCheckpointStore(leases=[lease]) or hand it "
                "to the leader of that lease as checkpoint_store="
            )
        holder = backend.current()
        if holder is None or holder.term != number:
            raise StaleLeaderError(
                f"term {number} no longer holds lease {name!r} (it was taken over, released "
                "or expired): nothing was written; stop acting as leader, the new leader's "
                "term is higher"
            )

    def __repr__(self) -> str:
        return f"MemoryCheckpointStore(leases={sorted(self._leases)!r}, keys={len(self._rows)})"


_PURGE_AFTER = 86_400.0  # seconds a lost node stays listed, as on Postgres and Redis


@dataclass
class _Row:
    """One node's entry in the roster of a lease."""

    started_at: datetime
    last_seen: datetime
    seen: float  # time.monotonic() of the last heartbeat: what liveness is measured on
    version: str | None
    eligible: bool


class _Roster:
    """The nodes of one lease object, shared by the memberships of that object."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[str, _Row] = {}


_ROSTERS: weakref.WeakKeyDictionary[Any, _Roster] = weakref.WeakKeyDictionary()
_ROSTERS_LOCK = threading.Lock()


def _roster_of(lease: LeaseBackend) -> _Roster:
    with _ROSTERS_LOCK:
        try:
            roster = _ROSTERS.get(lease)
            if roster is None:
                roster = _ROSTERS[lease] = _Roster()
        except TypeError as exc:  # not weakly referenceable, or not hashable
            raise ConfigError(
                f"a MemoryMembership lists the nodes of one lease object, and cannot key a "
                f"{type(lease).__name__}: {exc}"
            ) from exc
    return roster


class MemoryMembership(MembershipBase):
    """Heartbeats of one node in process memory, and the list of its lease's nodes.

    The :class:`~rselection.abc.Membership` of this process, for tests and for several
    leaders inside one process, with the rules of
    :class:`~rselection.postgres.PostgresMembership` and
    :class:`~rselection.redis.RedisMembership`: :meth:`start` heartbeats now and then
    every ``heartbeat_interval`` (on a daemon thread of its own) until :meth:`stop`,
    which removes the node; a node is alive while its last heartbeat is younger than
    ``node_timeout`` (this process's monotonic clock); a node lost for a day is dropped
    by the heartbeats of the others. The memberships of one lease object list each other
    (as leaders sharing a :class:`MemoryLease` compete), and its live holder is
    flagged ``is_leader``. Thread-safe.

    Args:
        lease: the lease the node competes for (its ``name`` names the nodes' lease).
        node_id: this node's id.
        heartbeat_interval: seconds between heartbeats.
        node_timeout: a node not seen for this long is lost; longer than
            ``heartbeat_interval``.
        version: the release this node runs (PEP 440), recorded with its heartbeats.
        eligible: whether this node may lead, recorded with its heartbeats.

    Raises:
        ConfigError: bad arguments (the message says which and why).
    """

    def __init__(
        self,
        lease: LeaseBackend,
        node_id: str,
        *,
        heartbeat_interval: float = 5.0,
        node_timeout: float = 15.0,
        version: str | None = None,
        eligible: bool = True,
    ) -> None:
        if not isinstance(lease, LeaseBackend):
            raise ConfigError(
                f"a MemoryMembership lists the nodes of a LeaseBackend, got {type(lease).__name__}"
            )
        super().__init__(
            name=lease.name,
            node_id=node_id,
            heartbeat_interval=heartbeat_interval,
            node_timeout=node_timeout,
            version=version,
            eligible=eligible,
        )
        self._lease = lease
        self._roster = _roster_of(lease)
        self._lock = threading.Lock()  # start() and stop() may race at shutdown
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (this node no longer heartbeats)."""
        return self._stopped

    def start(self) -> None:
        """Heartbeat now and then every ``heartbeat_interval`` until :meth:`stop`.

        Does nothing once stopped, or when already started.
        """
        with self._lock:
            if self._stopped or self._thread is not None:
                return
            self.beat()
            self._thread = threading.Thread(
                target=self._run, name=f"rselection-membership-{self.node_id}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self.heartbeat_interval):
            self.beat()

    def stop(self) -> None:
        """Stop heartbeating and remove this node from the list. Bounded: the heartbeat
        thread only takes a lock to write one entry."""
        with self._lock:
            self._stopped = True
            thread, self._thread = self._thread, None
        self._stopping.set()
        if thread is None:  # never heartbeated: nothing to remove
            return
        if thread is not threading.current_thread():
            thread.join()
        with self._roster.lock:
            self._roster.rows.pop(self.node_id, None)

    def beat(self) -> None:
        """Record one heartbeat of this node (and drop the nodes lost for a day)."""
        now, seen = datetime.now(UTC), time.monotonic()
        with self._roster.lock:
            rows = self._roster.rows
            row = rows.get(self.node_id)
            if row is None:
                rows[self.node_id] = _Row(now, now, seen, self.version, self.eligible)
            else:
                row.last_seen, row.seen = now, seen
                row.version, row.eligible = self.version, self.eligible
            for node_id in [n for n, r in rows.items() if seen - r.seen > _PURGE_AFTER]:
                del rows[node_id]

    def nodes(self) -> list[NodeInfo]:
        """Every node listed for this lease, oldest first; lost ones have ``alive=False``."""
        holder = self._lease.current()
        leader = None if holder is None else holder.node_id
        now = time.monotonic()
        host, pid = socket.gethostname(), os.getpid()
        with self._roster.lock:
            rows = list(self._roster.rows.items())
        nodes = [
            NodeInfo(
                node_id=node_id,
                name=self.name,
                hostname=host,
                pid=pid,
                client_addr=None,
                started_at=row.started_at,
                last_seen=row.last_seen,
                alive=now - row.seen <= self.node_timeout,
                is_leader=node_id == leader,
                version=row.version,
                eligible=row.eligible,
            )
            for node_id, row in rows
        ]
        nodes.sort(key=lambda n: (n.started_at, n.node_id))
        return nodes

    def __repr__(self) -> str:
        return f"MemoryMembership(name={self.name!r}, node_id={self.node_id!r})"


@dataclass
class _Published:
    entry: TaskEntry
    node_id: str
    term: int


class MemoryTaskStore(TaskStoreBase):
    """A :class:`~rselection.abc.TaskStore` in this process: task controls, task lists
    and run histories of any leases, kept in memory.

    What a :class:`~rselection.SingleNodeLeader` keeps them in, so that local
    development and tests pause, resume and trigger tasks and read their runs as a
    fleet would; several leaders of one process may share one. A change wakes the
    leaders of its lease at once (:meth:`on_change`), as a notification does on the
    servers.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paused: dict[str, dict[str, datetime]] = {}
        self._triggers: dict[str, dict[str, Trigger]] = {}
        self._tasks: dict[str, dict[str, _Published]] = {}
        self._next: dict[tuple[str, str], datetime | None] = {}
        self._runs: dict[tuple[str, str], deque[RunRecord]] = {}
        self._listeners: dict[str, list[Callable[[], None]]] = {}
        self.writes = 0
        """Calls of :meth:`write_runs` (each is one round trip on a server)."""

    def on_change(self, name: str, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after each change of the controls of lease ``name`` (a
        leader's board: it must not block)."""
        with self._lock:
            self._listeners.setdefault(name, []).append(callback)

    def _changed(self, name: str) -> None:
        with self._lock:
            listeners = list(self._listeners.get(name, ()))
        for callback in listeners:
            callback()

    def read_controls(self, name: str) -> TaskControls:
        """See :meth:`~rselection.abc.TaskStore.read_controls`."""
        with self._lock:
            paused = dict(self._paused.get(name, {}))
            triggers = tuple(self._triggers.get(name, {}).values())
        return TaskControls(paused, triggers)

    def publish_tasks(self, name: str, node_id: str, term: int, tasks: Sequence[TaskEntry]) -> None:
        """See :meth:`~rselection.abc.TaskStore.publish_tasks`."""
        with self._lock:
            self._tasks[name] = {entry.task: _Published(entry, node_id, term) for entry in tasks}
            for entry in tasks:
                self._next[name, entry.task] = entry.next_fire

    def write_runs(self, runs: Sequence[RunRecord], *, next_fires: NextFires, limit: int) -> None:
        """See :meth:`~rselection.abc.TaskStore.write_runs`."""
        with self._lock:
            self.writes += 1
            for run in runs:
                kept = self._runs.get((run.lease, run.task))
                if kept is None or kept.maxlen != limit:
                    kept = self._runs[run.lease, run.task] = deque(kept or (), maxlen=limit)
                kept.appendleft(run)
            self._next.update(next_fires)

    def drop_triggers(self, name: str, fire_keys: Sequence[str]) -> None:
        """See :meth:`~rselection.abc.TaskStore.drop_triggers`."""
        with self._lock:
            pending = self._triggers.get(name, {})
            for key in fire_keys:
                pending.pop(key, None)

    def read_tasks(self, name: str, *, last_run: bool = True) -> list[TaskInfo]:
        """See :meth:`~rselection.abc.TaskStore.read_tasks`."""
        with self._lock:
            published = dict(self._tasks.get(name, {}))
            paused = dict(self._paused.get(name, {}))
            found = []
            for task in sorted(published):
                one = published[task]
                runs = self._runs.get((name, task))
                found.append(
                    TaskInfo(
                        lease=name,
                        task=task,
                        kind=one.entry.kind,
                        schedule=one.entry.schedule,
                        next_fire=self._next.get((name, task)),
                        paused=task in paused,
                        paused_at=paused.get(task),
                        last_run=runs[0] if runs else None,
                        node_id=one.node_id,
                        term=one.term,
                    )
                )
        return found

    def read_runs(self, name: str, task: str, limit: int) -> list[RunRecord]:
        """See :meth:`~rselection.abc.TaskStore.read_runs`."""
        with self._lock:
            return list(self._runs.get((name, task), ()))[:limit]

    def _change_paused(self, name: str, task: str, paused: bool) -> bool:
        with self._lock:
            tasks = self._paused.setdefault(name, {})
            changed = (task in tasks) != paused
            if paused:
                tasks.setdefault(task, datetime.now(UTC))
            else:
                tasks.pop(task, None)
        self._changed(name)
        return changed

    def _record_trigger(self, name: str, task: str, fire_key: str) -> datetime:
        at = datetime.now(UTC)
        with self._lock:
            self._triggers.setdefault(name, {})[fire_key] = Trigger(name, task, fire_key, at)
        self._changed(name)
        return at

    def __repr__(self) -> str:
        with self._lock:
            return f"MemoryTaskStore(leases={sorted(set(self._tasks) | set(self._paused))!r})"
