"""The hold on a keeper session: an error never closes a session that holds a term."""

from __future__ import annotations

from rselection.session_hold import SessionHold


def test_a_session_that_holds_nothing_is_closed_on_its_first_error() -> None:
    hold = SessionHold()
    assert not hold.holding and not hold.broken
    assert hold.fail(), "nothing runs under it: close it now"
    assert not hold.broken


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
