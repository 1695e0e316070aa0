"""Test helpers: private Postgres and Redis servers, DSN helpers, a fault-injecting TCP proxy."""

from __future__ import annotations

from tests.support.pg import (
    PrivatePostgres,
    PrivateRedis,
    ServerStartError,
    with_host_port,
    with_search_path,
)
from tests.support.proxy import TcpProxy

__all__ = [
    "PrivatePostgres",
    "PrivateRedis",
    "ServerStartError",
    "TcpProxy",
    "with_host_port",
    "with_search_path",
]
