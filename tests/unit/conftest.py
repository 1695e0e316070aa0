"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs


@pytest.fixture
def leaders() -> Iterator[Callable[..., rs.SingleNodeLeader]]:
    """Make SingleNodeLeaders that are stopped at the end of the test, whatever happens."""
    made: list[rs.SingleNodeLeader] = []

    def make(handler: rs.TaskHandler, **kwargs: Any) -> rs.SingleNodeLeader:
        leader = rs.SingleNodeLeader(handler, **kwargs)
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.stop(timeout=10)
