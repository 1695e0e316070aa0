"""PostgresClaimer against a real Postgres: claim, retain, replace, cleanup, fail closed.

Every test runs in a schema of its own (the ``pg_dsn`` fixture). Waits for a ttl to pass
poll the server with a deadline; threads are joined through futures with a timeout.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from rselection.errors import BackendUnavailable, ConfigError
from rselection.postgres import PostgresClaimer, migrate
from rselection.postgres._conn import Connections
from rselection.postgres.claims import FIRE_KEY_FORMAT
from rselection.schedules import format_fire_key
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_until

# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def dsn(pg_dsn: str) -> str:
    """This test's schema, with every table migrated."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn)
    return pg_dsn


@pytest.fixture
def make_claimer(dsn: str) -> Iterator[Callable[..., PostgresClaimer]]:
    """Factory of claimers on this test's schema, all closed after the test."""
    made: list[PostgresClaimer] = []

    def make(**kw: Any) -> PostgresClaimer:
        claimer = PostgresClaimer(kw.pop("source", dsn), **kw)
        made.append(claimer)
        return claimer

    yield make
    for claimer in made:
        claimer.close()


@pytest.fixture
def admin(pg_server_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection outside the test's schema, for pg_terminate_backend."""
    with psycopg.connect(pg_server_dsn, autocommit=True, connect_timeout=10) as conn:
        yield conn


def rows(dsn: str, table: str = "rselection_claims") -> dict[str, tuple[Any, ...]]:
    """fire_key -> (format_version, holder, term, claimed_at, expires_at)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            sql.SQL(
                "SELECT fire_key, format_version, holder, term, claimed_at, expires_at FROM {}"
            ).format(sql.Identifier(*table.split(".")))
        ).fetchall()
    return {r[0]: tuple(r[1:]) for r in found}


def until_true(attempt: Callable[[], bool], timeout: float, what: str) -> float:
    """Call ``attempt`` until it returns True; fail after ``timeout``. Returns the time taken."""
    start = time.monotonic()
    while not attempt():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def tables_in_schema(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            )
        }


def via(proxy: TcpProxy, dsn: str, **extra: str) -> str:
    """``dsn`` pointed at ``proxy`` instead of the server."""
    return make_conninfo(dsn, host=proxy.host, port=str(proxy.port), **extra)


class FakePool:
    """A duck-typed pool: ``connection()`` lends a non-autocommit connection, commits after."""

    def __init__(self, dsn: str, size: int) -> None:
        self.conninfo = dsn
        self._free: queue.Queue[psycopg.Connection[Any]] = queue.Queue()
        for _ in range(size):
            self._free.put(psycopg.connect(dsn))
        self.lent = 0

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        conn = self._free.get(timeout=30)
        self.lent += 1
        try:
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            self._free.put(conn)

    def close(self) -> None:
        while not self._free.empty():
            self._free.get_nowait().close()


KEY = format_fire_key("purge", datetime(2026, 11, 30, 2, 40, tzinfo=UTC))


# ------------------------------------------------------------------------ semantics


def test_claim_is_won_once_and_kept_until_ttl_then_replaced(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    a = make_claimer(ttl=0.5, node_id="node-a")
    b = make_claimer(ttl=0.5, node_id="node-b")
    assert a.claim(KEY) is True
    # Kept, not released: neither the winner nor anyone else wins it again in its ttl.
    assert a.claim(KEY) is False
    assert b.claim(KEY) is False
    assert rows(dsn)[KEY][1] == "node-a"
    waited = until_true(lambda: b.claim(KEY), 10, "the expired claim to be replaced")
    assert 0.2 < waited < 5  # not before the ttl has (almost) passed
    assert rows(dsn)[KEY][1] == "node-b"  # replaced in place, one row per key
    assert len(rows(dsn)) == 1
    assert a.claim(KEY) is False


def test_claim_records_node_id_term_format_and_server_expiry(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    claimer = make_claimer(ttl=42.5, node_id="worker-7")
    assert claimer.claim(KEY, term=9)
    assert claimer.claim("other@2026-11-30T02:41:00.000000000Z")
    got = rows(dsn)
    fmt, holder, term, claimed_at, expires_at = got[KEY]
    assert (fmt, holder, term) == (FIRE_KEY_FORMAT, "worker-7", 9)
    # server arithmetic, to within the time between the statement's two clock readings
    assert abs(expires_at - claimed_at - timedelta(seconds=42.5)) < timedelta(milliseconds=1)
    assert got["other@2026-11-30T02:41:00.000000000Z"][2] is None  # no term given


def test_default_node_id_is_new_per_claimer(
    make_claimer: Callable[..., PostgresClaimer],
) -> None:
    a, b = make_claimer(), make_claimer()
    assert a.node_id and b.node_id and a.node_id != b.node_id
    assert a.ttl == 600.0 and a.table == "rselection_claims"


def test_many_keys_are_independent(make_claimer: Callable[..., PostgresClaimer]) -> None:
    a, b = make_claimer(), make_claimer()
    start = datetime(2026, 1, 1, tzinfo=UTC)
    keys = [format_fire_key("job", start + timedelta(seconds=i)) for i in range(20)]
    assert all(a.claim(k) for k in keys[::2])
    assert [b.claim(k) for k in keys] == [i % 2 == 1 for i in range(20)]


def test_cleanup_deletes_only_claims_expired_over_a_minute(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    claimer = make_claimer(ttl=600)
    assert claimer.cleanup() == 0
    for i in range(6):
        assert claimer.claim(f"k{i}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE rselection_claims SET expires_at = now() - interval '2 minutes'"
            " WHERE fire_key IN ('k0', 'k1', 'k2')"
        )
        conn.execute(
            "UPDATE rselection_claims SET expires_at = now() - interval '30 seconds'"
            " WHERE fire_key = 'k3'"
        )
    assert claimer.cleanup() == 3
    assert set(rows(dsn)) == {"k3", "k4", "k5"}
    assert claimer.cleanup() == 0
    assert claimer.claim("k3")  # expired (but kept by cleanup): claimable again
    assert not claimer.claim("k4")


def test_concurrent_claimers_win_each_key_exactly_once(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    threads, keys = 8, 200
    start = datetime(2026, 3, 29, 0, 59, tzinfo=UTC)
    all_keys = [
        format_fire_key("tick", start + timedelta(milliseconds=250 * i)) for i in range(keys)
    ]
    shared = make_claimer(node_id="shared")
    # Four threads with a claimer each, four sharing one (and so its connection).
    claimers = [make_claimer(node_id=f"own-{i}") for i in range(4)] + [shared] * 4
    barrier = threading.Barrier(threads)

    def run(index: int) -> list[str]:
        order = all_keys[:]
        random.Random(index).shuffle(order)
        barrier.wait(timeout=30)
        return [k for k in order if claimers[index].claim(k, term=index)]

    with ThreadPoolExecutor(threads) as pool:
        futures: list[Future[list[str]]] = [pool.submit(run, i) for i in range(threads)]
        won = [f.result(timeout=90) for f in futures]
    counts = Counter(k for keys_won in won for k in keys_won)
    assert set(counts) == set(all_keys)
    assert set(counts.values()) == {1}
    stored = rows(dsn)
    assert len(stored) == keys
    for index, keys_won in enumerate(won):
        for k in keys_won:
            assert stored[k][1] == claimers[index].node_id
            assert stored[k][2] == index


def test_pool_and_connection_sources(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    pool = FakePool(dsn, 2)
    try:
        by_pool = make_claimer(source=pool)
        assert by_pool.claim("p1") and not by_pool.claim("p1")
        assert pool.lent == 2
        with psycopg.connect(dsn) as conn:  # not autocommit
            by_conn = make_claimer(source=conn)
            assert by_conn.claim("c1") and not by_conn.claim("p1")
            assert "c1" in rows(dsn)  # committed at once, visible to others
            by_conn.close()
            assert not conn.closed  # the caller's connection stays open
        assert not make_claimer().claim("c1")
    finally:
        pool.close()


def test_a_claim_inside_an_open_transaction_binds_only_when_it_commits(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")  # opens a transaction
        in_tx = make_claimer(source=conn)
        assert in_tx.claim("tx1")
        assert "tx1" not in rows(dsn)  # not visible yet
        conn.rollback()  # the fire's work failed: so did its claim
        assert "tx1" not in rows(dsn)
        assert make_claimer().claim("tx1")


# ------------------------------------------------------------------------ fail closed


def test_unreachable_server_raises_and_hides_the_password(pg_dsn: str) -> None:
    with socket_closed_port() as port:
        dsn = make_conninfo(pg_dsn, host="127.0.0.1", port=str(port), password="s3cret-pw")
        claimer = PostgresClaimer(dsn, connect_timeout=2)
        with pytest.raises(BackendUnavailable) as info:
            claimer.claim(KEY)
    message = str(info.value)
    assert "s3cret-pw" not in message
    assert f"port={port}" in message
    with pytest.raises(BackendUnavailable):
        claimer.cleanup()


@contextlib.contextmanager
def socket_closed_port() -> Iterator[int]:
    """A loopback port with nothing listening."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    yield port


def test_severed_connection_raises_then_reconnects(
    dsn: str,
    make_claimer: Callable[..., PostgresClaimer],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    params = conninfo_to_dict(dsn)
    proxy = make_tcp_proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    claimer = make_claimer(source=via(proxy, dsn))
    assert claimer.claim("s1")
    proxy.sever()  # RST: the claimer's idle connection is gone
    proxy.blackhole()  # and no new connection gets through
    results: list[bool] = []
    with pytest.raises(BackendUnavailable):
        results.append(claimer.claim("s2"))
    assert results == []
    proxy.heal()
    assert claimer.claim("s2")  # reconnected; the failed call claimed nothing
    assert not claimer.claim("s1")


def test_session_killed_during_a_claim_raises_and_claims_nothing(
    dsn: str,
    make_claimer: Callable[..., PostgresClaimer],
    admin: psycopg.Connection[Any],
) -> None:
    claimer = make_claimer()
    assert claimer.claim("warm-up")
    with psycopg.connect(dsn) as blocker:
        # An uncommitted claim of the same key makes our claim wait on its row.
        blocker.execute(
            "INSERT INTO rselection_claims VALUES"
            " ('busy', 1, 'blocker', NULL, now(), now() + interval '1 hour')"
        )
        blocker_pid = blocker.info.backend_pid
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(claimer.claim, "busy")

            def waiting_pid() -> int | None:
                row = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    (blocker_pid,),
                ).fetchone()
                return None if row is None else int(row[0])

            until_true(lambda: waiting_pid() is not None, 10, "the claim to wait")
            admin.execute("SELECT pg_terminate_backend(%s)", (waiting_pid(),))
            with pytest.raises(BackendUnavailable):
                future.result(timeout=10)
        blocker.rollback()
    assert claimer.claim("busy")  # reconnects; nobody held the key after all


def test_server_ended_idle_session_is_replaced_before_the_next_claim(
    make_claimer: Callable[..., PostgresClaimer], admin: psycopg.Connection[Any]
) -> None:
    claimer = make_claimer()
    assert claimer.claim("i1")
    own = claimer._conns._idle[-1]  # the connection the call used, now idle
    admin.execute("SELECT pg_terminate_backend(%s)", (own.info.backend_pid,))
    until_true(lambda: not Connections.usable(own), 5, "the termination to arrive")
    assert claimer.claim("i2")
    assert not claimer.claim("i1")


def test_a_claim_over_its_statement_timeout_raises(
    dsn: str, make_claimer: Callable[..., PostgresClaimer]
) -> None:
    claimer = make_claimer(statement_timeout=0.3)
    with psycopg.connect(dsn) as blocker:
        blocker.execute(
            "INSERT INTO rselection_claims VALUES"
            " ('slow', 1, 'blocker', NULL, now(), now() + interval '1 hour')"
        )
        start = time.monotonic()
        with pytest.raises(BackendUnavailable, match="statement timeout"):
            claimer.claim("slow")
        assert time.monotonic() - start < 5
        blocker.rollback()
    assert claimer.claim("slow")


def test_claims_in_another_fire_key_format_stop_claims(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    claimer = make_claimer()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO rselection_claims VALUES"
            " ('purge/2026-11-30 02:40', 2, 'newer', NULL, now(), now() + interval '1 hour')"
        )
    with pytest.raises(ConfigError, match="fire-key format 2"):
        claimer.claim(KEY)
    assert KEY not in rows(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE rselection_claims SET expires_at = now() - interval '1 second'")
    assert claimer.claim(KEY)  # expired claims of another format no longer matter


# --------------------------------------------------------------------------- tables


def test_without_create_tables_a_missing_table_says_what_to_do(pg_dsn: str) -> None:
    claimer = PostgresClaimer(pg_dsn, create_tables=False)
    with pytest.raises(ConfigError, match=r"does not exist.*migrate"):
        claimer.claim(KEY)
    claimer.close()
    assert tables_in_schema(pg_dsn) == set()
    with PostgresClaimer(pg_dsn) as made:  # create_tables=True by default
        assert made.claim(KEY)
    assert tables_in_schema(pg_dsn) == {"rselection_claims", "rselection_schema_version"}


def test_custom_and_schema_qualified_tables(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
        assert row is not None
        schema = row[0]
        migrate(conn, table=None, elections_table=None, claims_table="app_claims")
    default = make_claimer()
    custom = make_claimer(table="app_claims")
    qualified = make_claimer(table=f"{schema}.other_claims", create_tables=True)
    assert default.claim(KEY) and custom.claim(KEY) and qualified.claim(KEY)
    assert not make_claimer(table=f"{schema}.app_claims").claim(KEY)  # same table
    assert set(rows(dsn, "app_claims")) == {KEY}
    assert set(rows(dsn, "other_claims")) == {KEY}
    with psycopg.connect(dsn, autocommit=True) as conn:
        versions = dict(
            conn.execute("SELECT component, version FROM rselection_schema_version").fetchall()
        )
    assert versions["claims:app_claims"] == 1 and versions["claims:other_claims"] == 1


def test_a_table_that_is_not_a_claims_table_is_refused(
    make_claimer: Callable[..., PostgresClaimer],
) -> None:
    with pytest.raises(ConfigError, match="not a claims table"):
        make_claimer(table="rselection_elections").claim(KEY)


@pytest.mark.parametrize(
    "table",
    [
        "claims; DROP TABLE rselection_leases",
        'claims"--',
        "a.b.c",
        "",
        "1claims",
        "claims-table",
        "x" * 64,
        "public.",
        " claims",
    ],
)
def test_hostile_table_names_are_refused_at_construction(pg_dsn: str, table: str) -> None:
    with pytest.raises(ConfigError, match="invalid table name"):
        PostgresClaimer(pg_dsn, table=table)


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize("ttl", [0, 0.0009, -1, float("nan"), float("inf"), True, "600", None])
def test_bad_ttl_is_refused(pg_dsn: str, ttl: Any) -> None:
    with pytest.raises(ConfigError, match="ttl"):
        PostgresClaimer(pg_dsn, ttl=ttl)


def test_smallest_ttl_is_one_millisecond(pg_dsn: str) -> None:
    assert PostgresClaimer(pg_dsn, ttl=0.001).ttl == 0.001


@pytest.mark.parametrize("source", [None, "", "   ", 42, object()])
def test_no_usable_connection_is_refused(source: Any) -> None:
    with pytest.raises(ConfigError, match="PostgresClaimer needs"):
        PostgresClaimer(source)


def test_closed_connection_and_bad_conninfo_are_refused(pg_dsn: str) -> None:
    conn = psycopg.connect(pg_dsn)
    conn.close()
    with pytest.raises(ConfigError, match="closed"):
        PostgresClaimer(conn)
    with pytest.raises(ConfigError, match="cannot be parsed"):
        PostgresClaimer("host=x port")


@pytest.mark.parametrize("node_id", ["", "   ", "a\x00b", 7, "n" * 1001])
def test_bad_node_id_is_refused(pg_dsn: str, node_id: Any) -> None:
    with pytest.raises(ConfigError, match="node_id"):
        PostgresClaimer(pg_dsn, node_id=node_id)


def test_a_fire_key_of_the_longest_lease_and_task_names_is_claimed(
    make_claimer: Callable[..., PostgresClaimer],
) -> None:
    # What a leader claims: "<lease name>/<task>@<instant>", each name up to 1,000
    # characters, so a fire key may be longer than a name.
    key = "l" * 1000 + "/" + format_fire_key("t" * 1000, datetime(2026, 1, 1, tzinfo=UTC))
    claimer = make_claimer()
    assert claimer.claim(key) and not claimer.claim(key)


@pytest.mark.parametrize(
    ("key", "term"),
    [
        ("", None),
        ("  ", None),
        ("a\x00", None),
        ("x" * 3000, None),
        (None, None),
        ("k", -1),
        ("k", True),
        ("k", 2**63),
        ("k", 1.5),
    ],
)
def test_bad_claim_arguments_are_refused_before_any_io(pg_dsn: str, key: Any, term: Any) -> None:
    with socket_closed_port() as port:
        claimer = PostgresClaimer(make_conninfo(pg_dsn, port=str(port)))
        with pytest.raises(ConfigError):
            claimer.claim(key, term=term)


# -- claim_missed: a starting leader's look back, in one statement --------------------


def test_claim_missed_takes_the_keys_after_the_newest_held(
    make_claimer: Callable[..., PostgresClaimer],
) -> None:
    old, new = make_claimer(node_id="old-leader"), make_claimer(node_id="new-leader")
    keys = [f"tick@{i:02d}" for i in range(10)]
    assert old.claim(keys[3]) and old.claim(keys[6])  # the old leader got as far as 6
    assert new.claim_missed(keys, term=7) == keys[7:]
    # Those now bind: a second look back finds nothing, the old leader cannot take them.
    assert new.claim_missed(keys, term=8) == []
    assert not old.claim(keys[8])
    # Keys before the newest held one stay unclaimed (not missed: before the handover).
    assert old.claim(keys[5])
    assert new.claim_missed([], term=1) == []


def test_claim_missed_with_nothing_held_takes_everything(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    claimer = make_claimer(node_id="first")
    keys = [f"first@{i:02d}" for i in range(5)]
    assert claimer.claim_missed(keys, term=1) == keys
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT holder, term FROM rselection_claims WHERE fire_key LIKE 'first@%'"
        ).fetchall()
    assert rows == [("first", 1)] * 5


def test_claim_missed_replaces_expired_claims(
    make_claimer: Callable[..., PostgresClaimer], dsn: str
) -> None:
    short = make_claimer(node_id="short", ttl=0.05)
    keys = ["exp@1", "exp@2", "exp@3"]
    assert short.claim("exp@3")

    def expired() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT expires_at <= clock_timestamp() FROM rselection_claims"
                " WHERE fire_key = 'exp@3'"
            ).fetchone()
        return row is not None and bool(row[0])

    wait_until(expired, 5.0, "the claim to expire (server time)")
    assert make_claimer(node_id="later").claim_missed(keys) == keys


def test_claim_missed_is_atomic_between_two_starting_leaders(
    make_claimer: Callable[..., PostgresClaimer],
) -> None:
    keys = [f"race@{i:03d}" for i in range(200)]
    a, b = make_claimer(node_id="a"), make_claimer(node_id="b")
    results: dict[str, list[str]] = {}
    barrier = threading.Barrier(2)

    def run(name: str, claimer: PostgresClaimer) -> None:
        barrier.wait(10)
        results[name] = claimer.claim_missed(keys, term=1)

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not set(results["a"]) & set(results["b"])  # no key won twice


def test_claim_missed_rejects_bad_input(make_claimer: Callable[..., PostgresClaimer]) -> None:
    claimer = make_claimer()
    with pytest.raises(ConfigError, match="fire_key"):
        claimer.claim_missed(["ok", ""])
    with pytest.raises(ConfigError, match="term"):
        claimer.claim_missed(["ok"], term=-1)
