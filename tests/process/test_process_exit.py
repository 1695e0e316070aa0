"""A process whose leader stopped, or whose task is stuck with on_stuck="exit", exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from typing import Any

_STUCK_CLAIM_SCRIPT = """
import threading, time
import rselection as rs

class StuckClaimer:
    # A claimer whose connection went silent: every claim waits far longer than the test.
    ttl = 600.0
    def __init__(self):
        self.entered = threading.Event()
    def ran_before(self, series):
        return False
    def claim(self, key, *, term=None):
        return key in self.claim_many([key], term=term)
    def claim_many(self, keys, *, term=None):
        self.entered.set()
        time.sleep(120)
        return set(keys)

handler = rs.TaskHandler(stop_grace=1.0)
handler.interval(0.2, name="tick")(lambda ctx: None)
claimer = StuckClaimer()
leader = rs.SingleNodeLeader(handler, claimer=claimer)
leader.start()
assert claimer.entered.wait(10), "no claim was made"
leader.stop(timeout=5)
print("stopped", flush=True)
"""


def test_a_claim_stuck_on_a_dead_connection_never_keeps_the_process_from_exiting() -> None:
    # The claim pool's workers were joined at interpreter exit: after stop() returned, a
    # process whose claim hung (a Redis client without a socket timeout) never exited.
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _STUCK_CLAIM_SCRIPT], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "stopped" in done.stdout
    # Start-up, one claim and stop() take about 1.5 s; before the fix it took 120 s.
    assert took < 20, f"the process took {took:.1f} s to exit after stop()"


def test_stuck_task_with_on_stuck_exit_ends_the_process() -> None:
    script = textwrap.dedent(
        """
        import threading, time
        import rselection as rs

        handler = rs.TaskHandler(stop_grace=0.2, on_stuck="exit")
        started = threading.Event()

        @handler.persistent("deaf")
        def deaf(ctx):
            started.set()
            while True:
                time.sleep(0.01)

        leader = rs.SingleNodeLeader(handler)
        leader.start()
        assert started.wait(5)
        leader.stop(timeout=10)
        print("stop returned", flush=True)
        raise SystemExit(0)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 70, result.stderr
    assert "stop returned" not in result.stdout
    assert "task 'deaf' of term 1 is still running" in result.stderr
    assert "exiting (code 70)" in result.stderr


def test_on_stuck_exit_exits_before_calling_receivers_that_could_block(tmp_path: Any) -> None:
    script = textwrap.dedent(
        """
        import threading, time
        import rselection as rs
        from rselection import signals
        from rselection.leader import LeaseLeader
        from rselection.memory import MemoryLease
        from rselection.timing import Timings

        handler = rs.TaskHandler(stop_grace=0.3, on_stuck="exit")

        @handler.persistent("deaf")
        def deaf(ctx):
            time.sleep(60)

        def block(sender, **kw):
            threading.Event().wait()  # a receiver that never returns

        signals.task_stuck.connect(block)
        timings = Timings(ttl=3, renew_interval=0.2, renew_deadline=1, retry_interval=0.2)
        leader = LeaseLeader(MemoryLease(name="x"), handler, timings=timings)
        leader.start()
        leader.wait_until_leader(5)
        print("leading", flush=True)
        leader.step_down(wait=False)
        time.sleep(30)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"leading"
        began = time.monotonic()
        code = proc.wait(10)
        took = time.monotonic() - began
    finally:
        proc.kill()
        proc.wait(5)
    assert code == 70
    assert took < 2.0, f"exited {took:.2f} s after the step-down (stop_grace 0.3 s)"
