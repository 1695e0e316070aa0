"""Parsing what a Redis lease's channels carry: signed beats, wake-ups, never a raise."""

from __future__ import annotations

import random

import pytest

from rselection.redis.messages import (
    Beat,
    beat_term,
    event_kind,
    read_beat,
    sign_beat,
    unsigned_beat,
)

TOKEN = "0123456789abcdef0123456789abcdef"
TERM = 1796309597925848


def test_a_signed_beat_reads_back_with_the_holders_token_only() -> None:
    beat = sign_beat(TOKEN, TERM, 500, 7)
    assert read_beat(beat, TOKEN) == Beat(TERM, 0.5, 7)
    assert read_beat(beat.encode(), TOKEN) == Beat(TERM, 0.5, 7)
    assert read_beat(beat, "f" * 32) is None
    assert read_beat(beat, "") is None  # a holder whose token we never read
    assert beat_term(beat) == TERM and not unsigned_beat(beat)


@pytest.mark.parametrize("part", [1, 2, 3])
def test_a_beat_with_any_signed_part_changed_is_refused(part: int) -> None:
    fields = sign_beat(TOKEN, TERM, 500, 7).split(":")
    fields[part] = str(int(fields[part]) + 1)
    assert read_beat(":".join(fields), TOKEN) is None


def test_an_older_releases_unsigned_beat_is_recognised_and_never_taken() -> None:
    old = f"alive:{TERM}:500"
    assert unsigned_beat(old) and read_beat(old, TOKEN) is None and beat_term(old) is None


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
        b"\x00" * 70_000,
    ],
)
def test_anything_else_is_no_event_and_no_beat(message: object) -> None:
    assert event_kind(message) is None
    assert read_beat(message, TOKEN) is None
    assert beat_term(message) is None
    assert not unsigned_beat(message)


def test_random_bytes_never_raise() -> None:
    rng = random.Random(32)
    alphabet = b"alive:resignd0123456789abcdef\xff\xc3\x00"
    for _ in range(20_000):
        message = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 90)))
        event_kind(message)
        read_beat(message, TOKEN)
        beat_term(message)
        unsigned_beat(message)
