"""The deadline clock: CLOCK_BOOTTIME on Linux (it counts suspended time), else monotonic."""

from __future__ import annotations

import sys
import time

import pytest

from rselection import clock


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CLOCK_BOOTTIME is Linux only")
def test_on_linux_it_reads_the_boot_time_clock() -> None:
    assert clock.CLOCK_NAME == "CLOCK_BOOTTIME"
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    reading = clock.monotonic()
    after = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert before <= reading <= after


def test_it_never_goes_back_and_counts_elapsed_time() -> None:
    readings = [clock.monotonic() for _ in range(10_000)]
    assert readings == sorted(readings)
    began = clock.monotonic()
    time.sleep(0.05)
    assert clock.monotonic() - began >= 0.05
