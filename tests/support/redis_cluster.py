"""A throwaway three-master Redis Cluster on loopback, for the cluster tests.

``PrivateRedisCluster`` starts three ``redis-server --cluster-enabled yes`` processes on
free ports of 127.0.0.1, each in its own temporary directory, joins them with
``redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes`` and waits until
every node reports ``cluster_state:ok`` and agrees on the slot map. It never touches any
other Redis. ``redis_cluster_fixture`` wraps it for a pytest fixture: it skips when the
binaries are missing, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pg import ServerStartError, find_free_port

__all__ = ["PrivateRedisCluster", "redis_cluster_fixture"]


def _ping(port: int) -> bool:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _cluster_info(port: int) -> dict[str, str]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        text = client.execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return {}
    finally:
        client.close()
    if isinstance(text, bytes):
        text = text.decode()
    if isinstance(text, dict):
        return {str(k): str(v) for k, v in text.items()}
    return dict(line.split(":", 1) for line in str(text).splitlines() if ":" in line)


class PrivateRedisCluster:
    """Three cluster masters on free loopback ports (no replicas).

    Parameters:
        masters: how many masters (3, the minimum ``redis-cli --cluster create`` takes).
        start_timeout: bound in seconds of the whole start.
    """

    host = "127.0.0.1"

    def __init__(self, *, masters: int = 3, start_timeout: float = 30.0) -> None:
        server = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if server is None or cli is None:
            raise ServerStartError("redis-server and redis-cli must be on PATH")
        self.server_binary, self.cli_binary = server, cli
        self.masters = masters
        self.start_timeout = start_timeout
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._tmp = tempfile.mkdtemp(prefix="rselection-cluster-")

    @property
    def url(self) -> str:
        """A ``redis://`` URL of the first node (a cluster client discovers the rest)."""
        return f"redis://{self.host}:{self.ports[0]}/0"

    def urls(self) -> list[str]:
        """One URL per node."""
        return [f"redis://{self.host}:{port}/0" for port in self.ports]

    def _log(self, i: int) -> Path:
        return Path(self._tmp) / f"node{i}" / "redis.log"

    def _tails(self) -> str:
        out = []
        for i in range(len(self.procs)):
            with contextlib.suppress(OSError):
                out.append(f"node{i}: " + self._log(i).read_text()[-600:])
        return "\n".join(out)

    def start(self) -> PrivateRedisCluster:
        """Start the nodes, create the cluster, wait until it serves every slot."""
        deadline = time.monotonic() + self.start_timeout
        used: set[int] = set()
        for i in range(self.masters):
            port = find_free_port(self.host)
            while port in used or port + 10000 > 65535:  # the bus port is port + 10000
                port = find_free_port(self.host)
            used.add(port)
            work = Path(self._tmp) / f"node{i}"
            work.mkdir()
            cmd = [
                self.server_binary,
                "--port",
                str(port),
                "--bind",
                self.host,
                "--dir",
                str(work),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "5000",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                str(self._log(i)),
            ]
            self.ports.append(port)
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        try:
            for i, port in enumerate(self.ports):
                while not _ping(port):
                    if self.procs[i].poll() is not None:
                        raise ServerStartError(
                            f"cluster node {i} exited with code {self.procs[i].returncode}:\n"
                            f"{self._tails()}"
                        )
                    if time.monotonic() > deadline:
                        raise ServerStartError(f"cluster node {i} did not answer:\n{self._tails()}")
                    time.sleep(0.05)
            create = subprocess.run(
                [
                    self.cli_binary,
                    "--cluster",
                    "create",
                    *(f"{self.host}:{port}" for port in self.ports),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
                stdin=subprocess.DEVNULL,
            )
            if create.returncode != 0:
                raise ServerStartError(
                    f"redis-cli --cluster create failed ({create.returncode}):\n"
                    f"{create.stdout[-800:]}{create.stderr[-800:]}"
                )
            while not self.ready():
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"the cluster did not reach cluster_state:ok within "
                        f"{self.start_timeout}s:\n{self._tails()}"
                    )
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def ready(self) -> bool:
        """True when every node says ``cluster_state:ok`` and knows all the masters."""
        for port in self.ports:
            info = _cluster_info(port)
            if info.get("cluster_state") != "ok":
                return False
            if info.get("cluster_known_nodes") != str(self.masters):
                return False
            if info.get("cluster_slots_assigned") != "16384":
                return False
        return True

    def close(self) -> None:
        """Kill every node and delete their directories. Idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs = []
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> PrivateRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def redis_cluster_fixture() -> Iterator[PrivateRedisCluster]:
    """Body of a fixture: a started cluster, closed afterwards; skips (fails under
    ``CI=true``) when the binaries or the redis client are missing or it cannot start."""
    try:
        import redis.cluster  # noqa: F401
    except ImportError:
        reason = "the redis client is not installed: pip install -e '.[redis]'"
    else:
        try:
            cluster = PrivateRedisCluster().start()
        except (ServerStartError, OSError, subprocess.SubprocessError) as exc:
            reason = f"could not start a private Redis Cluster: {exc}"
        else:
            try:
                yield cluster
            finally:
                cluster.close()
            return
    if _in_ci():
        pytest.fail(f"{reason} (CI=true: missing servers fail instead of skipping)", pytrace=False)
    pytest.skip(reason)
