"""The stacks of the library's threads alive now, for the report of a failed test.

A test that leaves a thread of the library running (a leader never stopped, a stop that
hangs) fails the next tests of its worker that wait for every thread to end; the stacks
show which thread that is and where it waits.
"""

from __future__ import annotations

import sys
import threading
import traceback


def thread_stacks(prefix: str = "rselection-") -> str:
    """Each live thread whose name starts with ``prefix``: its name and its stack."""
    frames = sys._current_frames()
    parts = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if not thread.name.startswith(prefix) or frame is None:
            continue
        parts.append(f"--- {thread.name}\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)
