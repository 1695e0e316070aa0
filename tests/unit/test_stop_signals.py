"""stop_on_signals: what lead() does with SIGTERM and Ctrl-C, in this process."""

from __future__ import annotations

import _signal
import signal
import sys
import threading
import time
from _thread import LockType
from types import FrameType
from typing import Any

import pytest

from rselection.stop_signals import StopSignals, stop_on_signals


def never_done() -> tuple[threading.Event, LockType]:
    """What a leader that never stops gives ``StopSignals.wait``: its event, and its
    latch, held."""
    latch = threading.Lock()
    latch.acquire()
    return threading.Event(), latch


def finish(done: threading.Event, latch: LockType) -> None:
    """What a leader's keeper does once it has shut down."""
    done.set()
    latch.release()


def test_sigterm_interrupts_the_main_thread_once_and_handlers_come_back() -> None:
    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with pytest.raises(KeyboardInterrupt), stop_on_signals("test") as signalled:
            # Not here, where the main thread may have just taken a lock: in the wait.
            signal.raise_signal(signal.SIGTERM)
            assert signalled.stopping
            signalled.wait(*never_done())
        assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_during_the_stop_does_not_interrupt_it_but_ctrl_c_does() -> None:
    with stop_on_signals("test") as signalled:
        signalled.stop_begins()
        signal.raise_signal(signal.SIGTERM)  # logged only
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signalled.gave_up


def test_a_ctrl_c_while_the_first_signal_waits_to_be_acted_on_gives_up() -> None:
    with stop_on_signals("test") as signalled:
        signal.raise_signal(signal.SIGTERM)  # recorded: lead() is not waiting yet
        assert not signalled.gave_up
        # It raises here, wherever the main thread is: lead() lets it through rather
        # than stop gracefully, which may need a lock this interruption left taken.
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signalled.gave_up


def test_a_second_sigterm_before_the_first_is_acted_on_is_only_logged() -> None:
    with pytest.raises(KeyboardInterrupt), stop_on_signals("test") as signalled:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # logged only
        assert not signalled.gave_up
        signalled.wait(*never_done())  # raises for the first one


def test_nested_blocks_keep_the_outer_handler() -> None:
    with stop_on_signals("outer") as signalled:
        outer = signal.getsignal(signal.SIGTERM)
        with stop_on_signals("inner") as inner:
            assert signal.getsignal(signal.SIGTERM) is outer
            # A signal the outer block received is acted on where the inner one waits.
            assert inner is signalled
        assert isinstance(outer, StopSignals) and outer.what == "outer"


def test_a_signal_interrupts_the_wait_itself() -> None:
    done, latch = never_done()
    main = threading.main_thread().ident
    assert main is not None
    # Bounds the test: a wait that a signal did not interrupt ends then, without raising.
    bound = threading.Timer(10, finish, (done, latch))
    with stop_on_signals("test") as signalled:
        # Sent to the main thread while it waits (or just before: then the wait raises
        # as it begins).
        sender = threading.Thread(target=signal.pthread_kill, args=(main, signal.SIGTERM))
        started = time.monotonic()
        try:
            bound.start()
            with pytest.raises(KeyboardInterrupt):
                sender.start()
                signalled.wait(done, latch)
        finally:
            bound.cancel()
            sender.join(10)
    assert time.monotonic() - started < 5


def test_the_wait_ends_once_the_leader_is_done() -> None:
    done, latch = never_done()
    with stop_on_signals("test") as signalled:
        threading.Thread(target=finish, args=(done, latch)).start()
        signalled.wait(done, latch)  # returns: no signal came
        assert not signalled.stopping


def test_a_signal_after_the_stop_began_is_not_acted_on_by_a_wait() -> None:
    done, latch = never_done()
    with stop_on_signals("test") as signalled:
        signalled.stop_begins()
        signal.raise_signal(signal.SIGTERM)  # logged only
        threading.Thread(target=finish, args=(done, latch)).start()
        signalled.wait(done, latch)  # returns once the leader stopped, not raising


def test_call_returns_what_the_call_returns_or_raises() -> None:
    with stop_on_signals("test") as signalled:
        assert signalled.call(lambda: 42, "test-call") == 42
        with pytest.raises(ValueError, match="no"):
            signalled.call(lambda: int("no"), "test-call")
        assert not signalled.stopping


def test_a_signal_interrupts_a_call_at_once() -> None:
    release = threading.Event()
    main = threading.main_thread().ident
    assert main is not None
    with stop_on_signals("test") as signalled:
        # A read the server answers only after its timeout: the signal comes meanwhile.
        def blocking() -> None:
            signal.pthread_kill(main, signal.SIGTERM)
            release.wait(10)

        started = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                signalled.call(blocking, "test-call")
        finally:
            release.set()
    assert time.monotonic() - started < 5


def test_a_signal_before_a_call_is_acted_on_as_it_begins() -> None:
    ran: list[bool] = []
    with stop_on_signals("test") as signalled:
        signal.raise_signal(signal.SIGTERM)  # recorded
        with pytest.raises(KeyboardInterrupt):
            signalled.call(lambda: ran.append(True), "test-call")
    assert not ran


def test_no_handler_outside_the_main_thread() -> None:
    seen: list[object] = []

    def run() -> None:
        with stop_on_signals("thread") as signalled:
            seen.append(signal.getsignal(signal.SIGTERM))
            signalled.stop_begins()

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert seen == [before]


def test_an_ignored_signal_stays_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), stop_on_signals("test") as signalled:
            signal.raise_signal(signal.SIGINT)  # ignored: nothing happens
            assert not signalled.stopping
            signal.raise_signal(signal.SIGTERM)
            signalled.wait(*never_done())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def ctrl_c_after_installing(handler_of_sigterm: type | object) -> Any:
    """A profile function that raises SIGINT once, right after ``signal.signal`` returned
    with SIGTERM's handler being ``handler_of_sigterm`` (a class: any instance of it)."""
    fired: list[bool] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "c_return" or arg is not _signal.signal or fired:
            return
        now = signal.getsignal(signal.SIGTERM)
        if isinstance(handler_of_sigterm, type):
            if not isinstance(now, handler_of_sigterm):
                return
        elif now is not handler_of_sigterm:
            return
        fired.append(True)
        signal.raise_signal(signal.SIGINT)

    return profile


def test_a_ctrl_c_between_installing_the_two_handlers_leaves_none_behind() -> None:
    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        # SIGTERM's handler is in place, SIGINT's not yet: Python's own raises.
        sys.setprofile(ctrl_c_after_installing(StopSignals))
        try:
            with pytest.raises(KeyboardInterrupt), stop_on_signals("test"):
                pass
        finally:
            sys.setprofile(None)
        # One left behind would swallow every SIGTERM from then on.
        assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_ctrl_c_while_the_handlers_are_put_back_still_puts_both_back() -> None:
    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with pytest.raises(KeyboardInterrupt), stop_on_signals("test") as signalled:
            signalled.stop_begins()
            # SIGTERM's is back, SIGINT's not yet: this block's gives up.
            sys.setprofile(ctrl_c_after_installing(own))
        sys.setprofile(None)
        assert signalled.gave_up
        assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGTERM, previous)
