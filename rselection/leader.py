"""The leadership state machine shared by every backend: follow, lead, step down.

:class:`LeaseLeader` is the leader over any :class:`~rselection.abc.LeaseBackend`;
``PostgresLeader``, ``RedisLeader`` and ``SingleNodeLeader`` build a backend (and its
default claimer, checkpoint store and fence) and hand them to it. The process's one
driver thread runs the state machine for every leader (:mod:`rselection.driven`); a
lease whose calls block goes through :class:`~rselection.blocking_lease.BlockingLease`.
See ``docs/explanation/how-it-works.md`` for the deadline and why the leader has
stopped its tasks before the server lets the lease expire.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

from . import forks, signals
from .abc import (
    CheckpointStore,
    LeaseBackend,
    NonBlockingLease,
    TaskStore,
    lease_ability,
    store_ability,
)
from .admin import Refused
from .blocking_lease import BlockingLease
from .claiming import FireClaimer, LeaseClaims
from .closeable import Service
from .context import TransactionFence, running_term
from .driven import DrivenKeeper
from .errors import ConfigError, RSelectionError
from .leadership import CLEANUP_TIMEOUT, Leadership, StepDown
from .lease import LeaderInfo
from .members import NodeInfo
from .specs import TaskType
from .stop_signals import stop_on_signals
from .task_board import TaskBoard
from .task_runs import RUN_HISTORY_LIMIT, check_run_limit
from .timing import Timings
from .validation import check_name, check_node_id, check_seconds, new_node_id
from .versions import check_eligible, check_version

if TYPE_CHECKING:
    from .broadcast import Broadcaster
    from .task_runs import RunRecord, TaskControlChange, TaskInfo, Trigger
    from .tasks import TaskHandler

__all__ = ["CLEANUP_TIMEOUT", "Leader", "LeaseLeader"]


_LEASE_MEMBERS = (
    "name",
    "ttl",
    "connect",
    "try_acquire",
    "renew",
    "release",
    "current",
    "wait_for_change",
    "interrupt",
    "term_ended",
    "close",
)


@runtime_checkable
class Leader(Protocol):
    """What every leader offers, whatever its backend."""

    def lead(self) -> None:
        """Run until :meth:`stop` (or Ctrl-C) in the calling thread."""

    def start(self) -> None:
        """Run in background threads; return at once."""

    def stop(self, timeout: float | None = None) -> None:
        """Cancel and join tasks, release the lease, stop every thread."""

    @property
    def is_leader(self) -> bool:
        """True while this node leads and its deadline has not passed."""

    @property
    def term(self) -> int | None:
        """The fencing term while leading, else ``None``."""

    @property
    def node_id(self) -> str:
        """This node's id."""

    def leader(self) -> LeaderInfo | None:
        """The current holder as the lease server sees it, from any node."""

    def nodes(self) -> list[NodeInfo]:
        """The nodes competing for the lease, alive or lost, with the leader flagged."""

    def wait_until_leader(self, timeout: float | None = None) -> bool:
        """Block until this node leads; ``False`` on timeout."""


class LeaseLeader(Service):
    """Leadership over any :class:`~rselection.LeaseBackend`: the one state machine.

    Competes for ``lease`` and, while it holds it, runs ``handler``'s tasks; every task
    is cancelled and joined the moment leadership is lost or in doubt, and the lease is
    released only after that. ``PostgresLeader``, ``RedisLeader`` and
    ``SingleNodeLeader`` are this class over their own lease; build one directly to lead
    over a backend of your own (an etcd lease, say) and check it with
    :class:`rselection.testing.LeaderConformance`.

    Example::

        leader = rs.LeaseLeader(MyLease("billing", ttl=15), tasks)
        leader.lead()

    Args:
        lease: the lease to compete for; the leader's name is ``lease.name``, and its
            ``ttl`` (seconds, or a :class:`~datetime.timedelta`) is how long the lease
            lasts on the server after a renewal.
        handler: the tasks to run while leading.
        node_id: this node's id (default: host, pid and a random suffix).
        ttl: the ttl the leader's deadline and ``stop_grace`` are reckoned on, seconds
            (default: the lease's ``ttl``). A lease whose ``ttl`` is shorter is
            refused: the leader must stop before its lease can pass on.
        renew_interval: seconds between renewals (default 2).
        renew_deadline: step down when no renewal succeeded for this long (default 10).
        retry_interval: a follower's polling period, jittered (default 2).
        timings: the four timings above as one :class:`~rselection.timing.Timings`
            (instead of them).
        claimer: claims each scheduled fire before it runs, so a fire runs once across
            the fleet and a new leader finds the fires missed while none led (any
            :class:`~rselection.FireClaimer`; ``None`` runs every fire unclaimed). Claim
            keys are ``"<lease name>/<fire key>"``, with ``%`` and ``/`` in the lease
            name written ``%25`` and ``%2F``; missed fires are claimed in one call when
            the claimer has ``claim_missed``, else fire by fire.
        checkpoint_store: keeps ``ctx.checkpoint`` (a
            :class:`~rselection.abc.CheckpointStore`; ``None``: tasks have no
            checkpoint). A store that fences against lease objects (a
            :class:`~rselection.MemoryCheckpointStore`) is given this lease.
        broadcaster: handed to tasks as ``ctx.broadcaster``.
        fence: fences a task's transaction to its term for ``ctx.fence`` /
            ``ctx.afence`` (a :class:`~rselection.context.TransactionFence`); ``None``
            when the lease cannot, and then ``ctx.fence`` raises ``ConfigError``.
        cleanup: called once each, in order, when the leader has stopped and released
            its lease (how a factory closes the claimer, store or client it built for
            the leader). They run on a thread of their own (each in a fresh
            :class:`contextvars.Context`), each waited for at most
            :data:`CLEANUP_TIMEOUT` seconds; one that raises (anything, ``SystemExit``
            too) is logged, one still running then is logged and left running (the
            rest go on on another thread), and the rest run either way.
        version: the release this node runs (PEP 440, such as ``"2.4.1"``), shown in
            ``nodes()``; ``None``: none given.
        eligible: ``False``: this node never leads (it never attempts to take the lease,
            and backends with membership refuse to hand it over to it).
        task_store: keeps the task controls and run history of the lease (a
            :class:`~rselection.abc.TaskStore`, such as a
            :class:`~rselection.MemoryTaskStore`): ``rselection task pause|resume|
            trigger|history``, and :meth:`pause_task` and the like; ``None``: none.
        run_history_limit: runs kept per task in the run history (default 100).

    Raises:
        ConfigError: bad arguments or inconsistent timings (the message shows the math).
    """

    def __init__(
        self,
        lease: LeaseBackend,
        handler: TaskHandler,
        *,
        node_id: str | None = None,
        ttl: float | None = None,
        renew_interval: float | None = None,
        renew_deadline: float | None = None,
        retry_interval: float | None = None,
        timings: Timings | None = None,
        claimer: FireClaimer | None = None,
        checkpoint_store: CheckpointStore | None = None,
        broadcaster: Broadcaster | None = None,
        fence: TransactionFence | None = None,
        cleanup: Iterable[Callable[[], object]] = (),
        version: str | None = None,
        eligible: bool = True,
        task_store: TaskStore | None = None,
        run_history_limit: int = RUN_HISTORY_LIMIT,
    ) -> None:
        if not isinstance(lease, LeaseBackend):
            missing = [m for m in _LEASE_MEMBERS if not hasattr(lease, m)]
            raise ConfigError(
                f"lease must be a LeaseBackend ({', '.join(_LEASE_MEMBERS)}), got "
                f"{type(lease).__name__}, which has no {', '.join(missing) or 'such members'}"
                " (a lease's ttl is the seconds it lasts on the server after a renewal)"
            )
        name = check_name(lease.name, "lease name")
        timings = _leader_timings(
            lease, timings, ttl, renew_interval, renew_deadline, retry_interval
        )
        for arg, value, role, needs in (
            (
                "claimer",
                claimer,
                FireClaimer,
                "must have claim(fire_key, *, term) and ttl (a PostgresClaimer, "
                "RedisClaimer or MemoryClaimer)",
            ),
            (
                "checkpoint_store",
                checkpoint_store,
                CheckpointStore,
                "must have load(key), save(key, state, *, term, name) and delete(key, *, "
                "term, name) (a PostgresCheckpointStore or MemoryCheckpointStore)",
            ),
            (
                "fence",
                fence,
                TransactionFence,
                "must have fence(conn, term) and afence(conn, term)",
            ),
            (
                "task_store",
                task_store,
                TaskStore,
                "must be a TaskStore (read_controls, publish_tasks, write_runs, ...; a "
                "MemoryTaskStore, say)",
            ),
        ):
            if value is not None and not isinstance(value, role):
                raise ConfigError(f"{arg} {needs}, or be None, got {type(value).__name__}")
        board = None
        if task_store is not None:
            limit = check_run_limit(run_history_limit, "run_history_limit")
            board = TaskBoard(task_store, name, limit=limit)
            # Its last runs are written before what the store uses is closed.
            cleanup = [board.close, *cleanup]
            watch = getattr(task_store, "on_change", None)
            if callable(watch):  # a store that calls back (in memory) instead of a lease
                watch(name, board.wake)
                board.notified = True
        # A default id names the process that starts (host, pid): a leader built before a
        # fork (gunicorn --preload) takes a new one in each child (see _fix_node_id).
        self._default_node_id = node_id is None
        self._node_id_pid = os.getpid()
        if claimer is not None:
            handler.check_claims(claimer.ttl)
        fenced_store = store_ability(checkpoint_store, "add_lease")
        if fenced_store is not None:
            fenced_store.add_lease(lease)
        self._lease = lease
        # What the driven keeper steps: the lease itself when its round trips start
        # without blocking, else the one adapter of blocking leases.
        backend: LeaseBackend
        driven: NonBlockingLease
        non_blocking = lease_ability(lease, "non_blocking")
        if non_blocking is not None:
            backend, driven = lease, non_blocking
        else:
            adapter = BlockingLease(lease)
            backend, driven = adapter, adapter
        self._backend = backend
        self._claimer = claimer
        self._checkpoint_store = checkpoint_store
        self._created_at = datetime.now(UTC)
        self._state = Leadership(
            sender=self,
            name=name,
            node_id=check_node_id(node_id) if node_id is not None else new_node_id(),
            timings=timings,
            stop_grace=timings.stop_grace(handler.stop_grace),
            handler=handler,
            backend=backend,
            lease=lease,
            broadcaster=broadcaster,
            fence=fence,
            claims=None if claimer is None else LeaseClaims(claimer, name),
            checkpoint_store=checkpoint_store,
            cleanup=list(cleanup),
            nodes=self.nodes,
            takeover_delay=self._takeover_delay,
            follows_announcements=self._follows_announcements,
            version=check_version(version),
            eligible=check_eligible(eligible),
        )
        self._state.tasks = board
        if board is not None:
            # On every (re)connect, before any attempt: the controls held may have
            # missed a notification (a leader with membership reads its drains too).
            self._state.check_drained = self._read_task_controls
        self._driven = DrivenKeeper(self._state, driven, backend)
        self._started = False
        self._observer_lock = threading.Lock()
        self._forked = False  # started in a parent process: unusable in this one
        forks.register(self)

    # -- public ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The lease name."""
        return self._state.name

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._state.node_id

    @property
    def version(self) -> str | None:
        """The release this node runs, as given (``None``: none given)."""
        return self._state.version

    @property
    def eligible(self) -> bool:
        """Whether this node may lead: ``eligible=`` as given, and not drained by an
        operator (``rselection drain``)."""
        return self._state.eligible

    @property
    def lease(self) -> LeaseBackend:
        """The lease backend this leader competes for."""
        return self._lease

    @property
    def claimer(self) -> FireClaimer | None:
        """The claimer given to the leader (claims go through it under the lease name)."""
        return self._claimer

    @property
    def checkpoint_store(self) -> CheckpointStore | None:
        """The store behind ``ctx.checkpoint`` (to inspect or seed task state), if any."""
        return self._checkpoint_store

    @property
    def handler(self) -> TaskHandler:
        """The task handler this leader runs."""
        return self._state.handler

    @property
    def broadcaster(self) -> Broadcaster | None:
        """The broadcaster handed to tasks, if any."""
        return self._state.broadcaster

    @property
    def timings(self) -> Timings:
        """The validated timings."""
        return self._state.timings

    @property
    def stop_grace(self) -> float:
        """Seconds this leader waits for cancelled tasks (the handler's, or what the
        timings allow)."""
        return self._state.stop_grace

    @property
    def is_leader(self) -> bool:
        """True while this node leads and its local deadline has not passed."""
        term = self._state.term
        return term is not None and term.live()

    @property
    def term(self) -> int | None:
        """The fencing term while leading, else ``None``."""
        term = self._state.term
        return term.number if term is not None and term.live() else None

    def leader(self) -> LeaderInfo | None:
        """The current holder as the lease server sees it (works on every node).

        After :meth:`stop` this still answers, but leaves no connection or thread open.
        """
        self._refuse_if_forked()
        with self._observer_lock:
            try:
                return self._backend.current()
            finally:
                if self._state.closed:
                    self._state.close_backend()

    def nodes(self) -> list[NodeInfo]:
        """The nodes competing for this lease. Here only this one; leaders with
        membership (Postgres) list every node from its heartbeats."""
        now = datetime.now(UTC)
        return [
            NodeInfo(
                node_id=self._state.node_id,
                name=self._state.name,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                client_addr=None,
                started_at=self._created_at,
                last_seen=now,
                alive=True,
                is_leader=self.is_leader,
                version=self._state.version,
                eligible=self._state.eligible,
            )
        ]

    # -- task controls and run history ------------------------------------------------

    def _task_board(self) -> TaskBoard:
        board = self._state.tasks
        if board is None:
            raise ConfigError(
                f"leader {self.name!r} keeps no task controls nor run history: a "
                "PostgresLeader, RedisLeader or SingleNodeLeader does; a LeaseLeader takes "
                "task_store= (a shard's leader keeps none)"
            )
        return board

    def _registered(self, task: str, *, scheduled: bool = False) -> str:
        """``task``, a task of this leader's handler (scheduled, if asked), else refused."""
        task = check_name(task, "task name")
        try:
            spec = self.handler.spec(task)
        except KeyError:
            names = ", ".join(repr(n) for n in self.handler.names) or "none"
            raise Refused(
                f"no task {task!r} in leader {self.name!r} (its tasks: {names})"
            ) from None
        if scheduled and spec.type is not TaskType.SCHEDULED:
            raise Refused(
                f"task {task!r} of {self.name!r} is persistent: only scheduled tasks can be "
                "triggered (pause and resume it instead)"
            )
        return task

    def tasks(self) -> list[TaskInfo]:
        """The tasks of this lease as its leader last published them, sorted by name,
        each with its controls and newest run (see
        :meth:`~rselection.admin.LeaseAdmin.tasks`).

        Raises:
            ConfigError: this leader keeps no task controls.
            BackendUnavailable: the store could not be reached.
        """
        return self._task_board().store.read_tasks(self.name)

    def pause_task(self, task: str) -> TaskControlChange:
        """Pause task ``task`` of this lease, on every node of it, durably until
        :meth:`resume_task` (as ``rselection task pause``; see
        :meth:`~rselection.admin.LeaseAdmin.pause_task`).

        Raises:
            Refused: no such task in this leader's handler.
            ConfigError: this leader keeps no task controls.
            BackendUnavailable: the store could not be reached.
        """
        return self._set_paused(task, True)

    def resume_task(self, task: str) -> TaskControlChange:
        """Resume task ``task`` of this lease (as ``rselection task resume``).

        Raises:
            Refused: no such task in this leader's handler.
            ConfigError: this leader keeps no task controls.
            BackendUnavailable: the store could not be reached.
        """
        return self._set_paused(task, False)

    def _set_paused(self, task: str, paused: bool) -> TaskControlChange:
        # Pause and resume differ only in the flag they write.
        board = self._task_board()
        return board.store.set_paused(self.name, self._registered(task), paused)

    def trigger_task(self, task: str) -> Trigger:
        """Ask the lease's leader for one extra fire of scheduled task ``task`` now, even
        while it is paused (as ``rselection task trigger``): claimed under its own fire
        key, it runs once across the fleet.

        Raises:
            Refused: no such task in this leader's handler, or a persistent one.
            ConfigError: this leader keeps no task controls.
            BackendUnavailable: the store could not be reached.
        """
        board = self._task_board()
        return board.store.add_trigger(self.name, self._registered(task, scheduled=True))

    def task_runs(self, task: str, *, limit: int = RUN_HISTORY_LIMIT) -> list[RunRecord]:
        """The last ``limit`` runs of task ``task`` of this lease, newest first (its run
        history, as ``rselection task history``).

        Raises:
            Refused: no such task in this leader's handler (as the admin API refuses a
                task its lease's list does not have).
            ConfigError: ``limit`` is not an int from 1, or this leader keeps no task
                controls.
            BackendUnavailable: the store could not be reached.
        """
        board = self._task_board()
        limit = check_run_limit(limit)
        return board.store.read_runs(self.name, self._registered(task), limit)

    def _read_task_controls(self) -> None:
        """The leader (re)connects: the task controls it holds may have missed a
        notification, so they are read again soon, on the task desk (never on the
        engine's thread that connects), and until then its next term reads them before
        it starts its tasks. Read ahead, a term that begins later starts its tasks at
        once, as the notifications since keep them current."""
        board = self._state.tasks
        if board is not None:
            board.stale()
            board.wake()

    def _wake_on_task_notices(self, on_tasks: Callable[[Callable[[], None] | None], None]) -> None:
        """Have the lease's notifications of task controls (its ``on_tasks``) wake this
        leader's board, which then holds current controls between them."""
        on_tasks(self._tasks_woken)
        if self._state.tasks is not None:
            self._state.tasks.notified = True

    def _tasks_woken(self) -> None:
        """A notification says the task controls of this lease may have changed: the
        board reads them (only while a term runs; never on the caller's thread)."""
        board = self._state.tasks
        if board is not None:
            board.wake()

    def wait_until_leader(self, timeout: float | None = None) -> bool:
        """Block until this node leads; return ``False`` after ``timeout`` seconds."""
        with self._state.cond:
            self._state.cond.wait_for(
                lambda: (
                    self._state.term is not None
                    or self._state.closed
                    or self._state.stopping.is_set()
                ),
                timeout,
            )
            return self._state.term is not None

    def start(self) -> None:
        """Start competing for the lease in background threads; return at once.

        Raises:
            RSelectionError: the leader was started in the process this one was forked
                from (build or start it in each worker instead).
        """
        self._refuse_if_forked()
        with self._state.cond:
            if self._started:
                raise RuntimeError("this leader was already started; create a new one")
            self._fix_node_id()
            if self._state.claims is not None:  # tasks may have been registered since __init__
                self._state.handler.check_claims(self._state.claims.ttl)
            self._state.handler.attach()
            self._started = True
            if self._state.tasks is not None:
                self._state.tasks.open()
        try:
            # Before any election: a receiver (the metrics' is_leader gauge) sees every
            # node, followers included, from its start.
            signals.emit(signals.started, self, node_id=self._state.node_id, name=self._state.name)
            self._before_driven()
            self._driven.start()
        except BaseException:  # Ctrl-C included: the keeper, if it started, winds down
            self._state.stopping.set()
            if not self._driven.running:
                # Nothing will close it but us: the backend (a lease that joined a
                # shared session, see _before_driven, leaves it now), the handler, and
                # what the clean-ups close (the task board, a factory's pools).
                self._state.close()
            else:
                self._driven.poke()
            raise

    def lead(self) -> None:
        """Compete and lead in this thread until :meth:`stop`, SIGTERM or Ctrl-C, then
        clean up and return.

        In the main thread, SIGTERM and SIGINT (Ctrl-C) stop the leader gracefully
        (tasks cancelled and joined, the lease released so a follower takes over at once)
        and ``lead()`` returns: a program whose last line is ``leader.lead()`` exits 0.
        The program's own handlers of both signals are put back on return.
        :meth:`start` and the context managers install no handler.

        Raises:
            ConfigError: the lease server cannot be used safely as configured (for
                example a connection pooler that is not in session mode); no task ran
                after the problem was found.
        """
        self._refuse_if_forked()
        with stop_on_signals(f"leader {self._state.name!r}") as signalled:
            try:
                # A signal that comes while starting (the first term may already run) is
                # acted on once started: it raises only in this wait.
                self.start()
                signalled.wait(self._driven.done, self._driven.latch)
            except KeyboardInterrupt:
                if signalled.gave_up:  # a second Ctrl-C: no graceful stop (see StopSignals)
                    raise
                signalled.stop_begins()
                self.stop()
        if self._state.fatal is not None:
            raise self._state.fatal

    def stop(self, timeout: float | None = None) -> None:
        """Cancel and join tasks, release the lease so a follower takes over at once.

        Works from any thread. Called from one of this leader's own tasks, from a signal
        receiver running on its keeper or watchdog, or from the event loop its async tasks
        run on, it only asks the leader to stop and returns at once (waiting there would
        wait for itself).

        When ``timeout`` runs out first, the term may already be over (tasks cancelled and
        joined, ``is_leader`` false) while ``demoted`` is still to come: the keeper sends
        it once its round trip in flight ends.

        Args:
            timeout: seconds this call may take in all (default: until stopped, which is
                bounded by ``stop_grace`` plus one release, plus at most
                :data:`CLEANUP_TIMEOUT` per ``cleanup`` callable; on a follower whose
                backend fails to :meth:`~rselection.LeaseBackend.interrupt` its wait,
                also the rest of that wait, at most the lease's ``ttl``).
        """
        if self._forked:  # the parent's threads are not in this process: nothing runs
            return
        self._state.stopping.set()
        with self._state.cond:
            self._state.cond.notify_all()
        self._state.interrupt_backend()
        self._driven.poke()
        if self._called_from_inside():
            return
        if self._driven.running:
            self._driven.done.wait(timeout)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): a leader not yet started
        takes a node id of this process if its id was the default; a started one is
        the parent's and refuses to run here (``is_leader`` False, :meth:`start` and
        :meth:`lead` raise, :meth:`stop` returns at once), and its terms are over here
        (the contexts of its tasks in a process a task forked see them ended)."""
        # A parent's thread may have held these at the fork (leader() holds its lock
        # across a round trip): in this process nothing would ever let go of them.
        self._state.cond = threading.Condition()
        self._observer_lock = threading.Lock()
        if self._started:
            self._forked = True
            for term in (self._state.term, self._state.last_term):
                if term is not None:  # seen over by the tasks' contexts in this process
                    term.reset_after_fork()
            self._state.term = None
            self._state.closed = True
        else:
            self._fix_node_id()

    def _refuse_if_forked(self) -> None:
        if self._forked:
            raise RSelectionError(
                f"leader {self._state.name!r} was started in process {self._node_id_pid}, and "
                f"this process ({os.getpid()}) is a fork of it: a leader cannot go on "
                f"in a forked child; {forks.FORK_ADVICE}"
            )

    def _fix_node_id(self) -> None:
        """A default node id is this process's: taken anew in a forked child."""
        if self._default_node_id and self._node_id_pid != os.getpid():
            self._node_id_pid = os.getpid()
            self._state.node_id = new_node_id()
            self._adopt_node_id(self._state.node_id)

    def _adopt_node_id(self, node_id: str) -> None:
        """Pass a new default ``node_id`` on to what was built with the old one (the
        factories' membership and claimer)."""

    def _wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the keeper to end; ``True`` once it has."""
        return self._driven.done.wait(timeout)

    def step_down(self, *, hold: float = 0.0, wait: bool = True) -> None:
        """Give leadership up now: cancel and join tasks, release, then compete again.

        Args:
            hold: seconds to stay a follower before competing again (lets another node
                take over).
            wait: block until the term has ended (never from this leader's own tasks,
                receivers or event loop, where it returns at once).
        """
        with self._state.cond:
            term = self._state.term
            if term is None:
                return
            earlier = self._state.step_down_request
            request = self._state.step_down_request = StepDown(term.number, hold, "step_down")
            if earlier is not None and earlier.term == term.number:
                # One step-down answers both callers (the latest hold counts).
                request.superseded.append(earlier)
        self._state.interrupt_backend()
        self._driven.poke()
        if wait and not self._called_from_inside():
            term.ended.wait()
            # The release follows the tasks' end: once it is done another node may lead
            # (bounded: a lease that cannot be released passes on when it expires).
            request.done.wait(self._state.timings.ttl)

    def _called_from_inside(self) -> bool:
        """True on a thread or loop whose work this leader's stop would wait for."""
        if threading.current_thread() is self._state.cleaning or self._driven.inside():
            return True
        running = running_term.get()
        if running is not None and running in (self._state.term, self._state.last_term):
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        return loop is self._state.loop

    async def __aenter__(self) -> Self:
        """Start, and run async tasks on the loop that entered the block."""
        self._state.loop = asyncio.get_running_loop()
        self.start()
        return self

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._state.name!r}, node_id={self._state.node_id!r}, "
            f"term={self.term})"
        )

    # -- hooks of subclasses ---------------------------------------------------------

    #: Whether a follower woken only by another node's acquisition follows the holder
    #: its notification announces instead of attempting (see
    #: :class:`~rselection.abc.AnnouncesHolder`). On for a sharded leader's shards,
    #: whose moves would otherwise cost every node an attempt each; off elsewhere: with a
    #: thousand leases per process it left the followers' attempts out of step with the
    #: keeper's attempt slots (measured: 18 statements per second per idle follower
    #: against 7, and a graceful handover of 1,000 leases 40 % slower).
    _follows_announcements = False

    def _before_driven(self) -> None:
        """Called by :meth:`start` right before the engine first steps this leader (a
        Postgres lease joins its process's keeper session here, so that leases started
        together listen in one round trip)."""

    def _takeover_delay(self) -> float:
        """Seconds a follower woken by a possible change waits before it attempts (the
        driven keeper asks once per wake); 0: at once. A sharded leader's shard waits
        when another node is planned to take it over."""
        return 0.0


def _leader_timings(
    lease: LeaseBackend,
    timings: Timings | None,
    ttl: float | None,
    renew_interval: float | None,
    renew_deadline: float | None,
    retry_interval: float | None,
) -> Timings:
    """The leader's timings from ``timings`` or the four values, checked against the
    lease's own ttl."""
    given = (ttl, renew_interval, renew_deadline, retry_interval)
    lease_ttl = check_seconds(lease.ttl, f"the ttl of lease {lease.name!r}")
    if timings is not None:
        if any(value is not None for value in given):
            raise ConfigError(
                "pass timings= or ttl/renew_interval/renew_deadline/retry_interval, not both"
            )
        if not isinstance(timings, Timings):
            raise ConfigError(f"timings must be a Timings, got {type(timings).__name__}")
    else:
        default = Timings()
        timings = Timings(
            ttl if ttl is not None else lease_ttl,
            renew_interval if renew_interval is not None else default.renew_interval,
            renew_deadline if renew_deadline is not None else default.renew_deadline,
            retry_interval if retry_interval is not None else default.retry_interval,
        )
    if lease_ttl < timings.ttl - 1e-9:
        raise ConfigError(
            f"lease {lease.name!r} expires {lease_ttl:g}s after a renewal, sooner than the "
            f"leader's ttl of {timings.ttl:g}s on which its deadline and stop_grace are "
            f"reckoned, so another node could lead while this one still does: pass "
            f"ttl={lease_ttl:g} (or less) to the leader, or give the lease a longer ttl"
        )
    return timings
