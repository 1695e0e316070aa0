"""Postgres leases behind a real PgBouncer: session mode works, transaction mode is refused.

Every test starts its own PgBouncer on loopback in front of the test server and uses a
database of its own (PgBouncer 1.18 cannot forward the ``options`` that the schema
fixtures use). Fleet tests keep an *activity ledger*: every task reports, with this
machine's wall clock, when it started and finished in which term, and no two terms'
activity may overlap.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.errors import BackendUnavailable, ConfigError
from rselection.postgres import (
    PostgresBroadcaster,
    PostgresCheckpointStore,
    PostgresClaimer,
    PostgresElector,
)
from rselection.postgres._conn import IoWatchdog
from rselection.postgres.keeper import opening as keeper_opening
from rselection.postgres.leader import PostgresLeader
from rselection.postgres.lease import PostgresLease
from rselection.postgres.pooler import check_session_pooling
from tests.support.node_process import NodeProcess
from tests.support.pgbouncer import PgBouncer
from tests.support.waiting import wait_until

# --------------------------------------------------------------------------- helpers


@dataclass
class Activity:
    """What one node's tasks did in one term: from the first start to the last end."""

    node: str
    term: int
    start: float
    end: float  # math.inf while still running


def overlapping(ledger: list[Activity]) -> list[tuple[Activity, Activity]]:
    """Pairs of entries of different terms whose activity overlaps (must be none)."""
    found = []
    for i, a in enumerate(ledger):
        for b in ledger[i + 1 :]:
            if a.term != b.term and a.start < b.end and b.start < a.end:
                found.append((a, b))
    return found


def ledger_of(nodes: dict[str, NodeProcess], died: dict[str, float]) -> list[Activity]:
    """The activity ledger from the nodes' task events; a killed node's open activity
    ends when the test saw it dead."""
    entries: dict[tuple[str, int], Activity] = {}
    for name, node in nodes.items():
        for event in node.seen:
            if event["event"] not in ("task-start", "task-end"):
                continue
            key = (name, int(event["term"]))
            entry = entries.setdefault(key, Activity(name, key[1], event["t"], math.inf))
            if event["event"] == "task-start":
                entry.start = min(entry.start, event["t"])
            elif entry.end == math.inf or event["t"] > entry.end:
                entry.end = event["t"]
    for entry in entries.values():
        if entry.end == math.inf and entry.node in died:
            entry.end = died[entry.node]
    return sorted(entries.values(), key=lambda e: e.start)


def drain(nodes: dict[str, NodeProcess]) -> None:
    """Move the events the nodes printed so far into their ``seen`` lists."""
    for node in nodes.values():
        while True:
            try:
                node.seen.append(node.events.get_nowait())
            except queue.Empty:
                break


def warm_pool(dsn: str, servers: int) -> None:
    """Make the pooler open ``servers`` server connections (they stay idle in its pool)."""
    conns = [psycopg.connect(dsn, connect_timeout=5) for _ in range(servers)]
    try:
        pids = {int(c.execute("SELECT pg_backend_pid()").fetchone()[0]) for c in conns}  # type: ignore[index]
        assert len(pids) == servers, pids
    finally:
        for conn in conns:
            conn.rollback()
            conn.close()


def table_exists(server_dsn: str, table: str) -> bool:
    with psycopg.connect(server_dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
    assert row is not None
    return bool(row[0])


def direct_dsn(pg_server_dsn: str, dbname: str) -> str:
    """The test server's DSN for database ``dbname``, without the pooler."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = {k: str(v) for k, v in conninfo_to_dict(pg_server_dsn).items()}
    params["dbname"] = dbname
    return make_conninfo("", **params)


@pytest.fixture
def lease_name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def leases() -> Iterator[Callable[..., PostgresLease]]:
    made: list[PostgresLease] = []

    def make(dsn: str, name: str, **kw: Any) -> PostgresLease:
        lease = PostgresLease(dsn, name=name, ttl=4.0, renew_deadline=2.0, **kw)
        made.append(lease)
        return lease

    yield make
    for lease in made:
        lease.close()


# --------------------------------------------------------------------------- the check


@pytest.mark.parametrize(
    ("pool_mode", "settings", "warm", "sign"),
    [
        # PgBouncer's default: the server connection freed last is handed out first
        ("transaction", {}, 0, "another connection was handed the keeper's backend"),
        ("statement", {}, 0, "another connection was handed the keeper's backend"),
        # idle server connections in turn: the keeper's next statement moves
        ("transaction", {"server_round_robin": "1"}, 2, "then on backend"),
        # round robin with only one server connection: the probe shares it
        ("transaction", {"server_round_robin": "1"}, 0, "another connection was handed"),
    ],
)
def test_lease_behind_a_transaction_pooler_is_refused_before_anything_is_acquired(
    make_pgbouncer: Callable[..., PgBouncer],
    pooled_database: str,
    pg_server_dsn: str,
    leases: Callable[..., PostgresLease],
    lease_name: str,
    pool_mode: str,
    settings: dict[str, str],
    warm: int,
    sign: str,
) -> None:
    bouncer = make_pgbouncer(pool_mode=pool_mode, pool_size=2, settings=settings)
    dsn = bouncer.dsn(pooled_database)
    for attempt in range(5):  # the same answer every time
        if warm:
            warm_pool(dsn, warm)
        lease = leases(dsn, lease_name)
        began = time.monotonic()
        with pytest.raises(ConfigError) as caught:
            lease.connect()
        took = time.monotonic() - began
        message = str(caught.value)
        assert "session mode" in message, message
        assert "connect to Postgres directly" in message, message
        assert sign in message, message
        assert took < 2.0, f"attempt {attempt}: the refusal took {took:.2f} s"
        assert lease.backend_pid is None
    # Refused before the tables were even created, so before anything was acquired.
    assert not table_exists(direct_dsn(pg_server_dsn, pooled_database), "rselection_leases")


def test_lease_behind_a_session_pooler_passes_the_check_every_time(
    make_pgbouncer: Callable[..., PgBouncer],
    pooled_database: str,
    pg_server_dsn: str,
    leases: Callable[..., PostgresLease],
    lease_name: str,
) -> None:
    bouncer = make_pgbouncer(pool_mode="session", pool_size=4)
    dsn = bouncer.dsn(pooled_database)
    took = []
    for _ in range(10):
        lease = leases(dsn, lease_name)
        began = time.monotonic()
        lease.connect()
        took.append(time.monotonic() - began)
        # backend_pid is the server's pid, not the pooler's stand-in
        with psycopg.connect(direct_dsn(pg_server_dsn, pooled_database), autocommit=True) as conn:
            row = conn.execute(
                "SELECT application_name FROM pg_stat_activity WHERE pid = %s",
                (lease.backend_pid,),
            ).fetchone()
        assert row == ("rselection:keeper",)  # the process's shared keeper session
        attempt = lease.try_acquire("node-a")
        assert attempt.acquired
        assert attempt.holder is not None
        assert lease.renew("node-a", attempt.holder.term)
        lease.release("node-a", attempt.holder.term)
        lease.close()
    print(f"connect with the check through session-mode PgBouncer: {sorted(took)}")


def test_a_lost_notification_alone_shows_a_transaction_pooler(
    make_pgbouncer: Callable[..., PgBouncer], pooled_database: str, pg_server_dsn: str
) -> None:
    # One server connection, and a probe that bypasses the pooler: the keeper keeps its
    # backend and the probe never shares it, so only the notification can tell.
    direct = direct_dsn(pg_server_dsn, pooled_database)
    io = IoWatchdog("test")
    try:
        for mode, refused in (("transaction", True), ("session", False)):
            bouncer = make_pgbouncer(pool_mode=mode, pool_size=1)
            with psycopg.connect(bouncer.dsn(pooled_database), autocommit=True) as keeper:

                def probe() -> psycopg.Connection[Any]:
                    return psycopg.connect(direct, autocommit=True)

                def check(keeper: psycopg.Connection[Any] = keeper) -> int:
                    return check_session_pooling(
                        keeper, probe, where="here", io=io, timeout=5.0, wait=0.3
                    )

                for _ in range(5):  # the same answer every time
                    if refused:
                        with pytest.raises(ConfigError, match="notification") as caught:
                            check()
                        assert "session mode" in str(caught.value)
                    else:
                        pid = check()
                        row = keeper.execute("SELECT pg_backend_pid()").fetchone()
                        assert row == (pid,)
            bouncer.close()
    finally:
        io.close()


def connect_and_acquire(
    leases: Callable[..., PostgresLease], dsn: str, name: str, node: str | None
) -> tuple[PostgresLease, Any]:
    """A lease connected through the transaction pooler (and, with ``node``, its
    acquisition), retried while its statements land on another backend: an idle pool
    mostly keeps the keeper's backend, but the ring watcher's statements through the same
    pooler may move it, and that is refused (the defence under test) before anything is
    taken."""
    for _ in range(20):
        lease = leases(dsn, name)
        try:
            lease.connect()
            return lease, lease.try_acquire(node) if node is not None else None
        except ConfigError as exc:
            assert "does not keep one database session" in str(exc)
            lease.close()
    pytest.fail("the keeper's statements never kept one backend in 20 connects")


@contextlib.contextmanager
def holding_backend(dsn: str, pid: int | None, direct: str, tries: int = 5) -> Iterator[None]:
    """Keep server backend ``pid`` from the keeper's next statement (transaction mode), so
    that it runs on another one: open clients, each in a transaction, until one of them
    got ``pid``. The pooler may instead have lent ``pid`` to the ring watcher's lock wait
    (it lasts up to 30 s): then ``pid`` is busy already and nobody else can get it. Five
    tries take every server connection of the pool (7) but the watcher's and one left for
    the keeper, never waiting for one."""
    others: list[psycopg.Connection[Any]] = []
    seen: list[Any] = []
    try:
        for _ in range(tries):
            other = psycopg.connect(dsn)
            others.append(other)
            row = other.execute("SELECT pg_backend_pid()").fetchone()
            seen.append(row)
            if row == (pid,):
                break
        else:
            with psycopg.connect(direct, autocommit=True) as conn:
                waiting = conn.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
            if waiting != ("Lock",):
                pytest.fail(
                    f"no client got the keeper's backend {pid} in {tries} tries, and it is "
                    f"not waiting on a lock ({waiting}): {seen}"
                )
            # The watcher holds it: give the others back, or the keeper finds no room.
            for other in others:
                other.rollback()
                other.close()
            others.clear()
        yield
    finally:
        for other in others:
            with contextlib.suppress(Exception):
                other.rollback()
                other.close()


def test_a_renewal_or_acquisition_on_another_backend_is_refused(
    make_pgbouncer: Callable[..., PgBouncer],
    pooled_database: str,
    pg_server_dsn: str,
    leases: Callable[..., PostgresLease],
    lease_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second line of defence, with the connect-time check switched off."""

    def only_the_pid(conn: psycopg.Connection[Any], *args: Any, **kw: Any) -> int:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return int(row[0])

    monkeypatch.setattr(keeper_opening, "check_session_pooling", only_the_pid)
    # Room for the keeper's statements and the ring watcher's while other clients hold
    # up to five backends (holding_backend).
    bouncer = make_pgbouncer(pool_mode="transaction", pool_size=7)
    dsn = bouncer.dsn(pooled_database)
    direct = direct_dsn(pg_server_dsn, pooled_database)

    def renewed_at() -> Any:
        with psycopg.connect(direct, autocommit=True) as conn:
            return conn.execute(
                "SELECT holder, renewed_at FROM rselection_leases WHERE name = %s", (lease_name,)
            ).fetchone()

    lease, taken = connect_and_acquire(leases, dsn, lease_name, "node-a")
    assert taken.acquired and taken.holder is not None
    before = renewed_at()
    # Another client holds the keeper's backend in a transaction: the renewal must run
    # on another server connection.
    with holding_backend(dsn, lease.backend_pid, direct):
        with pytest.raises(ConfigError, match="session mode") as caught:
            lease.renew("node-a", taken.holder.term)
        assert "then on backend" in str(caught.value)
    assert renewed_at() == before, "a renewal on another backend must renew nothing"
    # The keeper is unusable from now on; it is closed once its term is over (a leader
    # first joins the term's tasks).
    with pytest.raises(BackendUnavailable):
        lease.renew("node-a", taken.holder.term)
    lease.term_ended(taken.holder.term)

    lease, _ = connect_and_acquire(leases, dsn, lease_name, None)
    with holding_backend(dsn, lease.backend_pid, direct):
        # node-a's term expires now, so that node-b's acquisition takes the lease
        with psycopg.connect(direct, autocommit=True) as conn:
            conn.execute(
                "UPDATE rselection_leases SET expires_at = now() WHERE name = %s", (lease_name,)
            )
        with pytest.raises(ConfigError, match="session mode"):
            lease.try_acquire("node-b")
    holder, _ = renewed_at()
    assert holder is None, "a term taken on another backend is given back"


# --------------------------------------------------------------------------- other users


def test_broadcaster_and_membership_work_behind_a_session_pooler(
    make_pgbouncer: Callable[..., PgBouncer], pooled_database: str, lease_name: str
) -> None:
    bouncer = make_pgbouncer(pool_mode="session", pool_size=10)
    dsn = bouncer.dsn(pooled_database)
    reader = PostgresBroadcaster(dsn, io_timeout=5.0)
    writer = PostgresBroadcaster(dsn, io_timeout=5.0)
    leader = PostgresLeader(
        dsn,
        rs.TaskHandler(stop_grace=1.0),
        name=lease_name,
        node_id="node-a",
        ttl=4.0,
        renew_interval=0.5,
        renew_deadline=2.0,
        retry_interval=0.5,
        heartbeat_interval=0.3,
        claimer=None,
    )
    try:
        assert reader.wait_ready(10) and writer.wait_ready(10)
        sub = reader.subscribe("news")
        for i in range(20):
            writer.publish("news", {"n": i})
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 20:
            assert time.monotonic() < deadline, f"only {len(got)} of 20 messages arrived"
            with contextlib.suppress(TimeoutError):
                got.append(sub.get(0.5))
        assert got == [{"n": i} for i in range(20)]

        leader.start()
        assert leader.wait_until_leader(10)
        wait_until(
            lambda: (
                [(n.node_id, n.is_leader, n.alive) for n in leader.nodes()]
                == [("node-a", True, True)]
            ),
            10,
            "the heartbeat through the pooler",
        )
    finally:
        leader.stop(timeout=10)
        reader.close()
        writer.close()


def test_elector_claimer_and_checkpoints_work_behind_a_transaction_pooler_without_prepares(
    make_pgbouncer: Callable[..., PgBouncer], pooled_database: str
) -> None:
    """What the README promises for transaction mode: with a pool (here one connection)
    that does not prepare statements, while another client moves the server
    connections around."""
    bouncer = make_pgbouncer(pool_mode="transaction", pool_size=2)
    dsn = bouncer.dsn(pooled_database)

    class OneConnectionPool:
        def __init__(self) -> None:
            self.conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
            self.lock = threading.Lock()

        @contextlib.contextmanager
        def connection(self) -> Iterator[psycopg.Connection[Any]]:
            with self.lock:
                yield self.conn

    stop = threading.Event()

    def churn() -> None:
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                with conn.transaction():
                    conn.execute("SELECT pg_sleep(0.001)")

    pool = OneConnectionPool()
    mover = threading.Thread(target=churn, daemon=True)
    mover.start()
    try:
        mine = PostgresElector(pool, name="e", ttl=5.0, node_id="me")
        theirs = PostgresElector(pool, name="e", ttl=5.0, node_id="them")
        claimer = PostgresClaimer(pool, node_id="me")
        store = PostgresCheckpointStore(pool)
        for i in range(20):  # well past psycopg's prepare_threshold of 5
            assert mine.is_leader()
            assert not theirs.is_leader()
            assert claimer.claim(f"fire-{i}")
            assert not claimer.claim(f"fire-{i}")
            store.save("state", {"i": i})
            snapshot = store.load("state")
            assert snapshot is not None and snapshot.state == {"i": i}
    finally:
        stop.set()
        mover.join(10)
        pool.conn.close()


# --------------------------------------------------------------------------- leaders


def test_three_leaders_behind_a_transaction_pooler_refuse_and_run_no_task(
    make_pgbouncer: Callable[..., PgBouncer], pooled_database: str, lease_name: str
) -> None:
    bouncer = make_pgbouncer(pool_mode="transaction", pool_size=2)
    dsn = bouncer.dsn(pooled_database)
    ledger: list[tuple[str, int, str, float]] = []
    lock = threading.Lock()
    leaders: list[PostgresLeader] = []
    for i in range(3):
        handler = rs.TaskHandler(stop_grace=1.0)
        node = f"node-{i}"

        @handler.persistent("work")
        def work(ctx: rs.TaskContext, node: str = node) -> None:
            with lock:
                ledger.append((node, ctx.term, "start", time.time()))
            ctx.cancelled.wait()
            with lock:
                ledger.append((node, ctx.term, "end", time.time()))

        leaders.append(
            PostgresLeader(
                dsn,
                handler,
                name=lease_name,
                node_id=node,
                ttl=4.0,
                renew_interval=0.5,
                renew_deadline=2.0,
                retry_interval=0.5,
                claimer=None,
            )
        )
    outcomes: dict[str, BaseException | None] = {}

    def lead(leader: PostgresLeader) -> None:
        try:
            leader.lead()
            outcomes[leader.node_id] = None
        except BaseException as exc:
            outcomes[leader.node_id] = exc

    threads = [threading.Thread(target=lead, args=(x,), daemon=True) for x in leaders]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        assert not any(t.is_alive() for t in threads), "lead() must end: refused at start"
        assert ledger == [], f"no task may run behind a transaction pooler: {ledger}"
        for leader in leaders:
            error = outcomes[leader.node_id]
            assert isinstance(error, ConfigError), (
                f"{leader.node_id}: lead() must raise ConfigError, got {error!r}"
            )
            assert "session mode" in str(error)
    finally:
        for leader in leaders:
            leader.stop(timeout=10)


def test_background_leader_behind_a_transaction_pooler_logs_the_refusal_and_stops(
    make_pgbouncer: Callable[..., PgBouncer],
    pooled_database: str,
    lease_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bouncer = make_pgbouncer(pool_mode="transaction", pool_size=2)
    ran = threading.Event()
    handler = rs.TaskHandler(stop_grace=1.0)

    @handler.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ran.set()

    leader = PostgresLeader(
        bouncer.dsn(pooled_database),
        handler,
        name=lease_name,
        ttl=4.0,
        renew_interval=0.5,
        renew_deadline=2.0,
        retry_interval=0.5,
        claimer=None,
    )
    caplog.set_level(logging.ERROR)

    def refusal_logged() -> bool:
        for record in caplog.records:
            if record.levelno < logging.ERROR:
                continue
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += " " + str(record.exc_info[1])
            if "session mode" in text:
                return True
        return False

    try:
        leader.start()
        wait_until(refusal_logged, 10, "an ERROR log naming session mode")

        wait_until(lambda: leader._wait_stopped(0), 10, "the leader to stop after the refusal")
        assert not ran.is_set() and not leader.is_leader
    finally:
        leader.stop(timeout=10)


def test_fleet_behind_a_session_pooler_hands_over_on_stop_and_on_kill(
    make_pgbouncer: Callable[..., PgBouncer], pooled_database: str, lease_name: str
) -> None:
    # Session mode pins one server connection per client connection: room for every
    # node's keeper, heartbeat and the short-lived check connection.
    bouncer = make_pgbouncer(pool_mode="session", pool_size=20)
    dsn = bouncer.dsn(pooled_database)
    nodes = {
        f"node-{i}": NodeProcess(
            "tests.support.activity_node", dsn, "--lease", lease_name, "--node", f"node-{i}"
        )
        for i in range(3)
    }
    died: dict[str, float] = {}

    def elections() -> list[dict[str, Any]]:
        return sorted((e for n in nodes.values() for e in n.of("elected")), key=lambda e: e["term"])

    def wait_elections(count: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while len(elections()) < count:
            assert time.monotonic() < deadline, (
                f"no election {count} within {timeout} s: {[n.seen[-5:] for n in nodes.values()]}"
                f"\n{bouncer.log_tail()}"
            )
            drain(nodes)
            time.sleep(0.02)
        return elections()[count - 1]

    try:
        first = wait_elections(1, 20)
        time.sleep(1.5)  # several renewals: still the only leader
        assert len(elections()) == 1, elections()

        stopped_at = time.time()
        nodes[first["node"]].stop()
        second = wait_elections(2, 10)
        assert second["node"] != first["node"] and second["term"] == first["term"] + 1
        handover = None
        for e in nodes[second["node"]].of("task-start", term=second["term"]):
            handover = e["t"] - stopped_at
        time.sleep(1.0)

        victim = nodes[second["node"]]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        died[second["node"]] = time.time()
        third = wait_elections(3, 10)
        assert third["node"] not in (first["node"], second["node"])
        assert third["term"] == second["term"] + 1
        time.sleep(1.0)
        starts = nodes[third["node"]].of("task-start", term=third["term"])
        assert starts, "the new leader runs its task"
        failover = starts[0]["t"] - died[second["node"]]
        assert handover is not None, "the heir runs its task"
        print(
            f"through session-mode PgBouncer: graceful handover {handover * 1000:.0f} ms, "
            f"failover after kill -9 {failover * 1000:.0f} ms"
        )
        # A crashed leader's session ends with its client connection: the pooler resets
        # the server connection (its advisory lock goes), no waiting for the ttl.
        assert failover < 2.0, f"failover took {failover:.2f} s: waited for expiry?"
    finally:
        for name, node in nodes.items():
            if name not in died:
                node.reap()
        drain(nodes)

    ledger = ledger_of(nodes, died)
    assert [(a.node, a.term) for a in ledger] == [
        (first["node"], first["term"]),
        (second["node"], second["term"]),
        (third["node"], third["term"]),
    ], ledger
    assert overlapping(ledger) == [], ledger
    assert all(a.end != math.inf for a in ledger), ledger
