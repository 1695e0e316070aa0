"""PostgresLease against a real Postgres: terms, takeover, fast failover, waits, fencing.

Every test runs in a schema of its own (the ``pg_dsn`` fixture) and every wait is
bounded: threads are joined through futures with a timeout, never by sleeping and hoping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

import psutil
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from rselection.abc import LeaseBackend
from rselection.errors import BackendUnavailable, ConfigError, StaleLeaderError
from rselection.lease import Acquisition
from rselection.postgres import PostgresLease, afenced, fenced, migrate
from rselection.postgres.lease import TAKEABLE_RETRY
from rselection.postgres.schema import LEASES_VERSION, NODES
from tests.support.waiting import wait_until

T = TypeVar("T")

LEASES = "rselection_leases"


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def lease_dsn(pg_dsn: str) -> str:
    """DSN of this test's own schema."""
    return pg_dsn


@pytest.fixture
def make_lease(lease_dsn: str) -> Iterator[Callable[..., PostgresLease]]:
    """Factory of connected leases on this test's schema, all closed after the test.

    Each lease stands for a node of its own process: it gets a connection string of its
    own, so it has a keeper session of its own (leases of one process with the same
    connection string share one; ``shared=True`` makes such a lease).
    """
    made: list[PostgresLease] = []

    def make(*, shared: bool = False, **kw: Any) -> PostgresLease:
        options: dict[str, Any] = {"ttl": 30.0, "renew_deadline": 20.0, **kw}
        dsn = lease_dsn if shared else make_conninfo(lease_dsn, application_name=f"n{len(made)}")
        lease = PostgresLease(dsn, **options)
        made.append(lease)
        lease.connect()
        return lease

    yield make
    for lease in made:
        lease.close()


@pytest.fixture
def admin(pg_server_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection outside the test's schema, for pg_terminate_backend."""
    with psycopg.connect(pg_server_dsn, autocommit=True, connect_timeout=10) as conn:
        yield conn


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for calls that block; every result is awaited with a timeout."""
    executor = ThreadPoolExecutor(max_workers=8)
    yield executor
    executor.shutdown(wait=True, cancel_futures=True)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def terminate(admin: psycopg.Connection[Any], pid: int | None) -> None:
    """End a backend and wait (up to 5 s) until it is gone: without a timeout,
    pg_terminate_backend returns once signalled, while the backend still holds its locks."""
    assert pid is not None
    row = admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone()
    assert row == (True,)


def lease_row(dsn: str, name: str = "default") -> tuple[Any, ...] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            sql.SQL("SELECT holder, term, holder_pid FROM {} WHERE name = %s").format(
                sql.Identifier(LEASES)
            ),
            (name,),
        ).fetchone()


def expire_now(dsn: str, name: str = "default") -> None:
    """Make the lease expire on the server without touching the holder's session."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {} SET expires_at = now() WHERE name = %s").format(
                sql.Identifier(LEASES)
            ),
            (name,),
        )


def acquired(acq: Acquisition) -> int:
    assert acq.acquired, acq
    assert acq.holder is not None
    return acq.holder.term


def holder_server(dsn: str, name: str = "default") -> str | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT holder_server FROM {} WHERE name = %s").format(sql.Identifier(LEASES)),
            (name,),
        ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def take_over_at_expiry(lease: PostgresLease, node: str) -> tuple[Acquisition, float, float]:
    """Compete until ``lease`` acquires: (the acquisition, the seconds the first attempt
    said the lease had left, the seconds it took)."""
    first = lease.try_acquire(node)
    assert not first.acquired, "taken at once, not at expiry"
    start = time.monotonic()
    attempt = first
    while not attempt.acquired:
        assert time.monotonic() - start < first.expires_in + 5.0, "no takeover at expiry"
        lease.wait_for_change(max(0.05, attempt.expires_in))
        attempt = lease.try_acquire(node)
    return attempt, first.expires_in, time.monotonic() - start


# ------------------------------------------------------------------------ the contract


def test_is_a_lease_backend(make_lease: Callable[..., PostgresLease]) -> None:
    assert isinstance(make_lease(), LeaseBackend)


def test_acquire_then_another_node_sees_the_holder(
    make_lease: Callable[..., PostgresLease],
) -> None:
    a, b = make_lease(), make_lease()
    first = a.try_acquire("A")
    assert acquired(first) == 1
    assert first.holder is not None and first.holder.node_id == "A"
    assert first.expires_in == pytest.approx(30.0, abs=0.5)
    assert first.holder.acquired_at.tzinfo is not None

    second = b.try_acquire("B")
    assert not second.acquired
    assert second.holder is not None
    assert (second.holder.node_id, second.holder.term) == ("A", 1)
    assert 25.0 < second.expires_in <= 30.0
    info = b.current()
    assert info is not None and (info.node_id, info.term) == ("A", 1)


def test_renew_extends_only_the_holders_term(make_lease: Callable[..., PostgresLease]) -> None:
    a, b = make_lease(), make_lease()
    term = acquired(a.try_acquire("A"))
    before = a.current()
    assert before is not None
    assert a.renew("A", term)
    after = a.current()
    assert after is not None and after.expires_at > before.expires_at
    assert not a.renew("A", term + 1)  # wrong term
    assert not b.renew("A", term)  # right name and term, wrong session
    assert not b.renew("B", term)


def test_terms_grow_on_every_change_of_holder_and_survive_release(
    make_lease: Callable[..., PostgresLease],
) -> None:
    a, b = make_lease(), make_lease()
    assert acquired(a.try_acquire("A")) == 1
    a.release("A", 1)
    assert a.current() is None
    assert lease_row(a._conninfo)[:2] == (None, 1)  # type: ignore[index]
    assert acquired(a.try_acquire("A")) == 2  # re-acquire by the same node: new term
    a.release("A", 2)
    assert acquired(b.try_acquire("B")) == 3
    b.release("B", 3)
    assert acquired(a.try_acquire("A")) == 4


def test_release_lets_a_waiting_follower_take_over_at_once(
    make_lease: Callable[..., PostgresLease], pool: ThreadPoolExecutor
) -> None:
    a, b = make_lease(), make_lease()
    term = acquired(a.try_acquire("A"))
    assert not b.try_acquire("B").acquired
    waiting = pool.submit(timed, lambda: b.wait_for_change(10))
    time.sleep(0.2)  # let B block on A's lock (the result below is bounded anyway)
    released = time.monotonic()
    a.release("A", term)
    waiting.result(timeout=5)
    woke = time.monotonic() - released
    assert woke < 0.5, f"follower woke {woke:.3f}s after the release"
    assert acquired(b.try_acquire("B")) == term + 1
    assert not a.renew("A", term)


def test_notify_wakes_a_follower_that_knows_no_holder(
    make_lease: Callable[..., PostgresLease], pool: ThreadPoolExecutor
) -> None:
    a, c = make_lease(), make_lease()
    waiting = pool.submit(timed, lambda: c.wait_for_change(10))
    time.sleep(0.2)
    acquired(a.try_acquire("A"))
    _, took = waiting.result(timeout=5)
    assert took < 1.0


def test_a_session_that_holds_the_lease_takes_a_fresh_term(
    make_lease: Callable[..., PostgresLease],
) -> None:
    a = make_lease()
    assert acquired(a.try_acquire("A")) == 1
    # The keeper only asks again after it stopped leading: it gets a new term.
    assert acquired(a.try_acquire("A")) == 2
    assert not a.renew("A", 1)
    assert a.renew("A", 2)


def test_a_reconnected_keeper_cannot_renew(make_lease: Callable[..., PostgresLease]) -> None:
    a = make_lease()
    term = acquired(a.try_acquire("A"))
    a.close()
    a.connect()  # new session: the old one's lock is gone, so is the lease
    assert not a.renew("A", term)


# ------------------------------------------------------------------------- takeovers


def test_expired_lease_is_taken_over_and_the_old_holder_cannot_renew(
    make_lease: Callable[..., PostgresLease],
) -> None:
    a = make_lease(ttl=1.0, renew_deadline=0.5)
    b = make_lease(ttl=1.0, renew_deadline=0.5)
    start = time.monotonic()
    term = acquired(a.try_acquire("A"))
    # A stops renewing; its session stays alive and keeps its lock.
    deadline = start + 10
    while True:
        attempt = b.try_acquire("B")
        if attempt.acquired:
            break
        assert time.monotonic() < deadline, "no takeover after 10 s with ttl 1 s"
        b.wait_for_change(max(0.01, attempt.expires_in))
    took = time.monotonic() - start
    assert acquired(attempt) == term + 1
    assert 0.9 <= took < 3.0, f"takeover after {took:.2f}s with ttl 1 s"
    assert a.backend_pid is not None and lease_row(a._conninfo)[2] == b.backend_pid  # type: ignore[index]
    assert not a.renew("A", term)


@pytest.mark.parametrize("how", ["terminate", "close"])
def test_dead_session_is_taken_over_long_before_the_ttl(
    make_lease: Callable[..., PostgresLease],
    admin: psycopg.Connection[Any],
    pool: ThreadPoolExecutor,
    how: str,
) -> None:
    a, b = make_lease(), make_lease()  # ttl 30 s
    term = acquired(a.try_acquire("A"))
    attempt = b.try_acquire("B")
    assert not attempt.acquired and attempt.expires_in > 25
    waiting = pool.submit(timed, lambda: b.wait_for_change(10))
    time.sleep(0.2)
    start = time.monotonic()
    if how == "terminate":
        terminate(admin, a.backend_pid)
    else:
        a.close()
    waiting.result(timeout=15)
    woke = time.monotonic() - start
    assert acquired(b.try_acquire("B")) == term + 1
    took = time.monotonic() - start
    assert woke < 1.0, f"follower woke {woke:.3f}s after the holder's session ended"
    assert took < 2.0, f"takeover {took:.3f}s after the holder's session ended (ttl 30 s)"


def test_each_acquisition_records_the_server_of_the_holders_session(
    make_lease: Callable[..., PostgresLease], lease_dsn: str
) -> None:
    a = make_lease()
    acquired(a.try_acquire("A"))
    recorded = holder_server(lease_dsn)
    assert recorded is not None
    with psycopg.connect(lease_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT system_identifier FROM pg_control_system()),"
            " (SELECT timeline_id FROM pg_control_checkpoint()), pg_postmaster_start_time()"
        ).fetchone()
    assert row is not None
    system, timeline, started = recorded.split("/", 2)
    assert (int(system), int(timeline)) == row[:2]
    assert datetime.fromisoformat(started) == row[2]
    assert a.renew("A", 1) and holder_server(lease_dsn) == recorded


@pytest.mark.parametrize("recorded", ["another server", "unknown"])
def test_a_holder_recorded_on_another_server_is_replaced_only_at_expiry(
    make_lease: Callable[..., PostgresLease], lease_dsn: str, recorded: str
) -> None:
    """What a follower finds after a restart or a failover to a promoted standby: a
    holder whose session was on another server, so its pid and lock mean nothing here.
    A row acquired before the upgrade to schema version 3 (no server) counts alike."""
    a = make_lease(ttl=3.0, renew_deadline=2.0)
    b = make_lease(ttl=3.0, renew_deadline=2.0)
    term = acquired(a.try_acquire("A"))
    other = "1/1/2000-01-01T00:00:00+00:00" if recorded == "another server" else None
    with psycopg.connect(lease_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {} SET holder_server = %s WHERE name = 'default'").format(
                sql.Identifier(LEASES)
            ),
            (other,),
        )
    assert not a.renew("A", term), "a session on another server cannot be the holder"
    a.close()  # no session, no lock here: still not a dead session to take over
    attempt, left, took = take_over_at_expiry(b, "B")
    assert acquired(attempt) == term + 1
    assert left > 1.5 and took >= left - 0.1, f"taken after {took:.2f}s, {left:.2f}s early"


#: migrate() arguments that leave out every table but the lease table.
NOTHING_ELSE: dict[str, Any] = {
    "claims_table": None,
    "elections_table": None,
    "nodes_table": None,
    "broadcast_table": None,
    "checkpoint_prefix": None,
}


def test_a_table_older_than_protocol_2_is_refused_until_migrated(lease_dsn: str) -> None:
    """A table without the protocol column (schema version 4, nodes of the previous
    protocol may use it) is refused with a clear error; the upgrade keeps the rows and
    the terms go on from there."""
    with psycopg.connect(lease_dsn, autocommit=True) as conn:
        migrate(conn, table="rselection_leases", **NOTHING_ELSE)
        conn.execute(
            "INSERT INTO rselection_leases (name, lock_key, term) VALUES ('default', 1, 7)"
        )
        conn.execute("ALTER TABLE rselection_leases DROP COLUMN protocol")
        conn.execute("UPDATE rselection_schema_version SET version = 4 WHERE component = 'leases'")
    lease = PostgresLease(lease_dsn, ttl=3.0, renew_deadline=2.0, create_tables=False)
    try:
        with pytest.raises(ConfigError, match=r"schema version 5.*protocol 2.*rselection migrate"):
            lease.connect()
        with psycopg.connect(lease_dsn, autocommit=True) as conn:
            (change,) = migrate(conn, table="rselection_leases", **NOTHING_ELSE)
        assert (change.action, change.previous, change.version) == ("upgraded", 4, LEASES_VERSION)
        lease.connect()
        assert acquired(lease.try_acquire("A")) == 8
    finally:
        lease.close()


KEEPER = textwrap.dedent(
    """
    import sys, time
    from rselection.postgres import PostgresLease
    lease = PostgresLease(sys.argv[1], ttl=30, renew_deadline=20)
    lease.connect()
    acq = lease.try_acquire("doomed")
    print(acq.acquired, acq.holder.term if acq.holder else 0, flush=True)
    time.sleep(120)
    """
)


def test_kill_9_of_the_holder_process_is_taken_over_at_once(
    make_lease: Callable[..., PostgresLease], lease_dsn: str, pool: ThreadPoolExecutor
) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", KEEPER, lease_dsn], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = pool.submit(proc.stdout.readline).result(timeout=30)
        assert line.split() == ["True", "1"], line
        b = make_lease()
        assert not b.try_acquire("B").acquired
        waiting = pool.submit(lambda: b.wait_for_change(10))
        time.sleep(0.2)
        start = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        waiting.result(timeout=15)
        assert acquired(b.try_acquire("B")) == 2
        took = time.monotonic() - start
        assert took < 2.0, f"takeover {took:.3f}s after kill -9 (ttl 30 s)"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_leader_wait_raises_at_once_when_its_session_is_terminated(
    make_lease: Callable[..., PostgresLease],
    admin: psycopg.Connection[Any],
    pool: ThreadPoolExecutor,
) -> None:
    a = make_lease()
    term = acquired(a.try_acquire("A"))
    waiting = pool.submit(lambda: a.wait_for_change(10))
    time.sleep(0.2)
    start = time.monotonic()
    terminate(admin, a.backend_pid)
    with pytest.raises(BackendUnavailable, match="lost"):
        waiting.result(timeout=5)
    took = time.monotonic() - start
    assert took < 1.0, f"leader noticed its dead session after {took:.3f}s"
    # While the term is not declared ended the lease never reconnects on its own (a
    # leader must first join the term's tasks) ...
    with pytest.raises(BackendUnavailable):
        a.renew("A", term)
    # ... then the next call reconnects; the new session cannot keep the old term.
    a.term_ended(term)
    assert not a.renew("A", term)


def test_leader_wait_ignores_its_own_and_survives_others_notifications(
    make_lease: Callable[..., PostgresLease],
) -> None:
    a, c = make_lease(), make_lease()
    acquired(a.try_acquire("A"))
    _, took = timed(lambda: a.wait_for_change(0.3))  # its own NOTIFY does not wake it
    assert took >= 0.25
    with psycopg.connect(a._conninfo, autocommit=True) as other:
        assert a.channel is not None
        other.execute("SELECT pg_notify(%s, 'hello')", (a.channel,))
    a.wait_for_change(2)  # may wake early; must not raise
    assert a.renew("A", 1)
    assert c.current() is not None


# serial: under four workers this test once hung: after the restart the keeper's pump,
# holding the statement lock, waited for the session's opening, whose thread waited for
# that lock (a defect of the keeper, not of the test).
@pytest.mark.serial
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_after_a_server_restart_only_expiry_frees_the_lease(
    private_pg: Any, pool: ThreadPoolExecutor, mode: str
) -> None:
    """A restart ends every session, also a partitioned leader's that cannot notice it:
    the leader's own connection breaks at once, but followers wait for the expiry."""
    options: dict[str, Any] = {"ttl": 3.0, "renew_deadline": 2.0, "connect_timeout": 2.0}
    # Two connection strings: two processes, each with its keeper session.
    a = PostgresLease(make_conninfo(private_pg.dsn, application_name="a"), **options)
    b = PostgresLease(make_conninfo(private_pg.dsn, application_name="b"), **options)
    try:
        a.connect()
        b.connect()
        term = acquired(a.try_acquire("A"))
        assert not b.try_acquire("B").acquired
        leader_wait = pool.submit(lambda: a.wait_for_change(30))
        follower_wait = pool.submit(lambda: b.wait_for_change(30))
        time.sleep(0.2)
        stopped = time.monotonic()
        private_pg.stop(mode)
        with pytest.raises(BackendUnavailable):
            leader_wait.result(timeout=5)
        assert time.monotonic() - stopped < 2.0
        # A follower holds no term: its shared session is dropped at once and the wait
        # returns; its next attempt fails until the server is back.
        with contextlib.suppress(BackendUnavailable):
            follower_wait.result(timeout=5)
        assert time.monotonic() - stopped < 2.0
        with pytest.raises(BackendUnavailable):
            b.try_acquire("B")
        private_pg.start()
        restarted = time.monotonic()
        attempt = b.try_acquire("B")  # reconnects; A's session is gone, its lease is not
        assert not attempt.acquired and attempt.holder is not None
        assert attempt.holder.term == term
        while not attempt.acquired:
            assert time.monotonic() - restarted < 10, "no takeover after the expiry"
            b.wait_for_change(max(0.05, attempt.expires_in))
            attempt = b.try_acquire("B")
        assert acquired(attempt) == term + 1
        a.term_ended(term)  # as a leader does once the term's tasks are joined
        assert not a.renew("A", term)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("server", ["stock", "hardened"])
def test_a_plain_role_records_the_server_and_fails_over_at_once(
    private_pg: Any, server: str
) -> None:
    """Reading the server's identity needs no privileges on a stock server; where
    pg_control_system() is revoked the postmaster start time alone is recorded, and a
    dead holder is still replaced at once."""
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        conn.execute("CREATE ROLE app LOGIN")
        conn.execute("GRANT CREATE ON SCHEMA public TO app")
        if server == "hardened":
            conn.execute("REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC")
    dsn = private_pg.dsn.replace("postgres@", "app@", 1)
    options: dict[str, Any] = {"ttl": 30.0, "renew_deadline": 20.0}
    a, b = PostgresLease(dsn, **options), PostgresLease(dsn, **options)
    try:
        term = acquired(a.try_acquire("A"))
        recorded = holder_server(dsn)
        assert recorded is not None
        system, timeline, _ = recorded.split("/", 2)
        if server == "stock":
            assert system.isdigit() and timeline == "1", recorded
        else:
            assert (system, timeline) == ("-", "-"), recorded
        assert not b.try_acquire("B").acquired
        a.close()
        start = time.monotonic()
        assert acquired(b.try_acquire("B")) == term + 1
        assert time.monotonic() - start < 1.0
    finally:
        a.close()
        b.close()


def test_a_silent_link_bounds_every_call_and_only_expiry_frees_the_lease(
    lease_dsn: str,
    make_lease: Callable[..., PostgresLease],
    make_tcp_proxy: Callable[[str, int], Any],
    pool: ThreadPoolExecutor,
) -> None:
    from tests.support.pg import with_host_port

    params = psycopg.conninfo.conninfo_to_dict(lease_dsn)
    proxy = make_tcp_proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    options: dict[str, Any] = {"ttl": 3.0, "renew_deadline": 1.0, "connect_timeout": 2.0}
    a = PostgresLease(with_host_port(lease_dsn, proxy.host, proxy.port), **options)
    b = make_lease(**options)
    try:
        a.connect()
        term = acquired(a.try_acquire("A"))
        assert a.current() is not None
        proxy.blackhole()  # bytes accepted, never delivered: keepalives cannot tell
        start = time.monotonic()
        renewal = pool.submit(a.renew, "A", term)
        # While the term may still have running tasks, the lease never aborts its own
        # session (followers would take over at once): the renewal waits past its bound.
        with pytest.raises(concurrent.futures.TimeoutError):
            renewal.result(timeout=1.5)
        # Once the term is over, the overrun round trip is aborted at once.
        ended = time.monotonic()
        a.term_ended(term)
        with pytest.raises(BackendUnavailable, match="no answer"):
            renewal.result(timeout=5)
        took = time.monotonic() - ended
        assert took < 1.0, f"renew gave up {took:.2f}s after the term ended"
        # The server still sees A's session (the proxy holds it): only expiry frees it.
        attempt = b.try_acquire("B")
        assert not attempt.acquired and attempt.expires_in > 0.5
        while not attempt.acquired:
            b.wait_for_change(max(0.05, attempt.expires_in))
            attempt = b.try_acquire("B")
        assert acquired(attempt) == term + 1
        start = time.monotonic()
        with pytest.raises(BackendUnavailable):
            a.current()  # the observer connection is behind the same silent link
        assert time.monotonic() - start < 2 * 2.0 + 1.0
    finally:
        proxy.heal()
        a.close()


# ------------------------------------------------------------------------ interrupts


@pytest.mark.parametrize("role", ["leader", "follower", "no-holder"])
def test_interrupt_wakes_every_kind_of_wait(
    make_lease: Callable[..., PostgresLease], pool: ThreadPoolExecutor, role: str
) -> None:
    a, b = make_lease(), make_lease()
    if role == "leader":
        acquired(a.try_acquire("A"))
        waiter = a
    elif role == "follower":
        acquired(a.try_acquire("A"))
        assert not b.try_acquire("B").acquired
        waiter = b
    else:
        waiter = b
    waiter.wait_for_change(0.3)  # takes up a wake-up by a notification that came earlier
    waiting = pool.submit(timed, lambda: waiter.wait_for_change(20))
    time.sleep(0.3)
    assert not waiting.done()
    start = time.monotonic()
    waiter.interrupt()
    waiting.result(timeout=5)
    woke = time.monotonic() - start
    assert woke < 0.5, f"{role} wait woke {woke:.3f}s after interrupt()"
    # The keeper connection is still usable and holds no stray lock.
    if role == "follower":
        assert not b.try_acquire("B").acquired
        assert b.current() is not None
    if role == "leader":
        assert a.renew("A", 1)


def test_an_interrupt_before_the_wait_is_not_lost(
    make_lease: Callable[..., PostgresLease],
) -> None:
    a, b = make_lease(), make_lease()
    acquired(a.try_acquire("A"))
    assert not b.try_acquire("B").acquired
    for lease in (a, b):
        lease.interrupt()
        _, took = timed(functools.partial(lease.wait_for_change, 10))
        assert took < 0.2
        # ...and it is consumed: the next wait waits.
        _, took = timed(functools.partial(lease.wait_for_change, 0.2))
        assert took >= 0.15


def test_current_answers_while_the_keeper_is_blocked(
    make_lease: Callable[..., PostgresLease], pool: ThreadPoolExecutor
) -> None:
    a, b = make_lease(), make_lease()
    acquired(a.try_acquire("A"))
    assert not b.try_acquire("B").acquired
    waiting = pool.submit(lambda: b.wait_for_change(5))
    time.sleep(0.2)
    info, took = timed(b.current)
    assert info is not None and info.node_id == "A"
    assert took < 0.5
    b.interrupt()
    waiting.result(timeout=5)


# -------------------------------------------------------------------------- fencing


def _writes(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT term, what FROM writes ORDER BY at").fetchall()


@pytest.fixture
def writes(lease_dsn: str) -> str:
    with psycopg.connect(lease_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE writes (term bigint, what text, at timestamptz DEFAULT clock_timestamp())"
        )
    return lease_dsn


def test_fenced_write_with_the_current_term_commits(
    make_lease: Callable[..., PostgresLease], writes: str
) -> None:
    a = make_lease()
    term = acquired(a.try_acquire("A"))
    with psycopg.connect(writes) as conn, conn.transaction():
        fenced(conn, "default", term)
        conn.execute("INSERT INTO writes (term, what) VALUES (%s, 'ok')", (term,))
    assert _writes(writes) == [(term, "ok")]


def test_fenced_write_of_an_old_term_raises_and_writes_nothing(
    make_lease: Callable[..., PostgresLease], writes: str
) -> None:
    a = make_lease(ttl=1.0, renew_deadline=0.5)
    b = make_lease(ttl=1.0, renew_deadline=0.5)
    old = acquired(a.try_acquire("A"))
    expire_now(writes)
    new = acquired(b.try_acquire("B"))
    assert new == old + 1
    with (
        psycopg.connect(writes) as conn,
        pytest.raises(StaleLeaderError, match=f"term {old}"),
        conn.transaction(),
    ):
        fenced(conn, "default", old)
        conn.execute("INSERT INTO writes (term, what) VALUES (%s, 'stale')", (old,))
    assert _writes(writes) == []
    # A released lease refuses its last term too.
    b.release("B", new)
    with psycopg.connect(writes) as conn, pytest.raises(StaleLeaderError):
        fenced(conn, "default", new)


def test_no_takeover_while_a_fenced_transaction_of_the_old_term_is_open(
    make_lease: Callable[..., PostgresLease],
    admin: psycopg.Connection[Any],
    writes: str,
) -> None:
    """A takeover never waits on the shared keeper session (it would stall every other
    lease's renewal): it skips the row while a fenced transaction holds it, and takes it
    on the first attempt after that transaction ended."""
    a, b = make_lease(), make_lease()
    old = acquired(a.try_acquire("A"))
    with psycopg.connect(writes) as conn:
        fenced(conn, "default", old)  # transaction opened by the first statement
        assert a.renew("A", old)  # a renewal moves the row on; the share lock stays
        terminate(admin, a.backend_pid)  # the old leader's keeper dies: takeover is due
        for _ in range(3):
            attempt, took = timed(lambda: b.try_acquire("B"))
            assert not attempt.acquired and took < 1.0, "the takeover waited or took the row"
        conn.execute("INSERT INTO writes (term, what) VALUES (%s, 'last old write')", (old,))
        conn.commit()
    assert acquired(b.try_acquire("B")) == old + 1
    # The old term's write committed before the new term existed; after it, no stale
    # transaction can even start writing.
    with psycopg.connect(writes) as conn, pytest.raises(StaleLeaderError):
        fenced(conn, "default", old)
    assert _writes(writes) == [(old, "last old write")]


def test_acquirers_after_a_fenced_transaction_elect_exactly_one(
    make_lease: Callable[..., PostgresLease],
    admin: psycopg.Connection[Any],
    pool: ThreadPoolExecutor,
    writes: str,
) -> None:
    a = make_lease()
    contenders = [make_lease() for _ in range(3)]
    old = acquired(a.try_acquire("A"))
    with psycopg.connect(writes) as conn:
        fenced(conn, "default", old)
        terminate(admin, a.backend_pid)
        assert not any(lease.try_acquire(f"C{i}").acquired for i, lease in enumerate(contenders))
        conn.commit()
    attempts = [pool.submit(lease.try_acquire, f"C{i}") for i, lease in enumerate(contenders)]
    results = [f.result(timeout=5) for f in attempts]
    winners = [r for r in results if r.acquired]
    assert len(winners) == 1
    winner = winners[0].holder
    assert winner is not None and winner.term == old + 1
    for r in results:
        # A loser saw the winner, or (its attempt skipped the row the winner had locked,
        # the old holder's session gone) no live holder, to look again soon: never a
        # second term.
        assert (r.holder is None and r.expires_in == TAKEABLE_RETRY) or (
            r.holder is not None and r.holder.term == old + 1
        ), r


def test_a_fenced_write_during_a_takeover_waits_and_is_refused(
    make_lease: Callable[..., PostgresLease], pool: ThreadPoolExecutor, writes: str
) -> None:
    a = make_lease()
    old = acquired(a.try_acquire("A"))

    def stale_write(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            fenced(conn, "default", old)
            conn.execute("INSERT INTO writes (term, what) VALUES (%s, 'stale')", (old,))

    # A takeover in progress: row locked FOR UPDATE, term moved on, not yet committed
    # (what try_acquire does inside its one transaction).
    with psycopg.connect(writes) as takeover, psycopg.connect(writes, autocommit=True) as conn:
        takeover.execute(
            sql.SQL("SELECT 1 FROM {} WHERE name = 'default' FOR UPDATE").format(
                sql.Identifier(LEASES)
            )
        )
        takeover.execute(
            sql.SQL(
                "UPDATE {} SET term = term + 1, holder = 'B', holder_pid = pg_backend_pid()"
                " WHERE name = 'default'"
            ).format(sql.Identifier(LEASES))
        )
        check = pool.submit(stale_write, conn)
        time.sleep(0.3)
        assert not check.done(), "the fenced check did not wait for the takeover"
        takeover.commit()
        with pytest.raises(StaleLeaderError):
            check.result(timeout=5)
    assert _writes(writes) == []


def test_fenced_never_passes_a_stale_term_under_repeatable_read(
    make_lease: Callable[..., PostgresLease], writes: str
) -> None:
    a, b = make_lease(), make_lease()
    old = acquired(a.try_acquire("A"))
    with psycopg.connect(writes) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        fenced(conn, "default", old)  # first statement: snapshot and check agree
        conn.commit()
        conn.execute("SELECT 1")  # snapshot taken before the takeover below
        expire_now(writes)
        acquired(b.try_acquire("B"))
        with pytest.raises((StaleLeaderError, psycopg.errors.SerializationFailure)):
            fenced(conn, "default", old)
        conn.rollback()
        with pytest.raises(StaleLeaderError):
            fenced(conn, "default", old)


def test_renew_is_not_blocked_by_an_open_fenced_transaction(
    make_lease: Callable[..., PostgresLease], pool: ThreadPoolExecutor, writes: str
) -> None:
    a, b = make_lease(), make_lease()
    term = acquired(a.try_acquire("A"))
    with psycopg.connect(writes) as conn, psycopg.connect(writes) as conn2:
        fenced(conn, "default", term)
        fenced(conn2, "default", term)  # fenced transactions do not block each other
        ok, took = timed(lambda: a.renew("A", term))
        assert ok
        assert took < 0.5, f"renew took {took:.3f}s with a fenced transaction open"
        # A follower's attempt neither waits nor blocks anything while A is live.
        attempt, took = timed(lambda: b.try_acquire("B"))
        assert not attempt.acquired and took < 0.5
        ok, took = timed(lambda: a.renew("A", term))
        assert ok and took < 0.5
        conn.commit()
        conn2.commit()


def test_an_idle_fenced_transaction_cannot_block_a_takeover_forever(
    make_lease: Callable[..., PostgresLease],
    admin: psycopg.Connection[Any],
    pool: ThreadPoolExecutor,
    writes: str,
) -> None:
    a, b = make_lease(), make_lease()
    old = acquired(a.try_acquire("A"))
    conn = psycopg.connect(writes)
    try:
        fenced(conn, "default", old, idle_timeout=1.0)
        conn.execute("INSERT INTO writes (term, what) VALUES (%s, 'paused')", (old,))
        # ... and the old leader pauses here, transaction open.
        terminate(admin, a.backend_pid)
        start = time.monotonic()
        # Attempts skip the row while the paused transaction holds it (as a follower
        # would, a little apart); the server ends that transaction after idle_timeout.
        attempt = b.try_acquire("B")
        while not attempt.acquired and time.monotonic() - start < 10:
            time.sleep(0.05)
            attempt = b.try_acquire("B")
        took = time.monotonic() - start
        assert acquired(attempt) == old + 1
        assert 0.5 < took < 3.0, f"takeover after {took:.2f}s with idle_timeout 1 s"
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            conn.commit()  # the server ended the paused session: nothing committed
    finally:
        conn.close()
    assert _writes(writes) == []


def test_fenced_needs_an_open_transaction_and_a_known_table(
    make_lease: Callable[..., PostgresLease], lease_dsn: str
) -> None:
    a = make_lease()
    term = acquired(a.try_acquire("A"))
    with psycopg.connect(lease_dsn, autocommit=True) as conn:
        with pytest.raises(ConfigError, match="transaction"):
            fenced(conn, "default", term)
        with conn.transaction():
            fenced(conn, "default", term)  # autocommit, but inside a transaction block
        with pytest.raises(ConfigError, match="does not exist"), conn.transaction():
            fenced(conn, "default", term, table="no_such_table")
        with pytest.raises(ConfigError):
            fenced(conn, "default", term, table="x; drop table y")
        with pytest.raises(ConfigError):
            fenced(conn, "", term)


def test_fenced_on_a_lost_connection_raises_backend_unavailable(
    make_lease: Callable[..., PostgresLease], admin: psycopg.Connection[Any], lease_dsn: str
) -> None:
    a = make_lease()
    term = acquired(a.try_acquire("A"))
    with psycopg.connect(lease_dsn) as conn:
        terminate(admin, conn.info.backend_pid)
        with pytest.raises(BackendUnavailable, match="lost"):
            fenced(conn, "default", term)


def test_afenced_on_an_async_connection(
    make_lease: Callable[..., PostgresLease], writes: str
) -> None:
    a = make_lease()
    term = acquired(a.try_acquire("A"))

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(writes) as conn:
            async with conn.transaction():
                await afenced(conn, "default", term)
                await conn.execute("INSERT INTO writes (term, what) VALUES (%s, 'async')", (term,))
            with pytest.raises(StaleLeaderError):
                async with conn.transaction():
                    await afenced(conn, "default", term + 1)

    asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert _writes(writes) == [(term, "async")]


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "table", ["", "x; drop table y", "a.b.c", "1abc", 'x"y', "a..b", ".x", "x" * 64, "é"]
)
def test_unsafe_table_names_are_rejected_at_construction(lease_dsn: str, table: str) -> None:
    with pytest.raises(ConfigError, match="table name"):
        PostgresLease(lease_dsn, table=table)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"ttl": 0}, "ttl"),
        ({"ttl": float("nan")}, "ttl"),
        ({"ttl": 10, "renew_deadline": 10}, "renew_deadline 10 >= ttl 10"),
        ({"connect_timeout": -1}, "connect_timeout"),
        ({"stop_grace": -1}, "stop_grace"),
        ({"stop_grace": float("inf")}, "stop_grace"),
        ({"stop_grace": "5"}, "stop_grace"),
        ({"stop_grace": True}, "stop_grace"),
        ({"name": ""}, "lease name"),
    ],
)
def test_bad_settings_are_rejected_at_construction(
    lease_dsn: str, kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        PostgresLease(lease_dsn, **kw)


def test_unparseable_conninfo_is_rejected_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as info:
        PostgresLease("host=x password=s3cret-pw port")
    assert "s3cret-pw" not in str(info.value)


def test_schema_qualified_table_works(
    make_lease: Callable[..., PostgresLease], lease_dsn: str
) -> None:
    with psycopg.connect(lease_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
    assert row is not None
    a = make_lease(table=f"{row[0]}.my_leases", name="jobs")
    b = make_lease(table="my_leases", name="jobs")  # same table, spelled differently
    assert acquired(a.try_acquire("A")) == 1
    attempt = b.try_acquire("B")
    assert not attempt.acquired and attempt.holder is not None
    assert attempt.holder.node_id == "A"
    assert a.channel == b.channel
    with psycopg.connect(lease_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM my_leases").fetchone() == (1,)
        assert conn.execute(
            "SELECT component, version FROM rselection_schema_version"
        ).fetchall() == [("leases:my_leases", LEASES_VERSION)]


def test_leases_in_different_schemas_never_share_a_lock(
    make_pg_dsn: Callable[[], str],
) -> None:
    leases = [PostgresLease(make_pg_dsn(), ttl=30, renew_deadline=20) for _ in range(2)]
    try:
        for lease in leases:
            lease.connect()
        for lease in leases:  # same table name, same lease name, same term
            attempt, took = timed(functools.partial(lease.try_acquire, "X"))
            assert acquired(attempt) == 1 and took < 1.0
    finally:
        for lease in leases:
            lease.close()


def test_missing_table_without_create_tables_says_what_to_do(lease_dsn: str) -> None:
    lease = PostgresLease(lease_dsn, create_tables=False)
    try:
        with pytest.raises(BackendUnavailable, match="migrate"):
            lease.connect()
    finally:
        lease.close()


def test_a_closed_port_fails_fast_naming_the_server_not_the_password() -> None:
    lease = PostgresLease("postgresql://app:s3cret-pw@127.0.0.1:1/nowhere", connect_timeout=2.0)
    try:
        start = time.monotonic()
        with pytest.raises(BackendUnavailable) as info:
            lease.connect()
        assert time.monotonic() - start < 3.5
        message = str(info.value)
        assert "127.0.0.1" in message and "port=1" in message and "nowhere" in message
        assert "s3cret-pw" not in message and "s3cret-pw" not in repr(lease)
        for call in (lambda: lease.try_acquire("A"), lease.current):
            start = time.monotonic()
            with pytest.raises(BackendUnavailable) as info:
                call()
            assert time.monotonic() - start < 3.5
            assert "s3cret-pw" not in str(info.value)
    finally:
        lease.close()


def test_an_unanswering_host_fails_within_connect_timeout() -> None:
    # 192.0.2.0/24 is TEST-NET-1: never routed. Either the kernel refuses at once or the
    # attempt hangs until connect_timeout.
    lease = PostgresLease("host=192.0.2.1 port=5432 dbname=x user=y", connect_timeout=2.0)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"192\.0\.2\.1"):
        lease.connect()
    assert time.monotonic() - start < 4.0
    lease.close()


# ------------------------------------------------------------------------ concurrency


def test_racing_acquirers_never_share_a_term(lease_dsn: str, pool: ThreadPoolExecutor) -> None:
    rounds, nodes = 200, 5
    leases = [PostgresLease(lease_dsn, ttl=30, renew_deadline=20) for _ in range(nodes)]
    guard = threading.Lock()
    holder: list[str | None] = [None]
    terms: list[int] = []
    overlaps: list[str] = []
    start = threading.Barrier(nodes)

    def race(lease: PostgresLease, node: str) -> list[int]:
        lease.connect()
        seen: list[int] = []
        start.wait(timeout=30)
        for _ in range(rounds):
            attempt = lease.try_acquire(node)
            if attempt.holder is not None:
                seen.append(attempt.holder.term)
            if not attempt.acquired:
                continue
            term = acquired(attempt)
            with guard:
                if holder[0] is not None:
                    overlaps.append(f"{node} acquired term {term} while {holder[0]} held")
                holder[0] = f"{node}@{term}"
                terms.append(term)
            with guard:
                holder[0] = None
            lease.release(node, term)
        return seen

    try:
        futures: list[Future[list[int]]] = [
            pool.submit(race, lease, f"n{i}") for i, lease in enumerate(leases)
        ]
        seen = [f.result(timeout=120) for f in futures]
    finally:
        for lease in leases:
            lease.close()
    assert not overlaps
    assert terms, "nobody ever acquired"
    assert len(terms) == len(set(terms)), "two acquisitions got the same term"
    assert terms == sorted(terms), "terms did not grow in acquisition order"
    for observed in seen:  # every node saw terms that never go back
        assert observed == sorted(observed)
    row = lease_row(lease_dsn)
    assert row is not None and row[1] == len(terms)  # every increment was one acquisition


def test_concurrent_migrations_do_not_error(lease_dsn: str, pool: ThreadPoolExecutor) -> None:
    barrier = threading.Barrier(4)

    def run() -> None:
        with psycopg.connect(lease_dsn, autocommit=True) as conn:
            barrier.wait(timeout=30)
            migrate(conn)
            migrate(conn, table="other_leases")

    for future in [pool.submit(run) for _ in range(4)]:
        future.result(timeout=60)
    with psycopg.connect(lease_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT component, version FROM rselection_schema_version ORDER BY 1"
        ).fetchall()
    assert rows == [
        ("broadcast", 1),
        ("checkpoints", 1),
        ("claims", 1),
        ("drains", 1),
        ("elections", 1),
        ("leases", LEASES_VERSION),
        ("leases:other_leases", LEASES_VERSION),
        ("nodes", NODES.version),
    ]


# ------------------------------------------------------------------------- hygiene


def _own_sessions(admin: psycopg.Connection[Any]) -> dict[str, int]:
    """This process's sessions on the server (the admin connection aside), by name."""
    ports = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.laddr}
    rows = admin.execute(
        "SELECT application_name, client_port FROM pg_stat_activity"
        " WHERE client_port > 0 AND pid <> pg_backend_pid()"
    ).fetchall()
    counts: dict[str, int] = {}
    for app, port in rows:
        if port in ports:
            counts[app] = counts.get(app, 0) + 1
    return counts


def test_close_leaves_no_session_behind(
    make_lease: Callable[..., PostgresLease], admin: psycopg.Connection[Any]
) -> None:
    a = make_lease(name="hygiene")
    acquired(a.try_acquire("A"))
    assert a.current() is not None
    sessions = _own_sessions(admin)
    assert sessions.get("rselection:keeper") == 1 and sessions.get("rselection:watcher") == 1
    assert any(t.name.startswith("rselection-keeper-") for t in threading.enumerate())
    a.close()
    a.close()  # idempotent
    wait_until(
        lambda: not {"rselection:keeper", "rselection:watcher"} & _own_sessions(admin).keys(),
        5,
        "the sessions to end",
    )
    wait_until(
        lambda: not any(t.name.startswith("rselection-keeper-") for t in threading.enumerate()),
        5,
        "the keeper's threads to end",
    )


def test_keeper_session_settings_are_pinned(
    make_lease: Callable[..., PostgresLease], admin: psycopg.Connection[Any]
) -> None:
    # A cut-off leader winds down for renew_deadline + stop_grace after its last
    # renewal: the server must keep its session (and its lock) longer than that.
    a = make_lease(shared=True, ttl=15.0, renew_deadline=10.0, stop_grace=4.0)
    assert a.server_keepalives.total > 10.0 + 4.0 + 1.0
    assert a.server_user_timeout == a.server_keepalives.total * 1000
    keeper = a.keeper
    assert keeper is not None and keeper._conn is not None

    def settings() -> tuple[Any, ...]:
        assert keeper._conn is not None
        with keeper._lock:  # the keeper's thread reads the session while it is idle
            cur = keeper._conn.execute(
                "SELECT current_setting('idle_session_timeout'),"
                " current_setting('idle_in_transaction_session_timeout'),"
                " current_setting('statement_timeout'), current_setting('application_name'),"
                " current_setting('tcp_keepalives_idle')::int,"
                " current_setting('tcp_keepalives_interval')::int,"
                " current_setting('tcp_keepalives_count')::int,"
                " current_setting('tcp_user_timeout')::int"
            )
            row = cur.fetchone()
        assert row is not None
        return tuple(row)

    row = settings()
    assert row[:4] == ("0", "0", "0", "rselection:keeper")
    if (keeper._conn.info.host or "").startswith("/"):
        pytest.skip("Unix socket: no TCP keepalives")
    idle, interval, count, user_timeout = row[4:]
    assert idle + interval * count > 10.0 + 4.0 + 1.0
    assert user_timeout == a.server_user_timeout > (10.0 + 4.0 + 1.0) * 1000
    # A lease with a longer wind-down joining the same session raises them.
    longer = make_lease(shared=True, name="longer", ttl=60.0, renew_deadline=40.0, stop_grace=5.0)
    assert longer.keeper is keeper
    idle, interval, count, user_timeout = settings()[4:]
    assert idle + interval * count > 40.0 + 5.0 + 1.0
    assert user_timeout == longer.server_user_timeout
