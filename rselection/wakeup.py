"""A wake-up for a lease keeper blocked on its sockets: a sticky flag and a socket pair.

A backend's :meth:`~rselection.abc.LeaseBackend.wait_for_change` waits in a selector
on its connection's socket; :meth:`~rselection.abc.LeaseBackend.interrupt` must wake
it from another thread, and must not be lost when it comes just before the wait. The
flag is what counts (checked before waiting); the socket pair wakes a selector that is
already waiting.
"""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["Wakeup"]


class Wakeup:
    """A sticky wake-up for one waiting thread, safe to :meth:`wake` from any thread.

    The waiting thread calls :meth:`open` before its first wait, registers
    :attr:`socket` with its selector, returns at once while :attr:`pending` is true, and
    calls :meth:`clear` when its wait ends. :meth:`close` frees the socket pair;
    :meth:`open` makes a new one.
    """

    def __init__(self) -> None:
        """Create a wake-up without its socket pair (see :meth:`open`)."""
        self._lock = threading.Lock()
        self._pending = False
        self._sent = False  # a byte is on its way to the reading end since the last clear
        self._read: socket.socket | None = None
        self._write: socket.socket | None = None

    def open(self) -> None:
        """Make the socket pair, unless it exists already."""
        with self._lock:
            if self._read is None:
                self._read, self._write = socket.socketpair()
                self._read.setblocking(False)
                self._write.setblocking(False)

    @property
    def socket(self) -> socket.socket | None:
        """The end to watch for reading in a selector, or ``None`` before :meth:`open`."""
        return self._read

    @property
    def pending(self) -> bool:
        """True from :meth:`wake` until :meth:`clear`."""
        with self._lock:
            return self._pending

    def wake(self) -> None:
        """Set the flag and wake a selector waiting on :attr:`socket`; never blocks."""
        with self._lock:
            self._pending = True
            if self._write is not None and not self._sent:
                # One byte until the next clear wakes the selector: many wakes in a row
                # (a thousand leases queueing their attempts) cost one send, not each.
                with contextlib.suppress(OSError):  # buffer full: already woken
                    self._write.send(b"\0")
                    self._sent = True

    def clear(self) -> None:
        """Forget the wake-ups so far (flag and bytes); the waiting thread calls it."""
        with self._lock:
            self._pending = False
            self._sent = False
            if self._read is not None:
                try:
                    while self._read.recv(256):
                        pass
                except OSError:  # BlockingIOError: drained
                    pass

    def close(self) -> None:
        """Close the socket pair; idempotent. The flag is kept."""
        with self._lock:
            for sock in (self._read, self._write):
                if sock is not None:
                    sock.close()
            self._read = self._write = None
            self._sent = False
