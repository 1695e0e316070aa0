"""Connection plumbing of :class:`~rselection.postgres.PostgresBroadcaster`.

Not public API. What both of its threads (writer and listener) need around a
connection: bounding each round trip (:class:`Deadlines`), aborting a socket a thread is
blocked on, reconnect backoff, and error text safe to log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from ._conn import redact

__all__ = ["Deadlines", "abort_socket", "backoff", "first_line", "logger"]

#: Every part of the broadcaster logs under the name of its public module.
logger = logging.getLogger("rselection.postgres.broadcast")

#: Reconnect backoff: the first wait, doubling to the cap, each jittered to 50-100%.
_BACKOFF_FIRST = 0.1
_BACKOFF_CAP = 5.0


def backoff(failures: int) -> float:
    """Capped exponential backoff with jitter after ``failures`` failed attempts (>= 1)."""
    base = min(_BACKOFF_CAP, _BACKOFF_FIRST * float(2 ** min(failures - 1, 16)))
    return base * random.uniform(0.5, 1.0)


def abort_socket(conn: psycopg.Connection[Any]) -> None:
    """Shut ``conn``'s socket down so a thread blocked on it wakes with an error at once.

    The descriptor itself stays open (psycopg closes it later), so it cannot be reused by
    another socket while the blocked thread still refers to it.
    """
    try:
        fd = conn.pgconn.socket
        dup = socket.socket(fileno=os.dup(fd))
    except (OSError, psycopg.Error):
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


class Deadlines:
    """Aborts a connection whose round trip overruns its bound, without a wake-up per call.

    Like :class:`~rselection.postgres._conn.IoWatchdog` (a peer that accepts bytes and
    never answers must not hang a thread forever), but arming is a plain assignment and
    one thread checks every ``tick`` seconds: a publish costs no extra thread switch,
    which matters at thousands of messages a second. A round trip is aborted between
    ``bound`` and ``bound + tick`` seconds after it started.

    Args:
        tick: seconds between checks.
    """

    def __init__(self, tick: float) -> None:
        self._tick = tick
        self._armed: dict[int, tuple[float, psycopg.Connection[Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="rselection-broadcast-deadlines", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
        """Abort ``conn``'s socket if the ``with`` body runs longer than about ``seconds``."""
        key = threading.get_ident()
        self._armed[key] = (time.monotonic() + seconds, conn)
        try:
            yield
        finally:
            # The checker aborts under the lock, and only connections still armed: once
            # disarmed here, a connection is never touched again (no reused socket hit).
            with self._lock:
                self._armed.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            with self._lock:
                for key, (deadline, conn) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[key]
                        logger.debug("broadcast: aborting a round trip that overran its bound")
                        abort_socket(conn)

    def close(self) -> None:
        """Stop the checker thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self._tick + 5.0)


def first_line(exc: BaseException, conninfo: str) -> str:
    text = str(exc).strip()
    return redact(text.splitlines()[0], conninfo) if text else type(exc).__name__
