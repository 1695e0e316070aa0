"""Fixtures shared by the unit tests, and the tier's rule: no server, no process.

A unit test that asks for a server's fixture, or starts a process (a subprocess, a
fork), fails with a message saying where it belongs: ``tests/integration`` (a server)
or ``tests/process`` (a fresh interpreter, the docs' and the examples' tests).
"""

from __future__ import annotations

import os
import subprocess
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


_NO_PROCESS = "unit tests start no process: move this test to tests/process"
_NO_SERVER = "unit tests need no server: move this test to tests/integration"


@pytest.fixture(autouse=True)
def _no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse subprocesses and forks in the unit tier."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(_NO_PROCESS)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)


@pytest.fixture(scope="session")
def pg_server_dsn() -> str:
    """Refused: the Postgres fixtures (``pg_dsn``, ...) belong to the other tiers."""
    raise AssertionError(_NO_SERVER)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """Refused: the Redis fixtures belong to the other tiers."""
    raise AssertionError(_NO_SERVER)
