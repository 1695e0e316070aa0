"""The backend fixtures of the conformance suites: each test runs once per backend.

``backend`` is the shared server of one backend, in a place of this test's own: a fresh
schema on Postgres, a fresh key prefix on Redis (its keys deleted after the test).
``private_backend`` is a private server the test may stop, start or restart.
``shard_server`` is where a sharded leader's nodes run (see ``tests/support/shard_fleet.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.backends import Backend
from tests.support.shard_fleet import PostgresShards, RedisShards, ShardServer

BACKENDS = ["postgres", "redis"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The shared server of one backend, with a namespace of this test's own."""
    if request.param == "redis":
        found = Backend(
            "redis",
            request.getfixturevalue("redis_url"),
            key_prefix=f"t-{uuid.uuid4().hex[:10]}:",
        )
        yield found
        found.forget_keys()
        return
    yield Backend("postgres", request.getfixturevalue("pg_dsn"))


@pytest.fixture(params=BACKENDS)
def private_backend(request: pytest.FixtureRequest) -> Backend:
    """A private server of one backend, which the test may stop, start or restart."""
    if request.param == "redis":
        server = request.getfixturevalue("private_redis")
        return Backend("redis", server.url, restart=server.restart, server=server)
    server = request.getfixturevalue("private_pg")
    return Backend(
        "postgres", server.dsn, restart=lambda: server.restart(mode="fast"), server=server
    )


@pytest.fixture(params=BACKENDS)
def shard_server(request: pytest.FixtureRequest) -> Iterator[ShardServer]:
    """Where the test's sharded leaders run: a fresh schema, or the shared Redis (the
    keys of the names run there deleted after the test)."""
    if request.param == "redis":
        server = RedisShards(request.getfixturevalue("redis_url"))
        yield server
        server.forget_keys()
        return
    yield PostgresShards(request.getfixturevalue("pg_dsn"))
