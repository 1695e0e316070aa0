"""The leadership history's shared parts: limits, reasons, and how a Redis stream's
entries fold into records (an odd entry is skipped, never fatal)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rselection.errors import ConfigError
from rselection.history import MAX_HISTORY_LIMIT, check_history_limit, end_reason_of
from rselection.redis.history import fold


@pytest.mark.parametrize("bad", [0, 1, -5, MAX_HISTORY_LIMIT + 1, 2**31, 2.0, True, "10", None])
def test_a_history_limit_out_of_range_is_refused_at_construction(bad: object) -> None:
    with pytest.raises(ConfigError, match="history_limit must be an int from 2 to 1,000,000"):
        check_history_limit(bad)


def test_a_history_limit_in_range_is_kept() -> None:
    assert check_history_limit(2) == 2
    assert check_history_limit(MAX_HISTORY_LIMIT) == MAX_HISTORY_LIMIT
    assert check_history_limit(1, "limit", least=1) == 1


def test_the_engine_s_reasons_become_the_record_s() -> None:
    assert [end_reason_of(r) for r in ("stopped", "handover", "step_down", "drained")] == [
        "released",
        "handed_over",
        "stepped_down",
        "drained",
    ]
    assert {end_reason_of(r) for r in ("deadline", "lost", "error", "anything")} == {"deadline"}


def began(term: int, node: str, at: int = 1_000) -> tuple[bytes, dict[bytes, bytes]]:
    fields = {"kind": "began", "term": str(term), "node": node, "version": "", "host": "h"}
    fields |= {"pid": "7", "at": str(at)}
    return b"0-0", {k.encode(): v.encode() for k, v in fields.items()}


def ended(term: int, reason: str, at: object = 2_000) -> tuple[bytes, dict[bytes, bytes]]:
    fields = {"kind": "ended", "term": str(term), "reason": reason, "to": "", "by": ""}
    fields["at"] = str(at)
    return b"0-0", {k.encode(): v.encode() for k, v in fields.items()}


def test_entries_fold_into_records_newest_first() -> None:
    entries = [began(3, "c"), ended(2, "released"), began(2, "b"), ended(1, "expired")]
    records = fold("x", entries, 10)
    assert [(r.term, r.node_id, r.end_reason) for r in records] == [
        (3, "c", None),
        (2, "b", "released"),
    ]  # term 1's beginning was trimmed: its end alone is left out
    assert records[1].ended_at == datetime.fromtimestamp(2, UTC)
    assert fold("x", entries, 1)[0].term == 3


def test_an_entry_that_does_not_parse_is_skipped_not_fatal() -> None:
    not_utf8 = (b"0-0", {b"kind": b"began", b"term": b"4", b"node": b"\xff"})
    bad_end = ended(3, "released", at="soon")
    entries = [not_utf8, bad_end, began(3, "c"), (b"0-0", {b"kind": b"began"}), began(2, "b")]
    records = fold("x", entries, 10)
    # Term 4 is skipped; term 3 keeps its beginning (its end's time does not parse).
    assert [(r.term, r.ended_at) for r in records] == [(3, None), (2, None)]
