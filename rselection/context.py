"""What a running task sees: the term it runs in and its :class:`TaskContext`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from . import clock

# The fence role moved to rselection.abc with the others; its name stays importable here.
from .abc import TransactionFence
from .errors import ConfigError, LeadershipLost
from .task_checkpoint import TaskCheckpoint

if TYPE_CHECKING:
    from .abc import CheckpointStore
    from .broadcast import Broadcaster
    from .claiming import FireClaimer
    from .members import NodeInfo
    from .task_board import TaskBoard

__all__ = [
    "NoTransactionFence",
    "TaskContext",
    "TaskTerm",
    "Term",
    "TransactionFence",
    "running_term",
]


class NoTransactionFence:
    """The fence of a lease that cannot fence a transaction: refuses every call, saying
    what to call instead.

    ``ctx.fence(conn)`` and ``await ctx.afence(conn)`` raise its
    :class:`~rselection.errors.ConfigError` whatever ``conn`` is, so the message never
    sends a task from one refused call to the other.

    Args:
        reason: why the lease cannot, and a call that does work (the message after
            ``"ctx.fence(): "``).
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def refusal(self, call: str) -> ConfigError:
        """The error for ``call`` (``"ctx.fence()"`` or ``"ctx.afence()"``)."""
        return ConfigError(f"{call}: {self.reason}")

    def fence(self, conn: Any, term: int) -> None:
        """Refuse (see the class)."""
        raise self.refusal("ctx.fence()")

    async def afence(self, conn: Any, term: int) -> None:
        """Refuse (see the class)."""
        raise self.refusal("ctx.afence()")


NO_FENCE = (
    "this leader's lease cannot fence a transaction (a PostgresLeader's can), so a "
    "write would not be held back from a successor: check the term with ctx.check() "
    "before writing, and fence the write in its store (keep ctx.term with the data and "
    "refuse lower terms)"
)
"""Why ``ctx.fence`` is refused under a leader built without a transaction fence."""

NO_CHECKPOINT_STORE = (
    "ctx.checkpoint needs a checkpoint store, and this leader has none. A PostgresLeader "
    "and a SingleNodeLeader have one by default; a LeaseLeader built directly takes "
    "checkpoint_store= (a store that fences against its lease: a MemoryCheckpointStore "
    "in tests, or one of your own). A RedisLeader takes none: keep the state in Redis "
    "with a fenced write, leader.fence.call(ctx.term, 'SET', <key>, <json text>), which "
    "writes only while the term holds the lease"
)
"""Why ``ctx.checkpoint`` is refused under a leader built without a checkpoint store."""


@dataclass(eq=False, repr=False)
class Term:
    """One leadership term of one node: its number, deadline and cancellation flag.

    The leader moves :attr:`deadline` forward after each successful renewal. The term is
    *live* while it is not cancelled and the local deadline has not passed, so a task
    that checks in after a long pause (or after the machine was suspended) sees the loss
    even before the leader's own threads have woken up to cancel it.

    Args:
        number: the fencing term from the lease.
        node_id: this node's id.
        name: the lease name.
        deadline: :func:`rselection.clock.monotonic` instant after which the term is no
            longer live.
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        fence: fences a caller's transaction to this term (``ctx.fence``); ``None``
            when the lease cannot, and then ``ctx.fence`` raises ``ConfigError``.
        claimer: claims each scheduled fire before it runs; ``None`` runs every fire
            without claiming (claims switched off).
        checkpoint_store: keeps ``ctx.checkpoint``; ``None`` when the leader has none.
        nodes: lists the lease's nodes (the leader's ``nodes()``), for ``ctx.nodes()``.
        shard: the shard this term leads, under a sharded leader (else ``None``).
        shards: the sharded leader's number of shards (else ``None``).
        tasks: the leader's task controls and run history (``None``: it keeps none).
    """

    number: int
    node_id: str
    name: str = "default"
    _: KW_ONLY
    deadline: float = math.inf
    broadcaster: Broadcaster | None = None
    fence: TransactionFence | None = None
    claimer: FireClaimer | None = None
    checkpoint_store: CheckpointStore | None = None
    nodes: Callable[[], list[NodeInfo]] | None = None
    shard: int | None = None
    shards: int | None = None
    tasks: TaskBoard | None = None
    cancelled: threading.Event = field(default_factory=threading.Event, init=False)
    """Set the moment the term ends (see :meth:`cancel`)."""
    ended: threading.Event = field(default_factory=threading.Event, init=False)
    """Set once the term's tasks were cancelled and joined (or reported stuck)."""
    _async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=set, init=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    # The deadline was seen passed: the term is over for good.
    _expired: bool = field(default=False, init=False)
    _children: set[TaskTerm] = field(default_factory=set, init=False)  # see TaskTerm

    def live(self) -> bool:
        """True while the term is neither cancelled nor past its local deadline.

        Once anyone has seen the deadline passed, the term stays over: a renewal that
        comes back later cannot revive it (see :meth:`extend`).
        """
        return self.remaining() > 0

    def remaining(self) -> float:
        """Seconds until the local deadline (``inf`` without one, 0 once not live)."""
        if self.cancelled.is_set():
            return 0.0
        with self._lock:
            if self._expired:
                return 0.0
            left = self.deadline - clock.monotonic()
            if left <= 0:
                self._expired = True
                return 0.0
            return left

    def extend(self, deadline: float) -> bool:
        """Move the deadline to ``deadline`` after a successful renewal; ``False`` (and
        nothing moved) when the current deadline has passed already: that is final."""
        with self._lock:
            if self._expired or clock.monotonic() >= self.deadline:
                self._expired = True
                return False
            self.deadline = deadline
            return True

    def reset_after_fork(self) -> None:
        """In a forked child: the term is the parent's, over for good here (a process a
        task forked, which nothing joins when the term ends, must not act as leader).
        Its lock and event are made anew: a parent's thread may have held theirs. So
        are its tasks' own terms (:class:`TaskTerm`), which its runs see as theirs."""
        self._lock = threading.Lock()
        self._expired = True
        cancelled = threading.Event()
        cancelled.set()
        self.cancelled = cancelled
        self._async_waiters = set()
        for child in list(self._children):
            child.reset_after_fork()

    def cancel(self) -> None:
        """End the term: set :attr:`cancelled` and wake every sleeping task at once."""
        self.cancelled.set()
        with self._lock:
            waiters = list(self._async_waiters)
            children = list(self._children)
        for child in children:
            child.cancel()
        for loop, fut in waiters:
            # The loop may already be closed when a term ends during shutdown.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut)

    def _add_async_waiter(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
        with self._lock:
            self._async_waiters.add((loop, fut))

    def _remove_async_waiter(
        self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]
    ) -> None:
        with self._lock:
            self._async_waiters.discard((loop, fut))

    def __repr__(self) -> str:
        return f"Term({self.number}, node_id={self.node_id!r}, live={self.live()})"


class TaskTerm(Term):
    """The term as one persistent task's runs see it: it ends with its term, or before,
    when an operator pauses the task (:meth:`pause`: ``ctx.cancelled`` is set,
    ``ctx.sleep`` returns ``False``, an ``async def`` run is cancelled).

    Args:
        parent: the term.
    """

    def __init__(self, parent: Term) -> None:
        self.parent = parent
        super().__init__(
            parent.number,
            parent.node_id,
            parent.name,
            deadline=parent.deadline,
            broadcaster=parent.broadcaster,
            fence=parent.fence,
            claimer=parent.claimer,
            checkpoint_store=parent.checkpoint_store,
            nodes=parent.nodes,
            shard=parent.shard,
            shards=parent.shards,
            tasks=parent.tasks,
        )
        self.paused = False
        """Whether an operator paused the task (which ended this term early)."""
        self.task: asyncio.Task[Any] | None = None
        """The asyncio task running an ``async def`` task's runs, to cancel on a pause."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.released = False
        with parent._lock:
            parent._children.add(self)
        if parent.cancelled.is_set():
            self.cancel()

    @property
    def deadline(self) -> float:
        """The term's deadline (its renewals move it)."""
        return self.parent.deadline

    @deadline.setter
    def deadline(self, value: float) -> None:
        pass  # the parent's is the one that counts

    def remaining(self) -> float:
        """Seconds until the term's deadline; 0 once this task's runs must stop."""
        if self.cancelled.is_set():
            return 0.0
        return self.parent.remaining()

    def pause(self) -> None:
        """An operator paused the task: end its runs now."""
        self.paused = True
        self.cancel()
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs
                loop.call_soon_threadsafe(self._cancel_task)

    def _cancel_task(self) -> None:
        """On the loop: cancel the asyncio task, unless its runs under this term have
        ended meanwhile (it may run the task's runs under a newer one)."""
        if self.task is not None and not self.released:
            self.task.cancel()

    def release(self) -> None:
        """The task's runs under this term ended: the term forgets it."""
        self.released = True
        with self.parent._lock:
            self.parent._children.discard(self)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _is_async_connection(conn: Any) -> bool | None:
    """True for a connection whose queries are coroutines (psycopg ``AsyncConnection``,
    ``redis.asyncio``), False for a blocking one, None when it has no query method."""
    for method in ("execute", "execute_command"):
        fn = getattr(type(conn), method, None)
        if callable(fn):
            return inspect.iscoroutinefunction(fn)
    return None


# What fence() and afence() (by ``asynchronous``) say of a connection of the other kind.
_OTHER_KIND = {
    False: "ctx.fence() takes a blocking connection, got {kind} whose queries are "
    "coroutines: use `await ctx.afence(conn)` instead",
    True: "ctx.afence() takes an async connection (a psycopg AsyncConnection), got "
    "{kind}: use ctx.fence(conn) instead",
}


def _kind(conn: Any) -> str:
    return f"{type(conn).__module__}.{type(conn).__qualname__}"


# A wait's timeout is measured on CLOCK_MONOTONIC, which stands still while the machine
# is suspended; the term's deadline is on the boot-time clock, which does not. Waking at
# least this often bounds how long a resumed sleeper goes on believing it still leads.
_SLICE = 1.0


def _check_seconds(seconds: float) -> float:
    if not seconds >= 0:
        raise ValueError(f"sleep seconds must be >= 0, got {seconds!r}")
    return seconds


def _next_wait(term: Term, end: float) -> float | None:
    """How long a sleep until ``end`` waits next; ``None`` when it is over.

    Each wait lasts at most until the deadline known now: by then a renewal has moved
    the deadline forward (the sleep goes on) or the term is no longer live.
    """
    now = clock.monotonic()
    if term.cancelled.is_set() or now >= term.deadline or now >= end:
        return None
    return min(end - now, term.deadline - now, _SLICE)


class TaskContext:
    """Handed to every task run: who runs it, in which term, and how to stop in time.

    Attributes:
        name: the task's registered name.
        scheduled_at: the fire instant (aware UTC) for scheduled tasks, else ``None``.
        fire_key: ``"<task>@<UTC RFC 3339 nanos>"`` for scheduled fires, else ``None``.
    """

    def __init__(
        self,
        name: str,
        term: Term,
        *,
        scheduled_at: datetime | None = None,
        fire_key: str | None = None,
    ) -> None:
        self.name = name
        self.scheduled_at = scheduled_at
        self.fire_key = fire_key
        self._term = term
        self._checkpoint: TaskCheckpoint | None = None

    @property
    def term(self) -> int:
        """The fencing term this run belongs to."""
        return self._term.number

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._term.node_id

    @property
    def shard(self) -> int | None:
        """The shard this run belongs to (``0 .. shards - 1``) under a sharded leader
        (:class:`~rselection.PostgresShardedLeader`), else ``None``."""
        return self._term.shard

    @property
    def shards(self) -> int | None:
        """The sharded leader's number of shards, else ``None``."""
        return self._term.shards

    @property
    def cancelled(self) -> threading.Event:
        """Set the moment leadership ends; plain ``def`` tasks should check it often."""
        return self._term.cancelled

    def nodes(self) -> list[NodeInfo]:
        """The nodes of this lease with their liveness and the leader flag (see
        :meth:`rselection.PostgresLeader.nodes`).

        Raises:
            RuntimeError: the task runs outside a leader that keeps membership.
            BackendUnavailable: the membership table could not be read.
        """
        if self._term.nodes is None:
            raise RuntimeError("ctx.nodes() needs a leader; this term has no membership")
        return self._term.nodes()

    @property
    def broadcaster(self) -> Broadcaster | None:
        """The leader's broadcaster, or ``None`` when none was configured."""
        return self._term.broadcaster

    def is_live(self) -> bool:
        """True while this run may still act as leader."""
        return self._term.live()

    def sleep(self, seconds: float) -> bool:
        """Sleep ``seconds``; return ``False`` at once if leadership ends meanwhile.

        A sleep spans any number of renewals: it returns ``True`` once the full time has
        passed with the term still live, and ``False`` as soon as the term is cancelled
        or its (current) deadline passes.
        """
        term = self._term
        end = clock.monotonic() + _check_seconds(seconds)
        while (wait := _next_wait(term, end)) is not None:
            term.cancelled.wait(wait)
        return term.live()

    async def asleep(self, seconds: float) -> bool:
        """Async :meth:`sleep` for ``async def`` tasks; never blocks the event loop."""
        term = self._term
        end = clock.monotonic() + _check_seconds(seconds)
        if _next_wait(term, end) is None:
            return term.live()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        term._add_async_waiter(loop, fut)
        try:
            # Checked after registering: a cancel() that ran before resolves nothing.
            while (wait := _next_wait(term, end)) is not None:
                # asyncio.wait never cancels the future it waits on.
                await asyncio.wait((fut,), timeout=wait)
        finally:
            term._remove_async_waiter(loop, fut)
        return term.live()

    def check(self) -> None:
        """Raise :class:`~rselection.LeadershipLost` once this term is no longer live."""
        if not self._term.live():
            raise LeadershipLost(
                f"task {self.name!r}: term {self.term} of node {self.node_id!r} has ended; "
                "stop working and return"
            )

    def fence(self, conn: Any) -> None:
        """Fence the caller's open transaction on ``conn`` to this term.

        With a Postgres leader the transaction fails with
        :class:`~rselection.StaleLeaderError` unless this term still holds the lease, and
        a takeover waits until the transaction ends. It means the same on every leader:
        one whose lease cannot fence a transaction (Redis, single node) refuses with a
        :class:`~rselection.ConfigError` that names what to call instead, rather than
        only checking the term. For an async connection use :meth:`afence`.

        Raises:
            StaleLeaderError: this term no longer holds the lease; roll back.
            ConfigError: this leader cannot fence a transaction, ``conn`` is an async
                connection, or no transaction is open.
        """
        self._fence_for(conn, asynchronous=False).fence(conn, self.term)

    async def afence(self, conn: Any) -> None:
        """Async :meth:`fence` for an async connection (a psycopg ``AsyncConnection``).

        Awaits the same check as :meth:`fence` inside the caller's open transaction, and
        is refused the same way by a leader that cannot fence a transaction.

        Raises:
            StaleLeaderError: this term no longer holds the lease; roll back.
            ConfigError: this leader cannot fence a transaction, ``conn`` is a blocking
                connection, or no transaction is open.
        """
        await self._fence_for(conn, asynchronous=True).afence(conn, self.term)

    def _fence_for(self, conn: Any, *, asynchronous: bool) -> TransactionFence:
        """The term's fence for :meth:`fence` (``asynchronous``: :meth:`afence`) on
        ``conn``; refused when the leader cannot fence a transaction, or ``conn`` is a
        connection of the other kind."""
        fence = self._term.fence
        if fence is None:
            raise ConfigError(f"task {self.name!r}: {NO_FENCE}")
        if isinstance(fence, NoTransactionFence):
            # Whatever conn is: the other call is no help.
            raise fence.refusal("ctx.afence()" if asynchronous else "ctx.fence()")
        if _is_async_connection(conn) is (not asynchronous):
            raise ConfigError(_OTHER_KIND[asynchronous].format(kind=_kind(conn)))
        return fence

    @property
    def checkpoint(self) -> TaskCheckpoint:
        """Durable state of this task, fenced to this term, in the leader's checkpoint store.

        ``ctx.checkpoint.load()`` returns the task's last
        :class:`~rselection.checkpoints.Snapshot` (saved in any term) or ``None``;
        ``ctx.checkpoint.save(state)`` stores a new one under the task's name scoped to the
        lease (``lease_scoped(name, task)``, see :mod:`rselection.keys`) and commits
        only while this term still holds the lease (else
        :class:`~rselection.StaleLeaderError`). A :class:`~rselection.PostgresLeader`
        keeps it in Postgres, a :class:`~rselection.SingleNodeLeader` in memory; see
        :class:`~rselection.abc.CheckpointStore`.

        Raises:
            ConfigError: the leader has no checkpoint store (the message says what to do:
                a ``RedisLeader`` has none, a ``LeaseLeader`` takes ``checkpoint_store=``).
        """
        if self._checkpoint is None:
            store = self._term.checkpoint_store
            if store is None:
                raise ConfigError(f"task {self.name!r}: {NO_CHECKPOINT_STORE}")
            self._checkpoint = TaskCheckpoint(store, self.name, self._term.number, self._term.name)
        return self._checkpoint

    def __repr__(self) -> str:
        return f"TaskContext({self.name!r}, term={self.term}, node_id={self.node_id!r})"


running_term: contextvars.ContextVar[Term | None] = contextvars.ContextVar(
    "rselection_running_term", default=None
)
"""The term whose task runs in the current thread or asyncio task (``None`` elsewhere).

Set by the runtime for every task it runs, so a leader can tell that ``stop()`` or
``step_down()`` was called from one of its own tasks and must not wait for it to end.
"""
