"""Postgres leadership history at the edges: a release that a locked lease row holds up
still records why its term ended (not as a lost session when the next node takes the
lease), so does a term a leader of the same process takes over between its end and its
release, and a lease row deleted and made again starts a history of its own. An ended
term's lock waits for its release (no other process takes the lease over meanwhile), at
most ``RELEASE_WAIT``, and is freed at once when no release is coming."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.postgres import PostgresAdmin, PostgresLeader, PostgresLease
from rselection.postgres.keeper import session as keeper_session
from rselection.postgres.keeper.session import RELEASE_WAIT
from tests.support.waiting import wait_until

FAST: dict[str, Any] = {"ttl": 4.0, "renew_interval": 0.5, "renew_deadline": 2.0}
FAST["retry_interval"] = 0.5


def leader(dsn: str, name: str, node: str) -> PostgresLeader:
    return PostgresLeader(dsn, rs.TaskHandler(), name=name, node_id=node, claimer=None, **FAST)


def reasons(dsn: str, name: str) -> list[tuple[int, str, str | None]]:
    with PostgresAdmin(dsn) as admin:
        return [(r.term, r.node_id, r.end_reason) for r in admin.history(name)]


def test_a_release_held_up_by_a_locked_row_records_its_reason(pg_dsn: str) -> None:
    name = f"locked-{uuid.uuid4().hex[:6]}"
    a = leader(pg_dsn, name, "a")
    a.start()
    assert a.wait_until_leader(10)
    term = a.term
    with psycopg.connect(pg_dsn) as locker:
        # An operator's transaction holds the row past the release's bound: the release
        # gives up, the keeper frees the term's lock, the row still names `a`.
        locker.execute("SELECT 1 FROM rselection_leases WHERE name = %s FOR UPDATE", (name,))
        a.stop(timeout=15)
        b = leader(pg_dsn, name, "b")
        b.start()
        time.sleep(0.5)
    try:
        wait_until(lambda: b.is_leader, 10, "b to take over once the row is free")
        assert reasons(pg_dsn, name) == [(b.term, "b", None), (term, "a", "released")]
    finally:
        b.stop(timeout=10)


@contextlib.contextmanager
def two_leases(dsn: str, name: str) -> Iterator[tuple[PostgresLease, PostgresLease]]:
    """Leases ``a`` and ``b`` of ``name`` in this process (one keeper session), connected."""
    a = PostgresLease(dsn, name=name, ttl=10.0, renew_deadline=5.0)
    b = PostgresLease(dsn, name=name, ttl=10.0, renew_deadline=5.0)
    try:
        a.connect()
        b.connect()
        yield a, b
    finally:
        a.close()
        b.close()


def take_once_unlocked(lease: PostgresLease, node: str) -> rs.Acquisition:
    """Attempt until ``lease`` is taken: an ended term's lock that no release freed is
    freed after ``RELEASE_WAIT``."""
    taken: list[rs.Acquisition] = []
    wait_until(
        lambda: taken.append(lease.try_acquire(node)) or taken[-1].acquired,
        RELEASE_WAIT + 10,
        "the ended term's lock to be freed",
        interval=0.05,
    )
    return taken[-1]


@pytest.mark.parametrize(
    ("said", "reserved", "recorded"),
    [
        ("stepped_down", False, ("stepped_down", None, None)),
        ("handed_over", True, ("handed_over", "a", "operator")),
        ("deadline", False, ("deadline", None, None)),
    ],
)
def test_a_term_taken_over_in_its_own_process_before_its_release_keeps_its_reason(
    pg_dsn: str, said: str, reserved: bool, recorded: tuple[str, str | None, str | None]
) -> None:
    """Two leases of one name in one process share the keeper session. Once b's term
    ended (its tasks joined), its lock waits for b's release, at most ``RELEASE_WAIT``;
    an attempt of a that then takes the lease over before b's release closed b's record
    as ``session_lost``, though b said why it ended."""
    name = f"own-{uuid.uuid4().hex[:6]}"
    with two_leases(pg_dsn, name) as (a, b):
        held = b.try_acquire("b")
        assert held.acquired and held.holder is not None
        term = held.holder.term
        if reserved:
            with PostgresAdmin(pg_dsn) as admin:
                admin.request_handover(name, to="a")
        b.term_ending(term, said, "operator" if reserved else None)
        b.term_ended(term)
        assert not a.try_acquire("a").acquired  # b's lock waits for b's release
        taken = take_once_unlocked(a, "a")
        assert taken.holder is not None and taken.holder.term == term + 1
        b.release("b", term)  # the row is a's: it changes nothing
        with PostgresAdmin(pg_dsn) as admin:
            records = {r.term: r for r in admin.history(name)}
        assert (records[term].end_reason, records[term].handed_to, records[term].by) == recorded
        assert records[term + 1].node_id == "a" and records[term + 1].end_reason is None


def test_a_term_beyond_32_bits_taken_over_in_its_own_process_keeps_its_reason(
    pg_dsn: str,
) -> None:
    """Terms are 64-bit: a remembered term past 2**31 must not make the acquisition
    statement fail (every attempt of that lease from the process would)."""
    name = f"big-{uuid.uuid4().hex[:6]}"
    with two_leases(pg_dsn, name) as (a, b):
        first = b.try_acquire("b")
        assert first.acquired and first.holder is not None
        b.release("b", first.holder.term)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "UPDATE rselection_leases SET term = %s WHERE name = %s", (2**31 + 5, name)
            )
        held = b.try_acquire("b")
        assert held.acquired and held.holder is not None and held.holder.term == 2**31 + 6
        b.term_ending(held.holder.term, "stepped_down", None)
        b.term_ended(held.holder.term)
        taken = take_once_unlocked(a, "a")
        assert taken.holder is not None and taken.holder.term == 2**31 + 7
        assert reasons(pg_dsn, name)[:2] == [
            (2**31 + 7, "a", None),
            (2**31 + 6, "b", "stepped_down"),
        ]


def test_a_reason_kept_for_an_older_life_of_the_row_labels_no_other_node(pg_dsn: str) -> None:
    """A lease row deleted and made again counts terms from 1 again: the reason this
    process kept for its own term 1 must not close another node's term 1, which this
    process takes over once that node's session died (``session_lost``)."""
    name = f"life-{uuid.uuid4().hex[:6]}"
    other_process = pg_dsn + "&application_name=other-process"  # a keeper session of its own
    b = PostgresLease(pg_dsn, name=name, ttl=30.0, renew_deadline=5.0)
    c = PostgresLease(pg_dsn, name=name, ttl=30.0, renew_deadline=5.0)
    q = PostgresLease(other_process, name=name, ttl=30.0, renew_deadline=5.0)
    try:
        b.connect()
        held = b.try_acquire("b")
        assert held.acquired and held.holder is not None and held.holder.term == 1
        b.term_ending(1, "stepped_down", None)
        b.term_ended(1)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM rselection_leases WHERE name = %s", (name,))
            q.connect()
            taken_by_q = q.try_acquire("q")
            assert taken_by_q.acquired and taken_by_q.holder is not None
            assert taken_by_q.holder.term == 1
            pid = conn.execute(
                "SELECT holder_pid FROM rselection_leases WHERE name = %s", (name,)
            ).fetchone()
            assert pid is not None
            conn.execute("SELECT pg_terminate_backend(%s)", pid)
        c.connect()
        wait_until(lambda: c.try_acquire("c").acquired, 10, "c to take over from q's dead session")
        assert reasons(pg_dsn, name)[:2] == [(2, "c", None), (1, "q", "session_lost")]
    finally:
        for lease in (b, c, q):
            lease.close()


def test_a_lease_row_made_again_starts_its_history_anew(pg_dsn: str) -> None:
    name = f"again-{uuid.uuid4().hex[:6]}"
    a = leader(pg_dsn, name, "a")
    a.start()
    try:
        assert a.wait_until_leader(10)
        for _ in range(2):
            before = a.term
            a.step_down(hold=0.0)
            wait_until(lambda b=before: a.is_leader and a.term != b, 10, "a new term")
    finally:
        a.stop(timeout=10)
    assert [term for term, _, _ in reasons(pg_dsn, name)] == [3, 2, 1]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM rselection_leases WHERE name = %s", (name,))
    again = leader(pg_dsn, name, "a")
    again.start()
    try:
        assert again.wait_until_leader(10)
        assert again.term == 1
        # Terms 2 and 3 were of the row deleted: the new term 1 is the newest record.
        assert reasons(pg_dsn, name) == [(1, "a", None)]
    finally:
        again.stop(timeout=10)


def test_a_term_ended_keeps_its_lock_for_its_release_across_other_round_trips(
    pg_dsn: str,
) -> None:
    """A term that ended (its tasks joined) keeps its advisory lock until its release,
    though other round trips of its process's keeper session run between the two: a
    follower of another process that took the lease over in between recorded a graceful
    stop as ``session_lost``."""
    name = f"kept-{uuid.uuid4().hex[:6]}"
    other_process = pg_dsn + "&application_name=other-process"  # a keeper session of its own
    a = PostgresLease(pg_dsn, name=name, ttl=30.0, renew_deadline=5.0)
    beside = PostgresLease(pg_dsn, name=f"{name}-beside", ttl=30.0, renew_deadline=5.0)
    b = PostgresLease(other_process, name=name, ttl=30.0, renew_deadline=5.0)
    try:
        for lease in (a, beside, b):
            lease.connect()
        held = a.try_acquire("a")
        assert held.acquired and held.holder is not None
        term = held.holder.term
        a.term_ending(term, "stepped_down", None)
        a.term_ended(term)
        beside.try_acquire("a")  # a round trip of a's session before a's release
        assert not b.try_acquire("b").acquired  # a's session is alive, its term not given back
        a.release("a", term)
        taken = b.try_acquire("b")
        assert taken.acquired and taken.holder is not None and taken.holder.term == term + 1
        assert reasons(pg_dsn, name)[:2] == [(term + 1, "b", None), (term, "a", "stepped_down")]
    finally:
        for lease in (a, beside, b):
            lease.close()


def test_an_ended_term_never_released_frees_its_lock_after_the_release_wait(
    pg_dsn: str,
) -> None:
    """A leader that ends a term and gives it no release (its lease lost, a fatal error)
    keeps the term's lock no longer than ``RELEASE_WAIT``, though its keeper session has
    nothing else to send: a follower of another process then takes the lease over."""
    name = f"unreleased-{uuid.uuid4().hex[:6]}"
    other_process = pg_dsn + "&application_name=other-process"
    a = PostgresLease(pg_dsn, name=name, ttl=30.0, renew_deadline=5.0)
    b = PostgresLease(other_process, name=name, ttl=30.0, renew_deadline=5.0)
    try:
        a.connect()
        b.connect()
        held = a.try_acquire("a")
        assert held.acquired and held.holder is not None
        ended = time.monotonic()
        a.term_ended(held.holder.term)
        taken = take_once_unlocked(b, "b")
        assert time.monotonic() - ended >= RELEASE_WAIT
        assert taken.holder is not None and taken.holder.term == held.holder.term + 1
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def refusing_releases(dsn: str, table: str) -> Iterator[None]:
    """A trigger on ``table`` that refuses every release (clearing a held row's holder)."""
    function = f"{table}_refuse"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " IF NEW.holder IS NULL AND OLD.holder IS NOT NULL THEN"
            " RAISE EXCEPTION 'releases are refused'; END IF; RETURN NEW; END $$"
        )
        conn.execute(
            f"CREATE TRIGGER refuse BEFORE UPDATE ON {table} FOR EACH ROW"
            f" EXECUTE FUNCTION {function}()"
        )
    try:
        yield
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP TRIGGER refuse ON {table}")
            conn.execute(f"DROP FUNCTION {function}()")


def test_an_ended_term_whose_release_is_refused_frees_its_lock_at_once(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No release is coming once the server refused it: the term's lock is freed then,
    not after ``RELEASE_WAIT`` (made longer than the test here), though no other round
    trip of the session comes to carry it."""
    monkeypatch.setattr(keeper_session, "RELEASE_WAIT", 60.0)
    table = f"refused_{uuid.uuid4().hex[:6]}"
    a = PostgresLease(pg_dsn, name="lease", table=table, ttl=60.0, renew_deadline=5.0)
    b = PostgresLease(
        pg_dsn + "&application_name=other-process",
        name="lease",
        table=table,
        ttl=60.0,
        renew_deadline=5.0,
    )
    try:
        a.connect()
        b.connect()
        held = a.try_acquire("a")
        assert held.acquired and held.holder is not None
        with refusing_releases(pg_dsn, table):
            a.term_ended(held.holder.term)
            with pytest.raises(rs.BackendUnavailable, match="refused"):
                a.release("a", held.holder.term)
        taken = take_once_unlocked(b, "b")
        assert taken.holder is not None and taken.holder.term == held.holder.term + 1
    finally:
        a.close()
        b.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_history")


def test_an_ended_term_frees_its_lock_when_its_lease_closes(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease object closed after its term ended, without a release, frees the term's
    lock then, though another object of the process keeps the session open and idle."""
    monkeypatch.setattr(keeper_session, "RELEASE_WAIT", 60.0)
    name = f"closed-{uuid.uuid4().hex[:6]}"
    a = PostgresLease(pg_dsn, name=name, ttl=60.0, renew_deadline=5.0)
    idle = PostgresLease(pg_dsn, name=name, ttl=60.0, renew_deadline=5.0)
    b = PostgresLease(pg_dsn + "&application_name=other-process", name=name, ttl=60.0)
    try:
        for lease in (a, idle, b):
            lease.connect()
        held = a.try_acquire("a")
        assert held.acquired and held.holder is not None
        a.term_ended(held.holder.term)
        a.close()
        taken = take_once_unlocked(b, "b")
        assert taken.holder is not None and taken.holder.term == held.holder.term + 1
    finally:
        for lease in (a, idle, b):
            lease.close()


def test_the_keeper_does_not_spin_on_a_broken_session_with_an_ended_term(
    pg_dsn: str,
) -> None:
    """A session that broke while a term ended unreleased and another term still runs
    stays open (broken) until that term ends: its keeper's thread must idle meanwhile,
    not look again and again for a round trip it cannot send."""
    tag = uuid.uuid4().hex[:6]
    a = PostgresLease(pg_dsn, name=f"spin-a-{tag}", ttl=30.0, renew_deadline=5.0)
    b = PostgresLease(pg_dsn, name=f"spin-b-{tag}", ttl=30.0, renew_deadline=5.0)
    try:
        a.connect()
        b.connect()
        held_a, held_b = a.try_acquire("a"), b.try_acquire("b")
        assert held_a.holder is not None and held_b.holder is not None
        a.term_ended(held_a.holder.term)  # no release follows
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (a.backend_pid,))
        time.sleep(RELEASE_WAIT)  # the ended term's lock is overdue from here on
        before = time.process_time()
        time.sleep(2.0)
        used = time.process_time() - before
        assert used < 0.5, f"the process used {used:.2f} s of CPU in 2 s while idle"
        b.term_ended(held_b.holder.term)
    finally:
        a.close()
        b.close()
