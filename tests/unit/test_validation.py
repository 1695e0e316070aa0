"""The one set of checks every backend uses for names, node ids, durations and terms."""

from __future__ import annotations

from datetime import timedelta

import pytest

import rselection as rs
from rselection.errors import ConfigError
from rselection.validation import (
    MAX_NAME,
    check_name,
    check_node_id,
    check_optional_seconds,
    check_optional_term,
    check_seconds,
    check_term,
    name_bytes,
    new_node_id,
)


@pytest.mark.parametrize(
    "name", ["jobs", " jobs ", "a}b{c", "tab\there", "ünï", "x" * MAX_NAME, "emoji 🦆"]
)
def test_names_are_taken_verbatim(name: str) -> None:
    assert check_name(name, "lease name") == name


@pytest.mark.parametrize(
    "name", ["", "   ", "\t\n", "x" * (MAX_NAME + 1), "nul\x00", "lone\ud800", 7, None]
)
def test_unusable_names_are_refused_with_what_they_name(name: object) -> None:
    with pytest.raises(ConfigError, match="lease name"):
        check_name(name, "lease name")


def test_node_ids_follow_the_name_rule() -> None:
    assert check_node_id("node-1") == "node-1"
    with pytest.raises(ConfigError, match="node_id"):
        check_node_id(" ")
    ids = {new_node_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(check_node_id(i) == i for i in ids)


def test_durations() -> None:
    assert check_seconds(2, "ttl") == 2.0
    assert check_seconds(timedelta(milliseconds=1500), "ttl") == 1.5
    assert check_seconds(0, "jitter", allow_zero=True) == 0.0
    assert check_optional_seconds(None, "node_timeout") is None
    for bad in (0, -1, float("nan"), float("inf"), True, "2", None):
        with pytest.raises(ConfigError, match="ttl"):
            check_seconds(bad, "ttl")
    with pytest.raises(ConfigError, match=r"at least 0.001 s"):
        check_seconds(0.0001, "ttl", minimum=0.001)


@pytest.mark.parametrize(
    ("longest", "what"),
    [
        ("x" * MAX_NAME, "ASCII: one byte each"),
        ("é" * (MAX_NAME // 2), "two bytes each"),
        ("\U0001f986" * (MAX_NAME // 4), "four bytes each"),
        ('"' * (MAX_NAME // 2), "escaped as two bytes in a notification"),
        ("\b" * (MAX_NAME // 2), "escaped as two bytes in a notification"),
        ("\x01" * (MAX_NAME // 6), "escaped as six bytes in a notification"),
    ],
)
def test_names_are_limited_in_bytes_as_notifications_carry_them(longest: str, what: str) -> None:
    assert check_name(longest, "lease name") == longest, what
    assert name_bytes(longest) <= MAX_NAME
    with pytest.raises(ConfigError, match=rf"lease name must have at most {MAX_NAME} bytes"):
        check_name(longest + longest[0], "lease name")
    with pytest.raises(ConfigError, match="node_id"):
        check_node_id(longest + longest[0])


def test_a_names_size_is_what_json_makes_of_it() -> None:
    assert name_bytes('a"b\\c\x01\t\U0001f986é') == 1 + 2 + 1 + 2 + 1 + 6 + 2 + 4 + 2


@pytest.mark.parametrize("term", [0, -1, 2**63, True, False, 1.0, "1", None])
def test_a_fencing_term_is_an_int_from_1_to_2_63_minus_1(term: object) -> None:
    with pytest.raises(ConfigError, match="term must be an int from 1 to 2"):
        check_term(term)


def test_every_class_takes_the_same_terms() -> None:
    assert check_term(1) == 1 and check_term(2**63 - 1) == 2**63 - 1
    assert check_optional_term(None) is None and check_optional_term(7) == 7
    with pytest.raises(ConfigError, match="term must be"):
        check_optional_term(0)
    store, claimer = rs.MemoryCheckpointStore(), rs.MemoryClaimer()
    for refused in (lambda: store.save("k", 1, term=0), lambda: claimer.claim("f", term=0)):
        with pytest.raises(ConfigError, match="term must be an int from 1"):
            refused()
