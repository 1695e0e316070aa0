"""The keeper session that every lease of a process shares: what sharing must not break.

Several leaders in one process (one connection string and lease table) share one keeper
session. A lease held through it must stay held against every other leader of the
process, also one with the same node id; a stall of one kind of statement on it (a
heartbeat waiting for a locked row) must not hold up the renewals of every lease.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import rselection as rs
from rselection import signals
from rselection.postgres import PostgresLeader, PostgresLease, fenced
from rselection.postgres import keeper as keeper_module
from rselection.postgres.keeper import batches as keeper_batches
from rselection.postgres.keeper import session as keeper_session
from rselection.postgres.schema import create_tables
from tests.support.scale_fleet import ScaleFleet
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]

TIMINGS: dict[str, Any] = {
    "ttl": 8.0,
    "renew_interval": 0.5,
    "renew_deadline": 4.0,
    "retry_interval": 0.5,
}


class Events:
    """``elected`` and ``demoted`` of this test's leases, with the time each came."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[float, str, str, int, str | None]] = []

    def elected(self, sender: Any, **kw: Any) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), "elected", kw["name"], kw["term"], None))

    def demoted(self, sender: Any, **kw: Any) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), "demoted", kw["name"], kw["term"], kw["reason"]))

    def of(self, kind: str) -> list[tuple[float, str, str, int, str | None]]:
        with self.lock:
            return [e for e in self.seen if e[1] == kind]


@pytest.fixture
def events() -> Iterator[Events]:
    recorded = Events()
    signals.elected.connect(recorded.elected)
    signals.demoted.connect(recorded.demoted)
    yield recorded
    signals.elected.disconnect(recorded.elected)
    signals.demoted.disconnect(recorded.demoted)


@pytest.fixture
def made(pg_dsn: str) -> Iterator[list[PostgresLeader]]:
    """Leaders of this test, stopped after it (before its schema is dropped)."""
    leaders: list[PostgresLeader] = []
    yield leaders
    for leader in leaders:
        leader.stop(15)


def idle_handler() -> rs.TaskHandler:
    handler = rs.TaskHandler()

    @handler.persistent("idle")
    def idle(ctx: rs.TaskContext) -> None:
        ctx.cancelled.wait()

    return handler


def test_a_leader_restarted_with_the_same_node_id_waits_for_the_old_terms_tasks(
    pg_dsn: str, made: list[PostgresLeader], events: Events
) -> None:
    # A service restarts its leader in the process (node id from its configuration); the
    # old leader's stop(timeout) returns while its task still winds down.
    running = threading.Event()
    finished: list[float] = []
    old_handler = rs.TaskHandler(stop_grace=3.0)

    @old_handler.persistent("slow")
    def slow(ctx: rs.TaskContext) -> None:
        running.set()
        ctx.cancelled.wait()
        time.sleep(1.5)  # careless clean-up after the cancel
        finished.append(time.monotonic())

    old = PostgresLeader(pg_dsn, old_handler, name="svc", node_id="svc-1", claimer=None, **TIMINGS)
    made.append(old)
    old.start()
    wait_until(running.is_set, 15, "the old leader's task to run")
    old.stop(0.3)  # returns before the task is joined
    new = PostgresLeader(
        pg_dsn, idle_handler(), name="svc", node_id="svc-1", claimer=None, **TIMINGS
    )
    made.append(new)
    new.start()
    wait_until(lambda: new.is_leader, 20, "the new leader to lead")
    assert finished, "the new leader leads while the old term's task still runs"

    def second() -> list[float]:  # `elected` follows is_leader
        return [at for at, _, name, term, _ in events.of("elected") if term == 2]

    wait_until(lambda: bool(second()), 10, "the second term's election")
    assert second()[0] >= finished[0], (second(), finished, events.seen)


def test_two_leaders_of_one_lease_and_node_id_in_one_process_never_lead_at_once(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    a = PostgresLeader(pg_dsn, idle_handler(), name="x", node_id="same", claimer=None, **TIMINGS)
    b = PostgresLeader(pg_dsn, idle_handler(), name="x", node_id="same", claimer=None, **TIMINGS)
    made.extend([a, b])
    a.start()
    wait_until(lambda: a.is_leader, 15, "a to lead")
    b.start()
    both = 0
    deadline = time.monotonic() + 3.0  # six renewals of a, six attempts of b
    while time.monotonic() < deadline:
        both += a.is_leader and b.is_leader
        time.sleep(0.01)
    assert both == 0, f"both led at once in {both} samples"
    assert a.is_leader and a.term == 1 and not b.is_leader
    a.stop(10)
    wait_until(lambda: b.is_leader, 10, "b to lead once a released")
    assert b.term == 2


def test_a_locked_nodes_row_does_not_stop_the_renewals(
    pg_dsn: str, made: list[PostgresLeader], events: Events
) -> None:
    leaders = [
        PostgresLeader(
            pg_dsn,
            idle_handler(),
            name=f"l{i}",
            node_id=f"n{i}",
            claimer=None,
            heartbeat_interval=0.5,
            **TIMINGS,
        )
        for i in range(3)
    ]
    made.extend(leaders)
    for leader in leaders:
        leader.start()
    wait_until(lambda: all(x.is_leader for x in leaders), 20, "every lease to be led")
    wait_until(lambda: bool(leaders[0].nodes()), 10, "the first heartbeat")
    with psycopg.connect(pg_dsn) as locker:
        # An operator's row lock (VACUUM FULL or a migration would lock the whole table).
        locker.execute("SELECT 1 FROM rselection_nodes WHERE node_id = 'n0' FOR UPDATE")
        # Longer than any term lasts unrenewed: every lease must be led all along.
        until = time.monotonic() + TIMINGS["renew_deadline"] + 2.0
        while time.monotonic() < until:
            assert all(x.is_leader for x in leaders), [x.is_leader for x in leaders]
            time.sleep(0.05)
        locker.rollback()
    assert not events.of("demoted"), events.of("demoted")
    assert [x.term for x in leaders] == [1, 1, 1]
    before = next(n.last_seen for n in leaders[0].nodes() if n.node_id == "n0")
    wait_until(
        lambda: next(n.last_seen for n in leaders[0].nodes() if n.node_id == "n0") > before,
        10,
        "heartbeats to go on once the row is free",
    )


def four_leaders(pg_dsn: str, made: list[PostgresLeader]) -> list[PostgresLeader]:
    leaders = [
        PostgresLeader(pg_dsn, idle_handler(), name=f"l{i}", node_id="n", claimer=None, **TIMINGS)
        for i in range(4)
    ]
    made.extend(leaders)
    for leader in leaders:
        leader.start()
    wait_until(lambda: all(x.is_leader for x in leaders), 20, "every lease to be led")
    return leaders


def led_all_along(leaders: list[PostgresLeader], seconds: float) -> list[list[bool]]:
    """Sample who leads for ``seconds``; the samples in which a lease was not led."""
    gaps = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        sample = [x.is_leader for x in leaders]
        if not all(sample):
            gaps.append(sample)
        time.sleep(0.05)
    return gaps


@pytest.mark.parametrize("fault", ["trigger", "check"])
def test_a_row_the_server_refuses_to_update_costs_only_its_own_lease(
    pg_dsn: str, made: list[PostgresLeader], fault: str
) -> None:
    leaders = four_leaders(pg_dsn, made)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        if fault == "trigger":
            admin.execute(
                "CREATE FUNCTION refuse_l0() RETURNS trigger LANGUAGE plpgsql AS"
                " $$ BEGIN RAISE EXCEPTION 'no renewals of l0'; END $$"
            )
            admin.execute(
                "CREATE TRIGGER refuse_l0 BEFORE UPDATE ON rselection_leases FOR EACH ROW"
                " WHEN (OLD.name = 'l0') EXECUTE FUNCTION refuse_l0()"
            )
        else:  # a constraint every renewal of l0 violates (NOT VALID: rows stay as they are)
            admin.execute(
                "ALTER TABLE rselection_leases ADD CONSTRAINT only_short"
                " CHECK (name <> 'l0' OR expires_at < acquired_at) NOT VALID"
            )
        # Longer than a term lasts unrenewed: l0 is lost, the others are led all along.
        gaps = led_all_along(leaders[1:], TIMINGS["renew_deadline"] + 2.0)
        assert not gaps, f"the other leases were not led all along: {gaps[:3]}"
        assert not leaders[0].is_leader
        assert [x.term for x in leaders[1:]] == [1, 1, 1]
        if fault == "trigger":
            admin.execute("DROP TRIGGER refuse_l0 ON rselection_leases")
        else:
            admin.execute("ALTER TABLE rselection_leases DROP CONSTRAINT only_short")
    wait_until(lambda: leaders[0].is_leader, 15, "l0 to be led again once the fault is gone")


def test_a_refused_acquisition_backs_off_instead_of_retrying_ten_times_a_second(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    # A user's trigger refuses every write of one lease's row. Before the fix the
    # backoff restarted after each successful reconnect: about 10 attempts a second,
    # forever, each one a warning-level round trip.
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        create_tables(admin, leases="rselection_leases", timeout=10)
        # A sequence is not rolled back with the refused statement: it counts attempts.
        admin.execute("CREATE SEQUENCE refused_writes")
        admin.execute(
            "CREATE FUNCTION refuse_lx() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM nextval('refused_writes'); RAISE EXCEPTION 'no lx'; END $$"
        )
        admin.execute(
            "CREATE TRIGGER refuse_lx BEFORE INSERT OR UPDATE ON rselection_leases"
            " FOR EACH ROW WHEN (NEW.name = 'lx') EXECUTE FUNCTION refuse_lx()"
        )
        leader = PostgresLeader(
            pg_dsn, idle_handler(), name="lx", node_id="n", claimer=None, **TIMINGS
        )
        made.append(leader)
        leader.start()
        wait_until(
            lambda: admin.execute("SELECT last_value FROM refused_writes").fetchone() != (1,),
            10,
            "the first refused acquisitions",
        )
        start = int(admin.execute("SELECT nextval('refused_writes')").fetchone()[0])
        time.sleep(4.0)  # the span over which attempts are counted
        end = int(admin.execute("SELECT nextval('refused_writes')").fetchone()[0])
        assert not leader.is_leader
        # Backoff doubling from 0.1 s (jitter 0.5 to 1) makes about 6 attempts in 4 s;
        # without it there were about 40.
        attempts = end - start - 1
        assert attempts <= 15, f"{attempts} refused acquisitions in 4 s"
        admin.execute("DROP TRIGGER refuse_lx ON rselection_leases")
        # Led once the fault is gone (backoff is capped at 5 s).
        wait_until(lambda: leader.is_leader, 20, "lx to be led once writes are allowed")


def test_a_locked_lease_row_costs_only_its_own_lease(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    leaders = four_leaders(pg_dsn, made)
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM rselection_leases WHERE name = 'l0' FOR UPDATE")
        gaps = led_all_along(leaders[1:], TIMINGS["renew_deadline"] + 2.0)
        assert not gaps, f"the other leases were not led all along: {gaps[:3]}"
        assert [x.term for x in leaders[1:]] == [1, 1, 1]
        locker.rollback()
    wait_until(lambda: leaders[0].is_leader, 15, "l0 to be led again once its row is free")


def test_a_release_refused_on_a_locked_row_costs_only_its_own_lease(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    # A stop() whose release waits for a locked row past the lock bound: that release
    # fails alone. It failed the shared session, and every other lease lost its term.
    leaders = four_leaders(pg_dsn, made)
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM rselection_leases WHERE name = 'l0' FOR UPDATE")
        stopping = threading.Thread(target=leaders[0].stop, args=(15,))
        stopping.start()
        gaps = led_all_along(leaders[1:], 3.0)
        stopping.join(15)
        assert not stopping.is_alive()
        assert not gaps, f"the other leases were not led all along: {gaps[:3]}"
        assert [x.term for x in leaders[1:]] == [1, 1, 1]
        locker.rollback()


def test_a_release_waiting_for_a_locked_row_holds_up_no_renewal_and_no_other_release(
    pg_dsn: str, made: list[PostgresLeader], events: Events
) -> None:
    # Before, the release of a locked row waited for it on the shared session, for up
    # to a second: every renewal of the process, and every other release, queued behind.
    leaders = [
        PostgresLeader(pg_dsn, idle_handler(), name=f"l{i}", node_id="a", claimer=None, **TIMINGS)
        for i in range(6)
    ]
    made.extend(leaders)
    for leader in leaders:
        leader.start()
    wait_until(lambda: all(x.is_leader for x in leaders), 20, "every lease to be led by a")
    followers = [
        PostgresLeader(pg_dsn, idle_handler(), name=f"l{i}", node_id="b", claimer=None, **TIMINGS)
        for i in range(3)
    ]
    made.extend(followers)
    for follower in followers:
        follower.start()
    renewals: list[tuple[float, str, float]] = []

    def renewed(sender: Any, **kw: Any) -> None:
        renewals.append((time.monotonic(), kw["name"], kw["latency"]))

    signals.lease_renewed.connect(renewed)
    try:
        with psycopg.connect(pg_dsn) as locker:
            locker.execute("SELECT 1 FROM rselection_leases WHERE name = 'l0' FOR UPDATE")
            stopping = [threading.Thread(target=leaders[0].stop, args=(15,))]
            stopping[0].start()
            time.sleep(0.1)  # l0's release is under way (its row locked) before the others
            asked = time.monotonic()
            for leader in leaders[1:3]:
                stopping.append(threading.Thread(target=leader.stop, args=(15,)))
                stopping[-1].start()
            wait_until(
                lambda: followers[1].is_leader and followers[2].is_leader,
                10,
                "l1 and l2 to be handed over",
            )
            handed_over = time.monotonic() - asked
            watched_from = time.monotonic()
            time.sleep(0.8)  # l0's release keeps trying meanwhile (for up to 1 s)
            for thread in stopping:
                thread.join(15)
            assert not any(t.is_alive() for t in stopping)
            locker.rollback()
    finally:
        signals.lease_renewed.disconnect(renewed)
    # A graceful handover takes tens of milliseconds here; behind a release waiting for
    # its row it took over a second.
    assert handed_over < 0.7, f"l1 and l2 were handed over {handed_over:.2f} s after stop()"
    assert not followers[0].is_leader  # l0 was never released: it passes on by expiry
    slow = [(n, round(lat, 3)) for t, n, lat in renewals if t >= watched_from and lat > 0.5]
    assert not slow, f"renewals waited behind a release: {slow}"
    assert {n for t, n, _ in renewals if t >= watched_from} >= {"l3", "l4", "l5"}
    assert [x.term for x in leaders[3:]] == [1, 1, 1]


def locked_and_free(
    pg_dsn: str, made: list[PostgresLeader]
) -> tuple[list[str], list[PostgresLeader], list[PostgresLeader]]:
    """Node a leads 10 leases to be locked and 12 free ones; node b follows the free ones.
    Returns the locked names, a's leaders and b's."""
    locked = [f"locked{i}" for i in range(10)]
    free = [f"free{i}" for i in range(12)]

    def leader(name: str, node: str) -> PostgresLeader:
        made.append(
            PostgresLeader(pg_dsn, idle_handler(), name=name, node_id=node, claimer=None, **TIMINGS)
        )
        made[-1].start()
        return made[-1]

    leaders = [leader(name, "a") for name in locked + free]
    wait_until(lambda: all(x.is_leader for x in leaders), 20, "every lease to be led by a")
    return locked, leaders, [leader(name, "b") for name in free]


def test_releases_of_many_locked_rows_hold_up_no_other_release(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    # Before, each release of a locked row kept a worker of the driver for up to a
    # second: with 8 of them (the driver's workers), the other leases' releases waited
    # for a second (measured 1.1 s); now the keeper retries them without a worker.
    locked, leaders, followers = locked_and_free(pg_dsn, made)
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM rselection_leases WHERE name = ANY(%s) FOR UPDATE", (locked,))
        asked = time.monotonic()
        stopping = [threading.Thread(target=x.stop, args=(15,)) for x in leaders]
        for thread in stopping:
            thread.start()
        wait_until(lambda: all(x.is_leader for x in followers), 10, "the free leases to move")
        handed_over = time.monotonic() - asked
        for thread in stopping:
            thread.join(15)
        assert not any(t.is_alive() for t in stopping)
        locker.rollback()
    # About 0.1 s here; a second or more when locked releases held the workers.
    assert handed_over < 0.7, f"the free leases were handed over {handed_over:.2f} s after stop()"


def test_step_downs_of_many_locked_rows_hold_up_no_other_step_down(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    # Before, a step-down (a handover, a sharded leader's move) released on one of the
    # driver's 8 workers and held it while the row stayed locked, for up to a second:
    # the other leases' step-downs waited (measured 1.0 s); now they release as a stop
    # does, with no worker waiting.
    locked, leaders, followers = locked_and_free(pg_dsn, made)
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM rselection_leases WHERE name = ANY(%s) FOR UPDATE", (locked,))
        asked = time.monotonic()
        for x in leaders:
            x.step_down(hold=30, wait=False)
        wait_until(lambda: all(x.is_leader for x in followers), 10, "the free leases to move")
        handed_over = time.monotonic() - asked
        locker.rollback()
    # About 0.1 s here; a second when locked releases held the workers.
    assert handed_over < 0.7, (
        f"the free leases were handed over {handed_over:.2f} s after step_down()"
    )


def test_leases_that_joined_the_keeper_together_listen_in_one_round_trip(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, each lease listened in a round trip of its own, under the session's lock:
    # a sharded node of 1,024 shards sent its first attempts 1.5 to 3.8 s after start.
    listens: list[list[str]] = []
    real = keeper_session.listen_sql

    def counted(channels: Any) -> Any:
        listens.append(list(channels))
        return real(channels)

    monkeypatch.setattr(keeper_session, "listen_sql", counted)
    leases = [
        PostgresLease(pg_dsn, name=f"joined{i}", ttl=10.0, renew_deadline=5.0) for i in range(40)
    ]
    try:
        for lease in leases:
            lease.join_keeper()
        threads = [threading.Thread(target=lease.connect) for lease in leases]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        channels = {lease.channel for lease in leases}
        assert None not in channels and len(channels) == 40
        of_leases = [batch for batch in listens if set(batch) & channels]
        assert len(of_leases) == 1 and set(of_leases[0]) == channels, listens
        # Each is listening: another session's notification (of a kind rselection
        # sends: others are dropped) wakes it.
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_notify(%s, %s)",
                (leases[-1].channel, '{"event": "released", "node_id": "x", "term": 1}'),
            )
        started = time.monotonic()
        leases[-1].wait_for_change(10)
        assert time.monotonic() - started < 5
    finally:
        for lease in leases:
            lease.close()


def test_leaders_started_one_after_another_listen_in_a_few_round_trips(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a plain leader joined the keeper only inside its own connect, on the
    # driver's workers: 200 leaders started in a loop listened in 194 round trips (and
    # all led after 0.25 s); joined at start, whichever connects first listens for all
    # (2 round trips, all led after 0.08 to 0.14 s).
    listens: list[list[str]] = []
    real = keeper_session.listen_sql

    def counted(channels: Any) -> Any:
        listens.append(list(channels))
        return real(channels)

    monkeypatch.setattr(keeper_session, "listen_sql", counted)
    leaders = [
        PostgresLeader(pg_dsn, rs.TaskHandler(), name=f"one-by-one{i}", claimer=None)
        for i in range(60)
    ]
    try:
        for leader in leaders:
            leader.start()
        wait_until(lambda: all(leader.is_leader for leader in leaders), 30, "every lease led")
        channels: set[str | None] = set()
        for leader in leaders:
            assert isinstance(leader.lease, PostgresLease)
            channels.add(leader.lease.channel)
        of_leaders = [batch for batch in listens if set(batch) & channels]
        assert len(of_leaders) <= 10, f"{len(of_leaders)} round trips listened for 60 leases"
    finally:
        for leader in leaders:
            leader.stop(timeout=20)


def test_a_start_that_fails_before_the_engine_runs_leaves_the_keeper(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a leader whose start() failed after its lease joined the keeper session
    # (and before the engine ran) stayed a client of it for the life of the process: the
    # session stayed open and listened on the dead lease's channel.
    from rselection import driven

    leader = PostgresLeader(pg_dsn, rs.TaskHandler(), name="failed-start", claimer=None)

    def cannot_start(self: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(driven.DrivenKeeper, "start", cannot_start)
    with pytest.raises(RuntimeError, match="can't start"):
        leader.start()
    clients = [
        lease
        for keeper in keeper_module.SharedKeeper._registry.values()
        for lease in keeper._clients
    ]
    assert leader.lease not in clients


def listening(lease: PostgresLease) -> list[str]:
    """The channels the keeper session of ``lease`` (which holds no term) listens on,
    read on that very session."""
    keeper = lease.keeper
    assert keeper is not None
    rows = keeper.read(
        sql.SQL("SELECT c FROM pg_listening_channels() AS c ORDER BY c"), "read the channels"
    )
    assert rows is not None, "the keeper session is not free for a read"
    return [row[0] for row in rows]


def test_the_keeper_stops_listening_for_closed_leases(pg_dsn: str) -> None:
    stays = PostgresLease(pg_dsn, name="stays", ttl=10.0, renew_deadline=5.0)
    try:
        stays.connect()
        ring = [c for c in listening(stays) if c != stays.channel]
        assert len(ring) == 1, ring  # the ring channel
        for i in range(300):
            lease = PostgresLease(pg_dsn, name=f"gone{i}", ttl=10.0, renew_deadline=5.0)
            lease.connect()
            if i == 0:
                assert lease.channel in listening(stays)
            lease.close()
        seen: list[list[str]] = []

        def only_the_open_lease() -> bool:
            seen.append(listening(stays))
            return seen[-1] == sorted([*ring, str(stays.channel)])

        until = time.monotonic() + 5.0
        while not only_the_open_lease() and time.monotonic() < until:
            time.sleep(0.05)
        left = seen[-1] == sorted([*ring, str(stays.channel)])
        assert left, (
            f"after 300 leases opened and closed the keeper session listens on "
            f"{len(seen[-1])} channels: {seen[-1][:3]}..."
        )
    finally:
        stays.close()


@pytest.mark.parametrize("when", ["at once", "after the keeper stopped listening"])
def test_a_lease_opened_again_after_it_was_closed_is_woken(pg_dsn: str, when: str) -> None:
    stays = PostgresLease(pg_dsn, name="stays", ttl=10.0, renew_deadline=5.0)
    other = PostgresLease(
        make_conninfo(pg_dsn, application_name="other"), name="x", ttl=10.0, renew_deadline=5.0
    )
    again = PostgresLease(pg_dsn, name="x", ttl=10.0, renew_deadline=5.0)
    try:
        stays.connect()
        first = PostgresLease(pg_dsn, name="x", ttl=10.0, renew_deadline=5.0)
        first.connect()
        channel = first.channel
        first.close()
        if when != "at once":
            wait_until(lambda: channel not in listening(stays), 5, "the channel to be left")
        again.connect()
        assert channel in listening(stays)
        started = time.monotonic()
        held = other.try_acquire("holder")
        assert held.acquired and held.holder is not None
        again.wait_for_change(10)  # the acquisition's notification wakes it
        assert time.monotonic() - started < 5
    finally:
        for lease in (again, other, stays):
            lease.close()


def test_a_dead_keeper_wakes_only_the_followers_of_its_own_leases(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    # Before, a keeper's death woke every follower of every lease of the process, and
    # each attempted: in a sharded fleet of 8 nodes and 1,024 shards, thousands of
    # attempts for leases whose holders were alive, while the dead node's were taken
    # over. The followers now know each holder's keeper session.
    # Followers attempt by themselves only every 20 s or more: every attempt counted is
    # one a notification caused.
    timings = {"ttl": 30.0, "renew_interval": 1.0, "renew_deadline": 5.0, "retry_interval": 20.0}
    args = ["--ttl", "30", "--renew-interval", "1", "--renew-deadline", "5"]
    with (
        ScaleFleet(pg_dsn, "alive", 10, args) as first,
        ScaleFleet(pg_dsn, "dying", 10, args) as second,
    ):
        first.add("p1").ready(30)
        dying = second.add("p2")
        dying.ready(30)
        first.wait_all_led(30)
        second.wait_all_led(30)
        followers = {}
        for name in [f"alive/{i}" for i in range(10)] + [f"dying/{i}" for i in range(10)]:
            leader = PostgresLeader(
                pg_dsn, idle_handler(), name=name, node_id="me", claimer=None, **timings
            )
            made.append(leader)
            leader.start()
            followers[name] = leader
        wait_until(
            lambda: all(f._state.last_seen is not None for f in followers.values()),
            20,
            "every follower to have seen its holder",
        )
        attempts: Counter[str] = Counter()
        for leader in followers.values():
            lease = leader.lease
            assert isinstance(lease, PostgresLease)

            def counted(node_id: str, done: Any, lease: PostgresLease = lease) -> Any:
                attempts[lease.name] += 1
                return PostgresLease.acquire_soon(lease, node_id, done)

            lease.acquire_soon = counted  # type: ignore[method-assign]
        dying.kill()
        wait_until(
            lambda: all(followers[f"dying/{i}"].is_leader for i in range(10)),
            10,
            "the dead node's leases to be taken over",
        )
        time.sleep(0.5)  # any attempt the death caused has been sent by now
        caused = dict(attempts)  # before the other node stops (its releases wake us)
    assert not [n for n in caused if n.startswith("alive/")], caused
    assert all(caused.get(f"dying/{i}", 0) >= 1 for i in range(10))


def test_a_keeper_session_killed_while_a_locked_release_retries_is_a_lost_session(
    pg_dsn: str, made: list[PostgresLeader], caplog: pytest.LogCaptureFixture
) -> None:
    # Before, the retry after the kill failed an assertion: stop() logged an unexpected
    # error (AssertionError) where the session was simply gone.
    leaders = four_leaders(pg_dsn, made)
    lease = leaders[0]._backend
    assert isinstance(lease, PostgresLease)
    keeper_pid = lease.backend_pid
    assert keeper_pid is not None
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM rselection_leases WHERE name = 'l0' FOR UPDATE")
        stopping = [threading.Thread(target=x.stop, args=(15,)) for x in leaders[:3]]
        with caplog.at_level(logging.WARNING, logger="rselection"):
            for thread in stopping:
                thread.start()
            time.sleep(0.3)  # l0's release is being retried
            with psycopg.connect(pg_dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (keeper_pid,))
            for thread in stopping:
                thread.join(15)
        assert not any(t.is_alive() for t in stopping)
        locker.rollback()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any("could not release on stop" in r.getMessage() for r in caplog.records)


def test_a_deleted_lease_row_stops_its_leaders_with_a_clear_error(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    # Terms would start again from 1 with a new row: a leader that saw the row refuses to
    # go on (before the fix it attempted about 15 times a second, forever).
    leaders = four_leaders(pg_dsn, made)
    follower = PostgresLeader(
        pg_dsn, idle_handler(), name="l0", node_id="x", claimer=None, **TIMINGS
    )
    made.append(follower)
    saw: list[Any] = []

    def changed(sender: Any, **kw: Any) -> None:
        if sender is follower:
            saw.append(kw["leader"])

    signals.leader_changed.connect(changed)
    raised: list[BaseException] = []

    def lead() -> None:
        try:
            follower.lead()
        except rs.ConfigError as exc:
            raised.append(exc)

    thread = threading.Thread(target=lead, daemon=True)
    try:
        thread.start()
        wait_until(lambda: bool(saw), 10, "the follower's first attempt")
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute("DELETE FROM rselection_leases WHERE name = 'l0'")
        thread.join(TIMINGS["ttl"] + 15)
    finally:
        signals.leader_changed.disconnect(changed)
    assert not thread.is_alive(), "the follower still competes for a deleted lease row"
    assert raised and "was deleted" in str(raised[0]), raised
    assert all(x.is_leader for x in leaders[1:])


def test_a_fenced_transaction_open_at_a_crash_delays_the_takeover_only_until_it_ends(
    pg_dsn: str, made: list[PostgresLeader]
) -> None:
    # The holder's process is killed while a transaction fenced to its term is open: the
    # takeover waits for that transaction (fencing), then happens at once, not at expiry.
    ttl = 20.0
    timings = ["--ttl", str(ttl), "--renew-interval", "1", "--renew-deadline", "10"]
    env = {**os.environ, "SCALE_NODE_DSN": pg_dsn, "PYTHONPATH": str(ROOT)}
    node = [str(ROOT / "tests/support/scale_node.py"), "--prefix", "f", "--count", "1"]
    holder = subprocess.Popen(
        [sys.executable, *node, "--node", "a", "--idle-task", "none", *timings],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None
        for line in holder.stdout:  # bounded by the pytest timeout
            if json.loads(line)["event"] == "elected":
                break
        follower = PostgresLeader(
            pg_dsn,
            idle_handler(),
            name="f/0",
            node_id="b",
            claimer=None,
            ttl=ttl,
            renew_interval=1,
            renew_deadline=10,
            retry_interval=2,
        )
        made.append(follower)
        follower.start()
        wait_until(lambda: follower.leader() is not None, 10, "the follower to see a")
        with psycopg.connect(pg_dsn) as fence:
            fenced(fence, "f/0", 1)  # a task's transaction of term 1, still open
            holder.kill()
            holder.wait(10)
            time.sleep(1.0)  # the transaction stays open for a second after the crash
            assert not follower.is_leader, "took over while a fenced transaction was open"
            fence.commit()
            ended = time.monotonic()
        took = wait_until(lambda: follower.is_leader, ttl, "the follower to take over")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
    # At once once the transaction ended (retry_interval is 2 s; expiry ~19 s away).
    assert time.monotonic() - ended < 3.0, f"took over {took:.1f}s after the fence ended"
    assert follower.term == 2


def test_a_step_down_during_a_renewal_still_hands_over(
    pg_dsn: str, made: list[PostgresLeader], events: Events
) -> None:
    # step_down() interrupts the renewal waiting on the shared session (here: behind a
    # table lock): that is no outage; the term ends as asked and the lease is released.
    a = PostgresLeader(pg_dsn, idle_handler(), name="s", node_id="a", claimer=None, **TIMINGS)
    made.append(a)
    a.start()
    wait_until(lambda: a.is_leader, 15, "a to lead")
    b = PostgresLeader(pg_dsn, idle_handler(), name="s", node_id="b", claimer=None, **TIMINGS)
    made.append(b)
    b.start()
    pid = a.lease.backend_pid  # type: ignore[attr-defined]
    with psycopg.connect(pg_dsn) as blocker, psycopg.connect(pg_dsn, autocommit=True) as admin:
        blocker.execute("LOCK TABLE rselection_leases IN ACCESS EXCLUSIVE MODE")

        def renewal_waits() -> bool:
            row = admin.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            return row == ("Lock",)

        wait_until(renewal_waits, 5, "a's renewal to wait for the table lock")
        a.step_down(hold=30, wait=False)
        time.sleep(0.2)  # the interrupted renewal is handled while the lock is held
        blocker.rollback()
    wait_until(lambda: b.is_leader, 10, "b to take over the released lease")
    reasons = [e[4] for e in events.of("demoted") if e[2] == "s" and e[3] == 1]
    assert reasons == ["step_down"], reasons
    assert b.term == 2


def test_a_failed_acquisition_never_frees_the_lock_of_a_lease_whose_key_collides(
    pg_dsn: str, made: list[PostgresLeader], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lock keys are 32 random bits drawn for each term: two may be equal, and then the
    # next term of one lease is the lock of another's running term. Freeing what a failed
    # acquisition may have left must keep the locks of this session's running terms.
    a_name, b_name = "x0", "x1"
    a = PostgresLeader(pg_dsn, idle_handler(), name=a_name, node_id="n", claimer=None, **TIMINGS)
    made.append(a)
    a.start()
    wait_until(lambda: a.is_leader, 15, "a to lead")
    assert a.term == 1
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        found = admin.execute(
            "SELECT lock_key FROM rselection_leases WHERE name = %s", (a_name,)
        ).fetchone()
        assert found is not None
        key = found[0]
        monkeypatch.setattr(keeper_batches, "new_lock_key", lambda: key)  # b draws a's key
        # b's row, at term 0, and a fault on its acquisition only (a user's trigger)
        admin.execute(
            "INSERT INTO rselection_leases (name, lock_key) VALUES (%s, %s)", (b_name, key)
        )
        # (a sequence counts its attempts: nextval() is not undone by the rollback)
        admin.execute("CREATE SEQUENCE b_attempts")
        admin.execute(
            "CREATE FUNCTION refuse_b() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            f" IF NEW.name = '{b_name}' AND NEW.holder IS NOT NULL THEN"
            " PERFORM nextval('b_attempts'); RAISE EXCEPTION 'refused'; END IF;"
            " RETURN NEW; END $$"
        )
        admin.execute(
            "CREATE TRIGGER refuse_b BEFORE UPDATE ON rselection_leases FOR EACH ROW"
            " EXECUTE FUNCTION refuse_b()"
        )
        b = PostgresLeader(
            pg_dsn, idle_handler(), name=b_name, node_id="n", claimer=None, **TIMINGS
        )
        made.append(b)
        b.start()

        def attempts() -> int:
            row = admin.execute(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM b_attempts"
            ).fetchone()
            return int(row[0]) if row else 0

        def a_holds_its_lock() -> bool:
            row = admin.execute(
                "SELECT count(*) FROM pg_locks l JOIN rselection_leases t ON t.name = %s"
                " WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted"
                " AND l.classid::bigint = (t.lock_key::bigint & 4294967295)"
                " AND l.objid::bigint = t.term AND l.pid = t.holder_pid",
                (a_name,),
            ).fetchone()
            return row == (1,)

        # Each failed attempt of b frees the next-term locks it may have left.
        until = time.monotonic() + 30
        while attempts() < 3 and time.monotonic() < until:
            assert a_holds_its_lock(), "the lock of a's running term was freed"
            time.sleep(0.02)
        assert attempts() >= 3, "b did not attempt"
        assert a_holds_its_lock(), "the lock of a's running term was freed"
        assert a.is_leader and a.term == 1 and not b.is_leader


def test_a_short_lock_on_a_lease_row_costs_no_term(
    pg_dsn: str, made: list[PostgresLeader], events: Events
) -> None:
    # An operator's lock on the row (or `rselection forget` looking at it) shorter than
    # the time left before the deadline: the renewal is tried again until it goes through.
    leaders = four_leaders(pg_dsn, made)
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM rselection_leases WHERE name = 'l0' FOR UPDATE")
        gaps = led_all_along(leaders, TIMINGS["renew_deadline"] / 2)
        locker.rollback()
    assert not gaps, f"a lease was not led all along: {gaps[:3]}"
    assert not events.of("demoted"), events.of("demoted")
    assert [x.term for x in leaders] == [1, 1, 1, 1]


def test_an_attempt_sent_while_the_session_is_down_does_not_wait_for_its_opening(
    pg_dsn: str,
) -> None:
    """The keeper's thread sends queued attempts under the statement lock; an attempt of
    a lease whose session went away in between must not wait there for the session's
    opening, whose thread needs that lock to adopt it (the keeper's thread, and every
    lease of the process with it, hung until a lease was interrupted)."""
    lease = PostgresLease(
        pg_dsn, name=f"down-{os.getpid()}-{time.monotonic_ns()}", ttl=3.0, renew_deadline=2.0
    )
    closer = threading.Thread(target=lease.close, daemon=True)
    try:
        lease.connect()
        keeper = lease._shared()
        keeper._drop()  # the session is gone, as when the server ended it
        queued = keeper_module.Queued(lease, "n")
        keeper._enqueue(keeper._attempts, queued)
        assert queued.done.wait(10), "the keeper's thread hung waiting for the opening"
        assert isinstance(queued.error, rs.BackendUnavailable)
        # The opening it began completes; the next attempt takes the lease.
        wait_until(lambda: lease.try_acquire("n").acquired, 10, "the lease, once reopened")
    finally:
        closer.start()
        closer.join(10)
    assert not closer.is_alive(), "closing the lease hung on the keeper's lock"
