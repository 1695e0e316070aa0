"""What a PostgresBroadcaster listener makes of a NOTIFY payload: a wake-up, never data.

No server: the listener is built but never started, and only its reading of payloads
is exercised (the attacks themselves run against a real server in
tests/integration/postgres/test_security_broadcast.py).
"""

from __future__ import annotations

import logging
import time

import pytest

from rselection.postgres.broadcast import wakeups
from rselection.postgres.broadcast.listener import Listener
from rselection.postgres.broadcast.outbox import Outbox
from rselection.postgres.broadcast.sessions import Sessions
from rselection.postgres.broadcast.settings import Settings
from rselection.postgres.broadcast.wakeups import MAX_ID, IgnoredPayloads, notified_id, shown

LOGGER = "rselection.postgres.broadcast"

#: Payloads no writer sends; none may raise, none is an id.
JUNK = [
    "",
    '[["x"]]',
    "[" * 7990,
    "[[1]]",
    '[[1, "orders", "{}"]]',
    '{"id": 1}',
    "\u00b2",  # "²".isdigit() is true, int() refuses it
    "\u0661\u0662",  # Arabic-Indic digits: isdigit() is true and int() reads 12
    "\uff11",  # a fullwidth digit
    "-1",
    "+1",
    " 1",
    "1 ",
    "1_000",
    "0x10",
    "1e3",
    "1.0",
    str(MAX_ID + 1),
    "9" * 20,
    "9" * 100_000,
    "\x00",
    "\u202e\x1b]0;title\x07",
]


def make_listener() -> Listener:
    """A listener of an unstarted broadcaster's parts (nothing connects)."""
    settings = Settings(
        retention=600.0,
        probe_interval=5.0,
        io_timeout=10.0,
        close_timeout=5.0,
        max_message_bytes=1024 * 1024,
        max_pending=10,
        synchronous_commit=False,
        create_tables=False,
    )
    sessions = Sessions("postgresql://u@127.0.0.1:9/db", Outbox("rselection_broadcast"), settings)
    return Listener(sessions, lambda channel: True, lambda channel, message: None, None)


@pytest.mark.parametrize("payload", ["0", "1", "42", "0042", str(MAX_ID)])
def test_an_id_is_ascii_digits_of_a_bigint(payload: str) -> None:
    assert notified_id(payload) == int(payload)


@pytest.mark.parametrize("payload", JUNK, ids=range(len(JUNK)))
def test_anything_else_is_no_id_and_never_raises(payload: str) -> None:
    assert notified_id(payload) is None


def test_a_long_payload_is_refused_without_being_converted() -> None:
    started = time.perf_counter()
    for _ in range(1000):
        assert notified_id("9" * 7999) is None
    # int() of 7999 digits costs far more than a length check (and raises past 4300).
    assert time.perf_counter() - started < 0.5


def test_a_payload_is_shown_escaped_and_cut() -> None:
    assert shown("12") == "'12'"
    text = shown("\u202e\x1b]0;title\x07" + "x" * 100)
    assert text.isprintable() and text.isascii()
    assert "\\x1b" in text and "\\u202e" in text
    assert text.endswith("... (111 characters)")


def test_ignored_payloads_are_counted_and_reported_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(wakeups.time, "monotonic", lambda: now[0])
    ignored = IgnoredPayloads("rselection_broadcast", "host=db")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ignored.add('[["x"]]', 4242)
        for _ in range(500):
            ignored.add("junk", 4242)
            now[0] += 0.1  # 50 s in all
        assert len(caplog.records) == 1
        first = caplog.records[0].getMessage()
        assert "'[[\"x\"]]'" in first and "pid 4242" in first and "ignored_notifies" in first
        now[0] += 11.0  # a minute after the first report
        ignored.add("\x1b[2J", 77)
    assert ignored.count == 502
    assert len(caplog.records) == 2
    second = caplog.records[1].getMessage()
    assert "501 more" in second and "'\\x1b[2J'" in second and "pid 77" in second


def test_a_listener_takes_junk_as_nothing_and_counts_it() -> None:
    listener = make_listener()
    listener.last_id = 10
    for payload in JUNK:
        assert listener.on_notify(payload, 1) is False
    assert listener.ignored == len(JUNK)
    assert (listener.last_id, listener.gaps, listener.resets, listener.received) == (10, 0, 0, 0)


def test_an_id_only_decides_whether_to_fetch() -> None:
    listener = make_listener()
    listener.last_id = 10
    # At most the last id delivered, above every id named before: nothing new to fetch.
    assert listener.on_notify("7") is False
    assert listener.on_notify("10") is False
    # Above the last id delivered: fetch.
    assert listener.on_notify("11") is True
    # Not above an id named before: publishes commit in id order, so the ids went back
    # (or someone else sent it); a fetch finds out which.
    assert listener.on_notify("11") is True
    assert listener.on_notify("3") is True
    # A forged high id makes the next NOTIFYs fetch; it moves nothing.
    assert listener.on_notify(str(MAX_ID)) is True
    assert listener.on_notify("12") is True
    assert (listener.last_id, listener.gaps, listener.resets, listener.ignored) == (10, 0, 0, 0)
