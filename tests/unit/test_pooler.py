"""The pooler check's pure parts: the refusal message and the bound of the check."""

from __future__ import annotations

import pytest

from rselection.errors import ConfigError
from rselection.postgres.pooler import (
    NOTIFY_WAIT,
    ROUNDS,
    check_bound,
    check_same_backend,
)


def test_the_same_backend_passes() -> None:
    check_same_backend(4242, 4242, "host=db port=5432")


def test_another_backend_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError) as caught:
        check_same_backend(4242, 4343, "host=db port=6432 dbname=app")
    message = str(caught.value)
    assert "host=db port=6432 dbname=app" in message
    assert "backend 4242, then on backend 4343" in message
    assert "session mode" in message
    assert "connect to Postgres directly" in message


def test_the_bound_covers_every_round_trip_and_wait() -> None:
    limit = 5.0
    # one probe connect, a probe statement per attempt, two idle waits per attempt
    assert check_bound(limit) >= limit + (ROUNDS + 1) * (limit + 2 * NOTIFY_WAIT)
    assert check_bound(limit, wait=0.0) < check_bound(limit)
