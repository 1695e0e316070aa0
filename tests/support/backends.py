"""One face for both lease backends, so a single conformance suite runs on each.

A :class:`Backend` knows how to point a node fleet and in-process leaders at its
server, and how to read the fenced ledger the demo's nodes write (a Postgres table, or
a Redis list appended to by a fenced ``RPUSH``). For the elector, claimer and handover
conformance suites it also makes electors, claimers and leases, calls the backend's
handover functions, and reads (or, to stage a scenario, writes) what the backend stores:
an election's expiry, a claim's holder, a pending handover request, a node list.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

import rselection as rs
from rselection.commands.demo_fleet import redis_ledger_key
from tests.support import ledger as pg_ledger

LEDGER = "rselection_demo_ledger"
DEFAULT_KEY_PREFIX = "rselection:"


def closed_port() -> int:
    """A loopback port with nothing listening on it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    sock.close()
    return port


@dataclass
class Backend:
    """A lease server and how the tests use it.

    Args:
        kind: ``"postgres"`` or ``"redis"``.
        url: the DSN or Redis URL every node uses.
        restart: restarts the server (only for a private server), else ``None``.
        server: the private server (``PrivatePostgres`` or ``PrivateRedis``), else ``None``.
        key_prefix: Redis: the prefix of this test's elector and claim keys (leases and
            fleets use the default prefix and names of their own).
    """

    kind: str
    url: str
    restart: Callable[[], None] | None = None
    leases: list[str] = field(default_factory=list)
    server: Any = None
    key_prefix: str = DEFAULT_KEY_PREFIX

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

    # -- connections -----------------------------------------------------------------

    @property
    def cli_args(self) -> list[str]:
        """The ``rselection`` options that point a command at this server."""
        return ["--redis-url", self.url] if self.kind == "redis" else ["--dsn", self.url]

    def unreachable(self, password: str = "s3cret-pw") -> tuple[str, int]:
        """A URL (with ``password``) of a port where nothing listens, and that port."""
        port = closed_port()
        if self.kind == "redis":
            return f"redis://app:{password}@127.0.0.1:{port}/0", port
        return make_conninfo(self.url, host="127.0.0.1", port=str(port), password=password), port

    @contextlib.contextmanager
    def _redis(self) -> Iterator[Any]:
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            yield client
        finally:
            client.close()

    def _pg(self, query: str, params: Any = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            cur = conn.execute(query, params)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description is not None else []

    def create_tables(self) -> None:
        """Postgres: every table of ``migrate()`` (Redis needs none)."""
        if self.kind == "postgres":
            from rselection.postgres import migrate

            with psycopg.connect(self.url, autocommit=True) as conn:
                migrate(conn)

    def forget_keys(self) -> None:
        """Redis: delete every key under this test's ``key_prefix``."""
        if self.kind != "redis" or self.key_prefix == DEFAULT_KEY_PREFIX:
            return
        with self._redis() as client:
            keys = list(client.scan_iter(match=self.key_prefix + "*", count=1000))
            if keys:
                client.delete(*keys)

    # -- electors and claimers ----------------------------------------------------------

    def elector(self, url: str | None = None, **kw: Any) -> Any:
        """A ``PostgresElector`` or ``RedisElector`` (of this test's keys) on ``url``."""
        if self.kind == "redis":
            from rselection.redis import RedisElector

            return RedisElector(url or self.url, **{"key_prefix": self.key_prefix, **kw})
        from rselection.postgres import PostgresElector

        return PostgresElector(url or self.url, **kw)

    @property
    def elector_class(self) -> type:
        """``PostgresElector`` or ``RedisElector``."""
        if self.kind == "redis":
            from rselection.redis import RedisElector

            return RedisElector
        from rselection.postgres import PostgresElector

        return PostgresElector

    def election_expired(self, name: str = "default") -> bool:
        """Whether election ``name`` is past its expiry on the server (or was never held)."""
        if self.kind == "redis":
            from rselection.redis.elector import elector_keys

            with self._redis() as client:
                return not client.exists(elector_keys(name, self.key_prefix)[0])
        rows = self._pg(
            "SELECT expires_at <= clock_timestamp() FROM rselection_elections WHERE name = %s",
            (name,),
        )
        return not rows or bool(rows[0][0])

    def claimer(self, url: str | None = None, **kw: Any) -> Any:
        """A ``PostgresClaimer`` or ``RedisClaimer`` (of this test's keys) on ``url``."""
        if self.kind == "redis":
            from rselection.redis import RedisClaimer

            prefix = self.key_prefix + "claim:"
            return RedisClaimer(url or self.url, **{"key_prefix": prefix, **kw})
        from rselection.postgres import PostgresClaimer

        return PostgresClaimer(url or self.url, **kw)

    @property
    def claimer_class(self) -> type:
        """``PostgresClaimer`` or ``RedisClaimer``."""
        if self.kind == "redis":
            from rselection.redis import RedisClaimer

            return RedisClaimer
        from rselection.postgres import PostgresClaimer

        return PostgresClaimer

    def claim_of(self, fire_key: str) -> tuple[str, int | None] | None:
        """(node id, term) of the unexpired claim of ``fire_key`` as stored, or ``None``."""
        if self.kind == "redis":
            with self._redis() as client:
                raw = client.get(self.key_prefix + "claim:" + fire_key)
            if raw is None:
                return None
            doc = json.loads(raw)
            return str(doc["node_id"]), int(doc["term"]) if doc.get("term") else None
        rows = self._pg(
            "SELECT holder, term FROM rselection_claims WHERE fire_key = %s"
            " AND expires_at > clock_timestamp()",
            (fire_key,),
        )
        return (str(rows[0][0]), rows[0][1]) if rows else None

    def claim_expired(self, fire_key: str) -> bool:
        """Whether the claim of ``fire_key`` is past its expiry on the server (or absent)."""
        if self.kind == "redis":
            with self._redis() as client:
                return not client.exists(self.key_prefix + "claim:" + fire_key)
        rows = self._pg(
            "SELECT expires_at <= clock_timestamp() FROM rselection_claims WHERE fire_key = %s",
            (fire_key,),
        )
        return not rows or bool(rows[0][0])

    # -- leases and handover requests ---------------------------------------------------

    @property
    def handover(self) -> ModuleType:
        """The backend's handover module: ``request_handover``, ``cancel_handover``,
        ``current_holder``, each called as ``f(url, name, ...)``."""
        if self.kind == "redis":
            from rselection.redis import handover

            return handover
        from rselection.postgres import handover as pg_handover

        return pg_handover

    def lease(self, name: str, **kw: Any) -> Any:
        """A connected ``PostgresLease`` or ``RedisLease`` of lease ``name``."""
        lease: Any
        if self.kind == "redis":
            from rselection.redis import RedisLease

            lease = RedisLease(self.url, name=name, **kw)
        else:
            from rselection.postgres import PostgresLease

            lease = PostgresLease(self.url, name=name, **kw)
        lease.connect()
        return lease

    def admin(self) -> Any:
        """The backend's admin API (a ``PostgresAdmin`` or ``RedisAdmin``); close it."""
        if self.kind == "redis":
            from rselection.redis import RedisAdmin

            return RedisAdmin(self.url)
        from rselection.postgres import PostgresAdmin

        return PostgresAdmin(self.url)

    def handover_pending(self, name: str) -> bool:
        """Whether a handover request of lease ``name`` is stored (used or not)."""
        if self.kind == "redis":
            from rselection.redis.lease import handover_key

            with self._redis() as client:
                return bool(client.exists(handover_key(name)))
        rows = self._pg(
            "SELECT resign_term IS NOT NULL FROM rselection_leases WHERE name = %s", (name,)
        )
        return bool(rows and rows[0][0])

    def expire(self, name: str) -> None:
        """End the current holder's lease on the server now, as if its ttl had passed."""
        if self.kind == "redis":
            from rselection.redis.lease import lease_keys

            with self._redis() as client:
                client.delete(lease_keys(name)[0])
            return
        self._pg(
            "UPDATE rselection_leases SET expires_at = clock_timestamp() WHERE name = %s",
            (name,),
        )

    def fake_holder(self, name: str, node_id: str, term: int, seconds: float) -> None:
        """Record that ``node_id`` holds ``term`` of ``name`` for ``seconds``, with no
        process behind it."""
        if self.kind == "redis":
            from rselection.redis.lease import lease_keys

            key, term_key, _ = lease_keys(name)
            value = {"token": "0" * 32, "node": node_id, "term": str(term), "client": ""}
            value.update(run="", fast="0", at=str(int(time.time() * 1000)))
            with self._redis() as client:
                client.set(term_key, term)
                client.set(key, json.dumps(value), px=round(seconds * 1000))
            return
        self.create_tables()
        self._pg(
            "INSERT INTO rselection_leases (name, holder, term, lock_key, acquired_at,"
            " renewed_at, expires_at) VALUES (%s, %s, %s, 1, now(), now(),"
            " now() + make_interval(secs => %s))",
            (name, node_id, term, seconds),
        )

    def node_ids(self, name: str) -> list[str]:
        """The node ids the backend lists for lease ``name`` (heartbeats, or keepers'
        channels), sorted."""
        if self.kind == "redis":
            from rselection.redis import live_nodes

            return live_nodes(self.url, name) or []
        try:
            rows = self._pg("SELECT node_id FROM rselection_nodes WHERE name = %s", (name,))
        except psycopg.errors.UndefinedTable:
            return []  # the first heartbeat creates it
        return sorted(str(r[0]) for r in rows)

    # -- membership -------------------------------------------------------------------

    @property
    def member_options(self) -> dict[str, Any]:
        """Leader options that keep this test's membership apart (Redis: its key prefix)."""
        return {"key_prefix": self.key_prefix} if self.kind == "redis" else {}

    @property
    def member_args(self) -> list[str]:
        """``tests.support.member_node`` options that select this backend and namespace."""
        if self.kind == "redis":
            return ["--backend", "redis", "--key-prefix", self.key_prefix]
        return []

    def last_seen(self, name: str, node_id: str) -> Any:
        """The node's last heartbeat as stored (server time), or ``None`` when not listed."""
        if self.kind == "redis":
            from rselection.redis.keys import membership_keys

            with self._redis() as client:
                score = client.zscore(membership_keys(name, self.key_prefix)[0], node_id)
            return None if score is None else datetime.fromtimestamp(score / 1000, UTC)
        try:
            rows = self._pg(
                "SELECT last_seen FROM rselection_nodes WHERE name = %s AND node_id = %s",
                (name, node_id),
            )
        except psycopg.errors.UndefinedTable:  # before the first heartbeat creates it
            return None
        return rows[0][0] if rows else None

    def server_now(self) -> datetime:
        """The server's clock now."""
        if self.kind == "redis":
            with self._redis() as client:
                seconds, micros = client.time()
            return datetime.fromtimestamp(seconds + micros / 1e6, UTC)
        rows = self._pg("SELECT clock_timestamp()")
        return rows[0][0]  # type: ignore[no-any-return]

    def member_ids(self, name: str) -> set[str]:
        """The node ids stored as members of lease ``name`` (alive or lost)."""
        if self.kind == "redis":
            from rselection.redis.keys import membership_keys

            with self._redis() as client:
                raw = client.zrange(membership_keys(name, self.key_prefix)[0], 0, -1)
            return {r.decode() for r in raw}
        try:
            rows = self._pg("SELECT node_id FROM rselection_nodes WHERE name = %s", (name,))
        except psycopg.errors.UndefinedTable:
            return set()
        return {str(r[0]) for r in rows}

    def forget(self, name: str) -> None:
        """Redis: delete lease ``name``'s keys and ledger (Postgres: its schema goes)."""
        if self.kind != "redis":
            return
        from rselection.redis.keys import drains_key, membership_keys
        from rselection.redis.lease import handover_key, lease_keys

        with self._redis() as client:
            client.delete(
                *lease_keys(name)[:2],
                handover_key(name),
                *membership_keys(name),
                drains_key(name),
                redis_ledger_key(LEDGER, name),
            )
