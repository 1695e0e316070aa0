"""What a running task sees: the term it runs in and its :class:`TaskContext`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import math
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from . import clock
from .errors import ConfigError, LeadershipLost, StaleLeaderError

if TYPE_CHECKING:
    from .broadcast import Broadcaster
    from .claiming import FireClaimer
    from .members import NodeInfo
    from .postgres.checkpoint import TaskCheckpoint

__all__ = ["TaskContext", "Term", "running_term"]

Fencer = Callable[[Any, int], None]
"""Checks inside a caller's transaction that a term still holds the lease.

A fencer may also offer ``afence(conn, term)``, a coroutine function doing the same on
an async connection (``ctx.afence``; both leaders' fencers do), and
``bind_checkpoint(task, term)``, returning the task's durable state bound to that term
(``ctx.checkpoint``; the Postgres leader's fencer does).
"""


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
        fencer: checks a caller's transaction against the lease; ``None`` means no
            lease table exists (single node), so fencing checks liveness only.
        claimer: claims each scheduled fire before it runs; ``None`` runs every fire
            without claiming (a single node, or claims switched off).
        nodes: lists the lease's nodes (the leader's ``nodes()``), for ``ctx.nodes()``.
    """

    def __init__(
        self,
        number: int,
        node_id: str,
        name: str = "default",
        *,
        deadline: float = math.inf,
        broadcaster: Broadcaster | None = None,
        fencer: Fencer | None = None,
        claimer: FireClaimer | None = None,
        nodes: Callable[[], list[NodeInfo]] | None = None,
    ) -> None:
        self.number = number
        self.node_id = node_id
        self.name = name
        self.deadline = deadline
        self.broadcaster = broadcaster
        self.fencer = fencer
        self.claimer = claimer
        self.nodes = nodes
        self.cancelled = threading.Event()
        self.ended = threading.Event()
        """Set once the term's tasks were cancelled and joined (or reported stuck)."""
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()
        self._lock = threading.Lock()
        self._expired = False  # the deadline was seen passed: the term is over for good

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

    def cancel(self) -> None:
        """End the term: set :attr:`cancelled` and wake every sleeping task at once."""
        self.cancelled.set()
        with self._lock:
            waiters = list(self._async_waiters)
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
        a takeover waits until the transaction ends. Without a lease table (single node)
        it only checks that the term is live. For an async connection use
        :meth:`afence`.

        Raises:
            StaleLeaderError: this term no longer holds the lease; roll back.
            ConfigError: ``conn`` is an async connection, or no transaction is open.
        """
        if _is_async_connection(conn) is True:
            raise ConfigError(
                f"ctx.fence() takes a blocking connection, got {_kind(conn)} whose queries "
                "are coroutines: use `await ctx.afence(conn)` instead"
            )
        fencer = self._term.fencer
        if fencer is None:
            self._check_live_for_write()
            return
        fencer(conn, self.term)

    async def afence(self, conn: Any) -> None:
        """Async :meth:`fence` for an async connection (a psycopg ``AsyncConnection``).

        Awaits the same check as :meth:`fence` inside the caller's open transaction; with
        a :class:`~rselection.redis.RedisLeader`, a ``redis.asyncio`` client and a check
        of the term at this moment. Without a lease table (single node) it only checks
        that the term is live.

        Raises:
            StaleLeaderError: this term no longer holds the lease; roll back.
            ConfigError: ``conn`` is a blocking connection, or no transaction is open.
        """
        if _is_async_connection(conn) is False:
            raise ConfigError(
                f"ctx.afence() takes an async connection (a psycopg AsyncConnection), got "
                f"{_kind(conn)}: use ctx.fence(conn) instead"
            )
        fencer = self._term.fencer
        if fencer is None:
            self._check_live_for_write()
            return
        afence: Callable[[Any, int], Awaitable[None]] | None = getattr(fencer, "afence", None)
        if afence is None:
            raise ConfigError(
                "this leader's fence has no async form: use ctx.fence(conn) with a "
                "blocking connection"
            )
        await afence(conn, self.term)

    def _check_live_for_write(self) -> None:
        if not self._term.live():
            raise StaleLeaderError(
                f"term {self.term} has ended; roll back and let the new term do the write"
            )

    @property
    def checkpoint(self) -> TaskCheckpoint:
        """Durable state of this task, fenced to this term (Postgres leaders only).

        ``ctx.checkpoint.load()`` returns the task's last
        :class:`~rselection.postgres.Snapshot` (saved in any term) or ``None``;
        ``ctx.checkpoint.save(state)`` stores a new one under the task's name and commits
        only while this term still holds the lease (else
        :class:`~rselection.StaleLeaderError`). See
        :class:`~rselection.postgres.PostgresCheckpointStore`.

        Raises:
            NotImplementedError: the leader has no checkpoint store (single node).
        """
        if self._checkpoint is None:
            bind = getattr(self._term.fencer, "bind_checkpoint", None)
            if bind is None:
                raise NotImplementedError(
                    "ctx.checkpoint needs a PostgresCheckpointStore, which this leader "
                    "does not have: run the task under a PostgresLeader (it keeps task "
                    "state next to its lease)"
                )
            self._checkpoint = bind(self.name, self._term.number)
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
