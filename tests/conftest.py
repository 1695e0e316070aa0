"""Shared fixtures: a Postgres and a Redis for the suite, private servers, a TCP proxy.

Postgres, in order: ``RSELECTION_TEST_DSN`` if set; else the local server at
127.0.0.1:5432 (database ``test``, user ``postgres``) if it answers within 2 s;
else a private server from the ``pgserver`` binaries (extra ``embedded``) for
the whole session. Redis, in order: ``RSELECTION_TEST_REDIS_URL``; else
127.0.0.1:6379 if it answers; else a private ``redis-server`` if one is on
``PATH``. When none is available the tests that need it are skipped, except
when ``CI=true``, where they fail: CI must never pass by skipping.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import uuid
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

import pytest

from tests.support.pg import (
    DEFAULT_DSN,
    DEFAULT_REDIS_URL,
    PrivatePostgres,
    PrivateRedis,
    ServerStartError,
    pgserver_bin_dir,
    postgres_answers,
    redact,
    redis_answers,
    with_search_path,
)
from tests.support.proxy import TcpProxy
from tests.support.thread_stacks import thread_stacks

HOW_TO_POSTGRES = (
    "set RSELECTION_TEST_DSN=postgresql://USER@HOST:PORT/DB, run a Postgres on "
    "127.0.0.1:5432 (database 'test', user 'postgres'), or pip install -e '.[embedded]'"
)
HOW_TO_REDIS = (
    "set RSELECTION_TEST_REDIS_URL=redis://HOST:PORT/0, run Redis on 127.0.0.1:6379, "
    "or install redis-server; the client needs pip install -e '.[redis]'"
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report shows the library's threads still alive, with stacks."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        stacks = thread_stacks()
        if stacks:
            report.sections.append(("rselection threads alive", stacks))


def in_ci() -> bool:
    """Return True when the environment says this is CI (``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() == "true"


def unavailable(reason: str) -> NoReturn:
    """Skip the test for a missing server, or fail it under CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: missing servers fail instead of skipping)", pytrace=False)
    pytest.skip(reason)


_Server = TypeVar("_Server", PrivatePostgres, PrivateRedis)


def _start_private(kind: type[_Server], what: str) -> _Server:
    """Start a private server, or skip (fail under CI) saying why it could not."""
    try:
        return kind().start()
    except (ServerStartError, OSError) as exc:
        error = str(exc)
    unavailable(f"{what} ({error})")


# --------------------------------------------------------------------------- Postgres


@pytest.fixture(scope="session")
def pg_server_dsn() -> Iterator[str]:
    """DSN of the Postgres server the session uses (see the module docstring)."""
    env = os.environ.get("RSELECTION_TEST_DSN", "").strip()
    if env:
        if not postgres_answers(env, timeout=5):
            pytest.fail(
                f"RSELECTION_TEST_DSN={redact(env)} does not answer; fix it or unset it",
                pytrace=False,
            )
        yield env
        return
    if postgres_answers(DEFAULT_DSN, timeout=2):
        yield DEFAULT_DSN
        return
    if pgserver_bin_dir() is None:
        unavailable(f"no Postgres for the tests: {HOW_TO_POSTGRES}")
    server = _start_private(
        PrivatePostgres, f"could not start a private Postgres: {HOW_TO_POSTGRES}"
    )
    try:
        yield server.dsn
    finally:
        server.close()


def _create_schema(server_dsn: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(server_dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))


def _drop_schema(server_dsn: str, name: str) -> None:
    """Drop a test schema; end sessions that still lock its objects so it never hangs."""
    import psycopg
    from psycopg import errors, sql

    drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
    with psycopg.connect(server_dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute("SET lock_timeout = '2s'")
        try:
            conn.execute(drop)
            return
        except errors.LockNotAvailable:
            pass
        conn.execute(
            """
            SELECT pg_terminate_backend(l.pid)
            FROM pg_locks l
            JOIN pg_class c ON c.oid = l.relation
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = %s AND l.pid <> pg_backend_pid()
            """,
            (name,),
        )
        conn.execute(drop)


@pytest.fixture
def make_pg_dsn(pg_server_dsn: str) -> Iterator[Callable[[], str]]:
    """Factory: each call creates a fresh schema and returns a DSN that uses it.

    The DSN is a plain string (libpq URI with ``options=-csearch_path=<schema>``)
    that works in child processes too. Every schema is dropped (CASCADE) after
    the test.
    """
    created: list[str] = []

    def make() -> str:
        name = f"t_{uuid.uuid4().hex[:16]}"
        _create_schema(pg_server_dsn, name)
        created.append(name)
        return with_search_path(pg_server_dsn, name)

    yield make
    for name in created:
        _drop_schema(pg_server_dsn, name)


@pytest.fixture
def pg_dsn(make_pg_dsn: Callable[[], str]) -> str:
    """DSN whose connections live in a fresh schema of their own, dropped after the test."""
    return make_pg_dsn()


@contextlib.contextmanager
def fresh_database(server_dsn: str, prefix: str = "rselection_db") -> Iterator[str]:
    """A fresh database on the server of ``server_dsn``; its name. Dropped (with its
    sessions) on exit."""
    import psycopg
    from psycopg import sql

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True, connect_timeout=10) as conn:
        # template0: CREATE DATABASE fails while anyone is connected to template1
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(server_dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def lone_pg_dsn(pg_server_dsn: str) -> Iterator[str]:
    """DSN of a fresh database of this test's own, dropped after the test: for a test
    that holds a lock of a whole database (the migration lock), which in the shared
    database would hold up the tests of the other workers."""
    from psycopg.conninfo import make_conninfo

    with fresh_database(pg_server_dsn) as name:
        yield make_conninfo(pg_server_dsn, dbname=name)


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    """A started ``PrivatePostgres`` of this test's own, for stop/restart/kill tests."""
    if pgserver_bin_dir() is None:
        unavailable("no pgserver binaries for a private Postgres: pip install -e '.[embedded]'")
    server = _start_private(PrivatePostgres, "could not start a private Postgres")
    try:
        yield server
    finally:
        server.close()


# --------------------------------------------------------------------------- Redis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the Redis the session uses (see the module docstring)."""
    if importlib.util.find_spec("redis") is None:
        unavailable(f"the redis client is not installed: {HOW_TO_REDIS}")
    env = os.environ.get("RSELECTION_TEST_REDIS_URL", "").strip()
    if env:
        if not redis_answers(env, timeout=5):
            pytest.fail(
                f"RSELECTION_TEST_REDIS_URL={redact(env)} does not answer; fix it or unset it",
                pytrace=False,
            )
        yield env
        return
    if redis_answers(DEFAULT_REDIS_URL, timeout=2):
        yield DEFAULT_REDIS_URL
        return
    server = _start_private(PrivateRedis, f"no Redis for the tests: {HOW_TO_REDIS}")
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own on the test Redis; its keys are deleted after."""
    import redis  # the Redis tests' driver: the other tiers need not have it

    made = f"t{uuid.uuid4().hex[:8]}:"
    yield made
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=made + "*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A started ``PrivateRedis`` of this test's own, for stop/restart/kill tests."""
    server = _start_private(PrivateRedis, "could not start a private Redis")
    try:
        yield server
    finally:
        server.close()


# --------------------------------------------------------------------------- proxy


@pytest.fixture
def make_tcp_proxy() -> Iterator[Callable[[str, int], TcpProxy]]:
    """Factory: ``make_tcp_proxy(host, port)`` returns a ``TcpProxy`` closed after the test."""
    proxies: list[TcpProxy] = []

    def make(host: str, port: int) -> TcpProxy:
        proxy = TcpProxy(host, port)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        with contextlib.suppress(Exception):
            proxy.close()


# --------------------------------------------------------------------------- attackers


@pytest.fixture
def login_only_dsn(pg_server_dsn: str) -> Iterator[str]:
    """A DSN of a role with LOGIN and nothing else, on the test database: the client the
    security tests attack from (it can NOTIFY, LISTEN and take advisory locks, and read
    or write none of rselection's tables). The role is dropped after the test."""
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    role = f"rs_attacker_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield make_conninfo(pg_server_dsn, user=role)
    finally:
        with psycopg.connect(pg_server_dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@pytest.fixture
def publish_only_redis_url(redis_url: str) -> Iterator[str]:
    """A URL of a Redis user allowed PUBLISH (and PING) and nothing else: the client the
    security tests attack from. The user is deleted after the test."""
    import redis

    user, password = f"rs-attacker-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
    admin = redis.Redis.from_url(redis_url)
    try:
        admin.acl_setuser(
            user,
            enabled=True,
            passwords=[f"+{password}"],
            channels=["*"],
            commands=["-@all", "+publish", "+ping"],
            reset=True,
        )
        kw = admin.connection_pool.connection_kwargs
        where = f"{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
        yield f"redis://{user}:{password}@{where}"
    finally:
        admin.acl_deluser(user)
        admin.close()
