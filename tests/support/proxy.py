"""A loopback TCP proxy that can cut or silently partition its connections.

Fault tests route one connection (say, a leader's lease connection) through a
``TcpProxy`` and then call ``sever()`` (every connection reset at once, as when
a peer crashes or a firewall sends RST), ``blackhole()`` (connections stay
open but no byte moves in either direction, as in a silent network partition)
or ``delay(seconds)`` (the target's replies reach the client that much later, as
behind a congested link or a stalled server) and later ``heal()``.

One selector thread does all the work; every public method hands a command to
it and waits for it (bounded), so there are no races with the forwarding.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

__all__ = ["TcpProxy"]

_log = logging.getLogger(__name__)

_CHUNK = 64 * 1024
_BUFFER_LIMIT = 1024 * 1024  # stop reading a side while this much waits for the other
_COMMAND_TIMEOUT = 10.0


def _reset(sock: socket.socket | None) -> None:
    """Close ``sock`` so that the peer gets a TCP RST rather than a FIN."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


@dataclass(eq=False)
class _Link:
    """One proxied connection: the accepted client socket and its upstream socket."""

    client: socket.socket
    upstream: socket.socket | None = None
    connecting: bool = False
    connect_deadline: float = 0.0
    to_upstream: bytearray = field(default_factory=bytearray)
    to_client: bytearray = field(default_factory=bytearray)
    # Replies read from the upstream while delayed: (due time, bytes); b"" marks its FIN.
    held: collections.deque[tuple[float, bytes]] = field(default_factory=collections.deque)
    held_bytes: int = 0
    client_eof: bool = False  # the client sent FIN
    upstream_eof: bool = False  # the upstream sent FIN (and it is due to the client)
    upstream_eof_read: bool = False  # the upstream's FIN was read and is held back
    upstream_shut: bool = False  # we sent FIN to the upstream
    client_shut: bool = False  # we sent FIN to the client
    registered: dict[int, int] = field(default_factory=dict)  # fd -> events


class TcpProxy:
    """Forward TCP connections from ``127.0.0.1:<port>`` to ``target_host:target_port``.

    Parameters:
        target_host: where to connect for each accepted connection.
        target_port: the target's port.
        listen_host: the address to listen on (loopback by default).
        connect_timeout: seconds allowed for each upstream connect.

    Counters: ``accepted`` (connections accepted so far), ``active`` (open now),
    ``severed`` (connections reset by ``sever()``), ``bytes_up`` / ``bytes_down``
    (bytes delivered to the target / to clients).

    Use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        connect_timeout: float = 5.0,
    ) -> None:
        self.target: tuple[str, int] = (target_host, target_port)
        self.connect_timeout = connect_timeout
        self.accepted = 0
        self.severed = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._links: set[_Link] = set()
        self._blackholed = False
        self._delay = 0.0
        self._closed = False
        self._commands: collections.deque[tuple[Callable[[], Any], _Pending]] = collections.deque()
        self._selector = selectors.DefaultSelector()
        self._listener = socket.create_server((listen_host, 0), backlog=128)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._address: tuple[str, int] = self._listener.getsockname()[:2]
        self._thread = threading.Thread(
            target=self._loop, name=f"TcpProxy:{self.port}->{target_port}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ public API

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        return self._address[1]

    @property
    def host(self) -> str:
        """The address the proxy listens on."""
        return self._address[0]

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` to connect to instead of the target."""
        return self._address

    @property
    def active(self) -> int:
        """Number of proxied connections open now."""
        return len(self._links)

    @property
    def blackholed(self) -> bool:
        """True between ``blackhole()`` and ``heal()``."""
        return self._blackholed

    def retarget(self, host: str, port: int) -> None:
        """Send connections accepted from now on to ``host:port`` (a promoted standby,
        say); open connections keep their old target."""

        def do() -> None:
            self.target = (host, port)

        self._call(do)

    @property
    def delayed(self) -> float:
        """Seconds by which replies are held back now (0 when not delayed)."""
        return self._delay

    def delay(self, seconds: float) -> None:
        """Hold every byte the target sends back for ``seconds`` before the client gets it.

        Only replies are delayed: what the client sends (a query, a FIN) reaches the
        target at once, as when the return path is congested or the server is slow to
        answer. Order is kept, and a FIN from the target is delayed like data.
        ``delay(0)`` or ``heal()`` ends it; bytes already held are still delivered at
        their time.
        """
        if seconds < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {seconds!r}")

        def do() -> None:
            self._delay = float(seconds)

        self._call(do)

    def sever(self) -> int:
        """Reset every current connection (RST to both ends); return how many.

        New connections are accepted and forwarded normally afterwards (unless
        the proxy is blackholed).
        """

        def do() -> int:
            links = list(self._links)
            for link in links:
                self._drop(link)
            self.severed += len(links)
            return len(links)

        result: int = self._call(do)
        return result

    def blackhole(self) -> None:
        """Stop moving bytes in both directions while keeping every connection open.

        Bytes already read are held, not lost, and delivered after ``heal()``
        (as TCP would retransmit them). New connections are still accepted but
        not connected upstream until ``heal()``.
        """

        def do() -> None:
            self._blackholed = True
            for link in list(self._links):
                self._update(link)

        self._call(do)

    def heal(self) -> None:
        """Resume forwarding after ``blackhole()`` or ``delay()``; pending connections go
        upstream now."""

        def do() -> None:
            self._blackholed = False
            self._delay = 0.0
            for link in list(self._links):
                if link.upstream is None:
                    self._connect_upstream(link)
                if link in self._links:
                    self._update(link)

        self._call(do)

    def close(self) -> None:
        """Stop listening and reset every connection. Idempotent; bounded wait."""
        if self._closed:
            return
        with contextlib.suppress(RuntimeError):
            self._call(self._shutdown)
        self._thread.join(timeout=_COMMAND_TIMEOUT)
        self._closed = True
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(Exception):
            self._selector.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "blackholed" if self._blackholed else "forwarding"
        return (
            f"<TcpProxy {self.host}:{self.port} -> {self.target[0]}:{self.target[1]} "
            f"{state} active={self.active} accepted={self.accepted} severed={self.severed}>"
        )

    # ------------------------------------------------------------------ commands

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the proxy thread and return its result (bounded wait)."""
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("TcpProxy is closed")
        if threading.current_thread() is self._thread:
            return fn()
        pending = _Pending()
        self._commands.append((fn, pending))
        with contextlib.suppress(BlockingIOError):
            self._wake_w.send(b"x")
        if not pending.done.wait(_COMMAND_TIMEOUT):
            raise RuntimeError(f"TcpProxy thread did not answer within {_COMMAND_TIMEOUT}s")
        if pending.error is not None:
            raise pending.error
        return pending.result

    def _run_commands(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        while self._commands:
            fn, pending = self._commands.popleft()
            try:
                pending.result = fn()
            except Exception as exc:  # handed back to the caller
                pending.error = exc
            pending.done.set()

    def _shutdown(self) -> None:
        for link in list(self._links):
            self._drop(link)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._stopping = True

    # ------------------------------------------------------------------ event loop

    _stopping = False

    def _loop(self) -> None:
        while not self._stopping:
            for key, events in self._selector.select(timeout=self._select_timeout()):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    self._run_commands()
                else:
                    link, side = key.data
                    if link in self._links:
                        try:
                            self._handle(link, side, events)
                        except Exception:  # never let one link stop the proxy
                            _log.exception("TcpProxy: dropping a connection after an error")
                            self._drop(link)
            self._release_held()
            self._check_connect_timeouts()
        # answer commands that raced with the shutdown
        self._run_commands()

    def _select_timeout(self) -> float:
        """Wake in time for the next held reply (at most every 0.1 s)."""
        due = [link.held[0][0] for link in self._links if link.held]
        if not due:
            return 0.1
        return max(0.0, min(0.1, min(due) - time.monotonic()))

    def _release_held(self) -> None:
        """Hand delayed replies whose time has come to the client side."""
        now = time.monotonic()
        for link in list(self._links):
            if not link.held or link.held[0][0] > now:
                continue
            while link.held and link.held[0][0] <= now:
                _, data = link.held.popleft()
                link.held_bytes -= len(data)
                if data:
                    link.to_client += data
                else:
                    link.upstream_eof = True
            try:
                self._half_close(link)
            except OSError:
                self._drop(link)
                continue
            if link in self._links:
                self._update(link)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client=sock)
            self._links.add(link)
            self.accepted += 1
            if not self._blackholed:
                self._connect_upstream(link)
            if link in self._links:
                self._update(link)

    def _connect_upstream(self, link: _Link) -> None:
        try:
            infos = socket.getaddrinfo(*self.target, type=socket.SOCK_STREAM)
            family, socktype, proto, _, addr = infos[0]
            up = socket.socket(family, socktype, proto)
        except OSError:
            self._drop(link)
            return
        up.setblocking(False)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link.upstream = up
        code = up.connect_ex(addr)
        if code in (0, errno.EISCONN):
            link.connecting = False
        elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
            link.connecting = True
            link.connect_deadline = time.monotonic() + self.connect_timeout
        else:
            self._drop(link)

    def _check_connect_timeouts(self) -> None:
        now = time.monotonic()
        for link in list(self._links):
            if link.connecting and not self._blackholed and now > link.connect_deadline:
                self._drop(link)

    def _handle(self, link: _Link, side: str, events: int) -> None:
        try:
            if side == "up" and link.connecting:
                assert link.upstream is not None
                err = link.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, "upstream connect failed")
                link.connecting = False
            else:
                if events & selectors.EVENT_READ:
                    self._read(link, side)
                if events & selectors.EVENT_WRITE:
                    self._write(link, side)
            self._half_close(link)
        except OSError:
            # a reset or failure on one side is passed on as a reset to the other
            self._drop(link)
            return
        if link in self._links:
            self._update(link)

    def _read(self, link: _Link, side: str) -> None:
        sock = link.client if side == "client" else link.upstream
        assert sock is not None
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if side == "client":
            if data:
                link.to_upstream += data
            else:
                link.client_eof = True
        elif self._delay > 0 or link.held:  # keep order behind replies still held
            link.held.append((time.monotonic() + self._delay, data))
            link.held_bytes += len(data)
            if not data:
                link.upstream_eof_read = True
        elif data:
            link.to_client += data
        else:
            link.upstream_eof = True

    def _write(self, link: _Link, side: str) -> None:
        sock: socket.socket | None
        if side == "client":
            buf, sock = link.to_client, link.client
        else:
            buf, sock = link.to_upstream, link.upstream
        if not buf or sock is None:
            return
        try:
            sent = sock.send(buf)
        except (BlockingIOError, InterruptedError):
            return
        del buf[:sent]
        if side == "client":
            self.bytes_down += sent
        else:
            self.bytes_up += sent

    def _half_close(self, link: _Link) -> None:
        """Pass a FIN on once its direction is drained; finish when both are done."""
        up = link.upstream
        if up is None or link.connecting:
            return
        if link.client_eof and not link.to_upstream and not link.upstream_shut:
            up.shutdown(socket.SHUT_WR)
            link.upstream_shut = True
        if link.upstream_eof and not link.to_client and not link.client_shut:
            link.client.shutdown(socket.SHUT_WR)
            link.client_shut = True
        if link.upstream_shut and link.client_shut:
            self._forget(link)
            link.client.close()
            up.close()

    def _update(self, link: _Link) -> None:
        """Register exactly the events this link needs now."""
        client_events = 0
        up_events = 0
        if not self._blackholed:
            if not link.client_eof and len(link.to_upstream) < _BUFFER_LIMIT:
                client_events |= selectors.EVENT_READ
            if link.to_client:
                client_events |= selectors.EVENT_WRITE
            if link.upstream is not None:
                if link.connecting:
                    up_events = selectors.EVENT_WRITE
                else:
                    if (
                        not (link.upstream_eof or link.upstream_eof_read)
                        and len(link.to_client) + link.held_bytes < _BUFFER_LIMIT
                    ):
                        up_events |= selectors.EVENT_READ
                    if link.to_upstream:
                        up_events |= selectors.EVENT_WRITE
        self._set_events(link, link.client, client_events, (link, "client"))
        if link.upstream is not None:
            self._set_events(link, link.upstream, up_events, (link, "up"))

    def _set_events(
        self, link: _Link, sock: socket.socket, events: int, data: tuple[_Link, str]
    ) -> None:
        fd = sock.fileno()
        if fd < 0:
            return
        current = link.registered.get(fd, 0)
        if events == current:
            return
        if events == 0:
            self._selector.unregister(sock)
            del link.registered[fd]
        elif current == 0:
            self._selector.register(sock, events, data)
            link.registered[fd] = events
        else:
            self._selector.modify(sock, events, data)
            link.registered[fd] = events

    def _forget(self, link: _Link) -> None:
        """Unregister a link's sockets and remove it from the active set."""
        for sock in (link.client, link.upstream):
            if sock is not None and sock.fileno() in link.registered:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(sock)
        link.registered.clear()
        self._links.discard(link)

    def _drop(self, link: _Link) -> None:
        """Reset both ends of ``link`` at once."""
        self._forget(link)
        _reset(link.client)
        _reset(link.upstream)


class _Pending:
    """The result slot of a command handed to the proxy thread."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: Exception | None = None
