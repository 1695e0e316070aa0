"""PostgresLeader in one process: election, observers, fencing, bad input, clean stop, and
a psycopg connection or pool as ``conninfo``."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.postgres.leader import PostgresLeader
from rselection.postgres.lease import PostgresLease
from tests.support.pg import TEST_PASSWORD, connection_or_pool, with_host_port
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}


@pytest.fixture
def lease_name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_leader(pg_dsn: str, lease_name: str) -> Iterator[Callable[..., PostgresLeader]]:
    made: list[PostgresLeader] = []

    def make(handler: rs.TaskHandler | None = None, **kw: Any) -> PostgresLeader:
        options = {**FAST, **kw}
        leader = PostgresLeader(pg_dsn, handler or rs.TaskHandler(), name=lease_name, **options)
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


def the_leader(leaders: list[PostgresLeader]) -> PostgresLeader:
    wait_until(lambda: sum(x.is_leader for x in leaders) == 1, 10, "one leader")
    return next(x for x in leaders if x.is_leader)


def test_three_nodes_one_leader_and_everyone_agrees(
    make_leader: Callable[..., PostgresLeader],
) -> None:
    leaders = [make_leader(node_id=f"node-{i}") for i in range(3)]
    for leader in leaders:
        leader.start()
    chief = the_leader(leaders)
    views = [leader.leader() for leader in leaders]
    assert all(v is not None for v in views)
    assert {(v.node_id, v.term) for v in views if v} == {(chief.node_id, chief.term)}
    assert sum(x.is_leader for x in leaders) == 1

    changes: list[Any] = []
    receiver = lambda sender, **kw: changes.append((sender.node_id, kw["leader"]))  # noqa: E731
    rs.signals.leader_changed.connect(receiver)
    try:
        chief.stop()
        rest = [x for x in leaders if x is not chief]
        heir = the_leader(rest)
        assert heir.term == (views[0].term if views[0] else 0) + 1
        # Every surviving node heard of the new holder.
        wait_until(
            lambda: (
                {n for n, info in changes if info is not None and info.node_id == heir.node_id}
                >= {x.node_id for x in rest}
            ),
            5,
            "leader_changed on every node",
        )
    finally:
        rs.signals.leader_changed.disconnect(receiver)


def test_fenced_write_of_an_old_term_is_refused(
    pg_dsn: str, make_leader: Callable[..., PostgresLeader]
) -> None:
    terms: list[int] = []
    contexts: list[rs.TaskContext] = []
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.persistent("remember")
    def remember(ctx: rs.TaskContext) -> None:
        contexts.append(ctx)
        terms.append(ctx.term)
        ctx.cancelled.wait(30)

    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE fenced_writes (term bigint)")
    first = make_leader(handler, node_id="first")
    first.start()
    wait_until(lambda: bool(contexts), 10, "the first term's task")
    old = contexts[0]
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            old.fence(conn)
            conn.execute("INSERT INTO fenced_writes VALUES (%s)", (old.term,))
        first.stop()
        second = make_leader(rs.TaskHandler(), node_id="second")
        second.start()
        wait_until(lambda: second.is_leader, 10, "the takeover")
        with pytest.raises(rs.StaleLeaderError), conn.transaction():
            old.fence(conn)
            conn.execute("INSERT INTO fenced_writes VALUES (%s)", (old.term,))
        rows = conn.execute("SELECT term FROM fenced_writes").fetchall()
    assert rows == [(old.term,)]


def test_unsafe_timings_are_rejected_with_the_math(pg_dsn: str) -> None:
    with pytest.raises(rs.ConfigError, match=r"15 - 14.5 = 0.5"):
        PostgresLeader(pg_dsn, rs.TaskHandler(), ttl=15, renew_deadline=14.5)
    with pytest.raises(rs.ConfigError, match="renew_interval"):
        PostgresLeader(pg_dsn, rs.TaskHandler(), renew_interval=10, renew_deadline=10)
    with pytest.raises(rs.ConfigError, match="ttl"):
        PostgresLeader(pg_dsn, rs.TaskHandler(), ttl=0)
    with pytest.raises(rs.ConfigError, match="lease name"):
        PostgresLeader(pg_dsn, rs.TaskHandler(), name="")


@pytest.mark.parametrize("table", ["", "leases; drop table x", "a.b.c", "1abc", 'x"y'])
def test_unsafe_table_names_are_rejected(pg_dsn: str, table: str) -> None:
    with pytest.raises(rs.ConfigError):
        PostgresLeader(pg_dsn, rs.TaskHandler(), table=table)


def test_schema_qualified_table_works(
    pg_dsn: str, make_leader: Callable[..., PostgresLeader]
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema = conn.execute("SELECT current_schema()").fetchone()
    assert schema is not None
    leader = make_leader(table=f"{schema[0]}.my_leases")
    leader.start()
    wait_until(lambda: leader.is_leader, 10, "leadership")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM my_leases").fetchone() == (1,)


def test_unreachable_database_is_logged_without_password(caplog: pytest.LogCaptureFixture) -> None:
    dsn = "postgresql://app:s3cret-pw@127.0.0.1:1/nowhere?connect_timeout=2"
    leader = PostgresLeader(dsn, rs.TaskHandler(), **FAST)
    with caplog.at_level(logging.WARNING, logger="rselection"):
        leader.start()
        try:
            wait_until(lambda: "unavailable" in caplog.text, 10, "the warning")
            assert not leader.is_leader
        finally:
            leader.stop(timeout=10)
    assert "127.0.0.1" in caplog.text and "1" in caplog.text
    assert "s3cret-pw" not in caplog.text


def test_stop_leaves_no_threads_or_connections(
    pg_dsn: str, lease_name: str, make_leader: Callable[..., PostgresLeader]
) -> None:
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.persistent("idle")
    async def idle(ctx: rs.TaskContext) -> None:
        await ctx.asleep(60)

    leaders = [make_leader(handler if i == 0 else rs.TaskHandler()) for i in range(2)]
    for leader in leaders:
        leader.start()
    the_leader(leaders)
    for leader in leaders:
        leader.stop(timeout=10)

    def leftover_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("rselection-")]

    wait_until(lambda: not leftover_threads(), 5, f"threads to end: {leftover_threads()}")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:

        def sessions() -> int:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                (f"%{lease_name}%",),
            ).fetchone()
            return int(row[0]) if row else -1

        wait_until(lambda: sessions() == 0, 5, "lease sessions to close")
        # Asking who leads after stop() still answers, and leaves nothing open.
        for leader in leaders:
            assert leader.leader() is None
        assert leftover_threads() == []
        # leader() closes its connection before it returns; the server ends that
        # backend a moment later, so the count is awaited, not sampled.
        wait_until(lambda: sessions() == 0, 5, "the leader() query's session to close")


def _proxied(dsn: str, make_tcp_proxy: Callable[[str, int], Any]) -> tuple[Any, str]:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    proxy = make_tcp_proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    return proxy, with_host_port(dsn, proxy.host, proxy.port)


def test_stop_timeout_holds_for_a_follower_behind_a_silent_link(
    pg_dsn: str, make_leader: Callable[..., PostgresLeader], make_tcp_proxy: Any
) -> None:
    proxy, via_proxy = _proxied(pg_dsn, make_tcp_proxy)
    holder = make_leader(node_id="holder")
    holder.start()
    assert holder.wait_until_leader(10)
    follower = PostgresLeader(
        via_proxy, rs.TaskHandler(), name=holder.name, node_id="follower", **FAST
    )
    try:
        follower.start()
        lease = follower.lease
        assert isinstance(lease, PostgresLease)
        # The follower attempted once (it saw the row) and now waits for the holder.
        wait_until(lambda: lease.row_seen and not follower.is_leader, 10, "the follower to wait")
        proxy.blackhole()  # bytes accepted, never delivered: a cancel request cannot land
        began = time.monotonic()
        follower.stop(timeout=0.5)
        took = time.monotonic() - began
        assert took < 1.0, f"stop(timeout=0.5) took {took:.2f} s"
    finally:
        proxy.heal()
        follower.stop(timeout=30)


def test_stop_returns_for_a_leader_behind_a_silent_link(
    pg_dsn: str, lease_name: str, make_tcp_proxy: Any
) -> None:
    proxy, via_proxy = _proxied(pg_dsn, make_tcp_proxy)
    leader = PostgresLeader(
        via_proxy,
        rs.TaskHandler(),
        name=lease_name,
        node_id="cut-off",
        heartbeat_interval=1.0,
        **FAST,
    )
    try:
        leader.start()
        assert leader.wait_until_leader(10)
        time.sleep(1.2)  # a heartbeat and a claim connection are open too
        proxy.blackhole()
        began = time.monotonic()
        stopper = threading.Thread(target=leader.stop, daemon=True)
        stopper.start()
        # The term ends at its deadline (2 s), then every round trip stuck on the link
        # is abandoned by its own bound: stop() returns without a timeout of its own.
        stopper.join(20)
        took = time.monotonic() - began
        assert not stopper.is_alive(), f"stop() still running after {took:.1f} s"
        assert leader.term is None
    finally:
        proxy.heal()
        leader.stop(timeout=30)


# -- a connection or a pool as conninfo -------------------------------------------------


@pytest.mark.parametrize("kind", ["connection", "pool"])
def test_a_leader_on_a_connection_or_a_pool_leads_and_runs_its_tasks(
    pg_dsn: str, lease_name: str, kind: str
) -> None:
    terms: list[int] = []
    fires: list[str] = []
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.persistent("remember")
    def remember(ctx: rs.TaskContext) -> None:
        terms.append(ctx.term)
        ctx.cancelled.wait(30)

    @handler.interval(0.2, name="tick")  # each fire claimed through the conninfo given
    def tick(ctx: rs.TaskContext) -> None:
        fires.append(ctx.fire_key)

    with connection_or_pool(kind, pg_dsn) as source:
        leader = PostgresLeader(source, handler, name=lease_name, node_id="n1", **FAST)
        try:
            leader.start()
            assert leader.wait_until_leader(10)
            wait_until(lambda: terms == [leader.term] and len(fires) >= 2, 10, "the tasks")
            wait_until(lambda: [n.node_id for n in leader.nodes()] == ["n1"], 10, "a heartbeat")
            lease = leader.lease
            assert isinstance(lease, PostgresLease)
            keeper = lease.keeper
            assert keeper is not None and keeper._conn is not None
            # A session of the lease's own, opened with the password of the source.
            assert keeper._conn.info.password == TEST_PASSWORD
            if kind == "connection":
                assert lease.backend_pid != source.info.backend_pid  # never used itself
            else:
                assert source.get_stats()["requests_num"] > 0  # the claims borrowed from it
        finally:
            leader.stop(timeout=10)
