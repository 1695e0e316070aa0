"""lead() stops on SIGTERM whenever it comes, even right after the main thread took a lock.

Python runs a signal's handler between two bytecodes of the main thread, wherever that
thread is. A handler that raised there could leave a lock that the main thread had just
taken in Python code (``threading.Condition.__enter__``, inside ``Event.wait``) taken
for good: the stop then waited forever (the example's SIGTERM test timed out in CI).
The child below leads again and again, each time with SIGTERM raised at another return
of a ``threading`` function in the main thread, from ``lead()``'s start to its wait.
"""

from __future__ import annotations

import re
import subprocess
import sys

_MOMENTS_SCRIPT = """
import asyncio, faulthandler, signal, sys, threading
import rselection as rs
from rselection.stop_signals import StopSignals

THREADING = threading.__dict__
MAIN = threading.main_thread().ident


def build():
    tasks = rs.TaskHandler(stop_grace=2.0)
    tasks.interval(0.5, name="beat")(lambda ctx: None)

    @tasks.persistent("watch")
    async def watch(ctx):
        await asyncio.sleep(3600)  # cancelled when the term ends

    return rs.SingleNodeLeader(tasks, name="moments")


def lead_signalled_at(moment):
    # SIGTERM is raised as the main thread returns from its moment-th call of a function
    # of the threading module since lead() installed its handler (its handler then runs
    # before that frame returns, as a signal coming right then would). A moment lead()
    # does not reach within a second ends the sweep: it then gets SIGTERM from a timer.
    seen = 0
    came, late = [], []

    def tracer(frame, event, arg):
        nonlocal seen
        if event == "return" and frame.f_globals is THREADING:
            if isinstance(signal.getsignal(signal.SIGTERM), StopSignals):
                seen += 1
                if seen == moment + 1 and not late:
                    came.append(frame.f_code.co_qualname)
                    signal.raise_signal(signal.SIGTERM)
        return tracer

    def fallback():
        late.append(True)
        signal.pthread_kill(MAIN, signal.SIGTERM)

    leader = build()
    timer = threading.Timer(1.0, fallback)
    timer.daemon = True
    # A lead() that does not return: the stacks, and the test fails.
    faulthandler.dump_traceback_later(20, exit=True)
    sys.settrace(tracer)
    try:
        timer.start()
        leader.lead()
    finally:
        sys.settrace(None)
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
    assert not leader.is_leader
    return came


moment = 0
while moment < 200:
    came = lead_signalled_at(moment)
    if not came:
        break
    print(f"moment {moment}: {came[0]}", flush=True)
    moment += 1
print(f"swept {moment} moments", flush=True)
"""


def test_lead_stops_on_sigterm_at_every_return_of_a_threading_function() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _MOMENTS_SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    swept = re.search(r"swept (\d+) moments", done.stdout)
    assert swept, done.stdout
    # From lead()'s start to its wait there are a few dozen: Condition.__enter__ among
    # them, in start() (the driver's lock) and in the wait for the first term.
    assert int(swept.group(1)) >= 10, done.stdout
    assert "Condition.__enter__" in done.stdout, done.stdout


# A Ctrl-C right after the first stop signal, which lead() has not acted on yet (it
# still starts), raises where the main thread is: lead() gives up then, as after any
# second Ctrl-C, rather than stop gracefully and wait for a lock the interruption may
# have left taken (it hung so at the seventh moment). One child per moment: a leader
# given up on keeps running (and maybe a lock taken) in its process.
_DOUBLE_CTRL_C_SCRIPT = """
import faulthandler, signal, sys, threading
import rselection as rs
from rselection.stop_signals import StopSignals

THREADING = threading.__dict__
MAIN = threading.main_thread().ident
moment = int(sys.argv[1])
tasks = rs.TaskHandler(stop_grace=2.0)
tasks.interval(0.5, name="beat")(lambda ctx: None)
leader = rs.SingleNodeLeader(tasks, name="twice")
seen = 0
came, late = [], []


def tracer(frame, event, arg):
    # As in the sweep above: two Ctrl-C as the main thread returns from its moment-th
    # call of a threading function since lead() installed its handler.
    global seen
    if event == "return" and frame.f_globals is THREADING:
        if isinstance(signal.getsignal(signal.SIGINT), StopSignals):
            seen += 1
            if seen == moment + 1 and not late:
                came.append(frame.f_code.co_qualname)
                signal.raise_signal(signal.SIGINT)  # recorded: lead() is not waiting yet
                signal.raise_signal(signal.SIGINT)
    return tracer


def fallback():
    late.append(True)
    signal.pthread_kill(MAIN, signal.SIGINT)


timer = threading.Timer(1.0, fallback)
timer.daemon = True
faulthandler.dump_traceback_later(20, exit=True)
sys.settrace(tracer)
try:
    timer.start()
    leader.lead()
    outcome = "stopped"
except BaseException:
    # KeyboardInterrupt, or what it caused where it came (a Condition's wait it left
    # without its lock raises RuntimeError as it exits).
    outcome = "gave up"
finally:
    sys.settrace(None)
faulthandler.cancel_dump_traceback_later()
print(f"{came[0] if came else '-'}: {outcome}", flush=True)
"""


def test_a_second_ctrl_c_before_the_first_is_acted_on_gives_up_at_every_moment() -> None:
    seen: list[str] = []
    for moment in range(200):
        done = subprocess.run(
            [sys.executable, "-c", _DOUBLE_CTRL_C_SCRIPT, str(moment)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"moment {moment}: " + done.stdout + done.stderr[-8000:]
        came, _, outcome = done.stdout.strip().rpartition(": ")
        if came == "-":  # not reached: the fallback's one Ctrl-C stopped it gracefully
            assert outcome == "stopped", done.stdout
            break
        assert outcome == "gave up", f"moment {moment}: {done.stdout}"
        seen.append(came)
    assert len(seen) >= 10, seen
    assert "Condition.__enter__" in seen, seen
