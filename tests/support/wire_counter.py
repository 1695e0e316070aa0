"""A loopback TCP proxy in front of Postgres that counts what clients send, per connection.

Route one process through its own ``CountingProxy`` and read, per connection, the
``application_name`` of its startup message, whether it is still open, its upstream
local port (the ``client_port`` the server sees, for ``pg_stat_activity``) and how many
frontend messages of each type it sent: ``Q`` (simple query), ``P``/``B``/``E``
(parse, bind, execute of the extended protocol), ``S`` (sync), ``X`` (terminate)...
A statement the server runs is one ``Q`` or one ``E``: :meth:`Snapshot.statements`.

The proxy parses only the client's side: the untyped startup packet (after an
``SSLRequest`` or ``GSSENCRequest`` that the server refused with ``N``), then typed
messages (one type byte, an int32 length). A connection that negotiates encryption can
no longer be parsed and is marked ``encrypted``; give the client ``sslmode=disable``
(:func:`plain_dsn`). One asyncio loop in one thread serves every connection, so a
process that opens thousands of sessions costs the proxy no thread per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType

from psycopg.conninfo import make_conninfo

__all__ = ["ConnectionCounts", "CountingProxy", "Snapshot", "plain_dsn"]

_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
_CHUNK = 64 * 1024


def plain_dsn(dsn: str, host: str, port: int) -> str:
    """``dsn`` pointed at ``host:port`` without TLS or GSS encryption (so it can be parsed)."""
    return make_conninfo(dsn, host=host, port=port, sslmode="disable", gssencmode="disable")


@dataclass
class ConnectionCounts:
    """What one proxied connection sent so far."""

    id: int
    application_name: str = ""
    open: bool = True
    encrypted: bool = False
    cancel: bool = False  # a cancel request's connection, not a session
    upstream_port: int | None = None
    messages: Counter[str] = field(default_factory=Counter)

    @property
    def statements(self) -> int:
        """Statements the server was asked to run: simple queries plus executes."""
        return self.messages["Q"] + self.messages["E"]


@dataclass
class Snapshot:
    """A copy of every connection's counts at one moment."""

    connections: list[ConnectionCounts]

    def statements(self, application_name: str | None = None) -> int:
        """Statements sent over every connection (of one application_name, when given)."""
        return sum(
            c.statements
            for c in self.connections
            if application_name is None or c.application_name == application_name
        )

    def by_application(self) -> Counter[str]:
        """Statements sent, by application_name."""
        out: Counter[str] = Counter()
        for c in self.connections:
            out[c.application_name] += c.statements
        return out

    def open_sessions(self) -> Counter[str]:
        """Sessions open now through the proxy, by application_name."""
        return Counter(c.application_name for c in self.connections if c.open and not c.cancel)

    def minus(self, earlier: Snapshot) -> Snapshot:
        """Counts sent since ``earlier`` (connections that are new count in full)."""
        before = {c.id: c.messages for c in earlier.connections}
        out = []
        for c in self.connections:
            delta = Counter(c.messages)
            delta.subtract(before.get(c.id, Counter()))
            out.append(
                ConnectionCounts(
                    c.id,
                    c.application_name,
                    c.open,
                    c.encrypted,
                    c.cancel,
                    c.upstream_port,
                    +delta,
                )
            )
        return Snapshot(out)


class _FrontendParser:
    """Splits the client's byte stream into messages and counts them."""

    def __init__(self, counts: ConnectionCounts) -> None:
        self.counts = counts
        self.buffer = bytearray()
        self.startup = True  # next message is untyped (startup, SSL/GSS or cancel request)
        self.awaiting_reply = False  # an SSL/GSS request waits for the server's one byte
        self.dead = False  # encrypted or unparseable: stop looking

    def feed(self, data: bytes) -> None:
        if self.dead:
            return
        self.buffer += data
        while not self.awaiting_reply and not self.dead:
            if self.startup:
                if len(self.buffer) < 8:
                    return
                (length,) = struct.unpack_from("!i", self.buffer, 0)
                if length < 8 or len(self.buffer) < length:
                    if length < 8:
                        self.dead = True
                    return
                (code,) = struct.unpack_from("!i", self.buffer, 4)
                body = bytes(self.buffer[8:length])
                del self.buffer[:length]
                if code in (_SSL_REQUEST, _GSS_REQUEST):
                    self.awaiting_reply = True
                elif code == _CANCEL_REQUEST:
                    self.counts.cancel = True
                    self.startup = False
                else:
                    self.counts.application_name = _startup_parameter(body, "application_name")
                    self.startup = False
            else:
                if len(self.buffer) < 5:
                    return
                kind = chr(self.buffer[0])
                (length,) = struct.unpack_from("!i", self.buffer, 1)
                if length < 4:
                    self.dead = True
                    return
                if len(self.buffer) < 1 + length:
                    return
                del self.buffer[: 1 + length]
                self.counts.messages[kind] += 1

    def server_replied(self, first: bytes) -> None:
        """The server's answer to an SSL/GSS request: ``N`` keeps the stream plain."""
        if not self.awaiting_reply or not first:
            return
        self.awaiting_reply = False
        if first[:1] != b"N":
            self.counts.encrypted = True
            self.dead = True
        else:
            self.feed(b"")


def _startup_parameter(body: bytes, key: str) -> str:
    """One parameter of a startup packet's body: ``name\\0value\\0 ... \\0``."""
    parts = body.split(b"\0")
    for i in range(0, len(parts) - 1, 2):
        if not parts[i]:
            break  # the terminating empty name
        if parts[i].decode(errors="replace") == key:
            return parts[i + 1].decode(errors="replace")
    return ""


class CountingProxy:
    """Forward ``127.0.0.1:<port>`` to ``target_host:target_port``, counting client messages.

    Args:
        target_host: the Postgres server's address.
        target_port: its port.

    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._lock = threading.Lock()
        self._connections: list[ConnectionCounts] = []
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # one per connection, for close()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="CountingProxy", daemon=True
        )
        self._thread.start()
        if not ready.wait(10) or self._server is None:
            raise RuntimeError("the counting proxy did not start")
        address = self._server.sockets[0].getsockname()
        self.host: str = address[0]
        self.port: int = address[1]

    def dsn(self, dsn: str) -> str:
        """``dsn`` routed through this proxy, unencrypted."""
        return plain_dsn(dsn, self.host, self.port)

    def snapshot(self) -> Snapshot:
        """Copies of every connection's counts so far."""
        with self._lock:
            return Snapshot(
                [
                    ConnectionCounts(
                        c.id,
                        c.application_name,
                        c.open,
                        c.encrypted,
                        c.cancel,
                        c.upstream_port,
                        Counter(c.messages),
                    )
                    for c in self._connections
                ]
            )

    def upstream_ports(self) -> set[int]:
        """Local ports of the open upstream connections: the server's ``client_port``s."""
        with self._lock:
            return {
                c.upstream_port for c in self._connections if c.open and c.upstream_port is not None
            }

    def close(self) -> None:
        """Stop listening and close every connection; bounded wait."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(RuntimeError, TimeoutError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the loop thread ------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def listen() -> None:
            self._server = await asyncio.start_server(
                self._serve, "127.0.0.1", 0, backlog=4096, limit=_CHUNK
            )

        try:
            self._loop.run_until_complete(listen())
        finally:
            ready.set()
        self._loop.run_forever()
        with contextlib.suppress(Exception):
            self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # no goodbyes: thousands of sessions may be open
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        # Let every connection's task finish before the loop stops, so none is destroyed
        # while pending.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        try:
            await self._forward(reader, writer)
        except asyncio.CancelledError:
            # close() cancelled it; ending quietly keeps asyncio from logging the cancel
            writer.transport.abort()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts = ConnectionCounts(next(self._ids))
        parser = _FrontendParser(counts)
        with self._lock:
            self._connections.append(counts)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target, limit=_CHUNK)
        except OSError:
            counts.open = False
            writer.close()
            return
        counts.upstream_port = up_writer.get_extra_info("sockname")[1]
        self._writers.update((writer, up_writer))

        async def client_to_server() -> None:
            while data := await reader.read(_CHUNK):
                with self._lock:
                    parser.feed(data)
                up_writer.write(data)
                await up_writer.drain()

        async def server_to_client() -> None:
            while data := await up_reader.read(_CHUNK):
                if parser.awaiting_reply:
                    with self._lock:
                        parser.server_replied(data)
                writer.write(data)
                await writer.drain()

        tasks = [
            asyncio.ensure_future(client_to_server()),
            asyncio.ensure_future(server_to_client()),
        ]
        try:
            # Either side closing or failing ends the link (a session has no half-close).
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            # Collect them (a reset shows up as an error of one of them; it ends the link).
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (writer, up_writer):
                self._writers.discard(w)
                with contextlib.suppress(Exception):
                    w.close()
            with self._lock:
                counts.open = False
