"""Drive ``shard_node`` processes: start them, read their events, kill, pause or stop them.

``ShardNode`` is one node process (one sharded leader); a reader thread keeps its
events. ``ShardFleet`` holds the nodes of one sharded name and reads who holds each
shard from the server: a :class:`PostgresShards` (the lease table) or a
:class:`RedisShards` (the lease keys).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

import rselection as rs
from rselection.keys import lease_scoped
from tests.support.activity import check
from tests.support.pg import with_host_port
from tests.support.shard_node import redis_ledger_key

__all__ = [
    "ARGS",
    "REPO_ROOT",
    "TTL",
    "PostgresShards",
    "RedisShards",
    "ShardFleet",
    "ShardNode",
    "assert_fenced_ledger_per_shard",
    "assert_no_overlap_per_shard",
    "balanced",
]

REPO_ROOT = Path(__file__).resolve().parents[2]

Event = dict[str, Any]

TTL = 3.0
"""The tests' lease ttl (seconds): short, so that a pause beyond it is short too."""
HEARTBEAT = 0.5  # node_timeout is three heartbeats: 1.5 s
ARGS = [  # the tests' node options: fast timings and a fenced ledger per shard
    *("--ttl", str(TTL), "--renew-interval", "0.5", "--renew-deadline", "2"),
    *("--retry-interval", "0.5", "--heartbeat-interval", str(HEARTBEAT)),
    *("--rebalance-interval", "0.25"),
    *("--ledger", "shard_ledger"),
]


FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}
"""Fast timings of the one-process sharding tests' leaders."""


def unique(prefix: str) -> str:
    """A sharded lease name of its own (the Redis server is shared by the tests)."""
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def idle_tasks() -> rs.TaskHandler:
    """A handler with one persistent task that waits for its cancellation."""
    tasks = rs.TaskHandler()

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.cancelled.wait()

    return tasks


class PostgresShards:
    """The shards of a Postgres database: where nodes run and how the tests read them.

    Args:
        dsn: the connection string (its schema holds the tables).
    """

    backend = "postgres"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def env(self, via: tuple[str, int] | None = None) -> dict[str, str]:
        """What a node process needs in its environment (to connect through ``via``, a
        proxy's host and port, if given)."""
        return {"SHARD_NODE_DSN": self.url(via)}

    def url(self, via: tuple[str, int] | None = None) -> str:
        """The connection string (through ``via``, a proxy's host and port, if given)."""
        return self.dsn if via is None else with_host_port(self.dsn, *via)

    def host_port(self) -> tuple[str, int]:
        """The server's host and port (for a proxy in front of it)."""
        params = conninfo_to_dict(self.dsn)
        return str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)

    @property
    def cli_args(self) -> list[str]:
        """The ``rselection`` options that point a command at this server."""
        return ["--dsn", self.dsn]

    def register(self, name: str) -> None:
        """A sharded name run here (its tables go with the test's schema)."""

    def sharded_leader(
        self, handler: Any, *, via: tuple[str, int] | None = None, **options: Any
    ) -> Any:
        """A ``PostgresShardedLeader`` on this database (through ``via``, if given)."""
        import rselection as rs

        return rs.PostgresShardedLeader(self.url(via), handler, **options)

    def leader(self, handler: Any, name: str, **options: Any) -> Any:
        """A ``PostgresLeader`` of lease ``name`` on this database."""
        import rselection as rs

        return rs.PostgresLeader(self.dsn, handler, name=name, **options)

    def claimed(self, name: str) -> list[str]:
        """The fire keys claimed under the shards of ``name`` (their claims table rows)."""
        prefix = lease_scoped(name + "/", "")[:-1]  # "<name>%2F": every shard's lease name
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT fire_key FROM rselection_claims WHERE starts_with(fire_key, %s)",
                (prefix,),
            ).fetchall()
        return [key for (key,) in rows]

    def shards_record(self, name: str) -> object:
        """What the coordinator of ``name`` recorded of its number of shards, or ``None``."""
        from rselection.postgres import PostgresCheckpointStore
        from rselection.sharded import SHARDS_RECORD

        records = PostgresCheckpointStore(self.dsn)
        try:
            snapshot = records.load((SHARDS_RECORD, name))
        finally:
            records.close()
        return None if snapshot is None else snapshot.state

    def requests(self, name: str) -> dict[str, str | None]:
        """The handover requests recorded on the shards of ``name``: lease name -> the
        node it is reserved for (``None``: open to every node but its old holder)."""
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT name, resign_to FROM rselection_leases WHERE starts_with(name, %s)"
                    " AND resign_term IS NOT NULL",
                    (name + "/",),
                ).fetchall()
        except psycopg.errors.UndefinedTable:
            return {}
        return {lease: to for lease, to in rows}

    def holders(self, name: str) -> dict[int, str]:
        """Who holds each shard of ``name``, from the lease table (unexpired rows)."""
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT name, holder FROM rselection_leases WHERE name LIKE %s"
                    " AND holder IS NOT NULL AND expires_at > clock_timestamp()",
                    (name + "/%",),
                ).fetchall()
        except psycopg.errors.UndefinedTable:
            return {}
        return {int(lease.rsplit("/", 1)[1]): holder for lease, holder in rows}

    def coordinator(self, name: str) -> str | None:
        """The node that holds the coordinator's lease ``name``."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT holder FROM rselection_leases WHERE name = %s"
                " AND expires_at > clock_timestamp()",
                (name,),
            ).fetchone()
        return None if row is None else str(row[0])

    def assert_fenced_ledger(self, name: str, shards: int) -> int:
        """See :func:`assert_fenced_ledger_per_shard`."""
        return assert_fenced_ledger_per_shard(self.dsn, shards)


class RedisShards:
    """The shards of a Redis server: where nodes run and how the tests read them.

    Args:
        url: the ``redis://`` URL.
    """

    backend = "redis"

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis: Any = None  # one client for the tests' reads
        self.names: set[str] = set()  # the sharded names of the fleets run here

    def forget_keys(self) -> None:
        """Delete every key of the names run here (their leases, members and ledgers)."""
        client = self._client()
        try:
            for name in self.names:
                # The shards' keys are "rselection:{<name>/<k>}:...", the coordinator's
                # "rselection:{<name>}:..."; a glob's special characters are escaped.
                # The claims of its shards' fires are "rselection:claim:<name>%2F<k>/...".
                claims = CLAIM_PREFIX + lease_scoped(name + "/", "")[:-1]
                keys = [
                    key
                    for pattern in ("rselection:{" + _glob_escape(name), _glob_escape(claims))
                    for key in client.scan_iter(match=pattern + "*", count=1000)
                ]
                if keys:
                    client.delete(*keys)
        finally:
            client.close()
            self._redis = None

    def env(self, via: tuple[str, int] | None = None) -> dict[str, str]:
        """What a node process needs in its environment (to connect through ``via``, a
        proxy's host and port, if given)."""
        return {"SHARD_NODE_REDIS_URL": self.through(via)}

    def through(self, via: tuple[str, int] | None = None) -> str:
        """The URL (through ``via``, a proxy's host and port, if given)."""
        if via is None:
            return self.url
        parts = urllib.parse.urlsplit(self.url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{via[0]}:{via[1]}"
        return urllib.parse.urlunsplit(
            parts._replace(netloc=f"{userinfo}@{netloc}" if userinfo else netloc)
        )

    def host_port(self) -> tuple[str, int]:
        """The server's host and port (for a proxy in front of it)."""
        parts = urllib.parse.urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 6379

    @property
    def cli_args(self) -> list[str]:
        """The ``rselection`` options that point a command at this server."""
        return ["--redis-url", self.url]

    def register(self, name: str) -> None:
        """A sharded name run here: its keys are deleted by :meth:`forget_keys`."""
        self.names.add(name)

    def sharded_leader(
        self, handler: Any, *, via: tuple[str, int] | None = None, **options: Any
    ) -> Any:
        """A ``RedisShardedLeader`` on this server (through ``via``, if given)."""
        import rselection as rs

        self.register(options["name"])
        return rs.RedisShardedLeader(self.through(via), handler, **options)

    def leader(self, handler: Any, name: str, **options: Any) -> Any:
        """A ``RedisLeader`` of lease ``name`` on this server (its keys go with those of
        the sharded name it is under, see :meth:`register`)."""
        from rselection.redis import RedisLeader

        return RedisLeader(self.url, handler, name=name, **options)

    def claimed(self, name: str) -> list[str]:
        """The fire keys claimed under the shards of ``name`` (their claim keys; not the
        keys of their series, ``"<lease>/<task>@"``: see ``RedisClaimer.ran_before``)."""
        prefix = CLAIM_PREFIX + lease_scoped(name + "/", "")[:-1]  # every shard's lease name
        keys = self._client().scan_iter(match=_glob_escape(prefix) + "*", count=1000)
        found = (key.decode()[len(CLAIM_PREFIX) :] for key in keys)
        return [key for key in found if not key.endswith("@")]

    def shards_record(self, name: str) -> object:
        """What the coordinator of ``name`` recorded of its number of shards, or ``None``."""
        from rselection.sharded import SHARDS_RECORD

        raw = self._client().get(f"rselection:{{{name}}}:{SHARDS_RECORD}")
        return None if raw is None else json.loads(raw)

    def requests(self, name: str) -> dict[str, str | None]:
        """The handover requests recorded on the shards of ``name``: lease name -> the
        node it is reserved for (``None``: open to every node but its old holder)."""
        pattern = "rselection:{" + _glob_escape(name + "/") + "*}:resign"
        out: dict[str, str | None] = {}
        for key in self._client().scan_iter(match=pattern, count=1000):
            raw = self._client().get(key)
            if raw is not None:
                lease = key.decode()[len("rselection:{") : -len("}:resign")]
                out[lease] = json.loads(raw).get("to") or None
        return out

    def holders(self, name: str) -> dict[int, str]:
        """Who holds each shard of ``name``, from the lease keys (one pipeline)."""
        from rselection.redis.handover import current_holder

        client = self._client()
        return {
            shard: info.node_id
            for shard in range(_SHARDS[name])
            if (info := current_holder(client, f"{name}/{shard}")) is not None
        }

    def coordinator(self, name: str) -> str | None:
        """The node that holds the coordinator's lease ``name``."""
        from rselection.redis.handover import current_holder

        info = current_holder(self._client(), name)
        return None if info is None else info.node_id

    def assert_fenced_ledger(self, name: str, shards: int) -> int:
        """Per shard, no write of a term pushed after one of a newer term, and each term
        written by one node; returns the number of writes."""
        client = self._client()
        written = 0
        for shard in range(shards):
            key = redis_ledger_key(f"{name}/{shard}", "shard_ledger")
            entries = [json.loads(raw) for raw in client.lrange(key, 0, -1)]
            assert entries, f"shard {shard}: its task never wrote"
            terms = [e["term"] for e in entries]
            assert terms == sorted(terms), f"shard {shard}: an older term wrote after: {terms}"
            nodes: dict[int, set[str]] = {}
            for e in entries:
                nodes.setdefault(e["term"], set()).add(e["node"])
            shared = {t: n for t, n in nodes.items() if len(n) > 1}
            assert not shared, f"shard {shard}: terms written by two nodes: {shared}"
            written += len(entries)
        return written

    def _client(self) -> Any:
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(self.url)
        return self._redis


ShardServer = PostgresShards | RedisShards

CLAIM_PREFIX = "rselection:claim:"
"""The key prefix of a ``RedisShardedLeader``'s claims (by default)."""


def _glob_escape(text: str) -> str:
    """``text`` as a ``SCAN MATCH`` pattern that matches it alone."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# Redis has no table to list a name's shards from: the fleets register theirs.
_SHARDS: dict[str, int] = {}


class ShardNode:
    """One ``shard_node`` process and the events it printed.

    Args:
        node: its node id.
        server: where it runs (handed over in the environment).
        name: the sharded name.
        shards: the number of shards.
        args: more ``shard_node`` options (timings).
        log_dir: where its stderr goes (``<node>.log``).
    """

    def __init__(
        self,
        node: str,
        server: ShardServer,
        name: str,
        shards: int,
        args: Iterable[str] = (),
        *,
        log_dir: Path,
    ) -> None:
        self.node = node
        self.events: list[Event] = []
        self.paused: list[tuple[float, float]] = []  # wall-clock SIGSTOP..SIGCONT windows
        self.ended_at: float | None = None  # wall clock of a kill -9
        self._cond = threading.Condition()
        self.log_path = log_dir / f"{node}.log"
        env = dict(os.environ, **server.env(), PYTHONPATH=str(REPO_ROOT))
        cmd = [sys.executable, "-m", "tests.support.shard_node", "--backend", server.backend]
        cmd += ["--name", name, "--shards", str(shards), "--node", node, *args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
                env=env,
            )
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()

    def of(self, event: str, since: float = float("-inf")) -> list[Event]:
        """This node's events of one kind at or after ``since`` (``time.monotonic()``)."""
        with self._cond:
            return [e for e in self.events if e["event"] == event and e["mono"] >= since]

    def wait_for(self, predicate: Callable[[list[Event]], bool], timeout: float, what: str) -> None:
        """Wait (bounded) until ``predicate(events)`` holds; fail with the log's tail."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.events):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{self.node}: no {what} in {timeout} s\n{self.tail()}")
                self._cond.wait(min(left, 0.1))

    def ready(self, timeout: float = 30.0) -> None:
        """Wait until the leader was started."""
        self.wait_for(lambda ev: any(e["event"] == "ready" for e in ev), timeout, "ready")

    def kill(self) -> float:
        """kill -9; return ``time.monotonic()`` just before."""
        mono = time.monotonic()
        self.ended_at = time.time()
        self.proc.kill()
        self.proc.wait(10)
        return mono

    def pause(self) -> float:
        """SIGSTOP; return ``time.monotonic()`` just before."""
        mono = time.monotonic()
        self._stopped_at = time.time()
        self.proc.send_signal(signal.SIGSTOP)
        return mono

    def resume(self) -> float:
        """SIGCONT; return ``time.monotonic()`` just before."""
        mono = time.monotonic()
        self.paused.append((self._stopped_at, time.time()))
        self.proc.send_signal(signal.SIGCONT)
        return mono

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM and wait for the exit (kill -9 after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def exit_code(self, timeout: float) -> int:
        """Wait (bounded) for the process to exit; past ``timeout``, fail with its last
        events and the stacks of its threads (SIGUSR1, see ``shard_node``)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 5.0  # until the stacks are written, bounded
            while "most recent call first" not in self.tail(400) and time.monotonic() < deadline:
                time.sleep(0.05)
            with self._cond:
                last = [e["event"] for e in self.events[-10:]]
            raise AssertionError(
                f"{self.node} still running {timeout} s later; its last events {last}; "
                f"its log:\n{self.tail(400)}"
            ) from None

    def tail(self, lines: int = 20) -> str:
        """The last lines of its log."""
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""


class ShardFleet:
    """The nodes of one sharded name, and the server's view of them.

    Args:
        server: where the nodes run: a :class:`PostgresShards`, a :class:`RedisShards`,
            or a Postgres connection string.
        name: the sharded name.
        shards: the number of shards.
        args: ``shard_node`` options every node gets.
    """

    def __init__(
        self, server: ShardServer | str, name: str, shards: int, args: Iterable[str] = ()
    ) -> None:
        self.server = PostgresShards(server) if isinstance(server, str) else server
        self.name = name
        self.shards = shards
        _SHARDS[name] = shards
        self.server.register(name)
        self.args = list(args)
        self.nodes: dict[str, ShardNode] = {}
        self.log_dir = Path(tempfile.mkdtemp("-shards"))

    def add(self, node: str) -> ShardNode:
        """Start one more node."""
        started = ShardNode(
            node, self.server, self.name, self.shards, self.args, log_dir=self.log_dir
        )
        self.nodes[node] = started
        return started

    def holders(self) -> dict[int, str]:
        """Who holds each shard, from the server."""
        return self.server.holders(self.name)

    def coordinator(self) -> str | None:
        """The node that holds the coordinator's lease (the sharded name itself)."""
        return self.server.coordinator(self.name)

    def assert_fenced_ledger(self) -> int:
        """Per shard, no fenced write of a term after a newer term's, and each term
        written by one node; the number of writes."""
        return self.server.assert_fenced_ledger(self.name, self.shards)

    def counts(self, nodes: Iterable[str]) -> dict[str, int]:
        """Shards held by each of ``nodes`` (0 for none)."""
        out = dict.fromkeys(nodes, 0)
        for holder in self.holders().values():
            out[holder] = out.get(holder, 0) + 1
        return out

    def events(self) -> list[Event]:
        """Every node's events, in time order."""
        out = [e for node in self.nodes.values() for e in node.events]
        return sorted(out, key=lambda e: e["mono"])

    def close(self) -> None:
        """Stop every node still running (SIGTERM, at once for all, then wait)."""
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
                node.proc.terminate()
        for node in self.nodes.values():
            node.stop()

    def __enter__(self) -> ShardFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def balanced(fleet: ShardFleet, nodes: Iterable[str]) -> bool:
    """Every shard held by one of ``nodes``, each holding ``floor(S/N)`` or ``ceil(S/N)``."""
    counts = fleet.counts(nodes)
    if sum(counts.values()) != fleet.shards or set(counts) != set(nodes):
        return False
    share = fleet.shards // len(counts)
    return all(share <= c <= share + 1 for c in counts.values())


def assert_no_overlap_per_shard(fleet: ShardFleet, resume_grace: float = 0.0) -> int:
    """Per shard, no run of one term overlapped a run of another (the activity ledger,
    frozen windows cut out); returns the number of runs."""
    events = fleet.events()
    ended = {n: node.ended_at for n, node in fleet.nodes.items() if node.ended_at is not None}
    paused = {n: node.paused for n, node in fleet.nodes.items() if node.paused}
    runs = 0
    for shard in range(fleet.shards):
        mine = [e for e in events if e.get("ev") == "activity" and e["shard"] == shard]
        report = check(mine, ended_at=ended, paused=paused, resume_grace=resume_grace)
        assert not report.violations, f"shard {shard}: {report.summary()}"
        runs += len(report.runs)
    return runs


def assert_fenced_ledger_per_shard(dsn: str, shards: int) -> int:
    """Per shard, no write of a term committed after one of a newer term, and each term
    written by one node; returns the number of writes."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        late = conn.execute(
            "SELECT count(*) FROM shard_ledger a JOIN shard_ledger b ON a.shard = b.shard"
            " AND a.term < b.term AND (a.id > b.id OR a.written_at > b.written_at)"
        ).fetchone()
        shared = conn.execute(
            "SELECT shard, term FROM shard_ledger GROUP BY shard, term"
            " HAVING count(DISTINCT node) > 1"
        ).fetchall()
        written = conn.execute(
            "SELECT count(DISTINCT shard), count(*) FROM shard_ledger"
        ).fetchone()
    assert late is not None and written is not None
    assert late[0] == 0, f"{late[0]} fenced writes of an older term after a newer term's"
    assert not shared, f"terms written by two nodes: {shared}"
    assert written[0] == shards, "every shard's task wrote"
    return int(written[1])
