"""Failover of the database to a promoted standby never makes two leaders.

A private primary and a streaming standby (``pg_basebackup -R``). The leader runs on the
primary through a TCP proxy; the test cuts that link silently, stops the primary and
promotes the standby, as an HA manager would, then starts a follower on the promoted
server. The old leader cannot see any of this: it runs its term until its own deadline.
The standby's copy of the lease row names a holder session that never existed there, so
"the holder's session is gone" means nothing on it: only the lease's expiry may free the
lease, and the follower must not start its tasks before the old leader's have ended.

Each task records, with this machine's wall clock, when it started and ended: the
activity ledger of the two terms.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import rselection as rs
from rselection.errors import BackendUnavailable
from rselection.postgres import PostgresLease, migrate
from rselection.postgres.leader import PostgresLeader
from tests.conftest import unavailable
from tests.support.pg import PrivatePostgres, ServerStartError, pgserver_bin_dir, with_host_port
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_until

TTL = 4.0
RETRY = 0.5
TIMINGS: dict[str, float] = {
    "ttl": TTL,
    "renew_interval": 0.5,
    "renew_deadline": 3.0,
    "retry_interval": RETRY,
}


class Activity:
    """When each node's tasks started and ended (``time.time()``, one machine)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: list[dict[str, Any]] = []

    def handler(self, node: str) -> rs.TaskHandler:
        """Tasks for ``node``: one persistent task that runs until its term ends."""
        tasks = rs.TaskHandler(stop_grace=0.5)

        @tasks.persistent("work")
        async def work(ctx: rs.TaskContext) -> None:
            run: dict[str, Any] = {"node": node, "term": ctx.term, "start": time.time()}
            with self._lock:
                self.runs.append(run)
            try:
                await asyncio.Event().wait()  # until the term ends: CancelledError
            finally:
                run["end"] = time.time()

        return tasks

    def of(self, node: str) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(run) for run in self.runs if run["node"] == node]


@pytest.fixture
def replicated() -> Iterator[tuple[PrivatePostgres, PrivatePostgres]]:
    """A private primary and a streaming standby of it, both started."""
    if pgserver_bin_dir() is None:
        unavailable("no pgserver binaries for a private Postgres: pip install -e '.[embedded]'")
    primary = PrivatePostgres()
    standby = primary.make_standby()
    try:
        try:
            primary.start()
            standby.start()
        except (ServerStartError, OSError) as exc:
            unavailable(f"could not start a private primary and standby ({exc})")
        yield primary, standby
    finally:
        standby.close()
        primary.close()


def lease_on(dsn: str, name: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(
            "SELECT holder, term FROM rselection_leases WHERE name = %s", (name,)
        ).fetchone()


def test_a_follower_on_a_promoted_standby_waits_for_the_old_leaders_term_to_end(
    replicated: tuple[PrivatePostgres, PrivatePostgres],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    primary, standby = replicated
    name = f"p-{uuid.uuid4().hex[:6]}"
    activity = Activity()
    proxy = make_tcp_proxy(primary.host, primary.port)
    old = PostgresLeader(
        with_host_port(primary.dsn, proxy.host, proxy.port),
        activity.handler("old"),
        name=name,
        node_id="old",
        claimer=None,
        **TIMINGS,
    )
    new: PostgresLeader | None = None
    try:
        old.start()
        wait_until(lambda: activity.of("old"), 20, "the first leader's task")
        standby.wait_replayed(primary)  # the standby knows the lease and its holder
        assert lease_on(standby.dsn, name) == ("old", 1)

        cut = time.time()
        proxy.blackhole()  # the leader hears nothing more, and nobody hears it
        primary.stop("fast")
        standby.promote()
        promoted = time.time()
        new = PostgresLeader(
            standby.dsn,
            activity.handler("new"),
            name=name,
            node_id="new",
            claimer=None,
            **TIMINGS,
        )
        new.start()

        bound = TTL + RETRY + 3.0
        wait_until(lambda: activity.of("new"), bound, f"the follower to lead within {bound}s")
        wait_until(
            lambda: all("end" in run for run in activity.of("old")),
            10,
            "the old leader's tasks to end",
        )
        olds, news = activity.of("old"), activity.of("new")
        old_end = max(run["end"] for run in olds)
        new_start = min(run["start"] for run in news)
        print(
            f"promotion: promoted {promoted - cut:.2f}s after the cut; old tasks ended "
            f"{old_end - cut:.2f}s after it, the new leader's started {new_start - cut:.2f}s "
            f"after it (renew_deadline {TIMINGS['renew_deadline']:g} s, ttl {TTL:g} s)"
        )
        assert new_start >= old_end, (
            f"the follower on the promoted standby started its task {old_end - new_start:.2f}s "
            "before the old leader's task ended"
        )
        assert new_start - cut <= bound
        assert [run["term"] for run in news] == [2]
    finally:
        if new is not None:
            new.stop(timeout=10)
        proxy.sever()  # the old leader's connections fail at once: a bounded stop
        old.stop(timeout=15)


def test_dead_session_takeover_works_at_once_on_a_promoted_server(
    replicated: tuple[PrivatePostgres, PrivatePostgres],
) -> None:
    """A standby is refused with a clear error; once promoted, every session of it
    agrees on its identity from the first moment on (no wait for a checkpoint), so a
    crashed holder is still replaced at once."""
    primary, standby = replicated
    options: dict[str, Any] = {"ttl": 30.0, "renew_deadline": 20.0, "connect_timeout": 2.0}
    with psycopg.connect(primary.dsn, autocommit=True) as conn:
        migrate(conn)
    standby.wait_replayed(primary)
    early = PostgresLease(standby.dsn, create_tables=False, **options)
    with pytest.raises(BackendUnavailable, match="standby in recovery"):
        early.connect()
    early.close()
    primary.stop("fast")
    standby.promote()
    a = PostgresLease(standby.dsn, **options)
    b = PostgresLease(standby.dsn, **options)
    try:
        a.connect()
        acq = a.try_acquire("A")
        assert acq.acquired and acq.holder is not None
        attempt = b.try_acquire("B")
        assert not attempt.acquired and attempt.expires_in > 25
        a.close()  # the holder's session ends: its lock is freed at once
        start = time.monotonic()
        while not (attempt := b.try_acquire("B")).acquired:
            assert time.monotonic() - start < 5, "no takeover of a dead session (ttl 30 s)"
            b.wait_for_change(1.0)
        took = time.monotonic() - start
        assert attempt.holder is not None and attempt.holder.term == acq.holder.term + 1
        assert took < 2.0, f"takeover {took:.3f}s after the holder's session ended"
    finally:
        a.close()
        b.close()
