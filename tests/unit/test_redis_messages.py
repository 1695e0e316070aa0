"""Parsing what the Redis backend's channels carry: signed beats, wake-ups, never a raise."""

from __future__ import annotations

import random

import pytest

from rselection.redis.messages import (
    Beat,
    beat_sender,
    event_kind,
    read_beat,
    sign_beat,
    unsigned_beat,
)

TOKEN = "0123456789abcdef0123456789abcdef"
PROCESS = "00112233445566ff"
TERM = 1796309597925848


def test_a_signed_beat_reads_back_with_the_processs_secret_only() -> None:
    beat = sign_beat(TOKEN, PROCESS, 500, 3, 7)
    assert read_beat(beat, TOKEN) == Beat(PROCESS, 0.5, 3, 7)
    assert read_beat(beat.encode(), TOKEN) == Beat(PROCESS, 0.5, 3, 7)
    assert read_beat(beat, "f" * 32) is None
    assert read_beat(beat, "") is None  # a process whose secret we never read
    assert beat_sender(beat) == PROCESS and not unsigned_beat(beat)


@pytest.mark.parametrize("part", [1, 2, 3, 4])
def test_a_beat_with_any_signed_part_changed_is_refused(part: int) -> None:
    fields = sign_beat(TOKEN, PROCESS, 500, 3, 7).split(":")
    fields[part] = "00112233445566fe" if part == 1 else str(int(fields[part]) + 1)
    assert read_beat(":".join(fields), TOKEN) is None


@pytest.mark.parametrize("old", [f"alive:{TERM}:500", f"alive:{TERM}:500:7:{'0' * 32}"])
def test_an_earlier_releases_per_lease_beat_is_recognised_and_never_taken(old: str) -> None:
    assert unsigned_beat(old) and read_beat(old, TOKEN) is None and beat_sender(old) is None


@pytest.mark.parametrize("kind", ["acquired", "released", "cancelled", "resign"])
def test_the_events_a_keeper_wakes_for(kind: str) -> None:
    assert event_kind(f"{kind}:{TERM}") == kind
    assert event_kind(f"{kind}:{TERM}".encode()) == kind


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"\xff\xfe",
        b"released:\xff",
        "released:²",  # digits to str.isdigit, not to int()
        "released:\uff11\uff12",  # fullwidth digits
        "released:" + "9" * 20,
        "released:-1",
        "released:1 ",
        "resign:" + "[" * 5000,
        "hello",
        None,
        12,
        ["released:1"],
        b"alive:1:500:0:" + b"0" * 31,
        b"alive:1:500:0:" + b"G" * 32,
        "alive:1:" + "9" * 5000,
        b"beat:00112233445566ff:500:0:0:" + b"0" * 31,
        b"beat:00112233445566FF:500:0:0:" + b"0" * 32,
        b"beat:0011223344556:500:0:0:" + b"0" * 32,
        b"\x00" * 70_000,
    ],
)
def test_anything_else_is_no_event_and_no_beat(message: object) -> None:
    assert event_kind(message) is None
    assert read_beat(message, TOKEN) is None
    assert beat_sender(message) is None
    assert not unsigned_beat(message)


def test_random_bytes_never_raise() -> None:
    rng = random.Random(32)
    alphabet = b"alive:beatresignd0123456789abcdef\xff\xc3\x00"
    for _ in range(20_000):
        message = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 90)))
        event_kind(message)
        read_beat(message, TOKEN)
        beat_sender(message)
        unsigned_beat(message)
