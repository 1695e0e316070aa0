"""Notifications under attack from a role that may only log in.

Any role may NOTIFY on any channel, and the channels are public: a lease's is
``rselection:<schema>.<table>:<lease name>``, the ring's ``rselection-ring:`` followed by
a hash of the qualified table name. The attacker (``login_only_dsn``: no privilege on
any rselection table) sends what it likes there: payloads that are no JSON or JSON of
the wrong shape, ring announcements of pids that are no numbers, ``acquired`` events
naming a holder that does not exist, and floods of plausible events. None of it may
demote a leader, delay a crash failover, make a follower believe in a forged holder, or
make a keeper send a statement per notification.

Each test prints the figure it measures (``pytest -s``); its comment says what it
measured before the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import rselection as rs
from rselection.postgres import PostgresLeader
from tests.integration.postgres import test_security_locks as locks
from tests.integration.postgres.test_security_locks import (
    TIMINGS,
    Attacker,
    Pair,
    check_failover,
    idle_handler,
    measure,
    node,
    public_ring_channel,
)
from tests.support.waiting import wait_until
from tests.support.wire_counter import CountingProxy, Snapshot

pytestmark = pytest.mark.timeout(180)

# The fixtures of the advisory-lock tests: the test's schema with its lease table, the
# login-only attacker, and the leaders stopped after each test.
schema = locks.schema
attacker = locks.attacker
made = locks.made

KEEPER = "rselection:keeper"  # the application_name of every keeper session

FORGED_TERM = 10**15
FORGED_EXPIRY = "2999-01-01T00:00:00+00:00"

# Wake-ups a notification may cause: at most this many statements a second on a keeper
# session, beyond its quiet rate, plus a burst.
WAKE_RATE = 4.0
WAKE_BURST = 10
FLOOD_SECONDS = 5.0
FLOOD_RATE = 100.0  # NOTIFYs a second
BURST = 200_000  # NOTIFYs committed in one transaction


# ----------------------------------------------------------------- what the attacker knows


def public_lease_channel(qualified_table: str, name: str) -> str:
    """The channel of a lease (public): its name, or a hash when over 63 bytes."""
    channel = f"rselection:{qualified_table}:{name}"
    if len(channel.encode()) <= 63:
        return channel
    return "rselection:" + hashlib.blake2b(channel.encode(), digest_size=16).hexdigest()


def forged_acquired(name: str, holder_pid: int) -> str:
    """An ``acquired`` event of a holder that does not exist, for a term far ahead, that
    never expires."""
    return json.dumps(
        {
            "event": "acquired",
            "name": name,
            "node_id": "ghost",
            "term": FORGED_TERM,
            "acquired_at": "2024-01-01T00:00:00+00:00",
            "expires_at": FORGED_EXPIRY,
            "holder_pid": holder_pid,
        }
    )


class Flood:
    """NOTIFYs from one session of the attacker, ``rate`` a second for ``seconds``, in
    a thread of their own. Each message is ``(channel, payload)``, sent in turn,
    ``burst`` of them in each statement (delivered together, at its commit)."""

    def __init__(
        self,
        attacker: Attacker,
        messages: list[tuple[str, str]],
        rate: float,
        seconds: float,
        burst: int = 1,
    ) -> None:
        self.conn = attacker.session()
        self.messages = messages
        self.rate = rate
        self.seconds = seconds
        self.burst = burst
        self.sent = 0
        self.error: BaseException | None = None
        self.started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def start(self) -> Flood:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        query = "SELECT " + ", ".join(["pg_notify(%s, %s)"] * self.burst)
        try:
            while self.sent + self.burst <= self.rate * self.seconds:
                params: list[str] = []
                for i in range(self.sent, self.sent + self.burst):
                    params.extend(self.messages[i % len(self.messages)])
                self.conn.execute(query, params)
                self.sent += self.burst
                pause = self.started + self.sent / self.rate - time.monotonic()
                if pause > 0 and self._stop.wait(pause):
                    return
        except BaseException as exc:
            self.error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> int:
        """Wait for the flood's end (bounded); the NOTIFYs sent."""
        self._thread.join(self.seconds + 10.0)
        self._stop.set()
        assert not self._thread.is_alive(), "the flood did not end"
        if self.error is not None:
            raise self.error
        return self.sent


@contextlib.contextmanager
def receiving(signal: Any, receiver: Any) -> Iterator[None]:
    signal.connect(receiver)
    try:
        yield
    finally:
        signal.disconnect(receiver)


# ---------------------------------------------------------------- malformed notifications


def test_malformed_notifications_do_not_wedge_the_shared_keeper(
    pg_dsn: str, attacker: Attacker, made: list[Any]
) -> None:
    # Before the fix: a payload the keeper could not parse ('[' * 7990 overflows the
    # JSON decoder's recursion, '²' passes str.isdigit() but not int()) raised out of
    # its notification reader; one still queued was read by the next statement on the
    # session and raised there, in the middle of the statement, which left the session
    # unusable ("another command is already in progress"). All three leaders lost
    # their leases 0.5 s into the flood (reason "error"; in one run of five at the
    # renew_deadline, 4 s, reason "deadline"), and every term taken again was lost in
    # turn: 19 to 29 demotions in the 7 s of the flood.
    conninfo = make_conninfo(pg_dsn, application_name="node-a")  # one keeper for all three
    leaders = [
        PostgresLeader(conninfo, idle_handler(), name=f"l{i}", node_id="a", claimer=None, **TIMINGS)
        for i in range(3)
    ]
    made.extend(leaders)
    seen: list[tuple[str, str, int, str]] = []

    def demoted(sender: Any, **kw: Any) -> None:
        if sender in leaders:
            seen.append(("demoted", kw["name"], kw["term"], kw["reason"]))

    def elected(sender: Any, **kw: Any) -> None:
        if sender in leaders:
            seen.append(("elected", kw["name"], kw["term"], ""))

    with receiving(rs.signals.demoted, demoted), receiving(rs.signals.elected, elected):
        for leader in leaders:
            leader.start()
        wait_until(lambda: len(seen) == 3, 15, "three leases led")
        assert sorted(seen) == [("elected", f"l{i}", 1, "") for i in range(3)], seen
        terms = [leader.term for leader in leaders]
        seen.clear()

        lease = public_lease_channel(attacker.qualified, "l0")
        ring = public_ring_channel(attacker.qualified)
        messages = [
            (lease, "[" * 7990),
            (ring, "up:²"),
            (lease, '[["x"]]'),
            (ring, "down:²"),
            (lease, '{"event": 5}'),
            (ring, "up:" + "9" * 40),
            (lease, "not json {"),
        ]
        seconds = TIMINGS["renew_deadline"] + 3.0
        # 20 a second, the seven of the mix in one statement: delivered together, so
        # that the keeper reads several malformed ones at once.
        flood = Flood(attacker, messages, 20.0, seconds, burst=len(messages)).start()

        def intact() -> bool:
            return [leader.term for leader in leaders] == terms and all(
                leader.is_leader for leader in leaders
            )

        first_loss: float | None = None
        while flood.running:
            if first_loss is None and not intact():
                first_loss = time.monotonic() - flood.started
            time.sleep(0.05)
        sent = flood.join()
        # A little longer after the flood: whatever it queued is read by now.
        after = measure(lambda: not intact(), 3.0)
        state = [(leader.name, leader.is_leader, leader.term) for leader in leaders]
        demotions = [event for event in seen if event[0] == "demoted"]
        print(
            f"\n{sent} malformed NOTIFYs in {seconds:g} s: first leader lost "
            f"{first_loss} s after the flood began; 3 s after it {state}; "
            f"{len(demotions)} demotions, first {demotions[:3]}"
        )
    assert first_loss is None, (
        f"a leader lost its lease {first_loss:.2f} s into a flood of {sent} malformed "
        f"notifications (renew_deadline {TIMINGS['renew_deadline']} s): "
        f"{len(demotions)} demotions, first {demotions[:3]}; 3 s after the flood {state}"
    )
    assert after is None, f"a leader lost its lease after the flood: {state}, {seen}"
    assert not seen, f"leaders were demoted or elected again: {seen}"
    assert [leader.term for leader in leaders] == terms


def test_a_burst_of_notifications_does_not_end_a_term(
    pg_dsn: str, attacker: Attacker, made: list[Any]
) -> None:
    # Before the fix: the keeper's thread read every notification of a burst under the
    # session's statement lock before it sent the next renewal. 200,000 NOTIFYs that
    # the attacker committed in one transaction (0.5 s of its time) held the renewals
    # up for 7 s: the leader stepped down at its renew_deadline (4 s), 3.9 s after.
    leader = node(pg_dsn, "node-a")
    made.append(leader)
    demotions: list[str] = []

    def demoted(sender: Any, **kw: Any) -> None:
        if sender is leader:
            demotions.append(kw["reason"])

    with receiving(rs.signals.demoted, demoted):
        leader.start()
        wait_until(lambda: leader.is_leader, 15, "node-a to lead")
        term = leader.term
        channel = public_lease_channel(attacker.qualified, "jobs")
        started = time.monotonic()
        attacker.conn.execute(
            'SELECT count(pg_notify(%s, \'{"event": "released", "n": \' || i || \'}\'))'
            " FROM generate_series(1, %s) AS i",
            (channel, BURST),
        )
        sent = time.monotonic() - started
        # Twice the renew_deadline: a term the burst ends has ended by then.
        lost = measure(lambda: leader.term != term, 2 * TIMINGS["renew_deadline"])
    print(f"\n{BURST} NOTIFYs committed in {sent:.2f} s: term lost after {lost} s, {demotions}")
    assert lost is None and not demotions, (
        f"a burst of {BURST} notifications ended term {term} {lost:.2f} s after it was sent "
        f"(demotions {demotions})"
    )


# ------------------------------------------------------------- a forged `acquired` event


@pytest.mark.parametrize("holder", ["bogus-pid", "sender-pid"])
def test_a_forged_acquired_cannot_delay_a_crash_failover(
    pg_dsn: str, attacker: Attacker, holder: str
) -> None:
    # The attacker names a holder that does not exist, for a term far ahead that never
    # expires: the follower took its keeper pid for the holder's, so the ring's `down`
    # for the real leader's keeper was ignored. Before the fix the failover waited for
    # the lease to expire: 9.4 to 9.5 s (ttl 10 s), both ways. "sender-pid" names the
    # attacker's own session as holder, so that the sender of the event is its holder.
    pair = Pair(pg_dsn, attacker)
    with pair.fleet:
        first = pair.start()
        name = pair.fleet.name
        pid = pair.leader_pid + 12345 if holder == "bogus-pid" else attacker.conn.info.backend_pid
        channel = public_lease_channel(attacker.qualified, name)
        attacker.conn.execute("SELECT pg_notify(%s, %s)", (channel, forged_acquired(name, pid)))
        time.sleep(0.5)  # both nodes read it (delivered within milliseconds)
        check_failover(
            pair,
            first,
            f"a forged acquired (node 'ghost', term {FORGED_TERM}, holder_pid {pid}, "
            f"leader's keeper {pair.leader_pid}, sender {attacker.conn.info.backend_pid})",
        )


def test_a_sharded_follower_does_not_adopt_a_forged_holder(
    pg_dsn: str, attacker: Attacker, made: list[Any]
) -> None:
    # Before the fix: 5 ms after the forged event node a sent leader_changed naming
    # 'ghost' (term 10**15) for the shard node b leads, and kept believing it (a newer
    # term than any real one): its takeover plan counted the shard as the ghost's.
    shards = 4
    nodes = {
        node_id: rs.PostgresShardedLeader(
            make_conninfo(pg_dsn, application_name=f"sharded-{node_id}"),
            idle_handler(),
            name="pollers",
            shards=shards,
            node_id=node_id,
            **TIMINGS,
        )
        for node_id in ("a", "b")
    }
    made.extend(nodes.values())
    for leader in nodes.values():
        leader.start()
    a, b = nodes["a"], nodes["b"]
    assert a.wait_until_balanced(30), f"not balanced after 30 s: {a.assignment()}"
    wait_until(
        lambda: len(a.owned()) == 2 and len(b.owned()) == 2, 15, "two shards led by each node"
    )
    shard = min(b.owned())
    follower = a._leaders[shard]  # node a's leader of the shard b leads
    wait_until(lambda: follower.seen_holder() == "b", 10, f"node a to see b lead shard {shard}")
    heard: list[tuple[str, str, str | None, int | None]] = []

    def changed(sender: Any, **kw: Any) -> None:
        info = kw.get("leader")
        heard.append(
            (
                getattr(sender, "node_id", "?"),
                kw["name"],
                info.node_id if info else None,
                info.term if info else None,
            )
        )

    name = f"pollers/{shard}"
    channel = public_lease_channel(attacker.qualified, name)
    pid = attacker.conn.info.backend_pid
    with receiving(rs.signals.leader_changed, changed):
        attacker.conn.execute("SELECT pg_notify(%s, %s)", (channel, forged_acquired(name, pid)))
        took = measure(lambda: any(who == "ghost" for _, _, who, _ in heard), 2.0)
    believed = follower.seen_holder()
    print(f"\nforged holder of {name}: leader_changed for 'ghost' after {took} s; {heard}")
    assert took is None, (
        f"node a announced the forged holder of {name} {took:.3f} s after the forged "
        f"`acquired` (sender pid {pid}): {heard}"
    )
    assert believed == "b", f"node a believes {believed!r} leads {name} (b does)"
    assert a.assignment()[shard].node_id == "b"


# --------------------------------------------------------------------- a flood of wake-ups


def counting_proxy(pg_dsn: str) -> CountingProxy:
    params = conninfo_to_dict(pg_dsn)
    return CountingProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))


def keeper_statements(proxy: CountingProxy, since: Snapshot) -> int:
    return proxy.snapshot().minus(since).statements(KEEPER)


@pytest.mark.parametrize("event", ["released", "resign"])
def test_a_flood_of_notifications_wakes_keepers_at_a_bounded_rate(
    pg_dsn: str, attacker: Attacker, event: str
) -> None:
    # Plausible events of the real holder and term, a hundred a second for 5 s. Before
    # the fix each woke a keeper into a round trip: `released` the follower (an
    # attempt each), `resign` the holder (a renewal each): 422 to 499 statements of
    # the follower's keeper for 500 `released` (1 in the quiet 5 s before), 474 to 510
    # of the holder's for 500 `resign` (11 in the quiet 5 s).
    listener = attacker.session()
    listener.execute(f'LISTEN "{public_lease_channel(attacker.qualified, "jobs")}"')
    with counting_proxy(pg_dsn) as for_a, counting_proxy(pg_dsn) as for_b:
        a = node(for_a.dsn(pg_dsn), "node-a")
        b = node(for_b.dsn(pg_dsn), "node-b")
        try:
            a.start()
            wait_until(lambda: a.is_leader, 15, "node-a to lead")
            announced = next(listener.notifies(timeout=10, stop_after=1))
            term = int(json.loads(announced.payload)["term"])  # overheard
            b.start()
            wait_until(
                lambda: (info := b.leader()) is not None and info.node_id == "node-a",
                15,
                "node-b to follow node-a",
            )
            time.sleep(1.0)  # node-b's start-up round trips are over

            quiet = {"a": for_a.snapshot(), "b": for_b.snapshot()}
            time.sleep(FLOOD_SECONDS)
            baseline = {
                "a": keeper_statements(for_a, quiet["a"]),
                "b": keeper_statements(for_b, quiet["b"]),
            }

            payload = {
                "released": {"event": "released", "name": "jobs", "node_id": "node-a"},
                "resign": {"event": "resign", "name": "jobs"},
            }[event] | {"term": term, "to": None}
            channel = public_lease_channel(attacker.qualified, "jobs")
            before = {"a": for_a.snapshot(), "b": for_b.snapshot()}
            flood = Flood(attacker, [(channel, json.dumps(payload))], FLOOD_RATE, FLOOD_SECONDS)
            sent = flood.start().join()
            flooded = {
                "a": keeper_statements(for_a, before["a"]),
                "b": keeper_statements(for_b, before["b"]),
            }
            led = (a.is_leader, a.term, b.is_leader)
        finally:
            b.stop(15)
            a.stop(15)
    allowed = {k: baseline[k] + FLOOD_SECONDS * WAKE_RATE + WAKE_BURST for k in baseline}
    print(
        f"\n{sent} `{event}` NOTIFYs in {FLOOD_SECONDS:g} s: keeper statements of the "
        f"holder {flooded['a']} (quiet {baseline['a']}), of the follower {flooded['b']} "
        f"(quiet {baseline['b']}); allowed {allowed}"
    )
    assert led == (True, term, False), f"leadership changed under the flood: {led}"
    for who, role in (("a", "holder"), ("b", "follower")):
        assert flooded[who] <= allowed[who], (
            f"the {role}'s keeper sent {flooded[who]} statements during {sent} `{event}` "
            f"notifications in {FLOOD_SECONDS:g} s (quiet: {baseline[who]} in as long; "
            f"allowed {allowed[who]:g}): one wake-up per notification"
        )
