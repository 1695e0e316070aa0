"""The clock every local deadline is measured on: it keeps counting through suspend.

A leader's local deadline is "``renew_deadline`` after the last successful renewal was
sent". ``time.monotonic()`` reads ``CLOCK_MONOTONIC``, which on Linux *stops* while the
machine is suspended: a laptop closed for an hour, or a VM paused and resumed, would
wake up believing only a moment had passed and keep acting as leader while the server
let its lease expire long ago. ``CLOCK_BOOTTIME`` is the same clock plus the time spent
suspended, so a resumed process sees at once that its deadline has passed.

On other systems :func:`monotonic` is ``time.monotonic()``; whether that counts
suspended time depends on the system (macOS's does not), so a leader there relies on the
lease server's expiry and fencing alone across a suspend.

Waits with a timeout (``threading.Event.wait``, the event loop's timers) are measured on
``CLOCK_MONOTONIC`` and do not count suspended time, so code that waits for a deadline
on this clock must wake now and then to look at it (see ``TaskContext.sleep``).
"""

from __future__ import annotations

import time

__all__ = ["CLOCK_NAME", "monotonic"]


def _boottime() -> int | None:
    clock: int | None = getattr(time, "CLOCK_BOOTTIME", None)  # Linux only
    if clock is None:
        return None
    try:
        time.clock_gettime(clock)
    except OSError:  # a kernel or sandbox without it: fall back
        return None
    return clock


_BOOTTIME = _boottime()

CLOCK_NAME = "time.monotonic" if _BOOTTIME is None else "CLOCK_BOOTTIME"
"""Which clock :func:`monotonic` reads: ``"CLOCK_BOOTTIME"`` or ``"time.monotonic"``."""


def monotonic() -> float:
    """Seconds on a clock that never goes back and keeps counting through suspend.

    ``CLOCK_BOOTTIME`` on Linux, else ``time.monotonic()``. Only the difference between
    two readings means anything, as with ``time.monotonic()``.
    """
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)
