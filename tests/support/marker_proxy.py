"""A loopback TCP proxy that holds back, once, what a client sends when it holds a marker.

``MarkerProxy(("127.0.0.1", 5432))`` forwards every connection to the target;
``hold(b"marker", 1.5)`` delays the next chunk a client sends that contains
``b"marker"`` by 1.5 s (once), so that a test can keep one statement in flight (an
acquisition, say) while something else happens. The chunk then goes through whole.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

__all__ = ["MarkerProxy"]


class MarkerProxy:
    """See the module docstring. Close it after use (a context manager)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._rules: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self.held = 0  # chunks held back so far
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, marker: bytes, seconds: float) -> None:
        """Delay the next chunk a client sends that contains ``marker`` by ``seconds``."""
        with self._lock:
            self._rules[marker] = seconds

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                if from_client:
                    with self._lock:
                        found = [m for m in self._rules if m in data]
                        delay = sum(self._rules.pop(m) for m in found)
                        self.held += len(found)
                    if delay:
                        time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._server.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> MarkerProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
