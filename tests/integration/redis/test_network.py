"""A RedisLeader whose link to Redis is cut, through the loopback TCP proxy.

The leader reaches Redis only through a ``TcpProxy`` (lease and fenced writes alike);
two followers connect directly. A cut link that resets the connection ends the term at
once and lets a follower take over by the dead connection; a silent partition ends the
term at the leader's deadline, and a follower takes over only when the key expires.
Every leader appends fenced entries to one list; no entry of an older term may land
after one of a newer term.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import rselection as rs
from rselection.redis import RedisFence, RedisLeader
from rselection.redis.lease import lease_keys
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_until


@dataclass
class Record:
    """Elections and demotions of one lease, with ``time.monotonic()`` stamps."""

    name: str
    events: list[tuple[float, str, str, int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def elected(self, sender: Any, **kw: Any) -> None:
        if kw["name"] == self.name:
            with self.lock:
                self.events.append((time.monotonic(), "elected", kw["node_id"], kw["term"], ""))

    def demoted(self, sender: Any, **kw: Any) -> None:
        if kw["name"] == self.name:
            with self.lock:
                self.events.append(
                    (time.monotonic(), "demoted", kw["node_id"], kw["term"], kw["reason"])
                )

    def cancelled(self, node: str, term: int) -> None:
        with self.lock:
            self.events.append((time.monotonic(), "cancelled", node, term, ""))

    def find(self, kind: str, *, node: str | None = None, not_node: str | None = None) -> Any:
        with self.lock:
            for event in self.events:
                if event[1] == kind and node in (None, event[2]) and event[2] != not_node:
                    return event
        return None


@dataclass
class Setup:
    name: str
    proxy: TcpProxy
    direct: redis.Redis
    record: Record
    make: Callable[..., RedisLeader]
    ledger: str


@pytest.fixture
def setup(redis_url: str, make_tcp_proxy: Callable[[str, int], TcpProxy]) -> Iterator[Setup]:
    parts = urllib.parse.urlsplit(redis_url)
    proxy = make_tcp_proxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    name = f"net-{uuid.uuid4().hex[:6]}"
    ledger = f"ledger:{{{name}}}"
    direct = redis.Redis.from_url(redis_url, socket_timeout=5)
    record = Record(name)
    rs.signals.elected.connect(record.elected)
    rs.signals.demoted.connect(record.demoted)
    made: list[RedisLeader] = []
    clients: list[redis.Redis] = [direct]

    def make(node_id: str, *, via_proxy: bool, **timings: Any) -> RedisLeader:
        if via_proxy:
            client = redis.Redis(
                host=proxy.host,
                port=proxy.port,
                socket_timeout=1.0,
                socket_connect_timeout=1.0,
                retry=Retry(NoBackoff(), 0),
            )
        else:
            client = redis.Redis.from_url(redis_url, socket_timeout=5)
        clients.append(client)
        fence = RedisFence(client, name=name)
        tasks = rs.TaskHandler()

        @tasks.persistent("watch")
        def watch(ctx: rs.TaskContext) -> None:
            ctx.cancelled.wait(120)  # the moment the term ends, tasks are cancelled
            record.cancelled(ctx.node_id, ctx.term)

        @tasks.persistent("ledger")
        def write(ctx: rs.TaskContext) -> None:
            while ctx.sleep(0.02):
                entry = json.dumps({"term": ctx.term, "node": ctx.node_id})
                try:
                    fence.call(ctx.term, "RPUSH", ledger, entry)
                except rs.StaleLeaderError:
                    return
                except rs.BackendUnavailable:
                    continue  # the link is down; the keeper decides whether we lead

        leader = RedisLeader(
            client, tasks, name=name, node_id=node_id, connect_timeout=1.0, **timings
        )
        made.append(leader)
        return leader

    try:
        yield Setup(name, proxy, direct, record, make, ledger)
    finally:
        proxy.heal()
        for leader in made:
            leader.stop(timeout=15)
        rs.signals.elected.disconnect(record.elected)
        rs.signals.demoted.disconnect(record.demoted)
        direct.delete(ledger, *lease_keys(name)[:2])
        for client in clients:
            client.close()


def entries(s: Setup) -> list[tuple[int, str]]:
    return [
        (int(e["term"]), str(e["node"])) for e in map(json.loads, s.direct.lrange(s.ledger, 0, -1))
    ]


def check_ledger(s: Setup) -> dict[int, set[str]]:
    newest, late = 0, 0
    terms: dict[int, set[str]] = {}
    for term, node in entries(s):
        late += term < newest
        newest = max(newest, term)
        terms.setdefault(term, set()).add(node)
    assert late == 0, "an entry of an older term landed after a newer term's"
    assert all(len(nodes) == 1 for nodes in terms.values()), terms
    return terms


def start_fleet(s: Setup, timings: dict[str, float]) -> tuple[RedisLeader, list[RedisLeader]]:
    """The leader first (through the proxy), then two followers (direct)."""
    leader = s.make("cut", via_proxy=True, **timings)
    leader.start()
    assert leader.wait_until_leader(10)
    followers = [s.make(f"f{i}", via_proxy=False, **timings) for i in range(2)]
    for f in followers:
        f.start()
    wait_until(lambda: sum(1 for _, n in entries(s) if n == "cut") >= 5, 10, "fenced writes")
    assert leader.lease.fast_failover
    time.sleep(0.3)  # the followers are waiting on the leader's connection by now
    return leader, followers


def test_a_reset_link_ends_the_term_at_once_and_a_follower_takes_over(setup: Setup) -> None:
    s = setup
    timings = {"ttl": 6.0, "renew_interval": 0.5, "renew_deadline": 4.0, "retry_interval": 0.5}
    leader, followers = start_fleet(s, timings)
    term = leader.term
    assert term is not None
    # Cut the link: every connection reset, and nothing gets through afterwards, so
    # the leader cannot come back and the followers decide.
    s.proxy.blackhole()
    cut = time.monotonic()
    assert s.proxy.sever() >= 1
    wait_until(lambda: s.record.find("demoted", node="cut"), 5, "the leader to step down")
    wait_until(lambda: s.record.find("elected", not_node="cut"), timings["ttl"] + 5, "a takeover")
    demoted = s.record.find("demoted", node="cut")
    stopped = s.record.find("cancelled", node="cut")
    taken = s.record.find("elected", not_node="cut")
    print(
        f"reset link: leader's tasks cancelled after {(stopped[0] - cut) * 1000:.0f} ms, "
        f"stepped down after {(demoted[0] - cut) * 1000:.0f} ms ({demoted[4]}), "
        f"follower {taken[2]} took term {taken[3]} after "
        f"{(taken[0] - cut) * 1000:.0f} ms (ttl {timings['ttl']:g} s)"
    )
    assert demoted[3] == term and demoted[4] == "connection"
    assert stopped[0] - cut < 1.5  # at once, not at the deadline (4 s)
    assert taken[3] == term + 1 and stopped[0] < taken[0]
    assert taken[0] - cut < timings["ttl"] - 2  # by the dead connection, not the expiry
    s.proxy.heal()
    new = next(f for f in followers if f.node_id == taken[2])
    wait_until(lambda: (term + 1, new.node_id) in entries(s), 10, "the new term's writes")
    wait_until(
        lambda: leader.leader() is not None and leader.leader().node_id == new.node_id,  # type: ignore[union-attr]
        10,
        "the old leader to see the new one",
    )
    assert not leader.is_leader
    for x in (leader, *followers):
        x.stop(timeout=15)
    terms = check_ledger(s)
    assert terms[term] == {"cut"} and terms[term + 1] == {new.node_id}


def test_a_silent_partition_stops_the_leader_by_its_deadline_before_expiry(
    setup: Setup,
) -> None:
    s = setup
    timings = {"ttl": 4.0, "renew_interval": 0.5, "renew_deadline": 2.5, "retry_interval": 0.5}
    leader, followers = start_fleet(s, timings)
    term = leader.term
    assert term is not None
    cut = time.monotonic()
    s.proxy.blackhole()  # connections stay open, no byte moves
    wait_until(
        lambda: s.record.find("demoted", node="cut"), timings["renew_deadline"] + 5, "the deadline"
    )
    wait_until(lambda: s.record.find("elected", not_node="cut"), timings["ttl"] + 8, "a takeover")
    demoted = s.record.find("demoted", node="cut")
    stopped = s.record.find("cancelled", node="cut")
    taken = s.record.find("elected", not_node="cut")
    print(
        f"silent partition: leader's tasks cancelled after {(stopped[0] - cut) * 1000:.0f} ms, "
        f"stepped down (tasks joined) after {(demoted[0] - cut) * 1000:.0f} ms "
        f"({demoted[4]}, renew_deadline {timings['renew_deadline']:g} s), follower "
        f"{taken[2]} took term {taken[3]} after {(taken[0] - cut) * 1000:.0f} ms "
        f"(ttl {timings['ttl']:g} s)"
    )
    assert demoted[3] == term and demoted[4] == "deadline"
    # The deadline runs from the last renewal sent, at most renew_interval before the cut.
    assert stopped[0] - cut <= timings["renew_deadline"] + 0.5
    # The key lives ttl after that renewal reached Redis: no takeover before.
    assert taken[0] - cut >= timings["ttl"] - timings["renew_interval"] - 0.3
    assert stopped[0] < taken[0] and taken[3] == term + 1
    s.proxy.heal()  # writes held in the proxy arrive now, and are refused
    new = next(f for f in followers if f.node_id == taken[2])
    wait_until(lambda: (term + 1, new.node_id) in entries(s), 10, "the new term's writes")
    wait_until(
        lambda: leader.leader() is not None and leader.leader().node_id == new.node_id,  # type: ignore[union-attr]
        15,
        "the old leader to follow",
    )
    assert not leader.is_leader
    for x in (leader, *followers):
        x.stop(timeout=15)
    terms = check_ledger(s)
    assert terms[term] == {"cut"} and terms[term + 1] == {new.node_id}
