"""A forked child of a busy process: the parent leads one leader, and the child uses
leaders built before the fork.

The parent's started leaders must stay still in the child (never stepped there, never
released or renewed from there), and the leaders not started yet must work there as in
any process: what threads of the parent ran at the fork (the process's driver) are not
in the child.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import rselection as rs
from rselection import signals

FAST = {"ttl": 6.0, "renew_interval": 0.5, "renew_deadline": 3.0, "retry_interval": 0.5}


def _fork(body: Callable[[], dict[str, Any]]) -> tuple[int, int]:
    """Run ``body`` in a forked child; its pid and the pipe its report comes on."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's clean-ups
        os.close(read)
        try:
            result = body()
        except BaseException as exc:  # reported to the parent, which fails the test
            result = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    return pid, read


def _report(pid: int, read: int, timeout: float = 60.0) -> dict[str, Any]:
    """What the child ``pid`` returned (see :func:`_fork`), once it has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waited, status = os.waitpid(pid, os.WNOHANG)
        if waited:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child did not finish within {timeout} s")
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    return dict(json.loads(b"".join(chunks)))


def _idle_tasks() -> rs.TaskHandler:
    tasks = rs.TaskHandler(stop_grace=1.0)

    @tasks.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        ctx.sleep(3600)

    return tasks


def _returns_within(call: Callable[[], object], timeout: float) -> bool:
    """Run ``call`` in a thread; whether it returned within ``timeout`` seconds."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


class _Naming(logging.Handler):
    """Keeps the log lines that name ``lease`` (quoted, as the library names leases)."""

    def __init__(self, lease: str) -> None:
        super().__init__(logging.DEBUG)
        self.quoted = repr(lease)
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if self.quoted in line:
            self.lines.append(line)
            self.seen.set()


def test_a_child_uses_leaders_built_before_fork_while_the_parent_leads(pg_dsn: str) -> None:
    parents = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="parents", **FAST)
    childs = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="childs", **FAST)
    never = rs.PostgresLeader(pg_dsn, _idle_tasks(), name="never", **FAST)
    renewed = threading.Event()

    def on_renewed(sender: object, **kw: Any) -> None:
        if sender is parents:
            renewed.set()

    signals.lease_renewed.connect(on_renewed)
    naming = _Naming("parents")
    logging.getLogger("rselection").addHandler(naming)
    try:
        with parents:
            assert parents.wait_until_leader(20)
            term = parents.term
            # Forked between two renewals: none in flight, the parent's leader idle.
            renewed.clear()
            assert renewed.wait(10)

            def child() -> dict[str, Any]:
                naming.lines.clear()
                naming.seen.clear()
                never.stop()  # never started: it has nothing to stop, in no process
                childs.start()
                led = childs.wait_until_leader(10)
                stopped = _returns_within(lambda: childs.stop(timeout=10), 15)
                # Stepped here, the parent's leader would give its term back, after
                # waiting up to stop_grace + 5 s for the term's tasks (which are not
                # here, so it logs that it keeps the term instead).
                naming.seen.wait(parents.stop_grace + 5.0 + 2.0)
                return {"led": led, "stopped": stopped, "about the parent's": naming.lines}

            report = _report(*_fork(child))
            assert report == {"led": True, "stopped": True, "about the parent's": []}
            # The parent leads on in the same term, renewing through its own session.
            renewed.clear()
            assert renewed.wait(10)
            assert parents.is_leader and parents.term == term
    finally:
        logging.getLogger("rselection").removeHandler(naming)
        signals.lease_renewed.disconnect(on_renewed)
