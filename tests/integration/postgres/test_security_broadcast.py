"""PostgresBroadcaster attacked from a role that can only connect.

The attacker is a role with LOGIN and nothing else (``login_only_dsn``): it cannot read
or write the outbox, but any role may LISTEN and NOTIFY on any channel, and the
broadcaster's channel name is a public hash of the table's name. Whatever it sends, a
subscriber receives only messages committed to the outbox, each once; whatever it
hears, it learns no message's body.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from rselection.broadcast import Subscription
from rselection.postgres import PostgresBroadcaster
from rselection.postgres.broadcast.outbox import BROADCAST_TABLE, Outbox
from tests.support.waiting import wait_until

LOGGER = "rselection.postgres.broadcast"

#: Quick polls, so that a listener misled into a wrong position shows it within a second.
QUICK = {"probe_interval": 0.3, "io_timeout": 2.0}


@pytest.fixture
def make_bc(pg_dsn: str) -> Iterator[Callable[..., PostgresBroadcaster]]:
    """Factory of broadcasters on ``pg_dsn``, closed after the test."""
    made: list[PostgresBroadcaster] = []

    def make(**options: Any) -> PostgresBroadcaster:
        bc = PostgresBroadcaster(pg_dsn, **options)
        made.append(bc)
        assert bc.wait_ready(20), "the broadcaster did not reach Postgres within 20 s"
        return bc

    yield make
    for bc in made:
        bc.close()


@pytest.fixture
def channel(pg_dsn: str) -> str:
    """The NOTIFY channel of the test's outbox table: what anyone can compute from the
    table's schema-qualified name."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
    assert row is not None
    qualified = f"{row[0]}.{BROADCAST_TABLE}"
    channel = "rselection_bc_" + hashlib.blake2b(qualified.encode(), digest_size=8).hexdigest()
    assert channel == Outbox.channel(qualified)
    return channel


@pytest.fixture
def attacker(login_only_dsn: str, pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A session of the LOGIN-only role, after checking it cannot read the outbox."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
    assert row is not None
    with psycopg.connect(login_only_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                sql.SQL("SELECT payload FROM {}").format(sql.Identifier(row[0], BROADCAST_TABLE))
            )
        yield conn


def notify(conn: psycopg.Connection[Any], channel: str, payload: str) -> None:
    """Send one NOTIFY (committed at once: the session is in autocommit mode)."""
    conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))


def receive_until(sub: Subscription, last: object, timeout: float) -> list[Any]:
    """Every message ``sub`` gets until ``last`` arrives (included), within ``timeout``."""
    deadline = time.monotonic() + timeout
    got: list[Any] = []
    while not got or got[-1] != last:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"{last!r} did not arrive within {timeout} s; got {got!r:.300}")
        try:
            got.append(sub.get(remaining))
        except TimeoutError:
            continue
    return got


def receive_for(sub: Subscription, seconds: float) -> list[Any]:
    """Every message ``sub`` gets within ``seconds`` (to show that nothing more comes)."""
    deadline = time.monotonic() + seconds
    got: list[Any] = []
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            got.append(sub.get(remaining))
        except TimeoutError:
            break
    return got


def test_a_login_only_listener_hears_wake_ups_but_no_message_body(
    make_bc: Callable[..., PostgresBroadcaster],
    attacker: psycopg.Connection[Any],
    channel: str,
) -> None:
    bc = make_bc()
    sub = bc.subscribe("payments", maxsize=100)
    attacker.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
    secret = f"card-{uuid.uuid4().hex}"
    sent = [{"secret": secret, "n": n} for n in range(20)]
    bc.publish("payments", sent[0])  # a lone message
    assert bc.flush(10)
    for message in sent[1:]:  # and a batch
        bc.publish("payments", message)
    assert bc.flush(10)
    assert receive_until(sub, sent[-1], 10) == sent
    # Every NOTIFY was queued for the attacker when its transaction committed, before the
    # subscriber could read the message.
    heard = [note.payload for note in attacker.notifies(timeout=0.5)]
    assert heard, "the attacker LISTENs on the broadcaster's channel: it hears the wake-ups"
    leaked = [payload for payload in heard if secret in payload or "payments" in payload]
    assert not leaked, f"NOTIFY payloads carry message bodies: {leaked[0]!r:.200}"


def test_a_forged_notify_with_the_next_id_never_reaches_subscribers(
    make_bc: Callable[..., PostgresBroadcaster],
    attacker: psycopg.Connection[Any],
    channel: str,
) -> None:
    bc = make_bc(**QUICK)
    sub = bc.subscribe("orders", maxsize=100)
    bc.publish("orders", {"n": 0})
    assert receive_until(sub, {"n": 0}, 10) == [{"n": 0}]
    forged = {"forged": True}
    next_id = bc.stats().last_id + 1  # ids are no secret: they count messages
    notify(attacker, channel, json.dumps([[next_id, "orders", json.dumps(forged)]]))
    # Notifications reach a listener in commit order: the forged one comes first.
    bc.publish("orders", {"n": 1})
    assert bc.flush(10)
    got = receive_until(sub, {"n": 1}, 5)
    assert forged not in got, f"a subscriber received the forged body: {got!r}"
    assert got == [{"n": 1}]
    assert bc.stats().last_id == next_id
    assert bc.stats().gaps == 0 and bc.stats().resets == 0


@pytest.mark.parametrize("forged_id", ["next", "far"])
def test_a_forged_id_alone_moves_nothing(
    make_bc: Callable[..., PostgresBroadcaster],
    attacker: psycopg.Connection[Any],
    channel: str,
    forged_id: str,
) -> None:
    """A payload that is only an id, as the writer sends it, is a wake-up: the listener
    fetches what the table holds, and its position follows the table alone."""
    bc = make_bc(**QUICK)
    sub = bc.subscribe("orders", maxsize=100)
    bc.publish("orders", {"n": 0})
    assert receive_until(sub, {"n": 0}, 10) == [{"n": 0}]
    top = bc.stats().last_id
    notify(attacker, channel, str(top + (1 if forged_id == "next" else 10**15)))
    bc.publish("orders", {"n": 1})
    assert bc.flush(10)
    assert receive_until(sub, {"n": 1}, 5) == [{"n": 1}]
    assert receive_for(sub, 1.0) == []
    stats = bc.stats()
    assert (stats.last_id, stats.gaps, stats.resets) == (top + 1, 0, 0)


def test_a_forged_notify_that_jumps_ahead_redelivers_nothing(
    make_bc: Callable[..., PostgresBroadcaster],
    attacker: psycopg.Connection[Any],
    channel: str,
) -> None:
    bc = make_bc(**QUICK)
    sub = bc.subscribe("orders", maxsize=100)
    sent = [{"n": n} for n in range(5)]
    for message in sent:
        bc.publish("orders", message)
    assert bc.flush(10)
    assert receive_until(sub, sent[-1], 10) == sent
    top = bc.stats().last_id
    # Rows far past the newest id, on a channel nobody reads: nothing forged shows, but
    # a listener that believed them would take every real id for one that went back.
    notify(attacker, channel, json.dumps([[top + k, "elsewhere", "0"] for k in range(1, 51)]))
    bc.publish("orders", {"n": 5})
    assert bc.flush(10)
    got = receive_until(sub, {"n": 5}, 5)
    # Several polls (probe_interval=0.3) later, still nothing delivered a second time.
    got += receive_for(sub, 1.5)
    assert got == [{"n": 5}], f"{len(got)} deliveries for 1 new message: {got!r:.300}"
    stats = bc.stats()
    assert (stats.resets, stats.gaps) == (0, 0)
    assert stats.last_id == top + 1


#: Payloads no writer sends: each used to raise in the listener thread (or to be read
#: as rows), restarting the listening session.
JUNK = [
    '[["x"]]',
    "[" * 7990,  # RecursionError in json.loads
    "[[1]]",
    '[[null, "orders", "{}"]]',
    '[["1", "orders"]]',
    '[[1.5e400, "orders", "{}"]]',
    "[{}]",
    "[1, 2]",
    "[[" + "9" * 5000 + ', "orders", "{}"]]',  # int() refuses over 4300 digits
    '{"rows": 1}',
    "\u00b2",  # "²".isdigit() is true, int("²") raises
    "\u0661\u0662",  # Arabic-Indic digits: int() reads them
    "-1",
    " 7",
    "9" * 40,
    "",
    "\u202e\x1b]0;pwned\x07",
]


def test_junk_notify_payloads_never_restart_the_listener(
    make_bc: Callable[..., PostgresBroadcaster],
    attacker: psycopg.Connection[Any],
    channel: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bc = make_bc(**QUICK)
    sub = bc.subscribe("orders", maxsize=100)
    bc.publish("orders", {"n": 0})
    assert receive_until(sub, {"n": 0}, 10) == [{"n": 0}]
    pid = bc.stats().listener_pid
    assert pid is not None
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(3):
            for payload in JUNK:
                notify(attacker, channel, payload)
        # Delivery goes on, and the junk was read first (commit order).
        bc.publish("orders", {"n": 1})
        assert bc.flush(10)
        assert receive_until(sub, {"n": 1}, 5) == [{"n": 1}]
        assert receive_for(sub, 0.5) == []
    restarts = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    stats = bc.stats()
    assert stats.listener_pid == pid and stats.reconnects == 0, (
        f"the listener restarted ({stats.reconnects} reconnects): {restarts[:3]!r:.600}"
    )
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a payload"
    assert stats.ignored_notifies == 3 * len(JUNK)
    assert (stats.resets, stats.gaps) == (0, 0)
    # One warning says what was ignored, however many came (rate-limited).
    warned = [m for m in restarts if "NOTIFY" in m]
    assert len(warned) == 1, restarts
    assert "\x1b" not in warned[0] and "\u202e" not in warned[0]


def test_a_flood_of_forged_notifies_leaves_delivery_intact(
    make_bc: Callable[..., PostgresBroadcaster],
    attacker: psycopg.Connection[Any],
    channel: str,
) -> None:
    """Forged wake-ups interleaved with real publishes: every real message arrives once,
    in order, and nothing else does."""
    bc = make_bc(**QUICK)
    sub = bc.subscribe("orders", maxsize=1000)
    bc.publish("orders", {"n": -1})
    assert receive_until(sub, {"n": -1}, 10) == [{"n": -1}]
    sent = [{"n": n} for n in range(200)]
    junk = 0
    for i, message in enumerate(sent):
        bc.publish("orders", message)
        top = bc.stats().last_id
        forged = [
            json.dumps([[top + 1, "orders", json.dumps({"forged": i})]]),
            str(top + 1 + i),
            str(max(0, top - i)),
            "0",
            '[["x"]]',
        ][i % 5]
        junk += not forged.isdigit()
        notify(attacker, channel, forged)
    assert bc.flush(10)
    got = receive_until(sub, sent[-1], 20)
    got += receive_for(sub, 1.0)
    assert got == sent
    stats = bc.stats()
    assert (stats.resets, stats.gaps, stats.reconnects) == (0, 0, 0)
    # Rows and junk are ignored; ids are wake-ups.
    wait_until(lambda: bc.stats().ignored_notifies == junk == 80, 5, "the junk counted")


def test_a_login_only_role_cannot_hold_up_publishes(
    make_bc: Callable[..., PostgresBroadcaster],
    attacker: psycopg.Connection[Any],
    pg_dsn: str,
) -> None:
    """Publishes are put in id order by a lock that only roles with rights on the
    outbox's state table can take: a role that can only connect holds up nothing."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
    assert row is not None
    qualified = f"{row[0]}.{BROADCAST_TABLE}"
    bc = make_bc(io_timeout=2.0)
    sub = bc.subscribe("orders", maxsize=100)
    bc.publish("orders", {"n": 0})
    assert receive_until(sub, {"n": 0}, 10) == [{"n": 0}]
    # What a role can compute from the table's name: the advisory lock key publishes
    # used to wait for (a public hash), taken here for good.
    digest = hashlib.blake2b(b"rselection:broadcast:" + qualified.encode(), digest_size=8)
    attacker.execute(
        "SELECT pg_advisory_lock(%s)", (int.from_bytes(digest.digest(), "big", signed=True),)
    )
    # The state table's row is what orders publishes now: locking it needs rights.
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        attacker.execute(
            sql.SQL("SELECT FROM {} FOR UPDATE").format(
                sql.Identifier(row[0], f"{BROADCAST_TABLE}_state")
            )
        )
    started = time.monotonic()
    bc.publish("orders", {"n": 1})
    assert bc.flush(5), "a publish waited for a lock that a LOGIN-only role holds"
    assert receive_until(sub, {"n": 1}, 5) == [{"n": 1}]
    assert time.monotonic() - started < 2.0
