"""One face for both lease backends, so a single conformance suite runs on each.

A :class:`Backend` knows how to point a node fleet and in-process leaders at its
server, and how to read the fenced ledger the demo's nodes write (a Postgres table, or
a Redis list appended to by a fenced ``RPUSH``).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

import rselection as rs
from rselection.commands.demo_fleet import redis_ledger_key
from tests.support import ledger as pg_ledger

LEDGER = "rselection_demo_ledger"


@dataclass
class Backend:
    """A lease server and how the tests use it.

    Args:
        kind: ``"postgres"`` or ``"redis"``.
        url: the DSN or Redis URL every node uses.
        restart: restarts the server (only for a private server), else ``None``.
    """

    kind: str
    url: str
    restart: Callable[[], None] | None = None
    leases: list[str] = field(default_factory=list)

    @property
    def fleet_args(self) -> list[str]:
        """Node options that select this backend."""
        return ["--backend", "redis"] if self.kind == "redis" else []

    def host_port(self) -> tuple[str, int]:
        """Host and port of the server (for a proxy in front of it)."""
        parts = urllib.parse.urlsplit(self.url)
        default = 6379 if self.kind == "redis" else 5432
        return parts.hostname or "127.0.0.1", parts.port or default

    def leader(self, handler: rs.TaskHandler, name: str, **kw: Any) -> Any:
        """An in-process leader of lease ``name`` on this server."""
        if self.kind == "redis":
            from rselection.redis import RedisLeader

            return RedisLeader(self.url, handler, name=name, **kw)
        from rselection.postgres.leader import PostgresLeader

        return PostgresLeader(self.url, handler, name=name, **kw)

    # -- the ledger -------------------------------------------------------------------

    def entries(self, lease: str) -> list[tuple[int, str]]:
        """(term, node) of every ledger write of ``lease``, in the order they committed."""
        if self.kind == "redis":
            import redis

            client = redis.Redis.from_url(self.url)
            try:
                raw = client.lrange(redis_ledger_key(LEDGER, lease), 0, -1)
            finally:
                client.close()
            return [(int(e["term"]), str(e["node"])) for e in map(json.loads, raw)]
        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                f"SELECT term, node FROM {LEDGER} WHERE lease = %s ORDER BY id", (lease,)
            ).fetchall()
        return [(int(t), str(n)) for t, n in rows]

    def overlaps(self, lease: str) -> int:
        """Writes of an older term made after a write of a newer term (must be 0)."""
        if self.kind == "postgres":
            return pg_ledger.overlaps(self.url)
        count, newest = 0, 0
        for term, _ in self.entries(lease):
            if term < newest:
                count += 1
            newest = max(newest, term)
        return count

    def terms(self, lease: str) -> dict[int, set[str]]:
        """For each term in the ledger, the nodes that wrote with it (one each, if safe)."""
        out: dict[int, set[str]] = {}
        for term, node in self.entries(lease):
            out.setdefault(term, set()).add(node)
        return out

    def writes_by(self, lease: str, node: str, term: int) -> int:
        """How many ledger writes ``node`` made with ``term``."""
        return sum(1 for t, n in self.entries(lease) if (t, n) == (term, node))
