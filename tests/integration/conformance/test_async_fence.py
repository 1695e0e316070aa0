"""``await ctx.afence(conn)`` with async connections, and ``ctx.fence`` refusing them.

Postgres: a real ``PostgresLeader`` and a psycopg ``AsyncConnection``. Single node: no
lease table, so both only check that the term is live. Redis: a ``RedisLeader`` and a
``redis.asyncio`` client (a point-in-time check of the term, as ``ctx.fence`` does).
"""

from __future__ import annotations

import asyncio
import gc
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.context import TaskContext, Term
from rselection.postgres.leader import PostgresLeader
from tests.support.waiting import wait_until

FAST: dict[str, Any] = {
    "ttl": 3.0,
    "renew_interval": 0.5,
    "renew_deadline": 2.0,
    "retry_interval": 0.5,
}


@pytest.fixture
def lease_name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_pg_leader(pg_dsn: str, lease_name: str) -> Iterator[Callable[..., PostgresLeader]]:
    made: list[PostgresLeader] = []

    def make(handler: rs.TaskHandler, node_id: str) -> PostgresLeader:
        leader = PostgresLeader(pg_dsn, handler, name=lease_name, node_id=node_id, **FAST)
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


def remembering_handler(contexts: list[rs.TaskContext]) -> rs.TaskHandler:
    """A handler whose one task keeps its context for the test and waits for the end."""
    handler = rs.TaskHandler(stop_grace=0.5)

    @handler.persistent("remember", restart="never")
    def remember(ctx: rs.TaskContext) -> None:
        contexts.append(ctx)
        ctx.cancelled.wait(30)

    return handler


def no_unawaited_coroutines(caught: list[warnings.WarningMessage]) -> None:
    gc.collect()  # an unawaited coroutine warns when it is collected
    never_awaited = [w for w in caught if "never awaited" in str(w.message)]
    assert never_awaited == []


# -- Postgres ------------------------------------------------------------------------


def test_afence_in_an_async_transaction_commits_and_is_refused_after_takeover(
    pg_dsn: str, make_pg_leader: Callable[..., PostgresLeader]
) -> None:
    contexts: list[rs.TaskContext] = []
    first = make_pg_leader(remembering_handler(contexts), "first")
    first.start()
    wait_until(lambda: bool(contexts), 10, "the first term's task")
    old = contexts[0]

    async def write(conn: psycopg.AsyncConnection[Any]) -> None:
        async with conn.transaction():
            await old.afence(conn)
            await conn.execute("INSERT INTO fenced_writes VALUES (%s)", (old.term,))

    async def scenario() -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            await conn.execute("CREATE TABLE fenced_writes (term bigint)")
            await write(conn)
            await asyncio.to_thread(first.stop)
            second = make_pg_leader(rs.TaskHandler(stop_grace=0.5), "second")
            second.start()
            await asyncio.to_thread(wait_until, lambda: second.is_leader, 10, "the takeover")
            assert second.term == old.term + 1
            with pytest.raises(rs.StaleLeaderError):
                await write(conn)
            cur = await conn.execute("SELECT term FROM fenced_writes")
            return await cur.fetchall()

    assert asyncio.run(scenario()) == [(old.term,)]


def test_fence_with_an_async_connection_names_afence_and_leaves_nothing_behind(
    pg_dsn: str, make_pg_leader: Callable[..., PostgresLeader]
) -> None:
    contexts: list[rs.TaskContext] = []
    leader = make_pg_leader(remembering_handler(contexts), "only")
    leader.start()
    wait_until(lambda: bool(contexts), 10, "the term's task")
    ctx = contexts[0]

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            with pytest.raises(rs.ConfigError, match=r"await ctx\.afence\(conn\)"):
                ctx.fence(conn)
            # The connection is untouched: no transaction opened, still usable.
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            cur = await conn.execute("SELECT 1")
            assert await cur.fetchone() == (1,)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        no_unawaited_coroutines(caught)


def test_afence_with_a_blocking_connection_names_fence(
    pg_dsn: str, make_pg_leader: Callable[..., PostgresLeader]
) -> None:
    contexts: list[rs.TaskContext] = []
    leader = make_pg_leader(remembering_handler(contexts), "only")
    leader.start()
    wait_until(lambda: bool(contexts), 10, "the term's task")
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(rs.ConfigError, match=r"ctx\.fence\(conn\)"):
            asyncio.run(contexts[0].afence(conn))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_fenced_functions_refuse_the_other_kind_of_connection(pg_dsn: str) -> None:
    from rselection.postgres import afenced, fenced

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            with pytest.raises(rs.ConfigError, match=r"await afenced\("):
                fenced(aconn, "default", 1)  # type: ignore[arg-type]
        with psycopg.connect(pg_dsn) as conn:
            with pytest.raises(rs.ConfigError, match=r"fenced\(conn"):
                await afenced(conn, "default", 1)  # type: ignore[arg-type]
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        no_unawaited_coroutines(caught)


# -- single node ---------------------------------------------------------------------


def test_single_node_afence_is_refused_naming_what_to_call(pg_dsn: str) -> None:
    """No lease table: ctx.afence and ctx.fence refuse, live term or not, instead of only
    checking liveness."""
    term = Term(1, "n")  # no transaction fence, as under a SingleNodeLeader
    ctx = TaskContext("t", term)

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            with pytest.raises(rs.ConfigError, match=r"cannot fence a transaction.*ctx\.check"):
                await ctx.afence(conn)
            with pytest.raises(rs.ConfigError, match="cannot fence a transaction"):
                ctx.fence(conn)
            term.cancel()
            with pytest.raises(rs.ConfigError, match="cannot fence a transaction"):
                await ctx.afence(conn)

    asyncio.run(scenario())


# -- Redis ---------------------------------------------------------------------------


def test_redis_afence_is_refused_naming_the_async_fenced_call(
    redis_url: str, lease_name: str
) -> None:
    import redis
    import redis.asyncio

    from rselection.redis import RedisLeader, afenced_call

    contexts: list[rs.TaskContext] = []
    leaders: list[RedisLeader] = []

    def make(handler: rs.TaskHandler, node_id: str) -> RedisLeader:
        leader = RedisLeader(redis_url, handler, name=lease_name, node_id=node_id, **FAST)
        leaders.append(leader)
        return leader

    try:
        first = make(remembering_handler(contexts), "first")
        first.start()
        wait_until(lambda: bool(contexts), 10, "the first term's task")
        old = contexts[0]
        key = f"state:{{{lease_name}}}"

        async def scenario() -> None:
            client = redis.asyncio.Redis.from_url(redis_url)
            try:
                # Refused either way, each naming the calls that work (never the other).
                with pytest.raises(rs.ConfigError, match=r"leader\.fence\.call.*afenced_call"):
                    await old.afence(client)
                with pytest.raises(rs.ConfigError, match=r"leader\.fence\.call.*afenced_call"):
                    old.fence(client)
                assert await afenced_call(client, lease_name, old.term, "SET", key, "v1")
                await asyncio.to_thread(first.stop)
                second = make(rs.TaskHandler(stop_grace=0.5), "second")
                second.start()
                await asyncio.to_thread(wait_until, lambda: second.is_leader, 10, "the takeover")
                with pytest.raises(rs.StaleLeaderError):
                    await afenced_call(client, lease_name, old.term, "SET", key, "v2")
                assert await client.get(key) == b"v1"
            finally:
                await client.aclose()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncio.run(scenario())
            no_unawaited_coroutines(caught)

        blocking = redis.Redis.from_url(redis_url)
        try:
            with pytest.raises(rs.ConfigError, match=r"leader\.fence\.call") as refused:
                asyncio.run(old.afence(blocking))
            assert "ctx.fence(conn)" not in str(refused.value)  # refused too under Redis
        finally:
            blocking.close()
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
