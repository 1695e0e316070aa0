"""Fixtures for tests through a connection pooler: a private PgBouncer, a database of its own.

PgBouncer 1.18 refuses the ``options`` startup parameter, so the schema-per-test DSNs of
the other fixtures cannot go through it; a test behind PgBouncer gets a fresh database
instead (``pooled_database``), dropped after the test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import fresh_database, unavailable
from tests.support.pg import ServerStartError
from tests.support.pgbouncer import HOW_TO_PGBOUNCER, PgBouncer, pgbouncer_binary


@pytest.fixture
def pooled_database(pg_server_dsn: str) -> Iterator[str]:
    """The name of a fresh database on the test server, dropped (with its sessions) after."""
    with fresh_database(pg_server_dsn, "rselection_pool") as name:
        yield name


@pytest.fixture
def make_pgbouncer(pg_server_dsn: str) -> Iterator[Callable[..., PgBouncer]]:
    """Factory: ``make_pgbouncer(pool_mode=..., pool_size=..., settings=...)`` starts a
    private PgBouncer in front of the test server; every one is stopped after the test.

    Skips (fails under ``CI=true``) when the ``pgbouncer`` binary is missing.
    """
    if pgbouncer_binary() is None:
        unavailable(f"pgbouncer is not installed: {HOW_TO_PGBOUNCER}")
    started: list[PgBouncer] = []

    def make(**kw: Any) -> PgBouncer:
        bouncer = PgBouncer(pg_server_dsn, **kw)
        started.append(bouncer)
        try:
            return bouncer.start()
        except ServerStartError as exc:
            pytest.fail(f"could not start pgbouncer: {exc}", pytrace=False)

    yield make
    for bouncer in started:
        with contextlib.suppress(Exception):
            bouncer.close()
