"""The suite's database fixtures work: isolated schemas, private servers, the proxy."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import psycopg
import pytest

from tests.support.pg import PrivatePostgres, PrivateRedis, with_host_port
from tests.support.proxy import TcpProxy

WAIT = 10.0

# schemas handed out by pg_dsn in earlier tests of this module
_seen_schemas: list[str] = []


def _current_schema(dsn: str) -> str:
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        row = conn.execute("select current_schema()").fetchone()
    assert row is not None
    return str(row[0])


def _schema_exists(dsn: str, name: str) -> bool:
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        row = conn.execute("select count(*) from pg_namespace where nspname = %s", (name,))
        found = row.fetchone()
    return found is not None and found[0] == 1


@pytest.mark.parametrize("run", [1, 2])
def test_each_test_gets_a_fresh_schema(pg_dsn: str, pg_server_dsn: str, run: int) -> None:
    schema = _current_schema(pg_dsn)
    assert schema.startswith("t_")
    assert schema not in _seen_schemas
    # schemas of earlier tests were dropped at their teardown
    for earlier in _seen_schemas:
        assert not _schema_exists(pg_server_dsn, earlier)
    _seen_schemas.append(schema)


def test_schemas_do_not_see_each_other(make_pg_dsn: Callable[[], str]) -> None:
    first, second = make_pg_dsn(), make_pg_dsn()
    assert _current_schema(first) != _current_schema(second)
    with psycopg.connect(first, autocommit=True) as conn:
        conn.execute("create table items (id int primary key)")
        conn.execute("insert into items values (1)")
    with psycopg.connect(second, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("select * from items")
        conn.execute("create table items (id int primary key)")  # no clash
        row = conn.execute("select count(*) from items").fetchone()
        assert row == (0,)


def test_dsn_works_in_a_child_process(pg_dsn: str) -> None:
    code = (
        "import sys, psycopg\n"
        "with psycopg.connect(sys.argv[1], connect_timeout=5) as c:\n"
        "    print(c.execute('select current_schema()').fetchone()[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, pg_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == _current_schema(pg_dsn)


def test_schema_is_dropped_even_if_a_connection_is_left_open(
    make_pg_dsn: Callable[[], str], pg_server_dsn: str
) -> None:
    dsn = make_pg_dsn()
    schema = _current_schema(dsn)
    conn = psycopg.connect(dsn)
    conn.execute("create table t (x int)")
    conn.commit()
    conn.execute("select * from t")  # leaves a transaction open holding a lock
    try:
        from tests.conftest import _drop_schema

        _drop_schema(pg_server_dsn, schema)
        assert not _schema_exists(pg_server_dsn, schema)
    finally:
        conn.close()


def test_private_postgres_start_restart_kill() -> None:
    """The pgserver path: start, query, restart on the same port, survive a SIGKILL."""
    with PrivatePostgres() as pg:
        port = pg.port
        with psycopg.connect(pg.dsn, autocommit=True, connect_timeout=5) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
            conn.execute("create table kept (v text)")
            conn.execute("insert into kept values ('before restart')")

        pg.restart()
        assert pg.port == port
        with psycopg.connect(pg.dsn, autocommit=True, connect_timeout=5) as conn:
            assert conn.execute("select v from kept").fetchall() == [("before restart",)]

        conn = psycopg.connect(pg.dsn, autocommit=True, connect_timeout=5)
        pg.kill()
        assert not pg.is_running()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
        conn.close()

        pg.start()
        with psycopg.connect(pg.dsn, autocommit=True, connect_timeout=5) as conn:
            assert conn.execute("select count(*) from kept").fetchone() == (1,)

        pg.stop("immediate")
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(pg.dsn, connect_timeout=2).close()
        pg.start()
        assert pg.is_running()
    assert not pg.is_running()
    assert not pg.data_dir.exists()


def test_a_commit_acknowledged_just_before_a_kill_survives_it(
    private_pg: PrivatePostgres,
) -> None:
    """Chaos tests kill the server right after a term starts: its row must be kept.

    With ``synchronous_commit=off`` the WAL writer flushed commits up to 200 ms
    late, so a kill lost the lease row written just before it and the fleet saw
    the row as deleted.
    """
    with psycopg.connect(private_pg.dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute("create table acknowledged (n int)")
    for mode in ("immediate", "kill"):
        with psycopg.connect(private_pg.dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute("insert into acknowledged values (1)")
            if mode == "kill":
                private_pg.kill()
            else:
                private_pg.stop("immediate")
        private_pg.start()
    with psycopg.connect(private_pg.dsn, autocommit=True, connect_timeout=5) as conn:
        assert conn.execute("select count(*) from acknowledged").fetchone() == (2,)


def test_private_pg_fixture(private_pg: PrivatePostgres) -> None:
    assert private_pg.is_running()
    with psycopg.connect(private_pg.dsn, connect_timeout=5) as conn:
        assert conn.execute("show port").fetchone() == (str(private_pg.port),)


def test_proxy_in_front_of_postgres(
    private_pg: PrivatePostgres, make_tcp_proxy: Callable[[str, int], TcpProxy]
) -> None:
    proxy = make_tcp_proxy(private_pg.host, private_pg.port)
    dsn = with_host_port(private_pg.dsn, *proxy.address)
    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
    try:
        assert conn.execute("select 1").fetchone() == (1,)

        # silent partition: the query neither answers nor fails until healed
        proxy.blackhole()
        result: list[object] = []
        worker = threading.Thread(
            target=lambda: result.append(conn.execute("select 2").fetchone()), daemon=True
        )
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and not result
        proxy.heal()
        worker.join(WAIT)
        assert not worker.is_alive()
        assert result == [(2,)]

        # severed: the next statement fails at once, a new connection works
        assert proxy.sever() == 1
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 3")
    finally:
        conn.close()
    with psycopg.connect(dsn, connect_timeout=5) as again:
        assert again.execute("select 4").fetchone() == (4,)


def test_redis_url_answers(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        assert client.ping()
    finally:
        client.close()


def test_private_redis_restart_and_kill(private_redis: PrivateRedis) -> None:
    import redis

    port = private_redis.port
    client = redis.Redis.from_url(private_redis.url, socket_timeout=5, socket_connect_timeout=5)
    try:
        client.set("k", "v")
        private_redis.restart()
        assert private_redis.port == port
        assert client.get("k") == b"v"
        private_redis.kill()
        assert not private_redis.is_running()
        with pytest.raises(redis.ConnectionError):
            client.get("k")
        private_redis.start()
        assert client.get("k") == b"v"  # append-only file kept the write
    finally:
        client.close()
