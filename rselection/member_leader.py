"""``MemberLeader``: what the leaders of the backends share
(:class:`~rselection.PostgresLeader`, :class:`~rselection.RedisLeader`).

Such a leader is a :class:`~rselection.LeaseLeader` whose node heartbeats as a member
of its lease (:meth:`MemberLeader.nodes`), and which claims its fires with a claimer of
its backend's own unless given another (:data:`DEFAULT_CLAIMER`). What it builds with
its node id follows that id when a default one is taken anew in a forked child.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from .claiming import FireClaimer
from .drains import DRAINED, DrainWatch, heir
from .errors import BackendUnavailable
from .leader import LeaseLeader
from .members import MembershipBase
from .succession import ASK_AGAIN_AFTER, Look, SuccessionWatch
from .validation import check_node_id, check_seconds, new_node_id

if TYPE_CHECKING:
    from .abc import LeaseBackend, Membership
    from .members import NodeInfo
    from .tasks import TaskHandler

__all__ = ["DEFAULT_CLAIMER", "DefaultClaimer", "MemberLeader", "OwnClaimer"]

logger = logging.getLogger("rselection.leader")


class DefaultClaimer(enum.Enum):
    """The type of :data:`DEFAULT_CLAIMER`, for signatures."""

    CLAIMER = "a claimer of the backend's own, on the lease's server"


DEFAULT_CLAIMER = DefaultClaimer.CLAIMER
"""The default of a backend leader's ``claimer=``: a claimer on the lease's own server
(claims in a Postgres lease's database, in a Redis lease's Redis), closed with the
leader."""


class OwnClaimer(FireClaimer, Protocol):
    """A claimer a leader builds itself: it claims under the leader's node id, and the
    leader closes it."""

    node_id: str
    """Who claims: the leader's node id."""

    def close(self) -> None:
        """Close what the claimer opened itself."""
        ...


class MemberLeader(LeaseLeader):
    """Base of the backends' leaders: a lease leader with a membership and, by default,
    a claimer of its own.

    A subclass builds its membership and its default claimer (:meth:`_own_claimer`)
    with the node id it was given or a new one (:meth:`_first_node_id`), then calls this
    class's constructor.

    While it leads with a ``version`` set, it hands over once to a newer node that has
    heartbeated for ``settle`` seconds (see :mod:`rselection.succession`); a subclass
    says how to ask for that handover (:meth:`_request_successor`).

    An operator may drain its node (``rselection drain``, see :mod:`rselection.drains`):
    a subclass says how to read that (:meth:`_read_drained`) and has its lease call
    :meth:`_drain_woken` when a notification says the drains of the lease changed.

    Args:
        lease, handler: as for :class:`~rselection.LeaseLeader`.
        membership: this node's heartbeats as a member of the lease.
        node_id: the node id given (``None``: a new one of this process).
        cleanup: what to run when the keeper ends, after the node left the membership.
        settle: seconds a newer node must have heartbeated before it is handed the lease.
        options: the other keyword arguments of :class:`~rselection.LeaseLeader`.
    """

    _membership: Membership
    """This node's heartbeats as a member of the lease."""
    _owned_claimer: OwnClaimer | None = None
    """The claimer it built itself (see :meth:`_own_claimer`)."""

    def __init__(
        self,
        lease: LeaseBackend,
        handler: TaskHandler,
        *,
        membership: Membership,
        node_id: str | None,
        cleanup: list[Callable[[], Any]],
        settle: float = 10.0,
        **options: Any,
    ) -> None:
        self._membership = membership
        self._settle = check_seconds(settle, "settle", allow_zero=True)
        self._asked: dict[str, float] = {}  # successors asked for, when (monotonic)
        self._drained = False  # as last read (see check_drained)
        self._drain_listeners: list[Callable[[bool], None]] = []
        self._look_at = 0.0  # when to look at the nodes next (monotonic)
        # Whatever ends the keeper (stop(), or an error it cannot go on after), the node
        # leaves the membership with it: no heartbeats from a node that no longer competes.
        super().__init__(
            lease,
            handler,
            node_id=node_id,
            cleanup=[self._unwatch, membership.stop, *cleanup],
            **options,
        )
        # What was built with a new node id takes the leader's own (see _fix_node_id).
        self._adopt_node_id(self.node_id)
        self._state.check_drained = self._check_on_connect

    def _check_on_connect(self) -> None:
        """On every (re)connect, before any attempt: whether this node is drained; and
        the task controls held are no longer known to be current."""
        self.check_drained()
        self._read_task_controls()

    @staticmethod
    def _first_node_id(node_id: str | None) -> str:
        """The node id to build the membership and the claimer with: the one given, or a
        new one (which :meth:`_adopt_node_id` replaces by the leader's)."""
        return check_node_id(node_id) if node_id is not None else new_node_id()

    def _own_claimer(
        self,
        claimer: FireClaimer | DefaultClaimer | None,
        make: Callable[[], OwnClaimer],
        cleanup: list[Callable[[], Any]],
    ) -> FireClaimer | None:
        """``claimer`` as given, or for :data:`DEFAULT_CLAIMER` the backend's own, made
        by ``make``: its node id follows this leader's, and ``cleanup`` closes it."""
        if isinstance(claimer, DefaultClaimer):
            claimer = self._owned_claimer = make()
            cleanup.append(claimer.close)
        return claimer

    def _adopt_node_id(self, node_id: str) -> None:
        self._membership.node_id = node_id
        if self._owned_claimer is not None:
            self._owned_claimer.node_id = node_id

    def _leave_membership(self) -> None:
        """Stop heartbeating and delete this node's entry now (best effort): from then on
        the other nodes no longer count it (a sharded leader hands it no more shards)."""
        self._membership.stop()

    def start(self) -> None:
        """Start heartbeating and competing for the lease in background threads."""
        super().start()
        self._membership.start()
        if self.version is not None:
            SuccessionWatch.shared().add(self)

    def _unwatch(self) -> None:
        SuccessionWatch.shared().discard(self)
        DrainWatch.shared().discard(self)

    @property
    def drained(self) -> bool:
        """Whether an operator drained this node (``rselection drain``), as last read:
        it then leads nothing until undrained (:attr:`eligible` is ``False``)."""
        return self._drained

    def on_drain_change(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(drained)`` whenever this node is found drained or undrained
        (from the thread that read it; a sharded leader passes it on to the leaders of
        its shards)."""
        self._drain_listeners.append(listener)

    def _drain_woken(self, node_id: str | None = None) -> None:
        """A notification says the drains of this lease may have changed (those of
        ``node_id``; ``None``: any node's): read this node's soon, on the process's drain
        thread (never on the caller's)."""
        if node_id not in (None, self.node_id):
            return
        if self._started and not self._state.closed:
            DrainWatch.shared().wake(self)

    def _read_drained(self) -> bool:
        """*Backend*: whether this node is drained, as recorded on the lease's server
        (``False`` where drains are not recorded).

        Raises:
            BackendUnavailable: the server could not be reached.
        """
        return False

    def _read_drained_nodes(self) -> frozenset[str]:
        """*Backend*: the nodes of this lease an operator drained (empty where drains
        are not recorded).

        Raises:
            BackendUnavailable: the server could not be reached.
        """
        return frozenset()

    def check_drained(self) -> None:
        """Read whether this node is drained (``rselection drain``) and act on it: a
        drained node becomes ineligible, and if it leads it ends its term at once
        (reason ``"drained"``), reserving the lease for the newest eligible live node
        when versions tell one; an undrained one competes again (when started with
        ``eligible=True``). The leader calls it on every (re)connect and when a
        notification says the drains changed; a call changes nothing when nothing did.

        Raises:
            BackendUnavailable: the server could not be reached.
        """
        state = self._state
        if state.closed:
            return  # stopped: nothing to act on (a retry of the drain thread ends here)
        drained = self._read_drained()
        with state.cond:
            changed, self._drained = drained != self._drained, drained
            state.eligible = state.given_eligible and not drained
            term, since = state.term, state.acquired_at
        if changed:
            logger.info(
                "node %s of %r is %s",
                self.node_id,
                self.name,
                "drained" if drained else "undrained",
            )
            for listener in self._drain_listeners:
                listener(drained)
            membership = self._membership
            if isinstance(membership, MembershipBase):
                membership.set_eligible(state.eligible)
                if self._started:
                    try:  # shown at once, not at the next heartbeat (best effort)
                        membership.beat()
                    except BackendUnavailable as exc:
                        logger.debug(
                            "node %s: heartbeat after a drain failed: %s", self.node_id, exc
                        )
        if drained and term is not None and term.live():
            self._hand_over_drained(term.number, since)
            if state.ask_step_down(term, DRAINED) is not None:
                state.interrupt_backend()
                self._driven.poke()
        elif changed and state.eligible:
            self._driven.poke()  # compete again

    def _hand_over_drained(self, term: int, since: datetime | None) -> None:
        """Reserve term ``term``'s lease for the newest eligible live node, if versions
        tell one (best effort: else the release lets any eligible node take it)."""
        try:
            # A node drained while silent (paused, cut off) still heartbeated eligible.
            found = heir(self._membership.nodes(), self.node_id, since, self._read_drained_nodes())
            if found is not None:
                logger.info(
                    "node %s, drained, hands %r over to %s (version %s)",
                    self.node_id,
                    self.name,
                    found.node_id,
                    found.version,
                )
                self._request_successor(found.node_id, term)
        except Exception as exc:  # the step-down goes on: any eligible node may lead
            logger.warning(
                "node %s, drained: could not reserve %r for a successor (%s); releasing it",
                self.node_id,
                self.name,
                exc,
            )

    def hand_over_to_newer(self) -> None:
        """While leading, and when a look is due, ask for a handover to the newest
        settled node of a newer version, if there is one (see
        :class:`rselection.succession.Look`); the same node is not asked for again
        within :data:`~rselection.succession.ASK_AGAIN_AFTER` seconds.

        Raises:
            BackendUnavailable: the server could not be reached.
        """
        state = self._state
        with state.cond:  # the term and its acquisition time, of one term
            current, since = state.term, state.acquired_at
        now = time.monotonic()
        if current is None or not current.live() or now < self._look_at:
            return
        term = current.number
        # Settling is measured on this machine's clock against the server's first
        # heartbeat: a few milliseconds of skew against a settle of seconds.
        look = Look(
            self._membership.nodes(),
            self.node_id,
            self.version,
            self._settle,
            datetime.now(UTC),
            since,
        )
        self._look_at = now + look.next_look()
        heir = look.successor()
        if heir is None:
            return
        asked = self._asked.get(heir.node_id)
        if asked is not None and now - asked < ASK_AGAIN_AFTER:
            return
        self._asked[heir.node_id] = now
        logger.info(
            "node %s (version %s) hands %r over to %s, of a newer version (%s)",
            self.node_id,
            self.version,
            self.name,
            heir.node_id,
            heir.version,
        )
        state.own_handover_term = term
        self._request_successor(heir.node_id, term)

    def _request_successor(self, node_id: str, term: int) -> None:
        """*Backend*: ask that term ``term`` of this leader's lease be handed over to
        ``node_id`` (reserved for it for ``stop_grace`` + 1 seconds), as ``resign --to``
        does. Only while ``term`` still holds the lease, where the backend can tell."""
        raise NotImplementedError

    def nodes(self) -> list[NodeInfo]:
        """Every node of this lease from its heartbeats, oldest first.

        Each :class:`~rselection.NodeInfo` has the node's id, host, pid, client address,
        first and last heartbeat (server time), ``alive`` (seen within ``node_timeout``)
        and ``is_leader``. Works on any node, leader or follower; ``ctx.nodes()`` is the
        same list.

        Raises:
            BackendUnavailable: the lease's server could not be reached.
        """
        return self._membership.nodes()
