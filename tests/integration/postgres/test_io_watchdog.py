"""The one round-trip watchdog: a round trip that overruns its bound is aborted.

Used as the keeper's, the session pool's (a wake-up at each deadline) and the
broadcaster's (``tick``: a guard wakes no thread, the thread looks every tick), on a
server that accepts the statement and answers only much later (``pg_sleep``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from rselection.postgres._conn import IoWatchdog

_SLEEP = "SELECT pg_sleep(5)"  # the answer comes long after every bound below


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture(params=[None, 0.2], ids=["at-each-deadline", "every-tick"])
def watchdog(request: pytest.FixtureRequest) -> Iterator[IoWatchdog]:
    watchdog = IoWatchdog("test", tick=request.param)
    yield watchdog
    watchdog.close()


def test_a_round_trip_past_its_bound_is_aborted_not_before_it(
    conn: psycopg.Connection[Any], watchdog: IoWatchdog
) -> None:
    start = time.monotonic()
    with pytest.raises(psycopg.OperationalError), watchdog.guard(conn, 0.5) as fired:
        conn.execute(_SLEEP)
    took = time.monotonic() - start
    assert fired == [True]
    assert 0.5 <= took < 0.5 + (watchdog.tick or 0.0) + 2.0, took


def test_a_round_trip_within_its_bound_is_left_alone(
    conn: psycopg.Connection[Any], watchdog: IoWatchdog
) -> None:
    for _ in range(3):
        with watchdog.guard(conn, 2.0) as fired:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert fired == [False]
    time.sleep(0.5)  # past a tick: nothing armed is left to abort
    assert conn.execute("SELECT 2").fetchone() == (2,)


def test_a_held_round_trip_is_aborted_once_the_hold_is_over(
    conn: psycopg.Connection[Any],
) -> None:
    watchdog = IoWatchdog("test")
    holding = threading.Event()
    holding.set()

    def let_go() -> None:
        holding.clear()
        watchdog.recheck()

    timer = threading.Timer(1.0, let_go)
    try:
        start = time.monotonic()
        timer.start()
        with (
            pytest.raises(psycopg.OperationalError),
            watchdog.guard(conn, 0.2, held=holding.is_set) as fired,
        ):
            conn.execute(_SLEEP)
        took = time.monotonic() - start
        assert fired == [True]
        assert 1.0 <= took < 3.5, f"aborted at {took:.2f} s, the hold ended at 1 s"
    finally:
        timer.cancel()
        watchdog.close()
