"""The process's wait pump (:mod:`rselection.wait_pump`) against real Redis servers: a
server that hangs, or a channel that floods, holds up the waits of its own leases only.

A first pump did the beats, the checks and the reads of every lease on its one thread:
one paused server cost the leaders on a healthy server of the same process their terms
(beat gaps of 4.3 s), and a client publishing without pause on one lease's channel
stalled every lease of the process (10.7 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

import rselection as rs
from rselection.redis import RedisLeader
from rselection.redis.keys import liveness_channel
from rselection.redis.lease import lease_keys
from rselection.redis.messages import beat_sender
from tests.support.pg import PrivateRedis
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}
LEASES = 10
# Beats come every liveness_interval / 2 = 0.25 s; a follower checks the holder's
# connections after 0.5 s without one. A gap this long is a stall, not scheduling noise.
MOST_GAP = 1.0


class BeatGaps:
    """Listens to the liveness beats on ``url`` (one per process for all the leases it
    holds there); the longest gap between two beats of one process, from the first beat
    heard after :meth:`start` on."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(liveness_channel())
        self._last: dict[str | None, float] = {}
        self.gaps: dict[str | None, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.05)
            if message is None:
                continue
            now = time.monotonic()
            sender = beat_sender(message["data"])
            last = self._last.get(sender)
            if last is not None:
                self.gaps[sender] = max(self.gaps.get(sender, 0.0), now - last)
            self._last[sender] = now

    def start(self) -> None:
        self._thread.start()

    def longest(self) -> float:
        return max(self.gaps.values(), default=float("inf"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()
        self._client.close()


@contextmanager
def leaders_on(url: str, count: int, tag: str) -> Iterator[list[RedisLeader]]:
    prefix = f"pump-{tag}-{uuid.uuid4().hex[:6]}"
    made = [
        RedisLeader(url, rs.TaskHandler(), name=f"{prefix}-{i}", node_id="a", **FAST)
        for i in range(count)
    ]
    try:
        for leader in made:
            leader.start()
        yield made
    finally:
        for leader in made:
            leader.stop(timeout=15)


def watch_terms(leaders: list[RedisLeader], seconds: float) -> list[str]:
    """Poll for ``seconds``: what went wrong with the leaders' terms (none lost any)."""
    terms = [leader.term for leader in leaders]
    lost: list[str] = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for leader, term in zip(leaders, terms, strict=True):
            if leader.term != term and leader.name not in lost:
                lost.append(leader.name)
        time.sleep(0.05)
    return lost


def test_a_paused_server_holds_up_no_lease_of_another_server(
    private_redis: PrivateRedis,
) -> None:
    other = PrivateRedis().start()
    pid = other.pid
    assert pid is not None
    try:
        with (
            leaders_on(private_redis.url, LEASES, "healthy") as healthy,
            leaders_on(other.url, LEASES, "paused") as paused,
        ):
            wait_until(lambda: all(x.is_leader for x in healthy + paused), 20, "all to lead")
            gaps = BeatGaps(private_redis.url)
            try:
                gaps.start()
                time.sleep(1.0)  # beats heard before the pause
                os.kill(pid, signal.SIGSTOP)
                try:
                    lost = watch_terms(healthy, 6.0)
                finally:
                    os.kill(pid, signal.SIGCONT)
                longest = gaps.longest()
            finally:
                gaps.close()
            print(f"longest beat gap on the healthy server: {longest:.2f} s")
            assert lost == [], f"leaders on the healthy server lost their terms: {lost}"
            assert longest < MOST_GAP, f"beats on the healthy server stalled {longest:.2f} s"
    finally:
        os.kill(pid, signal.SIGCONT)
        other.close()


FLOOD = """
import sys, redis
client = redis.Redis.from_url(sys.argv[1])
channel = sys.argv[2]
pipe = client.pipeline(transaction=False)
while True:
    for _ in range(500):
        pipe.publish(channel, b"x" * 64)
    pipe.execute()
"""


def test_a_flooded_channel_holds_up_no_other_lease(private_redis: PrivateRedis) -> None:
    with leaders_on(private_redis.url, LEASES, "flood") as leaders:
        wait_until(lambda: all(x.is_leader for x in leaders), 20, "all to lead")
        flooded = leaders[0].name
        gaps = BeatGaps(private_redis.url)
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, private_redis.url, lease_keys(flooded)[2]],
            stdout=subprocess.DEVNULL,
        )
        try:
            gaps.start()
            with redis.Redis.from_url(private_redis.url) as admin:
                wait_until(
                    lambda: admin.info("stats")["total_commands_processed"] > 50_000,
                    10,
                    "the flood to begin",
                )
                before = admin.info("stats")["total_commands_processed"]
                lost = watch_terms(leaders, 5.0)
                published = admin.info("stats")["total_commands_processed"] - before
            longest = gaps.longest()
        finally:
            flood.kill()
            flood.wait(10)
            gaps.close()
        print(f"{published} messages in 5 s; longest beat gap of the process: {longest:.2f} s")
        assert published > 50_000, f"only {published} messages in 5 s: no flood"
        assert lost == [], f"leaders lost their terms during the flood: {lost}"
        assert longest < MOST_GAP, f"the process's beats stalled {longest:.2f} s"


def test_many_leases_on_a_paused_server_hold_up_no_lease_of_another_server(
    private_redis: PrivateRedis,
) -> None:
    # Before, the steps of every lease waited on one pool of workers, which learned only
    # four at a time that steps stuck on a paused server were stuck: with 60 leases on
    # it, the beats of the leaders on a healthy server stopped for 3.8 s (2.0 s with 30).
    # The paused side renews rarely: only the steps of its waits are stuck.
    rare = {"ttl": 120.0, "renew_interval": 30.0, "renew_deadline": 60.0, "retry_interval": 2.0}
    other = PrivateRedis().start()
    pid = other.pid
    assert pid is not None
    prefix = f"pump-many-{uuid.uuid4().hex[:6]}"
    paused = [
        RedisLeader(other.url, rs.TaskHandler(), name=f"{prefix}-{i}", node_id="a", **rare)
        for i in range(60)
    ]
    try:
        for leader in paused:
            leader.start()
        with leaders_on(private_redis.url, LEASES, "healthy") as healthy:
            wait_until(lambda: all(x.is_leader for x in healthy + paused), 30, "all to lead")
            gaps = BeatGaps(private_redis.url)
            try:
                gaps.start()
                time.sleep(1.0)  # beats heard before the pause
                os.kill(pid, signal.SIGSTOP)
                try:
                    lost = watch_terms(healthy, 4.0)
                finally:
                    os.kill(pid, signal.SIGCONT)
                longest = gaps.longest()
            finally:
                gaps.close()
        print(f"longest beat gap on the healthy server: {longest:.2f} s")
        assert lost == [], f"leaders on the healthy server lost their terms: {lost}"
        assert longest < MOST_GAP, f"beats on the healthy server stalled {longest:.2f} s"
    finally:
        os.kill(pid, signal.SIGCONT)
        for leader in paused:
            leader.stop(timeout=15)
        other.close()
