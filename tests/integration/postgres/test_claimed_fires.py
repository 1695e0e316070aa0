"""PostgresLeader claims each scheduled fire: handover without repeats, claims per lease,
switching claims off, failing closed when the claims database is unreachable."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import rselection as rs
from rselection.postgres import PostgresClaimer
from rselection.postgres.leader import PostgresLeader
from tests.support.proxy import TcpProxy
from tests.support.recording import Recorder
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}
PERIOD = 0.1


class Runs:
    """Each run of the task ``tick``: (lease, node, term, scheduled_at)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, int, datetime]] = []
        self._lock = threading.Lock()

    def task(self, lease: str) -> Callable[[rs.TaskContext], None]:
        def tick(ctx: rs.TaskContext) -> None:
            assert ctx.scheduled_at is not None
            with self._lock:
                self.items.append((lease, ctx.node_id, ctx.term, ctx.scheduled_at))

        return tick

    def count(self, **match: Any) -> int:
        fields = ("lease", "node", "term", "at")
        with self._lock:
            rows = [dict(zip(fields, item, strict=True)) for item in self.items]
        return sum(all(r[k] == v for k, v in match.items()) for r in rows)

    def instants(self, lease: str | None = None) -> list[datetime]:
        with self._lock:
            return [at for ls, _, _, at in self.items if lease in (None, ls)]


@pytest.fixture
def make_leader(pg_dsn: str) -> Iterator[Callable[..., PostgresLeader]]:
    made: list[PostgresLeader] = []

    def make(handler: rs.TaskHandler, **kw: Any) -> PostgresLeader:
        leader = PostgresLeader(kw.pop("dsn", pg_dsn), handler, **{**FAST, **kw})
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)


def ticking(runs: Runs, lease: str) -> rs.TaskHandler:
    handler = rs.TaskHandler()
    handler.interval(PERIOD, name="tick")(runs.task(lease))
    return handler


def claims(dsn: str, table: str = "rselection_claims") -> dict[str, tuple[str, int | None]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT fire_key, holder, term FROM {table}").fetchall()
    return {key: (holder, term) for key, holder, term in rows}


def test_a_handover_never_repeats_a_fire(
    pg_dsn: str, make_leader: Callable[..., PostgresLeader]
) -> None:
    runs = Runs()
    first = make_leader(ticking(runs, "default"), node_id="first")
    second = make_leader(ticking(runs, "default"), node_id="second")
    skipped = Recorder()
    rs.signals.fire_skipped.connect(skipped)
    try:
        first.start()
        assert first.wait_until_leader(10)
        second.start()
        wait_until(lambda: runs.count(node="first") >= 5, 10.0, "runs on the first node")
        first.stop(timeout=10)
        wait_until(lambda: runs.count(node="second") >= 5, 10.0, "runs on the second node")
        second.stop(timeout=10)
    finally:
        rs.signals.fire_skipped.disconnect(skipped)
    ran = runs.instants()
    assert len(ran) == len(set(ran)), "a fire ran on both nodes"
    # The seam: nothing between the first node's last fire and the second's first is lost
    # without a report.
    reported = {c["scheduled_at"] for c in skipped.calls}
    at = min(ran)
    while at <= max(ran):
        assert at in set(ran) or at in reported, f"fire at {at} neither ran nor reported"
        at += rs.IntervalSchedule(PERIOD).every
    # Each run was claimed under "<lease>/<fire key>", by its node, with its term.
    table = claims(pg_dsn)
    for _, node, term, at in runs.items:
        assert table[f"default/{rs.format_fire_key('tick', at)}"] == (node, term)


def test_leases_sharing_the_claims_table_keep_their_fires_apart(
    make_leader: Callable[..., PostgresLeader],
) -> None:
    runs = Runs()
    for lease in ("billing", "mail"):
        make_leader(ticking(runs, lease), name=lease).start()
    wait_until(
        lambda: min(len(runs.instants("billing")), len(runs.instants("mail"))) >= 5,
        10.0,
        "runs under both leases",
    )
    # Both leases have a task named "tick"; each ran the same instants.
    shared = set(runs.instants("billing")) & set(runs.instants("mail"))
    assert len(shared) >= 3


def test_claims_can_be_switched_off(
    pg_dsn: str, make_leader: Callable[..., PostgresLeader]
) -> None:
    runs = Runs()
    leader = make_leader(ticking(runs, "default"), claimer=None)
    leader.start()
    wait_until(lambda: runs.count() >= 3, 10.0, "runs")
    leader.stop(timeout=10)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        present = conn.execute("SELECT to_regclass('rselection_claims')").fetchone()
    assert present is not None
    if present[0] is not None:
        assert claims(pg_dsn) == {}


def test_a_claimer_of_your_own(pg_dsn: str, make_leader: Callable[..., PostgresLeader]) -> None:
    runs = Runs()
    with PostgresClaimer(pg_dsn, ttl=120, table="ops_claims", create_tables=True) as claimer:
        leader = make_leader(ticking(runs, "default"), claimer=claimer)
        leader.start()
        wait_until(lambda: runs.count() >= 3, 10.0, "runs")
        leader.stop(timeout=10)
        assert len(claims(pg_dsn, "ops_claims")) >= runs.count()
        # The leader does not close a claimer it was given.
        assert claimer.claim("still-open")


def test_bad_claimer_and_schedules_are_rejected(pg_dsn: str) -> None:
    handler = rs.TaskHandler()
    handler.interval(1.0, name="t", misfire_grace=300)(lambda ctx: None)
    with (
        PostgresClaimer(pg_dsn, ttl=120) as claimer,
        pytest.raises(rs.ConfigError, match="exceeds the claim ttl"),
    ):
        PostgresLeader(pg_dsn, handler, claimer=claimer)
    with pytest.raises(rs.ConfigError, match="claimer must have claim"):
        PostgresLeader(pg_dsn, rs.TaskHandler(), claimer="postgresql://")  # type: ignore[arg-type]
    unaligned = rs.TaskHandler()
    schedule = rs.IntervalSchedule(1.0, align=False)
    unaligned.register("u", rs.GenericTask("u", rs.TaskType.SCHEDULED, schedule))
    with pytest.raises(rs.ConfigError, match="not aligned"):
        PostgresLeader(pg_dsn, unaligned)
    PostgresLeader(pg_dsn, unaligned, claimer=None).stop()


def via_proxy(dsn: str, proxy: TcpProxy) -> str:
    """``dsn`` pointed at ``proxy`` instead of the server."""
    return make_conninfo(dsn, host=proxy.host, port=str(proxy.port))


def test_claims_fail_closed_while_their_database_is_unreachable(
    pg_dsn: str,
    make_leader: Callable[..., PostgresLeader],
    make_tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    """The lease stays up (direct connection) while the claims connection is cut: every
    fire is skipped as "claim-error", none runs unclaimed; once healed, fires run again."""
    parts = urlsplit(pg_dsn)
    proxy = make_tcp_proxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    runs = Runs()
    handler = ticking(runs, "default")
    skipped = Recorder()
    rs.signals.fire_skipped.connect(skipped, sender=handler)
    with PostgresClaimer(
        via_proxy(pg_dsn, proxy), create_tables=True, connect_timeout=1, statement_timeout=1
    ) as c:
        try:
            leader = make_leader(handler, claimer=c)
            leader.start()
            wait_until(lambda: runs.count() >= 3, 10.0, "runs through the proxy")
            proxy.sever()  # RST: the claimer's connection is gone
            proxy.blackhole()  # and no new one gets through
            wait_until(
                lambda: len(skipped.of("tick", reason="claim-error")) >= 3,
                20.0,
                "failed claims",
            )
            during = runs.count()
            errors = len(skipped.of("tick", reason="claim-error"))
            wait_until(
                lambda: len(skipped.of("tick", reason="claim-error")) >= errors + 2,
                20.0,
                "more failed claims",
            )
            assert runs.count() == during  # nothing ran unclaimed
            assert leader.is_leader  # the lease itself was never in doubt
            proxy.heal()
            wait_until(lambda: runs.count() >= during + 3, 20.0, "runs after healing")
        finally:
            rs.signals.fire_skipped.disconnect(skipped, sender=handler)
