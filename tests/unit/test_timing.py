"""Tests for lease timings: every inconsistent setting is refused with the math shown."""

from __future__ import annotations

import math

import pytest

import rselection as rs
from rselection.errors import ConfigError
from rselection.timing import Timings


def test_defaults_are_consistent() -> None:
    t = Timings()
    assert (t.ttl, t.renew_interval, t.renew_deadline, t.retry_interval) == (15, 2, 10, 2)
    assert t.margin == 5
    assert Timings.safety_margin_needed(15) == 1.5
    assert Timings.safety_margin_needed(5) == 1.0
    assert Timings.safety_margin_needed(100) == 10.0


def test_ints_become_floats() -> None:
    t = Timings(ttl=30, renew_interval=3, renew_deadline=20, retry_interval=1)
    assert isinstance(t.ttl, float) and t.ttl == 30.0
    assert t.margin == 10.0


def test_margin_too_small_shows_the_math() -> None:
    with pytest.raises(ConfigError) as info:
        Timings(ttl=10, renew_deadline=9.5)
    msg = str(info.value)
    assert "ttl - renew_deadline = 10 - 9.5 = 0.5s" in msg
    assert "max(1s, 10% of ttl) = 1s" in msg
    assert "lower renew_deadline to at most 9s" in msg


def test_margin_uses_ten_percent_of_a_long_ttl() -> None:
    with pytest.raises(ConfigError, match=r"= 5s, but it must be >= .* = 10s"):
        Timings(ttl=100, renew_deadline=95)
    assert Timings(ttl=100, renew_deadline=90).margin == 10


def test_margin_exactly_at_the_bound_is_accepted() -> None:
    assert Timings(ttl=10, renew_deadline=9, renew_interval=1).margin == 1


@pytest.mark.parametrize(("interval", "deadline"), [(10, 10), (11, 10)])
def test_renew_interval_must_be_below_renew_deadline(interval: float, deadline: float) -> None:
    with pytest.raises(ConfigError) as info:
        Timings(ttl=15, renew_interval=interval, renew_deadline=deadline)
    msg = str(info.value)
    assert f"renew_interval ({interval}s)" in msg
    assert f"renew_deadline ({deadline}s)" in msg
    assert "must be less than" in msg


@pytest.mark.parametrize("field", ["ttl", "renew_interval", "renew_deadline", "retry_interval"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(field: str, bad: float) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be a finite number of seconds"):
        Timings(**{field: bad})


@pytest.mark.parametrize("field", ["ttl", "renew_interval", "renew_deadline", "retry_interval"])
@pytest.mark.parametrize("bad", [0, -1, -0.5])
def test_non_positive_values_are_refused(field: str, bad: float) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be positive, got {bad}"):
        Timings(**{field: bad})


@pytest.mark.parametrize("bad", [True, "15", None])
def test_non_numbers_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="ttl must be a finite number of seconds"):
        Timings(ttl=bad)  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Timings(ttl=-1)


def test_stop_grace_must_end_half_a_second_before_the_lease_can_expire() -> None:
    t = Timings()
    t.check_stop_grace(4.5)  # 10 + 4.5 + 0.5 = 15: fits exactly
    with pytest.raises(ConfigError) as info:
        t.check_stop_grace(5.0)
    msg = str(info.value)
    assert "renew_deadline + stop_grace + 0.5 = 10 + 5 + 0.5 = 15.5s exceeds ttl = 15s" in msg
    assert "at most 4.5s" in msg


@pytest.mark.parametrize("on_stuck", ["log", "exit"])
def test_single_node_leader_rejects_a_stop_grace_that_outlives_the_lease(on_stuck: str) -> None:
    handler = rs.TaskHandler(stop_grace=6.0, on_stuck=on_stuck)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"10 \+ 6 \+ 0.5 = 16.5s exceeds ttl"):
        rs.SingleNodeLeader(handler)


def test_single_node_leader_takes_the_grace_its_timings_allow() -> None:
    leader = rs.SingleNodeLeader(rs.TaskHandler())
    assert leader.stop_grace == 4.5
    assert not leader.is_leader


def test_timings_longer_than_a_day_are_refused() -> None:
    # A lease server computes expiries from them; one that overflows its timestamps would
    # fail every renewal sent with it, those of the process's other leases included.
    with pytest.raises(ConfigError, match=r"ttl must be at most 86400 s \(a day\), got 1e\+13"):
        Timings(ttl=1e13, renew_deadline=10)
    with pytest.raises(ConfigError, match="retry_interval must be at most 86400 s"):
        Timings(retry_interval=86401)
    assert Timings(ttl=86400, renew_deadline=3600).ttl == 86400


def test_a_postgres_lease_longer_than_a_day_is_refused() -> None:
    from rselection.postgres import PostgresLease

    with pytest.raises(ConfigError, match=r"ttl must be at most 86400 s"):
        PostgresLease("postgresql://localhost/db", ttl=1e13, renew_deadline=10)
