"""A Kubernetes-style leader election over a lease row in Postgres (benchmark baseline).

A small re-implementation of client-go's ``tools/leaderelection`` algorithm, with its
``LeaseLock`` (a ``coordination.k8s.io/v1`` Lease read and written through the API
server) replaced by one row of a Postgres table. It exists so ``bench/peers.py`` can
compare rselection with the scheme most Kubernetes controllers use, on the same
database and machine; it is not part of the library.

What is kept from client-go, because it decides the timings being compared:

* The record: holder identity, lease duration, acquire time, renew time, leader
  transitions. Writes are optimistic: an update names the resource version it last
  read and fails (like HTTP 409 Conflict) if the row has changed since.
* Expiry is judged on the *follower's own clock*: a follower remembers when it last
  saw the record change (``observedTime``) and considers the lease valid until
  ``observedTime + leaseDuration``. Neither the renew time stored in the record nor any
  server clock is compared, so a follower that started, or saw the last renewal, late
  also takes over late.
* Followers try every ``retryPeriod`` with client-go's jitter (``wait.JitterUntil``,
  factor 1.2, sliding): the wait is uniform in ``[retryPeriod, 2.2 * retryPeriod]``.
* The leader renews every ``retryPeriod`` (``wait.Until``); a failed renewal is retried
  every ``retryPeriod`` until ``renewDeadline`` has passed since the attempt began, and
  then the leader gives up.
* The leader's renewal takes the "fast path": one optimistic update against the last
  record it wrote, falling back to read-then-update only if that fails.
* When the leader's context is cancelled (here: SIGTERM) and ``ReleaseOnCancel`` is set,
  it releases by writing a record with an empty holder and a 1 s lease duration;
  followers see the empty holder at their next try and take over then.

Defaults are client-go's usual ones (also those of controller-runtime and
kube-scheduler): lease duration 15 s, renew deadline 10 s, retry period 2 s.

One statement is one API request: ``get`` is one ``SELECT``, ``create`` one
``INSERT``, ``update`` one ``UPDATE``.

Node program (used by ``bench/peers.py``; JSON lines like ``python -m
rselection.commands.demo_fleet``)::

    python bench/k8s_style.py node DSN LEASE NODE_ID [--no-release]
        [--lease-duration 15] [--renew-deadline 10] [--retry-period 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import psycopg

TABLE = "k8s_style_leases"

DDL = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    name text PRIMARY KEY,
    holder_identity text NOT NULL,
    lease_duration_seconds integer NOT NULL,
    acquire_time timestamptz,
    renew_time timestamptz,
    leader_transitions integer NOT NULL,
    resource_version bigint NOT NULL
)
"""

#: client-go's ``JitterFactor`` of the acquire loop.
JITTER_FACTOR = 1.2


@dataclass(frozen=True)
class LeaderElectionRecord:
    """client-go's ``resourcelock.LeaderElectionRecord``.

    The times are the writer's wall clock, as in client-go; they are informational and
    never used to decide expiry.
    """

    holder_identity: str
    lease_duration_seconds: int
    acquire_time: datetime | None
    renew_time: datetime | None
    leader_transitions: int


class PostgresLeaseLock:
    """``LeaseLock`` on a table row: get, create and optimistic update.

    Like client-go's lock it keeps the last object it read or wrote, whose resource
    version the next update must match.

    Args:
        dsn: the database.
        name: the lease name (the row's key).
        identity: this candidate's holder identity.
        request_timeout: server-side bound of one request, like the request context.
    """

    def __init__(self, dsn: str, name: str, identity: str, request_timeout: float) -> None:
        self.dsn = dsn
        self.name = name
        self.identity = identity
        self.request_timeout = request_timeout
        self._conn: psycopg.Connection[Any] | None = None
        self._version: int | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        # A broken connection is replaced on the next request, as an HTTP client would.
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.dsn,
                autocommit=True,
                connect_timeout=max(1, int(self.request_timeout)),
                application_name=f"k8s-style:{self.name}",
                options=f"-c statement_timeout={int(self.request_timeout * 1000)}",
            )
        return self._conn

    def get(self) -> LeaderElectionRecord | None:
        """The current record, or ``None`` if the lease does not exist (404)."""
        row = (
            self._connection()
            .execute(
                f"SELECT holder_identity, lease_duration_seconds, acquire_time, renew_time,"
                f" leader_transitions, resource_version FROM {TABLE} WHERE name = %s",
                (self.name,),
            )
            .fetchone()
        )
        if row is None:
            return None
        self._version = int(row[5])
        return LeaderElectionRecord(*row[:5])

    def create(self, record: LeaderElectionRecord) -> bool:
        """Create the lease; ``False`` if it exists already (409 AlreadyExists)."""
        row = (
            self._connection()
            .execute(
                f"INSERT INTO {TABLE} (name, holder_identity, lease_duration_seconds,"
                f" acquire_time, renew_time, leader_transitions, resource_version)"
                f" VALUES (%s, %s, %s, %s, %s, %s, 1) ON CONFLICT (name) DO NOTHING"
                f" RETURNING resource_version",
                (self.name, *_values(record)),
            )
            .fetchone()
        )
        if row is None:
            return False
        self._version = int(row[0])
        return True

    def update(self, record: LeaderElectionRecord) -> bool:
        """Write ``record`` if the row is still at the version last seen (else 409)."""
        if self._version is None:
            raise RuntimeError("lease not initialized, call get or create first")
        row = (
            self._connection()
            .execute(
                f"UPDATE {TABLE} SET holder_identity = %s, lease_duration_seconds = %s,"
                f" acquire_time = %s, renew_time = %s, leader_transitions = %s,"
                f" resource_version = resource_version + 1"
                f" WHERE name = %s AND resource_version = %s RETURNING resource_version",
                (*_values(record), self.name, self._version),
            )
            .fetchone()
        )
        if row is None:
            return False
        self._version = int(row[0])
        return True

    def close(self) -> None:
        """Close the connection (a killed process never gets here)."""
        if self._conn is not None:
            self._conn.close()


def _values(r: LeaderElectionRecord) -> tuple[Any, ...]:
    return (
        r.holder_identity,
        r.lease_duration_seconds,
        r.acquire_time,
        r.renew_time,
        r.leader_transitions,
    )


class LeaderElector:
    """client-go's ``LeaderElector``: ``run`` = acquire, then renew until lost or stopped.

    Args:
        lock: the lease lock.
        lease_duration: how long a follower waits after it last saw the record change.
        renew_deadline: how long the leader keeps retrying a failed renewal.
        retry_period: the followers' polling period and the leader's renewal period.
        release_on_cancel: release the lease when stopped while leading.
        on_started: called with the record when this candidate starts leading.
        on_stopped: called with a reason when it stops leading.
    """

    def __init__(
        self,
        lock: PostgresLeaseLock,
        *,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        release_on_cancel: bool = True,
        on_started: Callable[[LeaderElectionRecord], None] = lambda r: None,
        on_stopped: Callable[[str], None] = lambda reason: None,
    ) -> None:
        if not lease_duration > renew_deadline > JITTER_FACTOR * retry_period:
            # client-go's NewLeaderElector checks the same two inequalities.
            raise ValueError("need leaseDuration > renewDeadline > 1.2 * retryPeriod")
        self.lock = lock
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.release_on_cancel = release_on_cancel
        self.on_started = on_started
        self.on_stopped = on_stopped
        self.observed_record: LeaderElectionRecord | None = None
        self.observed_time = 0.0  # time.monotonic() when the record last changed

    # -- state --------------------------------------------------------------------------

    def is_leader(self) -> bool:
        """Whether the last record this candidate saw or wrote names it."""
        r = self.observed_record
        return r is not None and r.holder_identity == self.lock.identity

    def _lease_valid(self, now: float) -> bool:
        r = self.observed_record
        seconds = r.lease_duration_seconds if r is not None else 0
        return self.observed_time + seconds > now

    def _observe(self, record: LeaderElectionRecord, now: float) -> None:
        self.observed_record = record
        self.observed_time = now

    # -- the algorithm --------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Acquire, lead until the lease is lost or ``stop`` is set, then release."""
        if not self._acquire(stop):
            return
        assert self.observed_record is not None
        self.on_started(self.observed_record)
        self._renew(stop)
        if self.release_on_cancel:
            self.release()  # a no-op unless this candidate still holds the lease
        self.on_stopped("stopped" if stop.is_set() else "lost")

    def _acquire(self, stop: threading.Event) -> bool:
        # wait.JitterUntil(..., RetryPeriod, JitterFactor, sliding=true): the jittered
        # period is drawn before each attempt and counted from the attempt's end.
        while not stop.is_set():
            period = self.retry_period * (1 + random.random() * JITTER_FACTOR)
            if self.try_acquire_or_renew():
                return True
            if stop.wait(period):
                break
        return False

    def _renew(self, stop: threading.Event) -> None:
        # wait.Until(..., RetryPeriod): each pass polls tryAcquireOrRenew every RetryPeriod
        # (immediately first) for at most RenewDeadline; a pass that never succeeds ends
        # the term.
        while not stop.is_set():
            deadline = time.monotonic() + self.renew_deadline
            while not self.try_acquire_or_renew():
                if stop.wait(self.retry_period):
                    return
                if time.monotonic() >= deadline:
                    return
            if stop.wait(self.retry_period):
                return

    def try_acquire_or_renew(self) -> bool:
        """One attempt to take or keep the lease, as client-go's ``tryAcquireOrRenew``."""
        try:
            return self._try_acquire_or_renew()
        except psycopg.Error:
            return False  # the request failed; client-go logs it and tries again later

    def _try_acquire_or_renew(self) -> bool:
        wall = datetime.now(UTC)
        now = time.monotonic()
        record = LeaderElectionRecord(
            holder_identity=self.lock.identity,
            lease_duration_seconds=int(self.lease_duration),
            acquire_time=wall,
            renew_time=wall,
            leader_transitions=0,
        )
        # 1. Fast path: the leader updates optimistically against the record it wrote.
        if self.is_leader() and self._lease_valid(now):
            assert self.observed_record is not None
            old = self.observed_record
            fast = replace(
                record,
                acquire_time=old.acquire_time,
                leader_transitions=old.leader_transitions,
            )
            if self.lock.update(fast):
                self._observe(fast, now)
                return True
        # 2. Get the record, or create it.
        old = self.lock.get()
        if old is None:
            if not self.lock.create(record):
                return False
            self._observe(record, now)
            return True
        # 3. A changed record restarts this candidate's expiry clock.
        if old != self.observed_record:
            self._observe(old, now)
        if old.holder_identity and self._lease_valid(now) and not self.is_leader():
            return False  # held by someone else and not yet expired
        # 4. Take it over (or renew it), keeping the transition count right.
        if self.is_leader():
            record = replace(
                record,
                acquire_time=old.acquire_time,
                leader_transitions=old.leader_transitions,
            )
        else:
            record = replace(record, leader_transitions=old.leader_transitions + 1)
        if not self.lock.update(record):
            return False  # someone else wrote first (409)
        self._observe(record, now)
        return True

    def release(self) -> bool:
        """Give the lease up: empty holder, 1 s duration (client-go's ``release``)."""
        if not self.is_leader():
            return True
        assert self.observed_record is not None
        wall = datetime.now(UTC)
        record = LeaderElectionRecord(
            holder_identity="",
            lease_duration_seconds=1,
            acquire_time=wall,
            renew_time=wall,
            leader_transitions=self.observed_record.leader_transitions,
        )
        try:
            ok = self.lock.update(record)
        except psycopg.Error:
            return False
        if ok:
            self._observe(record, time.monotonic())
        return ok


# -- node program ---------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    fields.update(ev=event, t=time.time())
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def run_node(args: argparse.Namespace) -> int:
    """Compete for the lease until SIGTERM; report events as JSON lines on stdout.

    The term reported is the record's leader transition count, which grows with every
    change of holder, the closest thing client-go has to a term. After losing the lease
    the node competes again (a ``RunOrDie`` loop), so it stays a follower.
    """
    stop = threading.Event()
    stopping: list[float] = []

    def on_signal(*_: object) -> None:
        stopping.append(time.monotonic())
        # On a thread of its own: set() here would deadlock if the signal came while the
        # main thread is inside stop.wait(), holding the Event's lock.
        threading.Thread(target=stop.set, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(4243)")  # nodes start at once: DDL one at a time
        conn.execute(DDL)
        conn.execute("SELECT pg_advisory_unlock(4243)")
    lock = PostgresLeaseLock(args.dsn, args.lease, args.node_id, args.renew_deadline)
    term: list[int] = [0]

    def started(record: LeaderElectionRecord) -> None:
        term[0] = record.leader_transitions
        _emit("elected", node=args.node_id, term=record.leader_transitions)

    elector = LeaderElector(
        lock,
        lease_duration=args.lease_duration,
        renew_deadline=args.renew_deadline,
        retry_period=args.retry_period,
        release_on_cancel=not args.no_release,
        on_started=started,
        on_stopped=lambda reason: _emit("demoted", node=args.node_id, term=term[0], reason=reason),
    )
    _emit("ready", node=args.node_id, pid=os.getpid())
    while not stop.is_set():
        elector.run(stop)
    lock.close()
    _emit("stopped", node=args.node_id, took=time.monotonic() - stopping[0])
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python bench/k8s_style.py node ...``."""
    p = argparse.ArgumentParser(prog="bench/k8s_style.py")
    sub = p.add_subparsers(dest="command", required=True)
    node = sub.add_parser("node", help="run one candidate")
    node.add_argument("dsn")
    node.add_argument("lease")
    node.add_argument("node_id")
    node.add_argument("--no-release", action="store_true", help="ReleaseOnCancel off")
    node.add_argument("--lease-duration", type=float, default=15.0)
    node.add_argument("--renew-deadline", type=float, default=10.0)
    node.add_argument("--retry-period", type=float, default=2.0)
    args = p.parse_args(argv)
    return run_node(args)


if __name__ == "__main__":
    sys.exit(main())
