"""stop_on_signals: what lead() does with SIGTERM and Ctrl-C, in this process."""

from __future__ import annotations

import signal
import threading

import pytest

from rselection.stop_signals import StopSignals, stop_on_signals


def test_sigterm_interrupts_the_main_thread_once_and_handlers_come_back() -> None:
    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with pytest.raises(KeyboardInterrupt), stop_on_signals("test") as signalled:
            signal.raise_signal(signal.SIGTERM)
        assert signalled.stopping
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


def test_nested_blocks_keep_the_outer_handler() -> None:
    with stop_on_signals("outer"):
        outer = signal.getsignal(signal.SIGTERM)
        with stop_on_signals("inner"):
            assert signal.getsignal(signal.SIGTERM) is outer
        assert isinstance(outer, StopSignals) and outer.what == "outer"


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
        with pytest.raises(KeyboardInterrupt), stop_on_signals("test"):
            signal.raise_signal(signal.SIGINT)  # ignored: nothing happens
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
