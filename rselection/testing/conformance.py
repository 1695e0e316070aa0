"""A backend author's conformance kit: :class:`LeaderConformance`, the scenarios every
lease backend passes under a :class:`~rselection.LeaseLeader`. See
:mod:`rselection.testing` and the how-to "Test your tasks" ("A backend of your own")."""

from __future__ import annotations

import functools
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from .. import signals
from ..abc import lease_ability
from ..context import TaskContext
from ..leader import LeaseLeader
from ..lease import RenewOutcome
from ..tasks import TaskHandler
from ..timing import Timings

if TYPE_CHECKING:
    from ..abc import LeaseBackend

__all__ = ["LeaderConformance"]


def _expect(condition: bool, message: str) -> None:
    """Fail the check (also under ``python -O``, which drops ``assert``)."""
    if not condition:
        raise AssertionError(message)


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.01)


def _term_after(leader: LeaseLeader, term: int) -> Callable[[], bool]:
    return lambda: (leader.term or 0) > term


class _Ledger:
    """When each node's tasks of each term started and ended (this process's clock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[tuple[str, int, float, float | None]] = []

    def handler(self, node: str, linger: float, stop_grace: float) -> TaskHandler:
        """A handler whose persistent task keeps running ``linger`` s after cancellation."""
        handler = TaskHandler(stop_grace=stop_grace)

        @handler.persistent("work", restart="never")
        def work(ctx: TaskContext) -> None:
            with self.lock:
                index = len(self.runs)
                self.runs.append((node, ctx.term, time.monotonic(), None))
            ctx.cancelled.wait()
            time.sleep(linger)  # a wind-down that takes a while, within stop_grace
            with self.lock:
                self.runs[index] = (node, ctx.term, self.runs[index][2], time.monotonic())

        return handler

    def of(self, node: str) -> list[tuple[int, float, float | None]]:
        with self.lock:
            return [(term, began, ended) for n, term, began, ended in self.runs if n == node]


class _FrozenRenewals:
    """A leader's renewals, stopped after the next successful one: its keeper then blocks
    inside ``renew()`` (as a paused or crashed process would) until :meth:`thaw`.

    Installed by replacing ``renew`` and ``term_ended`` (and ``renew_soon`` of a
    :class:`~rselection.abc.NonBlockingLease`, whose frozen renewal is then never
    answered until :meth:`thaw`) on the leader's lease object; the
    lease is neither released nor closed meanwhile, nor told that the term ended (a
    paused or crashed process tells its backend nothing: the lease may then only pass
    on by expiry); :meth:`thaw` tells it.
    """

    def __init__(self, leader: LeaseLeader, bound: float) -> None:
        lease: Any = leader.lease
        self.real = lease.renew
        self.real_term_ended = lease.term_ended
        self.bound = bound
        self.lock = threading.Lock()
        self.frozen = False
        self.last: tuple[float, float] | None = None  # the last successful renewal: sent, done
        self.ended: list[int] = []  # terms whose end the lease is told at thaw()
        self.stuck = threading.Event()  # the keeper is blocked in renew()
        self.thawed = threading.Event()
        lease.renew = self.renew  # on this lease object only
        lease.term_ended = self.term_ended
        if lease_ability(lease, "non_blocking") is not None:  # a driven leader renews so
            self.real_soon = lease.renew_soon
            setattr(lease, "renew_soon", self.renew_soon)  # noqa: B010 - a method, replaced

    def _stuck(self) -> bool:
        """Whether renewals are frozen (the keeper is then stuck)."""
        with self.lock:
            frozen = self.frozen
        if frozen:
            self.stuck.set()
        return frozen

    def _renewed(self, sent: float) -> None:
        """A renewal sent at ``sent`` succeeded: the next ones freeze (until thawed)."""
        with self.lock:
            self.last = (sent, time.monotonic())
            self.frozen = not self.thawed.is_set()

    def renew(self, node_id: str, term: int) -> bool:
        if self._stuck():
            self.thawed.wait(self.bound)
            return False  # the term is lost by now
        sent = time.monotonic()
        renewed = bool(self.real(node_id, term))
        if renewed:
            self._renewed(sent)
        return renewed

    def renew_soon(self, node_id: str, term: int, done: Callable[[RenewOutcome], None]) -> bool:
        if self._stuck():
            # Never answered until thawed (the round trip of a paused process).
            threading.Thread(target=self._answer_at_thaw, args=(done,), daemon=True).start()
            return True
        sent = time.monotonic()

        def answered(outcome: RenewOutcome) -> None:
            if outcome is True:
                self._renewed(sent)
            done(outcome)

        return bool(self.real_soon(node_id, term, answered))

    def _answer_at_thaw(self, done: Callable[[RenewOutcome], None]) -> None:
        self.thawed.wait(self.bound)
        done(False)  # the term is lost by now

    def term_ended(self, term: int) -> None:
        with self.lock:
            if self.frozen:
                self.ended.append(term)
                return
        self.real_term_ended(term)

    def thaw(self) -> None:
        """Let the keeper go on (its renewals then pass through); tell the lease of the
        terms that ended meanwhile."""
        with self.lock:
            self.frozen = False
            ended, self.ended = self.ended, []
        self.thawed.set()
        for term in ended:
            self.real_term_ended(term)


class LeaderConformance:
    """The scenarios every lease backend passes under a :class:`~rselection.LeaseLeader`.

    Subclass it in a test module as a ``Test...`` class (pytest collects the inherited
    ``test_*`` methods) and implement :meth:`make_lease`; override :meth:`make_leader`
    to check a leader factory instead (``PostgresLeader``, ``RedisLeader`` do). Every
    scenario runs leaders in this process, on one lease name of its own, with the short
    :attr:`timings`; each wait is bounded. When the lease needs a server that a pytest
    fixture provides, take it in an autouse fixture of the subclass and call
    :meth:`stop_leaders` there after the test, before the server goes away::

        class TestMyLease(LeaderConformance):
            @pytest.fixture(autouse=True)
            def server(self, my_server_url):
                self.url = my_server_url
                yield
                self.stop_leaders()

            def make_lease(self, name):
                return MyLease(self.url, name=name, ttl=self.timings.ttl)

    What it checks: one leader among several nodes, and every node agrees who it is;
    a renewing leader keeps the lease for longer than its ttl and no other node leads
    meanwhile (so a renewal must extend the lease on the server, not only answer
    ``True``); a leader whose renewals stop without a release (a crash or a pause) is
    replaced once its lease expired, :attr:`timings` ``.ttl`` after its last renewal was
    sent, and not before; a graceful stop hands over within :attr:`handover_bound`
    seconds, with a higher term (so a release must wake waiting followers); the old
    term's tasks have ended before the next term's start; terms strictly grow, also
    across release and re-acquire (by any step: a global revision counter will do); a
    step-down with a hold lets another node lead; a stopped leader leaves the lease free;
    ``leader_changed`` reaches every node.

    The scenario of stopped renewals freezes a leader's keeper: it replaces ``renew`` on
    the leader's lease object (:attr:`~rselection.LeaseLeader.lease`) with a method that
    blocks, so that object must accept attribute assignment (no ``__slots__``). The
    backend's session stays open meanwhile, as a paused process's would.
    """

    timings: ClassVar[Timings] = Timings(
        ttl=3.0, renew_interval=0.5, renew_deadline=2.0, retry_interval=0.5
    )
    """The leaders' timings (a lease should be made with ``ttl=timings.ttl``)."""

    handover_bound: ClassVar[float] = 1.0
    """Seconds a graceful handover may take, from ``stop()`` returning to the next leader."""

    wait_bound: ClassVar[float] = 10.0
    """Seconds any other awaited event may take."""

    expiry_slack: ClassVar[float] = 0.1
    """Seconds a lease may seem to expire before ``ttl`` has passed since its last renewal
    was sent (clock rates, rounding); a takeover sooner than that fails the suite."""

    takeover_slack: ClassVar[float] = 1.0
    """Seconds a takeover of an expired lease may take beyond ``ttl + retry_interval``
    (scheduling on a busy machine)."""

    _made: list[LeaseLeader]

    # -- what a backend provides ----------------------------------------------------------

    def make_lease(self, name: str) -> LeaseBackend:
        """A new lease object for the lease called ``name`` (several objects of one name
        compete for the same lease, as nodes do)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_lease(name) (or make_leader)"
        )

    def make_leader(self, name: str, handler: TaskHandler, *, node_id: str) -> LeaseLeader:
        """A leader of lease ``name`` for ``node_id`` (default: a
        :class:`~rselection.LeaseLeader` over :meth:`make_lease` with :attr:`timings`)."""
        return LeaseLeader(self.make_lease(name), handler, node_id=node_id, timings=self.timings)

    # -- helpers ------------------------------------------------------------------------

    def new_name(self) -> str:
        """A lease name no other scenario uses."""
        return f"conformance-{uuid.uuid4().hex[:10]}"

    def leader(self, name: str, node_id: str, handler: TaskHandler | None = None) -> LeaseLeader:
        """Make a leader with :meth:`make_leader`; :meth:`stop_leaders` stops it."""
        made = self.__dict__.setdefault("_made", [])
        leader = self.make_leader(name, handler or TaskHandler(), node_id=node_id)
        made.append(leader)
        return leader

    def stop_leaders(self) -> None:
        """Stop every leader made by :meth:`leader` (each within a bounded time)."""
        made: list[LeaseLeader] = self.__dict__.get("_made", [])
        while made:
            made.pop().stop(timeout=self.wait_bound)

    def teardown_method(self, method: object = None) -> None:
        """Stop the scenario's leaders (pytest calls it after each test)."""
        self.stop_leaders()

    def start_leaders(
        self, name: str, nodes: list[str], handler: Callable[[str], TaskHandler] | None = None
    ) -> tuple[list[LeaseLeader], LeaseLeader]:
        """Start a leader of lease ``name`` for each of ``nodes`` (with ``handler(node)``,
        or a handler of no tasks); return them and, once exactly one leads, that one."""
        leaders = [self.leader(name, node, handler(node) if handler else None) for node in nodes]
        for leader in leaders:
            leader.start()
        return leaders, self.the_leader(leaders)

    def the_leader(self, leaders: list[LeaseLeader]) -> LeaseLeader:
        """Wait until exactly one of ``leaders`` leads; return it."""
        _wait_until(lambda: sum(x.is_leader for x in leaders) == 1, self.wait_bound, "one leader")
        return next(x for x in leaders if x.is_leader)

    # -- scenarios ----------------------------------------------------------------------

    def test_one_of_three_nodes_leads_and_every_node_agrees(self) -> None:
        """Exactly one node leads; every node's ``leader()`` names it with its term."""
        name = self.new_name()
        leaders, chief = self.start_leaders(name, [f"node-{i}" for i in range(3)])
        deadline = time.monotonic() + 2 * self.timings.renew_interval
        while time.monotonic() < deadline:  # through renewals, still one leader
            _expect(sum(x.is_leader for x in leaders) <= 1, "two nodes lead at once")
            time.sleep(0.01)
        _expect(chief.is_leader and chief.term is not None, "the leader stopped leading")
        for leader in leaders:
            view = leader.leader()
            _expect(view is not None, f"{leader.node_id} sees no leader")
            assert view is not None
            _expect(
                (view.node_id, view.term) == (chief.node_id, chief.term),
                f"{leader.node_id} sees {view.node_id} term {view.term}, not "
                f"{chief.node_id} term {chief.term}",
            )
            _expect(view.expires_at > view.acquired_at, f"expiry not after acquisition: {view}")

    def test_a_renewing_leader_keeps_the_lease_longer_than_its_ttl(self) -> None:
        """While the leader renews, it keeps its term and no other node leads, for longer
        than the ttl: a renewal must extend the lease on the server."""
        name = self.new_name()
        leaders, chief = self.start_leaders(name, ["a", "b"])
        term = chief.term
        t = self.timings
        began = time.monotonic()
        watch = t.ttl + 2 * t.retry_interval
        while (elapsed := time.monotonic() - began) < watch:
            leading = [x.node_id for x in leaders if x.is_leader]
            _expect(
                len(leading) <= 1,
                f"{' and '.join(leading)} lead at once {elapsed:.2f} s after {chief.node_id} "
                f"began leading (ttl {t.ttl:g} s): does renew() extend the lease?",
            )
            _expect(
                chief.term == term,
                f"{chief.node_id} lost term {term} after {elapsed:.2f} s although it renews "
                f"every {t.renew_interval:g} s",
            )
            time.sleep(0.01)
        for leader in leaders:
            view = leader.leader()
            _expect(
                view is not None and (view.node_id, view.term) == (chief.node_id, term),
                f"after {watch:g} s {leader.node_id} sees {view}, not {chief.node_id} term {term}",
            )

    def test_a_leader_whose_renewals_stop_is_replaced_after_its_ttl_not_before(self) -> None:
        """A holder whose renewals stop without a release (a crash or a pause; here its
        keeper is frozen inside ``renew()``, its session open, and its lease is not told
        that the term ended) stops leading at its
        deadline; another node leads once the lease expired, ``ttl`` after the last
        renewal was sent (less :attr:`expiry_slack`), and within ``retry_interval`` plus
        :attr:`takeover_slack` after that."""
        name = self.new_name()
        leaders, chief = self.start_leaders(name, ["a", "b"])
        heir = next(x for x in leaders if x is not chief)
        t = self.timings
        frozen = _FrozenRenewals(chief, self.wait_bound + t.ttl)
        try:
            stuck = frozen.stuck.wait(2 * t.renew_interval + self.wait_bound)
            _expect(stuck and frozen.last is not None, "the leader renewed nothing")
            assert frozen.last is not None
            sent, done = frozen.last
            latest = done + t.ttl + t.retry_interval + self.takeover_slack
            while not heir.is_leader:
                _expect(
                    time.monotonic() < latest,
                    f"no other node led {latest - sent:.2f} s after the last renewal of "
                    f"{chief.node_id} (ttl {t.ttl:g} s): does the lease expire when its "
                    "holder stops renewing?",
                )
                time.sleep(0.005)
            took = time.monotonic() - sent
            _expect(
                took >= t.ttl - self.expiry_slack,
                f"{heir.node_id} led {took:.2f} s after the last renewal of {chief.node_id} "
                f"was sent, before its ttl of {t.ttl:g} s: does the lease expire sooner?",
            )
            _expect(not chief.is_leader, f"{chief.node_id} still leads without renewals")
        finally:
            frozen.thaw()

    def test_a_stopped_leader_hands_over_promptly_with_the_next_term(self) -> None:
        """``stop()`` releases the lease and wakes the followers: the next leader leads
        within :attr:`handover_bound` with a higher term, and every node hears of it."""
        name = self.new_name()
        leaders = [self.leader(name, f"node-{i}") for i in range(3)]
        changes: list[tuple[str, Any]] = []
        lock = threading.Lock()

        def receiver(sender: Any, **kw: Any) -> None:
            if sender in leaders:
                with lock:
                    changes.append((sender.node_id, kw["leader"]))

        signals.leader_changed.connect(receiver)
        try:
            for leader in leaders:
                leader.start()
            chief = self.the_leader(leaders)
            first_term = chief.term
            assert first_term is not None
            chief.stop(timeout=self.wait_bound)
            stopped = time.monotonic()
            rest = [x for x in leaders if x is not chief]
            heir = self.the_leader(rest)
            took = time.monotonic() - stopped
            _expect(
                took <= self.handover_bound,
                f"the handover took {took:.2f} s (bound {self.handover_bound:g} s): does "
                "release() wake followers blocked in wait_for_change()?",
            )
            _expect(
                heir.term is not None and heir.term > first_term,
                f"term {heir.term} after {first_term}",
            )

            def heard() -> bool:
                with lock:
                    nodes = {n for n, info in changes if info and info.node_id == heir.node_id}
                return nodes >= {x.node_id for x in rest}

            _wait_until(heard, self.wait_bound, "leader_changed on every node")
        finally:
            signals.leader_changed.disconnect(receiver)

    def test_the_old_terms_tasks_end_before_the_next_term_starts(self) -> None:
        """The lease passes on only once the old term's tasks are joined, on a stop and
        on a step-down."""
        name = self.new_name()
        ledger = _Ledger()
        grace = self.timings.stop_grace(None)
        linger = 0.6 * grace
        handler = functools.partial(ledger.handler, linger=linger, stop_grace=grace)
        leaders, chief = self.start_leaders(name, ["a", "b"], handler)
        # Each term is ended only once its task runs: a term ended as it begins may end
        # before its task's first line, and then leaves nothing to check.
        _wait_until(lambda: len(ledger.runs) >= 1, self.wait_bound, "the first term's task")
        chief.step_down(hold=3 * self.handover_bound)  # the other node leads next
        heir = self.the_leader(leaders)
        _expect(heir is not chief, "the node that stepped down with a hold leads again")
        _wait_until(lambda: len(ledger.runs) >= 2, self.wait_bound, "the second term's task")
        heir.stop(timeout=self.wait_bound)
        last = self.the_leader(leaders)
        _expect(last is chief, "the node on hold did not lead after the other stopped")
        _wait_until(lambda: len(ledger.runs) >= 3, self.wait_bound, "three terms' tasks")
        with ledger.lock:
            runs = sorted(ledger.runs, key=lambda run: run[1])
        for (node, term, _, ended), (next_node, next_term, began, _) in itertools.pairwise(runs):
            _expect(next_term > term, f"terms {term} then {next_term}")
            _expect(
                ended is not None and ended <= began,
                f"term {next_term} ({next_node}) started before term {term}'s task ({node}) ended",
            )

    def test_terms_only_grow_also_across_release_and_reacquire(self) -> None:
        """Each new leadership of a lease has a higher term, whoever takes it and
        whatever lease object it goes through."""
        name = self.new_name()
        seen: list[int] = []
        for round_ in range(2):
            leader = self.leader(name, f"node-{round_}")
            leader.start()
            _expect(leader.wait_until_leader(self.wait_bound), "the single node did not lead")
            term = leader.term
            assert term is not None
            seen.append(term)
            leader.step_down(hold=0.0)  # released, then acquired again
            _wait_until(_term_after(leader, term), self.wait_bound, "a next term")
            seen.append(leader.term or 0)
            leader.stop(timeout=self.wait_bound)
        _expect(seen == sorted(set(seen)), f"terms did not grow: {seen}")

    def test_a_step_down_with_a_hold_lets_another_node_lead(self) -> None:
        """``step_down(hold=...)`` ends the term, releases, and stays a follower."""
        name = self.new_name()
        leaders, chief = self.start_leaders(name, ["a", "b"])
        term = chief.term
        assert term is not None
        chief.step_down(hold=self.wait_bound)
        _expect(not chief.is_leader, "still leading after step_down() returned")
        began = time.monotonic()
        other = next(x for x in leaders if x is not chief)
        _wait_until(lambda: other.is_leader, self.wait_bound, "the other node to lead")
        took = time.monotonic() - began
        _expect(took <= self.handover_bound, f"the step-down handover took {took:.2f} s")
        _expect(other.term is not None and other.term > term, f"term {other.term} after {term}")
        _expect(not chief.is_leader, "the node on hold leads")

    def test_a_stopped_leader_leaves_the_lease_free(self) -> None:
        """After ``stop()`` no node holds the lease (and ``leader()`` still answers)."""
        name = self.new_name()
        leader = self.leader(name, "only")
        leader.start()
        _expect(leader.wait_until_leader(self.wait_bound), "the single node did not lead")
        leader.stop(timeout=self.wait_bound)
        _expect(not leader.is_leader and leader.term is None, "a stopped leader leads")
        _expect(leader.leader() is None, f"the lease is still held: {leader.leader()}")
