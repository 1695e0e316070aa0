"""Reading notifications any role may send, and the keeper's rate limit on what they
wake, without a server."""

from __future__ import annotations

import json
import logging

import pytest

from rselection import clock
from rselection.postgres import notice_gate, notices
from rselection.postgres.notice_gate import BURST, SPACING, NoticeGate
from rselection.postgres.notices import RingNotice, lease_notice, pid_of, ring_notice

CHANNEL = "rselection:public.rselection_leases:jobs"

HOSTILE = [
    "[" * 7990,  # RecursionError in json.loads
    '{"a":' * 3000 + "1" + "}" * 3000,
    '[["x"]]',
    "[1, 2]",
    '{"event": 5}',
    '{"event": "acquired", "term": "7"}',
    "not json",
    "",
    "{" + " " * 9000 + "}",
    # Timestamps that overflow when converted to UTC.
    '{"event": "acquired", "node_id": "x", "term": 3, "acquired_at": '
    '"9999-12-31T23:59:59-23:59", "expires_at": "9999-12-31T23:59:59-23:59"}',
    '{"event": "acquired", "node_id": "x", "term": 3, "acquired_at": '
    '"0001-01-01T00:00:00+23:59", "expires_at": "0001-01-01T00:00:00+23:59"}',
]


@pytest.mark.parametrize("payload", HOSTILE, ids=lambda p: repr(p[:12]))
def test_a_hostile_lease_payload_is_dropped_never_raised(payload: str) -> None:
    before = notices.dropped.count
    read = lease_notice(CHANNEL, payload, 4242)
    if read is not None:  # a known kind with wrong fields: read, its fields left out
        assert read.event == "acquired" and read.holder is None
    else:
        assert notices.dropped.count == before + 1


@pytest.mark.parametrize(
    "payload", ["up:²", "down:²", "up:" + "9" * 40, "down:-1", "up:0", "sideways:12", "down:"]
)
def test_a_hostile_ring_payload_is_dropped_never_raised(payload: str) -> None:
    before = notices.dropped.count
    assert ring_notice("rselection-ring:x", payload, 1) is None
    assert notices.dropped.count == before + 1


def test_rselections_own_notices_are_read_whatever_the_names_hold() -> None:
    assert ring_notice("r", "down:12345", 1) == RingNotice("down", 12345)
    node = "[[[{{ x" + "é" * 200  # brackets and non-ASCII in a name are data
    payload = json.dumps(
        {
            "event": "acquired",
            "name": "jobs",
            "node_id": node,
            "term": 7,
            "acquired_at": "2026-12-01T00:00:00+00:00",
            "expires_at": "2026-12-01T00:00:15+00:00",
            "holder_pid": 321,
        }
    )
    read = lease_notice(CHANNEL, payload, 321)
    assert read is not None and read.holder is not None
    assert (read.node_id, read.term, read.holder_pid, read.holder.node_id) == (node, 7, 321, node)


def test_pids_are_ascii_digits_of_a_32_bit_int() -> None:
    assert pid_of("2147483647") == 2**31 - 1
    assert [pid_of(t) for t in ("2147483648", "٣", "+5", " 5", "", "05x")] == [None] * 6


def test_dropped_notices_are_reported_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notices, "dropped", notices._Dropped())
    caplog.set_level(logging.WARNING, logger="rselection")
    for _ in range(500):
        lease_notice(CHANNEL, "\x1b]0;owned\x07", 77)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "backend pid 77" in lines[0] and "\x1b" not in lines[0], lines
    assert notices.dropped.count == 500


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    now = Clock()
    monkeypatch.setattr(clock, "monotonic", now)
    return now


def test_unproven_wake_ups_are_rate_limited_and_deferred_never_lost(fake_clock: Clock) -> None:
    gate = NoticeGate()
    gate.connected(10)
    admitted = sum(gate.admit(CHANNEL, gate.proven(666), "released") for _ in range(100))
    assert admitted == BURST
    assert gate.due() == []  # held back: one deferred wake-up for the channel
    due = gate.next_due(reading=True)
    assert due is not None and due <= fake_clock.now + SPACING
    fake_clock.now += SPACING
    assert gate.due() == [(CHANNEL, frozenset({"released"}))]
    assert gate.due() == []
    # The own session and the ring's members are believed, and never held back.
    gate.members_read([20])
    assert all(gate.admit(CHANNEL, gate.proven(pid), "released") for pid in (10, 20) * 50)


def test_unknown_senders_and_announced_keepers_read_the_members_at_a_bounded_rate(
    fake_clock: Clock,
) -> None:
    gate = NoticeGate()
    gate.connected(10)
    assert gate.read_now()
    gate.members_read([10, 20])
    assert not gate.read_now()
    for _ in range(100):
        assert not gate.proven(666)
        gate.joined()
    assert not gate.read_now()  # at most once each MEMBERS_EVERY
    fake_clock.now += notice_gate.MEMBERS_EVERY
    # A read due while the session is down is no reason to wake (the pump would spin).
    assert gate.next_due(reading=False) is None
    assert gate.next_due(reading=True) == fake_clock.now
    assert gate.read_now() and not gate.read_now()
