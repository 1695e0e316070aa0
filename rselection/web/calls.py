"""The console's admin calls: a few at a time, each in a thread of its own, waited for
only so long.

The admin API blocks on the leases' server. A server that stops answering must not take
the console with it: at most :data:`SLOTS` calls run at once and one more is refused at
once, not queued; a request stops waiting for its call after a bound (the call keeps its
slot until it returns, so stuck calls never pile up). Either way the request is answered
``503``. The calls run on threads of their own, never on the server's thread pool, which
serves the static files.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ACTION_TIMEOUT", "READ_TIMEOUT", "SLOTS", "Calls", "NotAnswering"]

T = TypeVar("T")

SLOTS = 4
"""Admin calls that run at once."""

READ_TIMEOUT = 10.0
"""Seconds a request waits for a read."""

ACTION_TIMEOUT = 30.0
"""Seconds a request waits for an action (a handover waits up to 10 s for its term)."""


class NotAnswering(Exception):
    """The leases' server does not answer: every slot is taken, or a call overran."""


class Calls:
    """Runs the console's blocking admin calls (see the module's docstring).

    Attributes:
        slots: calls that run at once.
        read_timeout: seconds a request waits for a read (:data:`READ_TIMEOUT`).
        action_timeout: seconds a request waits for an action (:data:`ACTION_TIMEOUT`).
    """

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self.read_timeout = READ_TIMEOUT
        self.action_timeout = ACTION_TIMEOUT
        self._free = threading.BoundedSemaphore(slots)

    async def run(self, function: Callable[[], T], *, timeout: float) -> T:
        """``function()``'s result, from a thread, waited for up to ``timeout`` seconds; its
        exception is raised here.

        Raises:
            NotAnswering: every slot is taken, or ``function`` did not return in time
                (it goes on in its thread, in its slot, until it returns).
        """
        if not self._free.acquire(blocking=False):
            raise NotAnswering(
                f"the leases' server is not answering: {self.slots} calls to it are still "
                "waiting; try again later"
            )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if done.done():  # the request stopped waiting
                return
            if ok:
                done.set_result(value)
            else:
                done.set_exception(value)

        def work() -> None:
            value: Any
            try:
                ok, value = True, function()
            except Exception as exc:  # handed to the request, which raises it
                ok, value = False, exc
            finally:
                self._free.release()
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(settle, ok, value)

        threading.Thread(target=work, name="rselection-console-call", daemon=True).start()
        try:
            return await asyncio.wait_for(done, timeout)
        except TimeoutError:
            raise NotAnswering(
                f"the leases' server is not answering: no answer within {timeout:g} s"
            ) from None
