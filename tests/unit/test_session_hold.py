"""The hold on a keeper session: an error never closes a session that holds a term."""

from __future__ import annotations

from rselection.session_hold import SessionHold, SessionHolds


def test_a_session_that_holds_nothing_is_closed_on_its_first_error() -> None:
    hold = SessionHold()
    assert not hold.holding and not hold.broken
    assert hold.fail(), "nothing runs under it: close it now"
    assert hold.broken and hold.stale, "nobody takes it for usable until it is closed"
    hold.reset()
    assert not hold.broken and not hold.stale


def test_an_error_while_holding_only_marks_the_session_broken_until_the_term_ends() -> None:
    hold = SessionHold()
    hold.begin(7)
    assert not hold.fail()
    assert hold.broken and hold.holding and not hold.stale
    assert not hold.fail(), "every later error keeps it too"
    hold.end(7)
    assert hold.stale, "the term is over: close it and start afresh"
    hold.reset()
    assert not hold.broken and not hold.holding and not hold.stale


def test_the_end_of_another_term_keeps_the_hold() -> None:
    hold = SessionHold()
    hold.begin(8)
    hold.end(7)  # a late report about the term before
    assert hold.holding and hold.term == 8
    assert not hold.fail()
    hold.end(8)
    assert not hold.holding and hold.term is None


def test_a_new_term_through_the_same_session_moves_the_hold() -> None:
    hold = SessionHold()
    hold.begin(1)
    hold.begin(2)
    hold.end(1)
    assert hold.holding
    hold.end(2)
    assert not hold.holding


def test_many_terms_hold_the_session_until_the_last_one_ends() -> None:
    holds: SessionHolds[str, int] = SessionHolds()
    holds.hold("a", 1, 101)
    holds.hold("b", 4, 104)
    assert not holds.fail(), "terms run under it: keep it open"
    assert holds.broken and not holds.stale
    assert holds.end_term("a", 1) == (1, 101)
    assert holds.holding and not holds.stale, "b still runs"
    assert holds.end_term("b", 4) == (4, 104)
    assert holds.stale and not holds.holding
    holds.reset()
    assert not holds.broken and not holds.holding


def test_a_key_holds_its_newest_term_and_gives_it_back_on_request() -> None:
    holds: SessionHolds[str, int] = SessionHolds()
    holds.hold("a", 1, 101)
    holds.hold("a", 2, 102)  # the key took a fresh term
    assert holds.end_term("a", 1) is None, "a late end of the older term changes nothing"
    assert holds.get("a") == (2, 102) and holds.term_of("a") == 2 and holds.term_of("b") is None
    assert holds.holders() == ["a"] and holds.terms() == [(2, 102)]
    assert holds.take("a") == (2, 102) and holds.take("a") is None
    assert not holds.holding
