"""How long Redis keeps a silent client under ``tcp-keepalive``, and which settings let a
holder offer fast crash failover.

Redis on Linux sets, on every client socket, the first keepalive probe after
``tcp-keepalive`` idle seconds, then a probe every ``tcp-keepalive / 3`` seconds (integer
division, at least 1), and drops the connection when 3 probes went unanswered.
"""

from __future__ import annotations

import pytest

from rselection.redis.keepalive import keepalive_drop_after, keepalive_refusal


@pytest.mark.parametrize(
    ("tcp_keepalive", "dropped_after"),
    [
        (1, 4),  # 1 + 3 * 1 (the interval is at least 1 s)
        (2, 5),  # 2 + 3 * 1
        (3, 6),
        (5, 8),
        (6, 12),
        (8, 14),  # not 16
        (9, 18),
        (10, 19),
        (60, 120),
        (300, 600),  # Redis's default
    ],
)
def test_a_silent_client_is_dropped_after_idle_plus_three_probes(
    tcp_keepalive: int, dropped_after: int
) -> None:
    assert keepalive_drop_after(tcp_keepalive) == dropped_after


def test_no_keepalive_never_drops_a_client() -> None:
    assert keepalive_drop_after(0) is None


@pytest.mark.parametrize("tcp_keepalive", [-1, 1.5, True])
def test_a_value_redis_cannot_have_is_refused(tcp_keepalive: object) -> None:
    with pytest.raises(ValueError, match="tcp-keepalive"):
        keepalive_drop_after(tcp_keepalive)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tcp_keepalive", "ttl", "accepted"),
    [
        (0, 15.0, True),
        (7, 15.0, False),  # 13 s
        (8, 15.0, False),  # 14 s: twice the setting (16 s) is not what Redis does
        (9, 15.0, True),  # 18 s
        (10, 15.0, True),
        (5, 7.9, True),  # 8 s
        (5, 8.0, False),  # 8 s: dropped no later than the ttl is too early
        (2, 4.5, True),  # 5 s
        (300, 599.0, True),
        (300, 600.0, False),
    ],
)
def test_fast_failover_needs_a_client_kept_longer_than_the_ttl(
    tcp_keepalive: int, ttl: float, accepted: bool
) -> None:
    assert (keepalive_refusal(tcp_keepalive, ttl) is None) is accepted


def test_the_refusal_shows_the_math_and_the_smallest_setting_that_fits() -> None:
    message = keepalive_refusal(8, 15.0)
    assert message is not None
    assert "8 + 3 * 2 = 14 s" in message  # idle, then 3 probes 8 // 3 = 2 s apart
    assert "ttl 15 s" in message
    assert "tcp-keepalive 0 or at least 9" in message  # 9 + 3 * 3 = 18 > 15
    assert keepalive_refusal(9, 15.0) is None
