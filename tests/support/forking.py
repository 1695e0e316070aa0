"""Run a function in a real ``os.fork()`` child, as gunicorn ``--preload``, uvicorn
``--workers`` and ``multiprocessing`` do, and get its report back through a pipe.

    from tests.support.forking import in_child
    report = in_child(lambda: {"pid": os.getpid()})
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["Child", "fork_child", "in_child"]


def in_child(body: Callable[[], dict[str, Any]], timeout: float = 30.0) -> dict[str, Any]:
    """Run ``body`` in a forked child; return what it returned (or raised, as text).

    The child leaves with ``os._exit`` (none of the parent's clean-ups, ``atexit``
    handlers or fixtures run there); one still running after ``timeout`` seconds is
    killed and the test fails.
    """
    return fork_child(body).report(timeout)


def fork_child(body: Callable[[], dict[str, Any]]) -> Child:
    """Start ``body`` in a forked child and return at once (the parent may act while
    the child runs); :meth:`Child.report` waits for what it returned."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's clean-ups
        os.close(read)
        try:
            result = body()
        except BaseException as exc:  # reported to the parent, which fails the test
            result = {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(result, default=str).encode()
        while data:
            data = data[os.write(write, data) :]
        os._exit(0)
    os.close(write)
    return Child(pid, read)


class Child:
    """A child :func:`fork_child` started: its pid and the pipe its report comes on."""

    def __init__(self, pid: int, read: int) -> None:
        self.pid = pid
        self._read = read

    def report(self, timeout: float = 30.0) -> dict[str, Any]:
        """What the child's body returned, once it has exited; one still running after
        ``timeout`` seconds is killed and the test fails."""
        pid, read = self.pid, self._read
        deadline = time.monotonic() + timeout
        chunks = []
        # Read while waiting: a report larger than the pipe's buffer would block the child.
        os.set_blocking(read, False)
        while True:
            try:
                while chunk := os.read(read, 65536):
                    chunks.append(chunk)
            except BlockingIOError:
                pass
            waited, status = os.waitpid(pid, os.WNOHANG)
            if waited:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                os.close(read)
                pytest.fail(f"the forked child did not finish within {timeout} s")
            time.sleep(0.02)
        os.set_blocking(read, True)
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0
        return dict(json.loads(b"".join(chunks)))
