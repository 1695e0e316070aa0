"""PostgresBroadcaster against a real Postgres: delivery across processes, order, catch-up
after a killed or blackholed listener, exactly-once writes, slow subscribers, gaps past
the retention, bad input, and use as a leader's broadcaster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.broadcast import BroadcasterClosed, Subscription
from rselection.errors import ConfigError
from rselection.postgres import PostgresBroadcaster, PostgresLeader, migrate
from rselection.postgres.broadcast import Gap, MessageEncodeError, PostgresBroadcastStats
from rselection.postgres.broadcast.fetches import Fetches
from rselection.postgres.broadcast.location import Locator
from rselection.postgres.broadcast.outbox import BROADCAST_TABLE, Outbox, text_array
from tests.support.broadcast_node import body
from tests.support.pg import with_host_port, with_search_path
from tests.support.proxy import TcpProxy
from tests.support.publish_lock import blocked_by, hold_publish_lock
from tests.support.sessions import process_sessions
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
LOGGER = "rselection.postgres.broadcast"

#: Quick failure detection for fault tests (the defaults are 5 s and 10 s).
QUICK = {"probe_interval": 0.3, "io_timeout": 2.0}


@pytest.fixture
def make_bc(pg_dsn: str) -> Iterator[Callable[..., PostgresBroadcaster]]:
    """Factory of broadcasters (on ``pg_dsn`` unless ``dsn=`` is given), closed after."""
    made: list[PostgresBroadcaster] = []

    def make(dsn: str | None = None, **options: Any) -> PostgresBroadcaster:
        bc = PostgresBroadcaster(dsn or pg_dsn, **options)
        made.append(bc)
        assert bc.wait_ready(20), "the broadcaster's listener did not connect within 20 s"
        return bc

    yield make
    for bc in made:
        bc.close()


def drain(sub: Subscription, n: int, timeout: float) -> list[Any]:
    """Read ``n`` messages from ``sub`` within one shared, bounded deadline."""
    deadline = time.monotonic() + timeout
    out: list[Any] = []
    while len(out) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"only {len(out)} of {n} messages arrived within {timeout} s")
        try:
            out.append(sub.get(remaining))
        except TimeoutError:
            continue
    return out


def assert_quiet(sub: Subscription, seconds: float = 0.5) -> None:
    """Nothing more arrives on ``sub`` for ``seconds`` (no duplicates trailing behind)."""
    with pytest.raises(TimeoutError):
        extra = sub.get(seconds)
        pytest.fail(f"unexpected extra message {extra!r:.200}")


def terminate(dsn: str, pid: int | None) -> int:
    """Terminate backend ``pid``; return 1 if it was terminated."""
    if pid is None:
        return 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
    return 1 if row and row[0] else 0


def proxied(dsn: str, proxy: TcpProxy) -> str:
    return with_host_port(dsn, proxy.host, proxy.port)


def proxy_for(dsn: str, make_tcp_proxy: Callable[[str, int], TcpProxy]) -> TcpProxy:
    parts = urllib.parse.urlsplit(dsn)
    return make_tcp_proxy(parts.hostname or "127.0.0.1", parts.port or 5432)


# --------------------------------------------------------------------------- processes


class Node:
    """A ``tests.support.broadcast_node`` process with its stdout read into a queue."""

    def __init__(self, dsn: str, name: str, *args: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tests.support.broadcast_node"),
                *("--dsn", dsn, "--name", name, *args),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """The next event called ``event`` (others are skipped), within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                got = self.events.get(timeout=max(0.0, remaining))
            except queue.Empty:
                pytest.fail(
                    f"node {self.name} sent no {event!r} within {timeout} s; "
                    f"stderr: {''.join(self.stderr)[-2000:]}"
                )
            if got["event"] == event:
                return got
            if got["event"] == "timeout":
                pytest.fail(f"node {self.name} timed out: {got}")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def nodes() -> Iterator[Callable[..., Node]]:
    """Factory of node processes, killed after the test if still running."""
    started: list[Node] = []

    def start(dsn: str, name: str, *args: str) -> Node:
        node = Node(dsn, name, *args)
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


def test_100_kb_message_reaches_three_node_processes_whole(
    pg_dsn: str, nodes: Callable[..., Node]
) -> None:
    size = 100_000
    fleet = [
        nodes(pg_dsn, "a", "--expect", "1", "--publish", "1", "--size", str(size)),
        nodes(pg_dsn, "b", "--expect", "1"),
        nodes(pg_dsn, "c", "--expect", "1"),
    ]
    for node in fleet:
        node.expect("ready", 30)
    for node in fleet:
        node.go()
    for node in fleet:
        done = node.expect("done", 60)
        assert done["received"] == {"a": [0]}, node.name
        assert done["sizes"] == [size]
        assert done["bodies_ok"], f"node {node.name} got a corrupted body"
        assert node.proc.wait(20) == 0
    assert len(body("a", 0, size)) == size


def test_10000_messages_from_two_publishers_reach_three_subscribers_in_order(
    pg_dsn: str, nodes: Callable[..., Node]
) -> None:
    per_publisher = 5_000
    total = 2 * per_publisher
    subscribers = [
        nodes(pg_dsn, f"s{i}", "--expect", str(total), "--timeout", "100") for i in range(3)
    ]
    publishers = [
        nodes(pg_dsn, f"p{i}", "--publish", str(per_publisher), "--size", "20", "--timeout", "100")
        for i in range(2)
    ]
    for node in subscribers + publishers:
        node.expect("ready", 30)
    for node in subscribers + publishers:
        node.go()
    for node in publishers:
        assert node.expect("published", 100)["flushed"]
    for node in subscribers:
        done = node.expect("done", 100)
        for publisher in ("p0", "p1"):
            # In publishing order, none lost, none twice.
            assert done["received"][publisher] == list(range(per_publisher)), node.name
        assert done["bodies_ok"]
        assert done["overflowed"] == 0
        assert node.proc.wait(20) == 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT id) FROM rselection_broadcast"
        ).fetchone()
    assert row == (total, total), "every message is one row"


# --------------------------------------------------------------------------- in process


def test_publisher_own_subscribers_get_each_message_once_in_order(
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    a = make_bc()
    b = make_bc()
    sub_a, sub_b = a.subscribe("mixed", maxsize=10_000), b.subscribe("mixed", maxsize=10_000)
    got_by_receiver: list[Any] = []
    a.connect("mixed", lambda channel, msg: got_by_receiver.append(msg))
    # Small messages travel inside the NOTIFY, big ones are fetched: mix both.
    sent = [{"i": i, "pad": "z" * (20_000 if i % 7 == 3 else 10)} for i in range(200)]
    for msg in sent:
        a.publish("mixed", msg)
    assert a.flush(20)
    assert drain(sub_a, len(sent), 30) == sent
    assert drain(sub_b, len(sent), 30) == sent
    wait_until(lambda: len(got_by_receiver) == len(sent), 10, "the receiver")
    assert got_by_receiver == sent
    assert_quiet(sub_a)
    stats = a.stats()
    assert isinstance(stats, PostgresBroadcastStats)
    assert stats.published == len(sent) and stats.pending == 0
    assert stats.subscribers == {"mixed": 1} and stats.receivers == {"mixed": 1}
    assert stats.listening and stats.listener_pid is not None


def test_message_above_the_notify_limit_is_delivered_whole(
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    a, b = make_bc(), make_bc()
    sub = b.subscribe("big")
    big = {"blob": body("x", 1, 100_000), "unicode": "é€😀" * 3000}
    a.publish("big", big)
    assert drain(sub, 1, 20) == [big]


def test_channel_names_of_any_length_and_characters(
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    a, b = make_bc(), make_bc()
    names = ["x" * 10_000, "ünï cödé 😀 \n\t 'quoted' \"double\" ; DROP TABLE x;--", "A", "a"]
    subs = {name: b.subscribe(name) for name in names}
    for n, name in enumerate(names):
        a.publish(name, n)
    for n, name in enumerate(names):
        assert drain(subs[name], 1, 20) == [n], f"channel {name[:20]!r}"
    for sub in subs.values():
        assert_quiet(sub, 0.2)


def test_tables_and_schemas_do_not_hear_each_other(
    make_pg_dsn: Callable[[], str], make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    dsn1, dsn2 = make_pg_dsn(), make_pg_dsn()
    same_name_1 = make_bc(dsn1)  # same default table name, other schema
    same_name_2 = make_bc(dsn2)
    other_table = make_bc(dsn1, table="other_broadcast")
    subs = [bc.subscribe("c") for bc in (same_name_1, same_name_2, other_table)]
    same_name_1.publish("c", 1)
    same_name_2.publish("c", 2)
    other_table.publish("c", 3)
    assert drain(subs[0], 1, 20) == [1]
    assert drain(subs[1], 1, 20) == [2]
    assert drain(subs[2], 1, 20) == [3]
    for sub in subs:
        assert_quiet(sub)


def broadcast_sessions(dsn: str) -> int:
    """The ``rselection:broadcast`` sessions this test process holds on the server."""
    return process_sessions(dsn, os.getpid())["rselection:broadcast"]


def test_broadcasters_of_a_process_share_one_listening_session(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    base = broadcast_sessions(pg_dsn)
    first, second = make_bc(), make_bc()
    third = make_bc(table="bc_third")  # another outbox table, on the same session
    subs = {
        "first": first.subscribe("a"),
        "second": second.subscribe("b"),
        "second-too": second.subscribe("a"),
        "third": third.subscribe("a"),
    }
    assert {bc.stats().listening for bc in (first, second, third)} == {True}
    pids = {bc.stats().listener_pid for bc in (first, second, third)}
    assert len(pids) == 1 and None not in pids, f"listener sessions {pids}"
    # Nothing published yet, so no writer is connected: one session for the three.
    assert broadcast_sessions(pg_dsn) == base + 1

    first.publish("a", "a from first")
    second.publish("b", "b from second")
    third.publish("a", "a on the third table")
    for bc in (first, second, third):
        assert bc.flush(20)
    assert drain(subs["first"], 1, 20) == ["a from first"]
    assert drain(subs["second"], 1, 20) == ["b from second"]
    assert drain(subs["second-too"], 1, 20) == ["a from first"]
    assert drain(subs["third"], 1, 20) == ["a on the third table"]
    for sub in subs.values():
        assert_quiet(sub, 0.3)
    assert first.stats().received == second.stats().received == 2, "its own table's rows"
    assert third.stats().received == 1

    # Reference-counted: the session stays while one broadcaster is left...
    first.close()
    second.close()
    assert not third.closed
    third.publish("a", "still heard")
    assert drain(subs["third"], 1, 20) == ["still heard"]
    assert third.stats().listener_pid in pids
    # ...and closes with the last one (writers included).
    third.close()
    wait_until(lambda: broadcast_sessions(pg_dsn) == base, 10, "every broadcast session closed")


def test_listener_killed_while_publishing_catches_up_in_order(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    publisher = make_bc()
    listener = make_bc(**QUICK)
    sub = listener.subscribe("stream", maxsize=10_000)
    total = 3_000
    done = threading.Event()

    def publish() -> None:
        for i in range(total):
            publisher.publish("stream", i)
            if i % 50 == 0:
                time.sleep(0.005)  # spread the stream over the kills
        done.set()

    threading.Thread(target=publish, daemon=True).start()
    kills = 0
    for _ in range(3):
        time.sleep(0.1)
        wait_until(lambda: listener.stats().listener_pid is not None, 20, "the listener")
        kills += terminate(pg_dsn, listener.stats().listener_pid)
    assert kills >= 1
    assert done.wait(30)
    assert publisher.flush(20)
    assert drain(sub, total, 60) == list(range(total))
    assert_quiet(sub)
    wait_until(lambda: listener.stats().reconnects >= 1, 10, "a counted reconnect")


def test_writer_connection_killed_while_publishing_writes_each_message_once(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    table = f"bc_{uuid.uuid4().hex[:12]}"  # names the pooled session that publishes
    publisher = make_bc(table=table, **QUICK)
    listener = make_bc(table=table)
    sub = listener.subscribe("w", maxsize=10_000)
    total = 3_000

    def writer_pids() -> list[int]:
        own = {listener.stats().listener_pid, publisher.stats().listener_pid}
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'rselection:pool'"
                " AND query LIKE %s",
                (f'%INSERT INTO %."{table}"%',),  # schema-qualified
            ).fetchall()
        return [int(r[0]) for r in rows if r[0] not in own]

    for i in range(total):
        publisher.publish("w", i)
        if i in (500, 1500, 2500):
            wait_until(lambda: bool(writer_pids()), 20, "the writer's session")
            for pid in writer_pids():
                terminate(pg_dsn, pid)
        if i % 100 == 0:
            time.sleep(0.01)
    assert publisher.flush(30)
    assert drain(sub, total, 60) == list(range(total))
    assert_quiet(sub)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table} WHERE channel = 'w'").fetchone()
    assert row == (total,)


@pytest.mark.parametrize("old_session_commits", [True, False], ids=["committed", "ended"])
def test_publish_whose_commit_was_not_confirmed_is_never_written_twice(
    pg_dsn: str,
    make_bc: Callable[..., PostgresBroadcaster],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
    old_session_commits: bool,
) -> None:
    proxy = proxy_for(pg_dsn, make_tcp_proxy)
    listener = make_bc()
    sub = listener.subscribe("amb")
    publisher = make_bc(proxied(pg_dsn, proxy), probe_interval=0.3, io_timeout=5.0)
    publisher.publish("amb", "warm-up")  # the writer connects and resolves the table
    assert publisher.flush(20)
    assert drain(sub, 1, 20) == ["warm-up"]
    with psycopg.connect(pg_dsn, autocommit=True) as blocker, blocker.transaction():
        # Hold the publish lock: the writer's next batch waits for it on the server.
        hold_publish_lock(blocker, publisher.table)
        publisher.publish("amb", "once")
        wait_until(lambda: blocked_by(pg_dsn, blocker), 20, "the writer blocked")
        [old_pid] = blocked_by(pg_dsn, blocker)
        # The client sees its connection reset; its server session still holds the
        # batch and will commit it once the lock is free, unless it is ended first.
        proxy.sever()
        if not old_session_commits:
            wait_until(lambda: not alive(pg_dsn, old_pid), 20, "the old session ended")
    # Lock released: an old session still alive commits the batch now.
    assert publisher.flush(30)
    assert drain(sub, 1, 20) == ["once"]
    assert_quiet(sub, 1.0)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM rselection_broadcast WHERE payload = %s", ('"once"',)
        ).fetchone()
    assert row == (1,)


def test_batch_confirmed_before_the_writer_session_was_cut_is_counted_once(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    table = f"bc_{uuid.uuid4().hex[:12]}"
    # Purges every second; a purge blocked on a row lock gives up after `io_timeout`.
    publisher = make_bc(table=table, retention=1.0, io_timeout=4.0)
    publisher.publish("c", "old")
    assert publisher.flush(20)

    def purges_blocked() -> list[tuple[int, Any]]:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid, query_start FROM pg_stat_activity"
                " WHERE application_name = 'rselection:pool' AND wait_event_type = 'Lock'"
                " AND query LIKE %s",
                (f'%DELETE FROM %."{table}"%',),  # schema-qualified
            ).fetchall()
        return [(int(pid), start) for pid, start in rows]

    with psycopg.connect(pg_dsn, autocommit=True) as blocker:
        with blocker.transaction():
            # Lock the row while it is younger than the retention: once it is older, the
            # writer's purges wait on it until their timeout.
            locked = blocker.execute(f"SELECT id FROM {table} FOR UPDATE").fetchall()
            assert len(locked) == 1, "the first message is still there"
            wait_until(purges_blocked, 10, "a purge blocked")
            [(_, first_start)] = purges_blocked()
            publisher.publish("c", "confirmed")  # written once that purge gives up
            # The next loop writes it (commit confirmed) and, the purge being due, purges
            # again in the same round: cut the session there.
            wait_until(
                lambda: any(start > first_start for _, start in purges_blocked()),
                15,
                "the purge after the confirmed write",
            )
            [(pid, _)] = purges_blocked()
            assert terminate(pg_dsn, pid) == 1
        publisher.publish("c", "after the reconnect")
        assert publisher.flush(30)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table} WHERE payload <> '\"old\"'").fetchone()
    assert row == (2,), "each message written once"
    assert publisher.stats().published == 3, "each message counted once"


def alive(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return (
            conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            is not None
        )


def test_blackholed_listener_is_found_by_its_probe_and_catches_up(
    pg_dsn: str,
    make_bc: Callable[..., PostgresBroadcaster],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = proxy_for(pg_dsn, make_tcp_proxy)
    publisher = make_bc()
    listener = make_bc(proxied(pg_dsn, proxy), **QUICK)
    sub = listener.subscribe("h", maxsize=10_000)
    publisher.publish("h", 0)
    assert drain(sub, 1, 20) == [0]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        proxy.blackhole()
        started = time.monotonic()
        # probe_interval + io_timeout (+ scheduling slack on a busy machine).
        wait_until(lambda: not listener.stats().listening, 15, "the half-open connection found")
        found_after = time.monotonic() - started
        for i in range(1, 101):
            publisher.publish("h", i)
        assert publisher.flush(20)
        proxy.heal()
        assert drain(sub, 100, 60) == list(range(1, 101))
    assert found_after < 10, f"the dead connection was found only after {found_after:.1f} s"
    assert "lost its connection" in caplog.text
    wait_until(lambda: listener.stats().listening, 20, "the listener back")
    assert listener.stats().reconnects >= 1
    assert listener.stats().gaps == 0
    assert_quiet(sub)


def test_slow_subscriber_does_not_slow_the_others_and_its_overflow_is_reported(
    make_bc: Callable[..., PostgresBroadcaster], caplog: pytest.LogCaptureFixture
) -> None:
    overflowed: list[int] = []
    publisher = make_bc()
    listener = make_bc(on_overflow=lambda channel, sub: overflowed.append(sub.overflowed))
    never_read = listener.subscribe("s", maxsize=10)
    fast = listener.subscribe("s", maxsize=5_000)
    total = 3_000
    with caplog.at_level(logging.WARNING, logger="rselection.broadcast"):
        started = time.monotonic()
        for i in range(total):
            publisher.publish("s", i)
        assert drain(fast, total, 30) == list(range(total))
        elapsed = time.monotonic() - started
    assert never_read.pending == 10
    assert never_read.overflowed == total - 10
    assert listener.stats().overflowed == total - 10
    assert overflowed and overflowed[0] == 1, "the first drop is reported"
    assert "not keeping up" in caplog.text
    assert elapsed < 30
    assert drain(never_read, 10, 5) == list(range(10)), "it keeps the oldest messages"


def lost_rows(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM rselection_broadcast WHERE payload LIKE '%%lost%%'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_gap_past_retention_is_reported(
    pg_dsn: str,
    make_bc: Callable[..., PostgresBroadcaster],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = proxy_for(pg_dsn, make_tcp_proxy)
    publisher = make_bc(retention=1.0)
    gaps: list[Gap] = []
    listener = make_bc(proxied(pg_dsn, proxy), on_gap=gaps.append, **QUICK)
    sub = listener.subscribe("g", maxsize=1_000)
    publisher.publish("g", "before")
    assert drain(sub, 1, 20) == ["before"]
    seen = listener.stats().last_id
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        proxy.blackhole()
        wait_until(lambda: not listener.stats().listening, 15, "the listener cut off")
        for i in range(5):
            publisher.publish("g", f"lost {i}")
        assert publisher.flush(20)
        time.sleep(1.5)  # older than the retention now
        publisher.purge()  # the writer may have purged them already, by itself
        assert lost_rows(pg_dsn) == 0
        publisher.publish("g", "after")
        assert publisher.flush(20)
        proxy.heal()
        assert drain(sub, 1, 30) == ["after"]
    stats = listener.stats()
    assert stats.gaps == 1
    assert len(gaps) == 1 and gaps[0].after_id == seen
    assert gaps[0].through_id >= seen + 5 and stats.missed == gaps[0].missed >= 5
    assert "fell behind by more than retention" in caplog.text
    assert_quiet(sub)


def recreate_outbox(conn: psycopg.Connection[Any], table: str) -> None:
    """Drop the outbox table and create it again in one transaction (its ``_state`` table
    stays); ``migrate()`` joins the open transaction, where ``create_tables()`` refuses."""
    with conn.transaction():
        conn.execute(f"DROP TABLE {table}")
        migrate(
            conn,
            table=None,
            claims_table=None,
            elections_table=None,
            nodes_table=None,
            broadcast_table=table,
            checkpoint_prefix=None,
        )


@pytest.mark.parametrize("how", ["recreated", "truncated"])
def test_outbox_ids_going_back_are_reported_and_the_listener_delivers_the_new_ones(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster], how: str
) -> None:
    table = f"bc_{uuid.uuid4().hex[:12]}"
    gaps: list[Gap] = []
    publisher = make_bc(table=table)
    listener = make_bc(table=table, on_gap=gaps.append, probe_interval=0.3)
    sub = listener.subscribe("r", maxsize=1_000)
    for i in range(30):
        publisher.publish("r", f"before {i}")
    assert drain(sub, 30, 20) == [f"before {i}" for i in range(30)]
    old_last = listener.stats().last_id
    assert old_last >= 30
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if how == "recreated":
            recreate_outbox(conn, table)  # as a restore would: another table, same name
        else:
            conn.execute(f"TRUNCATE {table} RESTART IDENTITY")
    for i in range(5):
        publisher.publish("r", f"after {i}")
    assert publisher.flush(30)
    # The new ids (1, 2, ...) are below the last one delivered: still delivered.
    assert drain(sub, 5, 30) == [f"after {i}" for i in range(5)]
    assert_quiet(sub)
    wait_until(lambda: len(gaps) == 1, 10, "the reset reported")
    [gap] = gaps
    assert gap.reset and gap.after_id == old_last and gap.missed == 0
    stats = listener.stats()
    assert stats.resets == 1 and stats.gaps == 0 and stats.missed == 0
    assert stats.last_id < old_last
    publisher.publish("r", "later")
    assert drain(sub, 1, 20) == ["later"]
    assert_quiet(sub)
    assert len(gaps) == 1


def test_outbox_recreated_while_the_listener_was_cut_off_is_found_by_its_identity(
    pg_dsn: str,
    make_bc: Callable[..., PostgresBroadcaster],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    proxy = proxy_for(pg_dsn, make_tcp_proxy)
    table = f"bc_{uuid.uuid4().hex[:12]}"
    gaps: list[Gap] = []
    publisher = make_bc(table=table)
    listener = make_bc(proxied(pg_dsn, proxy), table=table, on_gap=gaps.append, **QUICK)
    sub = listener.subscribe("r", maxsize=1_000)
    for i in range(10):
        publisher.publish("r", f"before {i}")
    assert drain(sub, 10, 20) == [f"before {i}" for i in range(10)]
    old_last = listener.stats().last_id
    proxy.blackhole()
    wait_until(lambda: not listener.stats().listening, 15, "the listener cut off")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        recreate_outbox(conn, table)
    # More new messages than old ones: the new ids pass the last one delivered, so
    # only the table's identity tells the listener that ids 1..old_last are new too.
    after = [f"after {i}" for i in range(old_last + 20)]
    for msg in after:
        publisher.publish("r", msg)
    assert publisher.flush(30)
    proxy.heal()
    assert drain(sub, len(after), 30) == after
    assert_quiet(sub)
    assert len(gaps) == 1 and gaps[0].reset and gaps[0].after_id == old_last
    assert listener.stats().resets == 1


def test_listener_starting_on_a_recreated_outbox_ignores_the_old_watermark(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    table = f"bc_{uuid.uuid4().hex[:12]}"
    old = make_bc(table=table, retention=0.2)
    for i in range(20):
        old.publish("w", i)
    assert old.flush(20)

    def watermark() -> int:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            row = conn.execute(f"SELECT purged_through FROM {table}_state").fetchone()
        assert row is not None
        return int(row[0])

    wait_until(lambda: old.purge() >= 0 and watermark() >= 20, 10, "the old rows purged")
    old.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        recreate_outbox(conn, table)  # the state table, and its watermark, stay
    publisher = make_bc(table=table)
    publisher.publish("w", "first of the new table")
    assert publisher.flush(20)
    listener = make_bc(table=table)
    sub = listener.subscribe("w")
    publisher.publish("w", "after subscribe")  # id 2, below the old watermark
    assert drain(sub, 1, 20) == ["after subscribe"]
    assert_quiet(sub)
    assert listener.stats().gaps == 0


def test_publishes_go_on_after_the_state_row_was_deleted(
    make_bc: Callable[..., PostgresBroadcaster], pg_dsn: str
) -> None:
    """Publishes lock the state table's row to keep ids in commit order: a row deleted
    by hand is put back, and nothing waits for it."""
    bc = make_bc(create_tables=True)
    sub = bc.subscribe("state")
    bc.publish("state", 1)
    assert drain(sub, 1, 20) == [1]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM rselection_broadcast_state")
    bc.publish("state", 2)
    assert bc.flush(10)
    assert drain(sub, 1, 10) == [2]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM rselection_broadcast_state").fetchone() == (1,)


def test_retention_purge_runs_by_itself(
    make_bc: Callable[..., PostgresBroadcaster], pg_dsn: str
) -> None:
    publisher = make_bc(retention=0.5)
    for i in range(20):
        publisher.publish("p", i)
    assert publisher.flush(20)

    def rows() -> int:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM rselection_broadcast").fetchone()
        assert row is not None
        return int(row[0])

    # The writer purges every max(1 s, retention / 10), jittered: well within 10 s.
    wait_until(lambda: rows() == 0, 10, "old messages purged")


def test_new_listener_starts_at_the_end_without_a_gap(
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    publisher = make_bc(retention=0.2)
    for i in range(10):
        publisher.publish("n", i)
    assert publisher.flush(20)
    time.sleep(0.5)
    publisher.purge()
    late = make_bc()
    sub = late.subscribe("n")
    publisher.publish("n", "new")
    assert drain(sub, 1, 20) == ["new"]
    assert late.stats().gaps == 0


def test_publisher_only_node_does_not_listen(
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    publisher = make_bc()
    other = make_bc()
    sub = other.subscribe("po", maxsize=1_000)
    for i in range(200):
        publisher.publish("po", i)
    assert publisher.flush(20)
    assert drain(sub, 200, 30) == list(range(200))
    stats = publisher.stats()
    assert stats.published == 200
    assert stats.listener_pid is not None, "connected (wait_ready), just not listening"
    assert not stats.listening
    assert stats.received == 0, "its listener never woke for a message"
    assert other.stats().listening and other.stats().received == 200


def test_late_subscriber_gets_everything_published_after_subscribe_returned(
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    publisher = make_bc()  # publishes and, later, subscribes to its own messages
    late_node = make_bc()  # another node, idle until it subscribes
    total = 3_000
    published = 0
    stop = threading.Event()

    def publish() -> None:
        nonlocal published
        for i in range(total):
            publisher.publish("late", i)
            published = i + 1
            if i % 20 == 0:
                time.sleep(0.002)
        stop.set()

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    wait_until(lambda: published >= 300, 20, "the stream under way")
    own = publisher.subscribe("late", maxsize=10_000)
    own_mark = published  # every i >= this was published after subscribe() returned
    wait_until(lambda: published >= own_mark + 300, 20, "more of the stream")
    other = late_node.subscribe("late", maxsize=10_000)
    other_mark = published
    assert own_mark < total - 500 and other_mark < total - 200, "subscribed mid-stream"
    assert stop.wait(60)
    assert publisher.flush(20)
    for sub, mark in ((own, own_mark), (other, other_mark)):
        got = drain(sub, total - mark, 60)
        while True:  # the rest, if the subscription started before the mark
            try:
                got.append(sub.get(1.0))
            except TimeoutError:
                break
        first = got[0]
        assert first <= mark
        # A contiguous tail of the stream, in order, each once, through the last message.
        assert got == list(range(first, total))
    assert publisher.stats().gaps == late_node.stats().gaps == 0


def test_subscribe_does_not_wait_for_another_broadcasters_catch_up(
    make_bc: Callable[..., PostgresBroadcaster], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One row per fetch (a page is bounded by the bytes of its rows, and by a number of
    # rows set to 1 here): the publisher's listener needs one round trip per message to
    # catch up on a backlog, and the broadcasters of this process share its listening
    # thread.
    monkeypatch.setattr("rselection.postgres.broadcast.listener._FETCH_ROWS", 1)
    publisher = make_bc(max_message_bytes=256 * 1024 * 1024, max_pending=20_000)
    late_node = make_bc()
    total = 5_000
    own = publisher.subscribe("backlog", maxsize=total + 100)
    for i in range(total):
        publisher.publish("backlog", i)
    assert publisher.flush(30)
    assert drain(own, 1, 20) == [0], "the catch-up under way"
    other = late_node.subscribe("backlog")
    behind = total - publisher.stats().received
    # A new reader starts within a turn of the shared thread, not after the backlog
    # another broadcaster of the process is still fetching.
    assert behind > 0, "subscribe() waited for the other listener's whole catch-up"
    publisher.publish("backlog", "after")
    assert drain(other, 1, 20) == ["after"]
    assert_quiet(other)
    assert drain(own, total, 60) == [*range(1, total), "after"]
    assert publisher.stats().gaps == late_node.stats().gaps == 0


def test_a_fetch_page_holds_the_rows_that_fit_in_its_bytes_and_at_least_one(
    make_bc: Callable[..., PostgresBroadcaster], pg_dsn: str
) -> None:
    bc = make_bc()
    for size in (100, 100, 5000, 100):
        bc.publish("pages", "a" * (size - 2))  # `size` bytes of JSON
    assert bc.flush(10)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        locator = Locator(Outbox(BROADCAST_TABLE))
        locator.read_path(conn)
        location = locator.find(conn)
        fetches = Fetches(conn, location, locator)

        def page(after: int, rows: int, size: int, woken: bool) -> list[int | None]:
            got = fetches.run(after, rows, size, woken=woken)
            assert {row[:3] for row in got} == {(0, 4, location.oid)}
            return [row[3] for row in got]

        for woken in (True, False):
            # Rows while the payloads before them add up to less than the bytes.
            assert page(0, 1000, 150, woken) == [1, 2]
            assert page(0, 1000, 201, woken) == [1, 2, 3]
            assert page(0, 1000, 5201, woken) == [1, 2, 3, 4]
            assert page(0, 3, 10**9, woken) == [1, 2, 3]
            # At least one row, whatever its size.
            assert page(2, 1000, 1, woken) == [3]
            assert page(4, 1000, 1, woken) == [None]


def test_notifications_received_during_a_fetch_wait_for_the_listener(
    make_bc: Callable[..., PostgresBroadcaster], pg_dsn: str
) -> None:
    """The fetch runs through libpq, which keeps the NOTIFYs that arrive meanwhile: they
    are handed to psycopg, so the listener's next wait sees them at once."""
    make_bc()
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        psycopg.connect(pg_dsn, autocommit=True) as other,
    ):
        locator = Locator(Outbox(BROADCAST_TABLE))
        locator.read_path(conn)
        fetches = Fetches(conn, locator.find(conn), locator)
        conn.execute("LISTEN wake")
        for n in range(3):
            other.execute("SELECT pg_notify('wake', %s)", (str(n),))
            fetches.run(0, 10, 1000, woken=n % 2 == 0)  # reads the NOTIFY off the socket
            notes = list(conn.notifies(timeout=0.0))
            assert [(note.channel, note.payload) for note in notes] == [("wake", str(n))]


def test_listener_stops_with_the_last_reader_and_starts_again(
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    publisher = make_bc()
    node = make_bc(probe_interval=0.3)
    sub = node.subscribe("cycle")
    assert node.stats().listening
    publisher.publish("cycle", "first")
    assert drain(sub, 1, 20) == ["first"]
    sub.close()
    # It notices at its next wake-up: a message or a probe.
    wait_until(lambda: not node.stats().listening, 10, "the listener stopped")
    received = node.stats().received
    for i in range(20):
        publisher.publish("cycle", f"unheard {i}")
    assert publisher.flush(20)
    time.sleep(0.5)
    assert node.stats().received == received, "an idle node reads nothing"

    got: list[Any] = []
    disconnect = node.connect("cycle", lambda channel, msg: got.append(msg))
    assert node.stats().listening, "connect() returns once the listener listens"
    again = node.subscribe("cycle")
    publisher.publish("cycle", "second")
    assert drain(again, 1, 20) == ["second"]
    assert_quiet(again)
    wait_until(lambda: got == ["second"], 10, "the receiver")
    again.close()
    publisher.publish("cycle", "receiver only")
    wait_until(lambda: got == ["second", "receiver only"], 10, "the receiver alone")
    assert node.stats().listening, "a receiver keeps the listener"
    disconnect()
    publisher.publish("cycle", "nobody")
    wait_until(lambda: not node.stats().listening, 10, "the listener stopped again")
    assert node.stats().gaps == 0


def test_subscribe_while_postgres_is_unreachable_returns_after_timeout(
    pg_dsn: str,
    make_bc: Callable[..., PostgresBroadcaster],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = proxy_for(pg_dsn, make_tcp_proxy)
    publisher = make_bc()
    node = make_bc(proxied(pg_dsn, proxy), probe_interval=0.3, io_timeout=1.0)
    assert not node.stats().listening
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        proxy.blackhole()
        started = time.monotonic()
        sub = node.subscribe("down")
        waited = time.monotonic() - started
        assert "could LISTEN" in caplog.text
    assert 0.9 <= waited < 5, f"subscribe() waited {waited:.1f} s"
    proxy.heal()
    wait_until(lambda: node.stats().listening, 30, "the listener back")
    publisher.publish("down", "after")
    assert drain(sub, 1, 20) == ["after"]
    assert_quiet(sub)


def test_batches_carry_any_channel_and_payload_text(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    awkward = ["NULL", "", " x ", 'q"uo\\te', "{a,b}", "\\N", "é€😀", '\n\t\\"', "'", ","]
    with psycopg.connect(pg_dsn, autocommit=True, client_encoding="UTF8") as conn:
        literal = text_array(value.encode() for value in awkward)
        result = conn.pgconn.exec_params(b"SELECT $1::text[]", [literal])
        assert result.status == psycopg.pq.ExecStatus.TUPLES_OK
        parsed = conn.execute("SELECT %s::text[]", (result.get_value(0, 0).decode(),)).fetchone()
        assert parsed is not None and parsed[0] == awkward
    a, b = make_bc(), make_bc()
    channels = [name or "empty" for name in awkward]
    subs = {name: b.subscribe(name, maxsize=1_000) for name in channels}
    sent = [
        (channels[i % len(channels)], {"i": i, "text": awkward[i % len(awkward)]})
        for i in range(300)
    ]
    batches: list[int] = []
    write = a._writer.write

    def counting_write(conn: Any, batch: Any) -> None:
        batches.append(len(batch))
        write(conn, batch)

    a._writer.write = counting_write  # type: ignore[method-assign]
    for channel, msg in sent:
        a.publish(channel, msg)  # a tight loop: the writer takes them in batches
    assert a.flush(20)
    assert max(batches) > 1, "several messages per statement"
    for name in channels:
        expected = [msg for channel, msg in sent if channel == name]
        assert drain(subs[name], len(expected), 20) == expected, repr(name)


async def _read_async(sub: Subscription, n: int) -> list[Any]:
    out: list[Any] = []
    async with asyncio.timeout(20):
        async for msg in sub:
            out.append(msg)
            if len(out) == n:
                break
    return out


def test_async_iteration(make_bc: Callable[..., PostgresBroadcaster]) -> None:
    a, b = make_bc(), make_bc()
    sub = b.subscribe("async")
    for i in range(5):
        a.publish("async", {"n": i})
    assert asyncio.run(_read_async(sub, 5)) == [{"n": i} for i in range(5)]


def test_postgres_leader_hands_the_broadcaster_to_tasks(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    node_bc = make_bc()
    other_node = make_bc()
    from_leader = other_node.subscribe("from-leader")
    tasks = rs.TaskHandler()
    echoed = threading.Event()

    @tasks.persistent("echo")
    def echo(ctx: rs.TaskContext) -> None:
        assert ctx.broadcaster is node_bc
        with ctx.broadcaster.subscribe("to-leader") as inbox:
            ctx.broadcaster.publish("from-leader", {"term": ctx.term, "hello": True})
            while not ctx.cancelled.is_set():
                try:
                    msg = inbox.get(0.1)
                except TimeoutError:
                    continue
                ctx.broadcaster.publish("from-leader", {"echo": msg})
                echoed.set()

    leader = PostgresLeader(
        pg_dsn,
        tasks,
        name="bc-leader",
        ttl=3.0,
        renew_interval=0.5,
        renew_deadline=2.0,
        retry_interval=0.5,
        broadcaster=node_bc,
    )
    leader.start()
    try:
        assert leader.wait_until_leader(20)
        first = drain(from_leader, 1, 20)[0]
        assert first == {"term": leader.term, "hello": True}
        other_node.publish("to-leader", [1, "two"])
        assert drain(from_leader, 1, 20) == [{"echo": [1, "two"]}]
        assert echoed.is_set()
    finally:
        leader.stop(timeout=10)


# --------------------------------------------------------------------------- bad input


class NotJson:
    pass


@pytest.mark.parametrize(
    "message",
    [NotJson(), {1, 2}, float("nan"), {"t": float("inf")}, b"bytes", {"k": object()}],
    ids=["object", "set", "nan", "inf", "bytes", "nested"],
)
def test_message_without_json_form_is_refused(
    make_bc: Callable[..., PostgresBroadcaster], message: object
) -> None:
    bc = make_bc()
    with pytest.raises(MessageEncodeError, match="cannot be sent as JSON") as info:
        bc.publish("c", message)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, TypeError)
    assert bc.stats().pending == 0


def test_circular_message_is_refused(make_bc: Callable[..., PostgresBroadcaster]) -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(MessageEncodeError, match="circular"):
        make_bc().publish("c", loop)


@pytest.mark.parametrize("channel", ["", None, 7, "nul\x00inside", "\ud800"])
def test_bad_channel_is_refused(make_bc: Callable[..., PostgresBroadcaster], channel: Any) -> None:
    bc = make_bc()
    with pytest.raises(ConfigError, match="channel"):
        bc.publish(channel, 1)
    assert bc.stats().pending == 0


def test_oversized_message_is_refused(make_bc: Callable[..., PostgresBroadcaster]) -> None:
    bc = make_bc(max_message_bytes=1000)
    with pytest.raises(ConfigError, match="max_message_bytes=1000"):
        bc.publish("c", "x" * 1000)
    bc.publish("c", "x" * 990)


def test_publish_after_close_raises(make_bc: Callable[..., PostgresBroadcaster]) -> None:
    a, b = make_bc(), make_bc()
    sub = b.subscribe("last")
    a.publish("last", "final words")
    a.close()  # writes what is pending first
    assert a.closed and a.stats().closed and a.stats().pending == 0
    assert drain(sub, 1, 20) == ["final words"]
    with pytest.raises(BroadcasterClosed, match="closed"):
        a.publish("last", "too late")
    with pytest.raises(BroadcasterClosed):
        a.subscribe("last")
    a.close()  # idempotent


def test_close_wakes_readers_and_is_quick(make_bc: Callable[..., PostgresBroadcaster]) -> None:
    bc = make_bc(probe_interval=30.0)
    sub = bc.subscribe("c")
    started = time.monotonic()
    bc.close()
    assert time.monotonic() - started < 5, "close must not wait for the probe interval"
    assert sub.closed


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"retention": 0}, "retention"),
        ({"retention": -1}, "retention"),
        ({"retention": float("inf")}, "retention"),
        ({"retention": "10"}, "retention"),
        ({"probe_interval": 0}, "probe_interval"),
        ({"io_timeout": float("nan")}, "io_timeout"),
        ({"close_timeout": True}, "close_timeout"),
        ({"max_message_bytes": 0}, "max_message_bytes"),
        ({"max_message_bytes": 2**40}, "max_message_bytes"),
        ({"max_pending": 0}, "max_pending"),
        ({"table": "x; drop table y"}, "table"),
        ({"table": "a.b.c"}, "table"),
        ({"on_gap": 5}, "on_gap"),
        ({"on_overflow": "no"}, "on_overflow"),
    ],
)
def test_bad_settings_fail_at_construction(
    pg_dsn: str, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        PostgresBroadcaster(pg_dsn, **options)


@pytest.mark.parametrize("conninfo", ["", "   ", "host=x port", "postgresql://[bad", None, 42])
def test_bad_conninfo_fails_at_construction(conninfo: Any) -> None:
    with pytest.raises(ConfigError, match=r"PostgresBroadcaster needs a conninfo|parsed"):
        PostgresBroadcaster(conninfo)


class PoolWithConninfo:
    """The part of psycopg_pool.ConnectionPool a broadcaster reads: conninfo, kwargs."""

    def __init__(self, conninfo: str, **kwargs: Any) -> None:
        self.conninfo = conninfo
        self.kwargs = kwargs

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        raise AssertionError("a broadcaster opens sessions of its own, it never borrows")
        yield  # pragma: no cover


def test_a_connection_or_a_pool_gives_the_parameters_of_its_own_sessions(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    options = params.pop("options", None)  # the test's schema, given as a pool kwarg
    pool = PoolWithConninfo(
        psycopg.conninfo.make_conninfo("", **params),
        options=options,
        autocommit=True,  # not a libpq parameter: ignored
    )
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        by_conn = make_bc(conn)
        by_pool = make_bc(pool)
        sub = by_pool.subscribe("c")
        by_conn.publish("c", "from a connection's parameters")
        assert drain(sub, 1, 20) == ["from a connection's parameters"]
        assert by_conn.stats().listener_pid != conn.info.backend_pid
    with pytest.raises(ConfigError, match="has no str attribute 'conninfo'"):
        PostgresBroadcaster(TinyPoolWithoutConninfo())


class TinyPoolWithoutConninfo:
    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        raise AssertionError("never used")
        yield  # pragma: no cover


def test_missing_table_without_create_tables_is_reported(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bc = PostgresBroadcaster(pg_dsn, create_tables=False, **QUICK)
        try:
            assert not bc.wait_ready(1.0)
            wait_until(lambda: "does not exist" in caplog.text, 10, "the warning")
            assert "migrate(conninfo, broadcast_table=" in caplog.text
        finally:
            bc.close()


def current_schema(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
    assert row is not None and row[0]
    return str(row[0])


def create_outbox(conn: psycopg.Connection[Any], table: str) -> None:
    """Create the outbox tables ``table`` (schema-qualified) as ``migrate()`` does."""
    migrate(
        conn,
        table=None,
        claims_table=None,
        elections_table=None,
        nodes_table=None,
        broadcast_table=table,
        checkpoint_prefix=None,
    )


def rows_in(dsn: str, table: str, channel: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {table} WHERE channel = %s", (channel,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_writer_and_listener_follow_a_table_that_a_schema_earlier_in_the_path_now_holds(
    pg_server_dsn: str,
    make_pg_dsn: Callable[[], str],
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    home = current_schema(make_pg_dsn())
    early = f"t_{uuid.uuid4().hex[:16]}"  # first in the path, created later
    dsn = with_search_path(pg_server_dsn, f"{early},{home}")
    table = f"bc_{uuid.uuid4().hex[:12]}"
    gaps: list[Gap] = []
    publisher = make_bc(dsn, table=table)
    listener = make_bc(dsn, table=table, on_gap=gaps.append, probe_interval=0.3)
    sub = listener.subscribe("s")
    publisher.publish("s", "before")
    assert drain(sub, 1, 20) == ["before"]
    try:
        with psycopg.connect(pg_server_dsn, autocommit=True) as admin:
            admin.execute(f"CREATE SCHEMA {early}")
            create_outbox(admin, f"{early}.{table}")
        # The name now means the table of the earlier schema, for every new session too.
        sub.close()
        wait_until(lambda: not listener.stats().listening, 10, "the listener released")
        sub = listener.subscribe("s")
        after = [f"after {i}" for i in range(3)]
        for msg in after:
            publisher.publish("s", msg)
        assert publisher.flush(20)
        assert drain(sub, 3, 20) == after, "written where the listener reads"
        assert_quiet(sub)
        assert rows_in(pg_server_dsn, f"{early}.{table}", "s") == 3
        assert rows_in(pg_server_dsn, f"{home}.{table}", "s") == 1
    finally:
        for bc in (publisher, listener):
            bc.close()
        with psycopg.connect(pg_server_dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA IF EXISTS {early} CASCADE")


def test_a_listening_node_follows_the_table_to_an_earlier_schema_with_the_writer(
    pg_server_dsn: str,
    make_pg_dsn: Callable[[], str],
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    home = current_schema(make_pg_dsn())
    early = f"t_{uuid.uuid4().hex[:16]}"
    dsn = with_search_path(pg_server_dsn, f"{early},{home}")
    table = f"bc_{uuid.uuid4().hex[:12]}"
    gaps: list[Gap] = []
    publisher = make_bc(dsn, table=table)
    listener = make_bc(dsn, table=table, on_gap=gaps.append, probe_interval=0.3)
    sub = listener.subscribe("s")
    publisher.publish("s", "before")
    assert drain(sub, 1, 20) == ["before"]
    try:
        with psycopg.connect(pg_server_dsn, autocommit=True) as admin:
            admin.execute(f"CREATE SCHEMA {early}")
            create_outbox(admin, f"{early}.{table}")
        after = [f"after {i}" for i in range(3)]
        for msg in after:
            publisher.publish("s", msg)
        assert publisher.flush(20)
        assert drain(sub, 3, 20) == after, "the listener followed the writer"
        assert_quiet(sub)
        assert rows_in(pg_server_dsn, f"{early}.{table}", "s") == 3
        wait_until(lambda: len(gaps) == 1, 10, "the change of table reported")
        assert gaps[0].reset
    finally:
        for bc in (publisher, listener):
            bc.close()
        with psycopg.connect(pg_server_dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA IF EXISTS {early} CASCADE")


def test_writer_and_listener_follow_the_table_moved_to_another_schema_of_the_path(
    pg_server_dsn: str,
    make_pg_dsn: Callable[[], str],
    make_bc: Callable[..., PostgresBroadcaster],
) -> None:
    first, second = current_schema(make_pg_dsn()), current_schema(make_pg_dsn())
    dsn = with_search_path(pg_server_dsn, f"{first},{second}")
    table = f"bc_{uuid.uuid4().hex[:12]}"
    gaps: list[Gap] = []
    publisher = make_bc(dsn, table=table)
    listener = make_bc(dsn, table=table, on_gap=gaps.append, probe_interval=0.3)
    sub = listener.subscribe("m")
    publisher.publish("m", "before")
    assert drain(sub, 1, 20) == ["before"]
    with psycopg.connect(pg_server_dsn, autocommit=True) as admin, admin.transaction():
        for name in (table, f"{table}_state"):
            admin.execute(f"ALTER TABLE {first}.{name} SET SCHEMA {second}")
    after = [f"after {i}" for i in range(3)]
    for msg in after:
        publisher.publish("m", msg)
    assert publisher.flush(20), "the writer follows the table"
    assert drain(sub, 3, 20) == after
    assert_quiet(sub)
    assert rows_in(pg_server_dsn, f"{second}.{table}", "m") == 4
    assert not gaps, "the same table: nothing to resynchronise"


def test_batch_cut_after_its_commit_is_written_once_after_the_ids_were_reset(
    pg_dsn: str,
    make_bc: Callable[..., PostgresBroadcaster],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    proxy = proxy_for(pg_dsn, make_tcp_proxy)
    table = f"bc_{uuid.uuid4().hex[:12]}"
    publisher = make_bc(proxied(pg_dsn, proxy), table=table, probe_interval=0.3, io_timeout=5.0)
    for i in range(50):
        publisher.publish("amb", i)
    assert publisher.flush(20)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table} RESTART IDENTITY")
    publisher.publish("amb", "after the reset")  # ids start at 1 again
    assert publisher.flush(20)
    with psycopg.connect(pg_dsn, autocommit=True) as blocker, blocker.transaction():
        hold_publish_lock(blocker, table)
        publisher.publish("amb", "once")
        wait_until(lambda: blocked_by(pg_dsn, blocker), 20, "the writer blocked")
        proxy.sever()  # its server session commits the batch once the lock is free
    assert publisher.flush(30)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {table} WHERE payload = %s", ('"once"',)
        ).fetchone()
    assert row == (1,), "settled on the batch itself, not on ids from before the reset"
    assert publisher.stats().published == 52


def test_a_receiver_subscribing_to_another_broadcaster_gets_every_later_message(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    first = make_bc(table=f"bc_{uuid.uuid4().hex[:12]}")
    other_table = f"bc_{uuid.uuid4().hex[:12]}"
    other = make_bc(table=other_table)  # no reader yet
    other_publisher = make_bc(table=other_table)
    subscribed = threading.Event()
    published = threading.Event()
    subs: list[Subscription] = []

    def receiver(channel: str, message: object) -> None:
        subs.append(other.subscribe("late"))  # from the listener thread
        subscribed.set()
        published.wait(20)  # meanwhile another node publishes, after subscribe returned

    first.connect("go", receiver)
    first.publish("go", 1)
    assert subscribed.wait(20)
    other_publisher.publish("late", "after subscribe")
    assert other_publisher.flush(20)
    published.set()
    assert drain(subs[0], 1, 20) == ["after subscribe"]


def test_flush_from_a_receiver_returns_at_once_and_delivery_goes_on(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    reader = make_bc(table=f"bc_{uuid.uuid4().hex[:12]}")
    # Another connection string: another pool, whose writers' turn the blocked one holds.
    blocked = make_bc(f"{pg_dsn}&connect_timeout=11", table=f"bc_{uuid.uuid4().hex[:12]}")
    results: list[tuple[bool, float]] = []

    def receiver(channel: str, message: object) -> None:
        started = time.monotonic()
        results.append((blocked.flush(), time.monotonic() - started))

    reader.connect("flush", receiver)
    sub = reader.subscribe("other")
    with psycopg.connect(pg_dsn, autocommit=True) as blocker, blocker.transaction():
        # The blocked broadcaster's batch waits on the server: flush() cannot succeed.
        hold_publish_lock(blocker, blocked.table)
        blocked.publish("b", "waits")
        wait_until(lambda: blocked_by(pg_dsn, blocker), 20, "the writer blocked")
        reader.publish("flush", 1)
        reader.publish("other", "delivered meanwhile")
        assert drain(sub, 1, 10) == ["delivered meanwhile"], "the listener is not stalled"
        assert len(results) == 1
        [(flushed, took)] = results
        assert not flushed and took < 1.0
    assert blocked.flush(20)


def test_wait_ready_from_a_receiver_returns_at_once_and_delivery_goes_on(
    pg_dsn: str, make_bc: Callable[..., PostgresBroadcaster]
) -> None:
    reader = make_bc()
    # Never ready: its table does not exist and it may not create it.
    missing = PostgresBroadcaster(pg_dsn, table=f"bc_{uuid.uuid4().hex[:12]}", create_tables=False)
    results: list[tuple[bool, float]] = []

    def receiver(channel: str, message: object) -> None:
        started = time.monotonic()
        results.append((missing.wait_ready(), time.monotonic() - started))

    try:
        reader.connect("ready", receiver)
        sub = reader.subscribe("other")
        reader.publish("ready", 1)
        reader.publish("other", "delivered meanwhile")
        assert drain(sub, 1, 10) == ["delivered meanwhile"], "the listener is not stalled"
        [(ready, took)] = results
        assert not ready and took < 1.0
    finally:
        missing.close()
