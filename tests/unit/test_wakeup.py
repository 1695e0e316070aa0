"""The keeper's wake-up: sticky, wakes a selector, never blocks the waker."""

from __future__ import annotations

import selectors
import threading
import time

from rselection.wakeup import Wakeup


def test_a_wake_before_the_wait_is_kept_until_cleared() -> None:
    wakeup = Wakeup()
    wakeup.wake()  # before open(): the flag alone counts
    assert wakeup.pending
    wakeup.open()
    wakeup.clear()
    assert not wakeup.pending
    wakeup.close()


def test_a_wake_from_another_thread_ends_a_selector_wait() -> None:
    wakeup = Wakeup()
    wakeup.open()
    sock = wakeup.socket
    assert sock is not None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_READ)
            timer = threading.Timer(0.05, wakeup.wake)
            timer.start()
            start = time.monotonic()
            assert sel.select(5), "the wake-up did not reach the selector"
            assert time.monotonic() - start < 2
            timer.join(5)
            wakeup.clear()
            assert not sel.select(0), "clear() drains the socket"
    finally:
        wakeup.close()


def test_many_wakes_never_block_and_close_is_idempotent() -> None:
    wakeup = Wakeup()
    wakeup.open()
    for _ in range(20_000):  # far more than a socket buffer holds
        wakeup.wake()
    wakeup.clear()
    wakeup.close()
    wakeup.close()
    assert wakeup.socket is None
    wakeup.open()
    assert wakeup.socket is not None
    wakeup.close()


def test_wakes_in_a_row_send_one_byte_and_a_wake_after_clear_wakes_again() -> None:
    wakeup = Wakeup()
    wakeup.open()
    sock = wakeup.socket
    assert sock is not None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_READ)
            for _ in range(1_000):
                wakeup.wake()
            assert sel.select(0)
            assert sock.recv(4096) == b"\0", "one byte wakes the selector, not one a wake"
            # The byte is gone but clear() was not called: wakes still count as pending.
            assert wakeup.pending
            wakeup.clear()
            assert not sel.select(0)
            wakeup.wake()
            assert sel.select(0), "a wake after clear() sends a byte again"
            wakeup.clear()
            wakeup.close()
            wakeup.open()
            new = wakeup.socket
            assert new is not None
            wakeup.wake()
            assert new.recv(16) == b"\0", "a new socket pair gets its own byte"
    finally:
        wakeup.close()
