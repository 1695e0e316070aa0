"""A private Redis primary with replicas, for tests that fail the primary over.

Each replica follows the primary (or another replica) through its own loopback
``TcpProxy``, so a test can stall one replica's replication stream silently
(``stall``: the link stays open, no byte moves, as in a partition) and then let a write
reach the primary only. ``promote`` turns a replica into a primary with ``REPLICAOF NO
ONE``, as Sentinel or an operator does after the primary died.
"""

from __future__ import annotations

import contextlib
import time
from types import TracebackType

import redis

from tests.support.pg import PrivateRedis
from tests.support.proxy import TcpProxy

__all__ = ["RedisReplicaSet", "repl_info"]


def repl_info(client: redis.Redis) -> dict[str, str]:
    """``INFO replication`` of one server as a dict of strings."""
    raw: dict[str, object] = client.info("replication")
    return {k: str(v) for k, v in raw.items()}


class RedisReplicaSet:
    """One private primary and ``replicas`` private replicas, each behind a proxy.

    ``servers[0]`` is the primary at start; ``servers[i]`` follows ``servers[0]``
    through ``proxies[i]`` (``proxies[0]`` is ``None``). Servers keep no append-only
    file: a failover here loses exactly what the stream did not carry.

    Parameters:
        replicas: how many replicas.
        timeout: bound in seconds of every wait (start, sync, promotion).
    """

    def __init__(self, replicas: int = 1, *, timeout: float = 15.0) -> None:
        self.timeout = timeout
        self.servers = [PrivateRedis(appendonly=False) for _ in range(replicas + 1)]
        self.proxies: list[TcpProxy | None] = [None]
        self._clients: list[redis.Redis] = []

    def __enter__(self) -> RedisReplicaSet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Start every server and let each replica sync with the primary."""
        for server in self.servers:
            server.start()
            self._clients.append(redis.Redis.from_url(server.url, socket_timeout=self.timeout))
        primary = self.servers[0]
        for i in range(1, len(self.servers)):
            proxy = TcpProxy(primary.host, primary.port)
            self.proxies.append(proxy)
            self.client(i).execute_command("REPLICAOF", proxy.host, proxy.port)
        for i in range(1, len(self.servers)):
            self._wait(lambda i=i: repl_info(self.client(i)).get("master_link_status") == "up")
        self.wait_synced()

    def url(self, i: int) -> str:
        """The ``redis://`` URL of server ``i``."""
        return self.servers[i].url

    def client(self, i: int) -> redis.Redis:
        """A client of server ``i`` (kept open until :meth:`close`)."""
        return self._clients[i]

    def follow(self, i: int, leader: int) -> None:
        """Point replica ``i`` at server ``leader`` (through its own proxy)."""
        proxy = self.proxies[i]
        assert proxy is not None
        target = self.servers[leader]
        proxy.sever()  # bytes a stall held back are dropped with the links
        proxy.heal()
        proxy.retarget(target.host, target.port)
        self.client(i).execute_command("REPLICAOF", proxy.host, proxy.port)
        self._wait(lambda: repl_info(self.client(i)).get("master_link_status") == "up")

    def wait_synced(self, primary: int = 0) -> None:
        """Wait until every replica that is linked and not stalled has processed
        everything server ``primary`` wrote (equal replication offsets)."""
        for i, proxy in enumerate(self.proxies):
            if i == primary or proxy is None or proxy.blackholed:
                continue
            self._wait(lambda i=i: self._offset(i) >= self._offset(primary))

    def _offset(self, i: int) -> int:
        info = repl_info(self.client(i))
        if info.get("role") == "master":
            return int(info["master_repl_offset"])
        return int(info.get("slave_repl_offset", "-1"))

    def stall(self, i: int) -> None:
        """Silently stop replica ``i``'s stream: it hears nothing more from its primary."""
        proxy = self.proxies[i]
        assert proxy is not None
        proxy.blackhole()

    def kill(self, i: int) -> None:
        """SIGKILL server ``i``, like a crash."""
        self.servers[i].kill()

    def promote(self, i: int) -> None:
        """Make replica ``i`` a primary (``REPLICAOF NO ONE``) and wait until it writes."""
        proxy = self.proxies[i]
        if proxy is not None:
            proxy.sever()  # a stalled stream must not deliver its held bytes later
        self.client(i).execute_command("REPLICAOF", "NO", "ONE")
        self._wait(lambda: repl_info(self.client(i)).get("role") == "master")

    def _wait(self, predicate: object) -> None:
        assert callable(predicate)
        deadline = time.monotonic() + self.timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica set: no progress within {self.timeout}s")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop every proxy and server; idempotent."""
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()
        for proxy in self.proxies:
            if proxy is not None:
                proxy.close()
        self.proxies = [None]
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.kill()
            with contextlib.suppress(Exception):
                server.close()
