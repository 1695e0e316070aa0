"""Sessions, sockets, threads and locks after ``fork()``: a child never touches its parent's.

A server that forks its workers (gunicorn ``--preload``, uvicorn ``--workers``,
``multiprocessing``) gives each child a copy of every object the parent built and used:
claimers, checkpoint stores, electors, broadcasters, leaders, with the parent's idle
sessions and the threads that served them. In the child each of them must work on
connections and threads of its own, and nothing it does (a call, a ``close()``) may
send one byte on a socket the parent still uses.

How a parent's session is seen to be left alone, from the servers' side:

* Postgres: the parent's sessions are the backends whose ``client_port`` is a local port
  of the parent's connections. Those the parent does not use while the child runs (its
  pooled sessions, its broadcast listener) must show the same ``state_change`` after
  the child exited: no statement ran on them. Every one of the parent's backends must
  still be there (same pid and ``backend_start``): none was ended by a ``Terminate``
  the child sent while closing an object.
* Redis: ``CLIENT LIST`` entries of the parent's connections keep their id, their last
  command, their subscriptions, and an ``idle`` time that went on growing while the
  child ran. The parent's liveness beats (``rselection:liveness``) and a leading
  parent's keeper go on while the child runs: those keep their id.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import rselection as rs
from rselection.postgres import (
    PostgresBroadcaster,
    PostgresCheckpointStore,
    PostgresClaimer,
    PostgresElector,
    PostgresLease,
)
from tests.support.forking import in_child
from tests.support.sessions import local_ports, server_port
from tests.support.waiting import wait_until

FAST = {"ttl": 6.0, "renew_interval": 0.5, "renew_deadline": 3.0, "retry_interval": 0.5}

#: Sessions the parent does not use while its child runs: no statement may run on them.
QUIET = ("rselection:pool", "rselection:broadcast")


def _idle_tasks() -> rs.TaskHandler:
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.sleep(3600)

    return tasks


def _attempt(report: dict[str, Any], name: str, call: Callable[[], Any]) -> None:
    """Record what ``call`` returned in ``report[name]``, or the error it raised."""
    try:
        report[name] = call()
    except Exception as exc:
        report[name] = f"error: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- Postgres


@dataclass(frozen=True)
class Backend:
    """A parent's session as ``pg_stat_activity`` shows it."""

    pid: int
    application_name: str
    backend_start: datetime
    state_change: datetime | None
    query: str


def _backends(dsn: str, pid: int) -> dict[int, Backend]:
    """The backends of process ``pid``'s connections to the server of ``dsn``."""
    ports = sorted(local_ports(pid, server_port(dsn)))
    with psycopg.connect(dsn, autocommit=True, application_name="rselection-tests") as conn:
        rows = conn.execute(
            "SELECT pid, application_name, backend_start, state_change, query"
            " FROM pg_stat_activity WHERE client_port = ANY(%s) AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'",
            (ports,),
        ).fetchall()
    return {row[0]: Backend(*row) for row in rows}


#: How the keeper's read of the ring's members begins (``rselection.postgres.ring``).
RING_MEMBERS_READ = "SELECT m.pid FROM (SELECT l.pid, l.objid::bigint AS tag FROM pg_catalog"


def _quiet_but_for_the_ring(was: Backend, now: Backend) -> bool:
    """Whether the keeper session ``was`` ran no statement since, or only the ring's
    members read: the keeper's answer to another keeper announcing ``up``."""
    return now.state_change == was.state_change or now.query.startswith(RING_MEMBERS_READ)


def _left_alone(before: dict[int, Backend], after: dict[int, Backend]) -> list[str]:
    """What the child did to the parent's backends: each one gone or restarted, and each
    quiet one that ran a statement meanwhile."""
    wrong = []
    for pid, was in before.items():
        now = after.get(pid)
        if now is None or now.backend_start != was.backend_start:
            wrong.append(f"{was.application_name} (pid {pid}) was ended")
        elif was.application_name in QUIET and now.state_change != was.state_change:
            wrong.append(
                f"{was.application_name} (pid {pid}) ran a statement while only the child "
                f"could: {now.query[:120]!r}"
            )
    return wrong


def _own_backends(dsn: str, parent: dict[int, Backend]) -> dict[str, Any]:
    """In the child: the backends of its own connections, and those it shares (inherited)."""
    mine = _backends(dsn, os.getpid())
    return {
        "own": sorted(pid for pid in mine if pid not in parent),
        "inherited": sorted(pid for pid in mine if pid in parent),
    }


@pytest.fixture
def closing() -> Iterator[ExitStack]:
    """Close what a test registers, in reverse order, after it."""
    with ExitStack() as stack:
        yield stack


def test_postgres_objects_used_before_fork_take_sessions_of_their_own_in_the_child(
    pg_dsn: str, closing: ExitStack
) -> None:
    marker = uuid.uuid4().hex[:12]
    claimer = PostgresClaimer(pg_dsn)
    closing.callback(claimer.close)
    store = PostgresCheckpointStore(pg_dsn)
    closing.callback(store.close)
    elector = PostgresElector(pg_dsn, name="forked")
    closing.callback(elector.close)
    # No probe while the child runs: the parent's listening session stays silent.
    bc = PostgresBroadcaster(pg_dsn, probe_interval=3600)
    closing.callback(bc.close)
    leader = rs.PostgresLeader(
        pg_dsn, _idle_tasks(), name="forked", claimer=claimer, broadcaster=bc, **FAST
    )
    closing.callback(leader.stop)
    follower = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="forked", **FAST)  # not started
    closing.callback(follower.stop)

    # The parent uses every object, so that each holds (or lent) a session of the parent.
    leader.start()
    assert leader.wait_until_leader(20)
    term = leader.term
    assert claimer.claim(f"forked/parent-{marker}")
    store.save(("forked", "parent"), {"by": "parent"})
    loaded = store.load(("forked", "parent"))
    assert loaded is not None and loaded.state == {"by": "parent"}
    assert elector.is_leader()
    sub = bc.subscribe("parent")
    bc.publish("parent", "hello")
    assert sub.get(timeout=10) == "hello"
    info = leader.leader()
    assert info is not None and info.node_id == leader.node_id
    assert leader.node_id in [n.node_id for n in leader.nodes()]
    follower_info = follower.leader()
    assert follower_info is not None and follower_info.node_id == leader.node_id
    assert leader.node_id in [n.node_id for n in follower.nodes()]
    # The child's publish NOTIFYs the parent's listener too, which would read the row
    # from the table on its session: the parent's listening thread waits in a receiver
    # until the child is done, so its session stays silent.
    parked, release = threading.Event(), threading.Event()
    closing.callback(release.set)

    def park(channel: str, message: object) -> None:
        parked.set()
        release.wait(150)

    bc.connect("park", park)
    bc.publish("park", None)
    assert parked.wait(10), "the parent's listening thread did not reach the receiver"
    before = _backends(pg_dsn, os.getpid())
    assert {"rselection:pool", "rselection:broadcast", "rselection:keeper"} <= {
        b.application_name for b in before.values()
    }, before
    expires_before = info.expires_at

    def child() -> dict[str, Any]:
        report: dict[str, Any] = {"is_leader": leader.is_leader}
        _attempt(report, "claim", lambda: claimer.claim(f"forked/child-{marker}"))
        _attempt(report, "save", lambda: store.save(("forked", "child"), {"by": "child"}).state)
        _attempt(report, "load", lambda: getattr(store.load(("forked", "child")), "state", None))
        _attempt(report, "elected", elector.is_leader)
        report["elector_id"] = elector.node_id
        _attempt(report, "follower.leader", lambda: getattr(follower.leader(), "node_id", None))
        _attempt(report, "follower.nodes", lambda: [n.node_id for n in follower.nodes()])
        _attempt(report, "leader.nodes", lambda: [n.node_id for n in leader.nodes()])

        def broadcast() -> Any:
            child_sub = bc.subscribe(f"child-{marker}")
            bc.publish(f"child-{marker}", {"from": "child"})
            return child_sub.get(timeout=10)

        _attempt(report, "broadcast", broadcast)
        report["sessions"] = _own_backends(pg_dsn, before)
        # Closing must not end the parent's sessions (a Terminate on their sockets).
        for each in (claimer, store, elector, bc):
            _attempt(report, f"close {type(each).__name__}", each.close)
        _attempt(report, "stop follower", follower.stop)
        _attempt(report, "stop leader", leader.stop)
        return report

    report = in_child(child, timeout=120)
    after = _backends(pg_dsn, os.getpid())
    release.set()

    assert not _left_alone(before, after), (_left_alone(before, after), report)
    assert "error" not in report, report
    assert report["is_leader"] is False, report
    assert report["claim"] is True, report
    assert report["save"] == {"by": "child"} and report["load"] == {"by": "child"}, report
    # A default node id is the process's: the child is another candidate, which the
    # parent's leadership keeps out (the same id would have made both lead).
    assert report["elector_id"] != elector.node_id and report["elected"] is False, report
    assert report["follower.leader"] == leader.node_id, report
    assert leader.node_id in report["follower.nodes"], report
    assert leader.node_id in report["leader.nodes"], report
    assert report["broadcast"] == {"from": "child"}, report
    for name in ("close PostgresClaimer", "close PostgresCheckpointStore"):
        assert report[name] is None, report
    assert report["sessions"]["own"], report

    # The parent goes on: same term, renewed since, its objects working.
    def renewed() -> bool:
        now = leader.leader()
        return now is not None and now.expires_at > expires_before

    wait_until(renewed, timeout=5, what="a renewal of the parent's lease after the fork")
    assert leader.is_leader and leader.term == term
    assert claimer.claim(f"forked/parent-after-{marker}")
    assert elector.is_leader()
    bc.publish("parent", "again")
    assert sub.get(timeout=10) == "again"


def test_a_following_processs_keeper_session_is_never_used_by_its_child(
    pg_dsn: str, closing: ExitStack
) -> None:
    # Another connection string: the holder has a keeper session of its own, and this
    # process's follower reads leader() and nodes() on its own keeper session.
    holder = rs.PostgresLeader(
        make_conninfo(pg_dsn, connect_timeout=9), _idle_tasks(), name="followed", **FAST
    )
    closing.callback(holder.stop)
    follower = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="followed", **FAST)
    closing.callback(follower.stop)
    holder.start()
    assert holder.wait_until_leader(20)
    follower.start()
    lease: Any = follower.lease
    wait_until(
        lambda: (
            lease.backend_pid is not None
            and (seen := follower.leader()) is not None
            and seen.node_id == holder.node_id
        ),
        timeout=20,
        what="the follower to connect and see the holder",
    )
    assert holder.node_id in [n.node_id for n in follower.nodes()]
    keeper = lease.backend_pid
    # The nodes list read on the keeper session, as pg_stat_activity shows it until
    # the keeper's next statement (an attempt, a heartbeat) replaces it.
    listing = "n.last_seen >= clock_timestamp()"
    wait_until(
        lambda: listing not in _backends(pg_dsn, os.getpid())[keeper].query,
        timeout=20,
        interval=0.1,
        what="the follower's keeper to run a statement after its nodes list",
    )
    before = _backends(pg_dsn, os.getpid())
    assert before[keeper].application_name == "rselection:keeper"

    def child() -> dict[str, Any]:
        report: dict[str, Any] = {}
        _attempt(report, "nodes", lambda: [n.node_id for n in follower.nodes()])
        _attempt(report, "stop", follower.stop)
        return report

    report = in_child(child, timeout=60)
    after = _backends(pg_dsn, os.getpid())
    assert not _left_alone(before, after), (_left_alone(before, after), report)
    # The follower's keeper ran none of the child's reads (the parent listed no nodes
    # since it was snapshotted).
    assert listing not in after[keeper].query, (after[keeper], report)
    assert report.get("nodes") and holder.node_id in report["nodes"], report
    assert lease.backend_pid == keeper
    assert holder.node_id in [n.node_id for n in follower.nodes()]
    seen = follower.leader()
    assert seen is not None and seen.node_id == holder.node_id


def test_a_lease_connected_before_fork_connects_anew_in_the_child_and_leaves_the_parents(
    pg_dsn: str,
) -> None:
    lease = PostgresLease(pg_dsn, name="bare", ttl=20, renew_deadline=10)
    lease.connect()
    try:
        got = lease.try_acquire("parent")
        assert got.acquired and got.holder is not None
        term = got.holder.term
        keeper = lease.backend_pid
        assert keeper is not None
        time.sleep(0.2)  # the keeper's first round trips are over: it is quiet now
        before = _backends(pg_dsn, os.getpid())

        def child() -> dict[str, Any]:
            report: dict[str, Any] = {}
            _attempt(report, "holder", lambda: getattr(lease.current(), "node_id", None))
            try:
                attempt = lease.try_acquire("child")
                report["acquired"] = attempt.acquired
                report["attempt holder"] = getattr(attempt.holder, "node_id", None)
            except Exception as exc:
                report["attempt"] = f"error: {type(exc).__name__}: {exc}"
            report["keeper"] = lease.backend_pid
            _attempt(report, "close", lease.close)
            return report

        report = in_child(child, timeout=60)
        after = _backends(pg_dsn, os.getpid())
        wrong = [w for w in _left_alone(before, after) if "ended" in w]
        assert not wrong, (wrong, report)
        # Quiet since: the keeper ran nothing of the child's (no renewal was due), at most
        # its own read of the ring's members, in answer to the child's keeper announcing
        # itself.
        assert _quiet_but_for_the_ring(before[keeper], after[keeper]), (after[keeper], report)
        assert "error" not in report, report
        assert report["holder"] == "parent" and report["attempt holder"] == "parent", report
        assert report["acquired"] is False, report
        assert report["keeper"] not in (None, keeper), report
        assert lease.renew("parent", term), "the parent's keeper session was lost"
        assert lease.backend_pid == keeper
    finally:
        lease.close()


def test_a_connection_or_pool_given_before_fork_is_refused_in_the_child(
    pg_dsn: str, closing: ExitStack
) -> None:
    """A connection or a pool the user passed is the parent's: the child's calls refuse
    it (saying why) rather than run in the parent's sessions."""
    from psycopg_pool import ConnectionPool

    conn = psycopg.connect(pg_dsn, autocommit=True, application_name="user-connection")
    closing.callback(conn.close)
    pool = ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True)
    closing.callback(pool.close)
    given = {"connection": PostgresClaimer(conn), "pool": PostgresClaimer(pool)}
    for kind, claimer in given.items():
        closing.callback(claimer.close)
        assert claimer.claim(f"given/parent-{kind}")
    bc = PostgresBroadcaster(pool, probe_interval=3600)  # publishes on the pool's
    closing.callback(bc.close)
    sub = bc.subscribe("given")
    bc.publish("given", "parent")
    assert sub.get(timeout=10) == "parent"
    mine = conn.info.backend_pid
    before = _backends(pg_dsn, os.getpid())

    def child() -> dict[str, Any]:
        report: dict[str, Any] = {}
        for kind, claimer in given.items():
            _attempt(report, kind, functools.partial(claimer.claim, f"given/child-{kind}"))
        _attempt(report, "publish", functools.partial(bc.publish, "given", "child"))
        bc.close()
        return report

    report = in_child(child, timeout=60)
    after = _backends(pg_dsn, os.getpid())
    for kind in (*given, "publish"):
        assert str(report[kind]).startswith("error: RSelectionError"), report
        assert "forked from" in report[kind] and "post_fork" in report[kind], report
    assert after[mine].state_change == before[mine].state_change, "the child used it"
    assert not _left_alone(before, after), _left_alone(before, after)
    for kind, claimer in given.items():
        assert claimer.claim(f"given/parent-after-{kind}"), kind
    bc.publish("given", "parent again")
    assert sub.get(timeout=10) == "parent again"


def test_locks_held_by_a_parents_thread_at_the_fork_do_not_hang_the_child(
    pg_dsn: str, closing: ExitStack
) -> None:
    """A thread of the parent that holds a process-wide lock at the moment of the fork
    does not exist in the child: the lock must not stay held there for ever."""
    from rselection.driver import LeaseDriver
    from rselection.event_loops import SharedLoops
    from rselection.postgres.broadcast.listening import ListeningSession
    from rselection.postgres.broadcast.turns import Turn
    from rselection.postgres.keeper import SharedKeeper
    from rselection.postgres.session_pool import SessionPool

    tasks = rs.TaskHandler(stop_grace=1.0)
    ran = threading.Event()

    @tasks.persistent("work")
    async def work(ctx: rs.TaskContext) -> None:  # on the shared event loops
        ran.set()
        await ctx.asleep(3600)

    leader = rs.PostgresLeader(pg_dsn, tasks, name="locked", **FAST)  # not started
    claimer = PostgresClaimer(pg_dsn)
    closing.callback(claimer.close)
    bc = PostgresBroadcaster(pg_dsn, probe_interval=3600)
    closing.callback(bc.close)
    locks = [
        SessionPool._registry_lock,
        SharedKeeper._registry_lock,
        ListeningSession._registry_lock,
        Turn._registry_lock,
        LeaseDriver._shared_lock,
        SharedLoops._shared_lock,
    ]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait(60)
        for lock in locks:
            lock.release()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(5)

    def child() -> dict[str, Any]:
        report: dict[str, Any] = {}
        _attempt(report, "claim", lambda: claimer.claim("locked/child"))
        leader.start()
        try:
            report["led"] = leader.wait_until_leader(20)
            report["ran"] = ran.wait(10)
        finally:
            leader.stop()

        def broadcast() -> Any:
            sub = bc.subscribe("child")
            bc.publish("child", 1)
            return sub.get(timeout=10)

        _attempt(report, "broadcast", broadcast)
        bc.close()
        return report

    try:
        report = in_child(child, timeout=90)
    finally:
        release.set()
        holder.join(5)
    assert report == {"claim": True, "led": True, "ran": True, "broadcast": 1}, report


# --------------------------------------------------------------------------- Redis


def _client_list(redis_url: str) -> list[dict[str, Any]]:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return list(client.client_list())
    finally:
        client.close()


def _parents_connections(redis_url: str, ports: set[int]) -> dict[str, dict[str, Any]]:
    """``CLIENT LIST`` entries of this process's connections whose port is in ``ports``."""
    out = {}
    for entry in _client_list(redis_url):
        port = int(str(entry["addr"]).rsplit(":", 1)[1])
        if port in ports:
            out[str(entry["id"])] = entry
    return out


def _redis_ports(redis_url: str) -> set[int]:
    from redis.connection import ConnectionPool

    port = int(ConnectionPool.from_url(redis_url).connection_kwargs.get("port", 6379))
    return local_ports(os.getpid(), port)


def _redis_ports_once_beating(redis_url: str) -> set[int]:
    """This process's ports to Redis once its liveness hub has connected: the hub
    connects from its own thread, after the lease is taken, so ports read at once may
    miss it (and the test would see no beats)."""
    found: set[int] = set()

    def beating() -> bool:
        found.clear()
        found.update(_redis_ports(redis_url))
        return any(_named(LIVENESS, e) for e in _parents_connections(redis_url, found).values())

    wait_until(beating, timeout=10, interval=0.1, what="the liveness hub's connection")
    return found


def _untouched(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], waited: float
) -> list[str]:
    """What the child did to the parent's connections (see the module docstring)."""
    wrong = []
    for cid, was in before.items():
        now = after.get(cid)
        if now is None:
            wrong.append(f"client {cid} ({was['name'] or 'no name'}) was closed")
            continue
        for field in ("cmd", "sub", "psub"):
            if now[field] != was[field]:
                wrong.append(f"client {cid} {field}: {was[field]} -> {now[field]}")
        if int(now["idle"]) < int(was["idle"]) + int(waited) - 1:
            wrong.append(
                f"client {cid} ({was['name'] or 'no name'}) ran {now['cmd']} while only "
                f"the child could (idle {was['idle']} -> {now['idle']} s over {waited:.1f} s)"
            )
    return wrong


#: The client name of a process's liveness hub (:mod:`rselection.redis.liveness`): the
#: parent beats on it while the child runs.
LIVENESS = "rselection:liveness"


def _split_busy(
    connections: dict[str, dict[str, Any]], busy: Callable[[dict[str, Any]], bool]
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """The parent's connections it leaves idle, and the ids of those it uses itself."""
    idle = {cid: e for cid, e in connections.items() if not busy(e)}
    return idle, set(connections) - set(idle)


def _named(name: str, entry: dict[str, Any]) -> bool:
    return str(entry["name"]) == name


def _quiet(redis_url: str, ports: set[int], exclude: Callable[[dict[str, Any]], bool]) -> None:
    """Wait until the parent's connections (but ``exclude``\\ d ones) are idle for 2 s, so
    that a command on them resets an idle time that can only have grown otherwise."""
    wait_until(
        lambda: all(
            int(e["idle"]) >= 2
            for e in _parents_connections(redis_url, ports).values()
            if not exclude(e)
        ),
        timeout=10,
        interval=0.2,
        what="the parent's Redis connections to be idle",
    )


def test_a_redis_lease_connected_before_fork_leaves_the_parents_connections_alone(
    redis_url: str,
) -> None:
    from rselection.redis import RedisLease

    name = f"forked-{uuid.uuid4().hex[:12]}"
    lease = RedisLease(redis_url, name=name, ttl=30, renew_deadline=20, liveness_interval=0.2)
    lease.connect()
    try:
        got = lease.try_acquire("parent")
        assert got.acquired and got.holder is not None
        term = got.holder.term
        assert lease.renew("parent", term)
        ports = _redis_ports_once_beating(redis_url)
        beating = functools.partial(_named, LIVENESS)
        _quiet(redis_url, ports, beating)
        before, busy = _split_busy(_parents_connections(redis_url, ports), beating)
        assert len([e for e in before.values() if e["name"] == f"rselection:{name}"]) == 2
        assert busy  # the parent beats for the lease it holds
        began = time.monotonic()

        def child() -> dict[str, Any]:
            report: dict[str, Any] = {}
            _attempt(report, "holder", lambda: getattr(lease.current(), "node_id", None))
            _attempt(
                report, "attempt", lambda: getattr(lease.try_acquire("child").holder, "node_id", "")
            )
            _attempt(report, "wait", lambda: lease.wait_for_change(0.5))
            report["client_id"] = lease.client_id
            _attempt(report, "close", lease.close)
            time.sleep(1.5)  # a command on the parent's connections shows in its idle time
            return report

        report = in_child(child, timeout=60)
        waited = time.monotonic() - began
        after = _parents_connections(redis_url, ports)
        assert not _untouched(before, after, waited), (_untouched(before, after, waited), report)
        assert busy <= set(after), "the child closed the parent's liveness connections"
        assert report["holder"] == "parent" and report["attempt"] == "parent", report
        assert report["wait"] is None and report["close"] is None, report
        assert report["client_id"] not in (None, lease.client_id), report
        assert lease.renew("parent", term), "the parent's keeper connection was lost"
    finally:
        lease.close()


def test_redis_objects_used_before_fork_work_in_the_child_on_connections_of_their_own(
    redis_url: str, closing: ExitStack
) -> None:
    import redis

    from rselection.redis import RedisClaimer, RedisElector

    name = f"forked-{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(redis_url)
    closing.callback(client.close)
    claimer = RedisClaimer(client)
    elector = RedisElector(client, name=name)
    # Heartbeats far apart: the parent's heartbeat connection stays quiet meanwhile.
    slow_beats = {"heartbeat_interval": 60.0}
    leader = rs.RedisLeader(client, _idle_tasks(), name=name, claimer=claimer, **FAST, **slow_beats)
    closing.callback(leader.stop)
    built = rs.RedisLeader(redis_url, _idle_tasks(), name=name, **FAST)  # not started here
    leader.start()
    assert leader.wait_until_leader(20)
    term = leader.term
    assert claimer.claim(f"{name}/parent")
    assert elector.is_leader()
    wait_until(
        lambda: leader.node_id in [n.node_id for n in leader.nodes()],
        timeout=10,
        what="the leader's heartbeat",
    )
    assert built.leader() is not None
    ports = _redis_ports_once_beating(redis_url)
    keeper_name = f"rselection:{name}"

    def busy_in_parent(entry: dict[str, Any]) -> bool:
        return str(entry["name"]) in (keeper_name, LIVENESS)

    _quiet(redis_url, ports, busy_in_parent)
    before, busy = _split_busy(_parents_connections(redis_url, ports), busy_in_parent)
    assert before and busy
    began = time.monotonic()

    def child() -> dict[str, Any]:
        report: dict[str, Any] = {"is_leader": leader.is_leader}
        _attempt(report, "claim", lambda: claimer.claim(f"{name}/child"))
        _attempt(report, "elected", elector.is_leader)
        report["elector_id"] = elector.node_id
        _attempt(report, "holder", lambda: getattr(built.leader(), "node_id", None))
        _attempt(report, "leader.nodes", lambda: [n.node_id for n in leader.nodes()])
        built.start()
        try:
            deadline = time.monotonic() + 10
            nodes: list[str] = []
            while built.node_id not in nodes and time.monotonic() < deadline:
                nodes = [n.node_id for n in built.nodes()]
                time.sleep(0.05)
            report["built"] = built.node_id
            report["nodes"] = nodes
        finally:
            built.stop()
        _attempt(report, "stop leader", leader.stop)
        return report

    report = in_child(child, timeout=90)
    waited = time.monotonic() - began
    after = _parents_connections(redis_url, ports)
    assert not _untouched(before, after, waited), (_untouched(before, after, waited), report)
    assert busy <= set(after), "the child closed the parent's keeper or liveness connections"
    assert "error" not in report, report
    assert report["is_leader"] is False and report["claim"] is True, report
    assert report["elector_id"] != elector.node_id and report["elected"] is False, report
    assert report["holder"] == leader.node_id, report
    assert leader.node_id in report["leader.nodes"], report
    # The leader built before the fork and started in the child heartbeats there.
    assert report["built"] in report["nodes"], report
    assert leader.is_leader and leader.term == term
    assert leader.node_id in [n.node_id for n in leader.nodes()]
    assert elector.is_leader()


# --------------------------------------------------------------------------- threads


def test_a_child_never_runs_the_calls_its_parent_queued_for_its_workers() -> None:
    """A shared pool's calls queued in the parent (a term's claims waiting for a busy
    worker) are the parent's: a child's first call does not run them there."""
    from rselection.daemon_pool import SharedPool

    pool = SharedPool("rselection-test-forked", 1, most=1)
    parents, gate = pool.lane(2), threading.Event()
    ran: list[str] = []
    parents.submit(gate.wait, 30)  # holds the pool's only worker
    parents.submit(ran.append, "parent's queued call")  # waits for a worker
    try:

        def child() -> dict[str, Any]:
            own = pool.lane(1)
            own.submit(ran.append, "child's call").result(10)
            time.sleep(0.2)  # a queued call of the parent's would run now
            own.shutdown()
            return {"ran": list(ran)}

        report = in_child(child, timeout=30)
    finally:
        gate.set()
        parents.shutdown()
    assert report == {"ran": ["child's call"]}, report
    wait_until(lambda: ran == ["parent's queued call"], timeout=5, what="the parent's call")
