"""Tests of the test helpers that need no database: the TCP proxy and the DSN helpers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support.pg import redact, with_host_port, with_search_path
from tests.support.proxy import TcpProxy

WAIT = 5.0  # upper bound for anything that should happen "at once"
QUIET = 0.3  # how long we watch for bytes that must not arrive


class EchoServer:
    """A tiny threaded echo server on 127.0.0.1 that counts its connections."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self.connections = 0
        self.resets = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._accept_thread = threading.Thread(target=self._accept, daemon=True)
        self._accept_thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._socks.append(sock)
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(0.1)
        with sock:
            while not self._stop.is_set():
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    self.resets += 1
                    return
                except OSError:
                    return
                if not data:  # client half-closed: close our side too
                    return
                sock.sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._accept_thread.join(WAIT)
        for thread in self._threads:
            thread.join(WAIT)


def wait_for(predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    """Poll ``predicate`` until true or ``timeout``; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def recv_exactly(sock: socket.socket, n: int, timeout: float = WAIT) -> bytes:
    """Read ``n`` bytes within ``timeout`` seconds or raise ``TimeoutError``."""
    deadline = time.monotonic() + timeout
    out = bytearray()
    while len(out) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"got {len(out)} of {n} bytes")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def nothing_arrives(sock: socket.socket, wait: float = QUIET) -> bool:
    """True if no byte (and no EOF) arrives on ``sock`` within ``wait`` seconds."""
    sock.settimeout(wait)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    return False


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", echo.port) as p:
        yield p


def connect(proxy: TcpProxy) -> socket.socket:
    return socket.create_connection(proxy.address, timeout=WAIT)


# --------------------------------------------------------------------------- proxy


def test_forwards_both_ways_and_counts(proxy: TcpProxy, echo: EchoServer) -> None:
    assert proxy.host == "127.0.0.1"
    assert proxy.port != echo.port
    with connect(proxy) as a, connect(proxy) as b:
        a.sendall(b"hello")
        b.sendall(b"world")
        assert recv_exactly(a, 5) == b"hello"
        assert recv_exactly(b, 5) == b"world"
        assert proxy.accepted == 2
        assert proxy.active == 2
        assert echo.connections == 2
    assert wait_for(lambda: proxy.active == 0)
    assert proxy.bytes_up == 10
    assert proxy.bytes_down == 10


def test_large_payload_is_forwarded_intact(proxy: TcpProxy) -> None:
    payload = bytes(range(256)) * 16 * 1024  # 4 MiB, more than any buffer
    with connect(proxy) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
        sender.start()
        assert recv_exactly(sock, len(payload), timeout=30) == payload
        sender.join(WAIT)
        assert not sender.is_alive()


def test_half_close_is_passed_on(proxy: TcpProxy) -> None:
    with connect(proxy) as sock:
        sock.sendall(b"bye")
        sock.shutdown(socket.SHUT_WR)
        assert recv_exactly(sock, 3) == b"bye"
        sock.settimeout(WAIT)
        assert sock.recv(1) == b""  # the echo server closed after our FIN
    assert wait_for(lambda: proxy.active == 0)


def test_sever_resets_every_connection(proxy: TcpProxy, echo: EchoServer) -> None:
    a, b = connect(proxy), connect(proxy)
    with a, b:
        a.sendall(b"x")
        b.sendall(b"y")
        assert recv_exactly(a, 1) == b"x"
        assert recv_exactly(b, 1) == b"y"
        assert proxy.sever() == 2
        assert proxy.severed == 2
        assert proxy.active == 0
        for sock in (a, b):
            sock.settimeout(WAIT)
            with pytest.raises(ConnectionResetError):
                sock.recv(1)
    # the server side saw a reset too, not a clean close
    assert wait_for(lambda: echo.resets == 2)
    # new connections work normally afterwards
    with connect(proxy) as c:
        c.sendall(b"again")
        assert recv_exactly(c, 5) == b"again"


def test_blackhole_holds_bytes_until_heal(proxy: TcpProxy) -> None:
    with connect(proxy) as sock:
        sock.sendall(b"before")
        assert recv_exactly(sock, 6) == b"before"

        proxy.blackhole()
        assert proxy.blackholed
        sock.sendall(b"during")
        assert nothing_arrives(sock)  # no reply, no reset, no EOF: a silent partition
        assert proxy.active == 1

        proxy.heal()
        assert not proxy.blackholed
        assert recv_exactly(sock, 6) == b"during"  # held, not lost
        sock.sendall(b"after")
        assert recv_exactly(sock, 5) == b"after"


def test_delay_holds_replies_but_not_requests(proxy: TcpProxy, echo: EchoServer) -> None:
    with connect(proxy) as sock:
        sock.sendall(b"before")
        assert recv_exactly(sock, 6) == b"before"

        proxy.delay(0.5)
        assert proxy.delayed == 0.5
        sent = time.monotonic()
        sock.sendall(b"one")
        sock.sendall(b"two")
        assert recv_exactly(sock, 6) == b"onetwo"  # in order, nothing lost
        took = time.monotonic() - sent
        assert 0.5 <= took < 0.5 + WAIT / 2
        assert echo.connections == 1

        proxy.delay(0)
        sent = time.monotonic()
        sock.sendall(b"now")
        assert recv_exactly(sock, 3) == b"now"
        assert time.monotonic() - sent < 0.5


def test_retarget_sends_new_connections_elsewhere(proxy: TcpProxy, echo: EchoServer) -> None:
    other = EchoServer()
    try:
        with connect(proxy) as old:
            proxy.retarget("127.0.0.1", other.port)
            with connect(proxy) as new:
                new.sendall(b"new")
                assert recv_exactly(new, 3) == b"new"
            old.sendall(b"old")
            assert recv_exactly(old, 3) == b"old"
        assert (echo.connections, other.connections) == (1, 1)
    finally:
        other.close()


def test_delay_holds_the_targets_fin_behind_its_data(proxy: TcpProxy) -> None:
    with connect(proxy) as sock:
        proxy.delay(0.3)
        sock.sendall(b"bye")
        sock.shutdown(socket.SHUT_WR)  # the echo server answers, then closes
        assert recv_exactly(sock, 3) == b"bye"
        sock.settimeout(WAIT)
        assert sock.recv(1) == b""  # then the FIN
    proxy.heal()
    assert proxy.delayed == 0


def test_blackhole_accepts_new_connections_without_forwarding(
    proxy: TcpProxy, echo: EchoServer
) -> None:
    proxy.blackhole()
    with connect(proxy) as sock:
        sock.sendall(b"ping")
        assert nothing_arrives(sock)
        assert proxy.accepted == 1
        assert echo.connections == 0  # nothing reached the target
        proxy.heal()
        assert recv_exactly(sock, 4) == b"ping"
        assert wait_for(lambda: echo.connections == 1)


def test_sever_while_blackholed_resets(proxy: TcpProxy) -> None:
    with connect(proxy) as sock:
        proxy.blackhole()
        assert proxy.sever() == 1
        sock.settimeout(WAIT)
        with pytest.raises(ConnectionResetError):
            sock.recv(1)
    proxy.heal()


def test_unreachable_target_resets_the_client() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        dead_port = placeholder.getsockname()[1]
    with TcpProxy("127.0.0.1", dead_port) as proxy:
        # The reset may arrive while connect() is still returning, or on the first read.
        with contextlib.suppress(ConnectionResetError), connect(proxy) as sock:
            sock.settimeout(WAIT)
            assert sock.recv(1) == b""
        assert proxy.accepted == 1
        assert wait_for(lambda: proxy.active == 0)


def test_close_resets_connections_and_stops_listening(echo: EchoServer) -> None:
    proxy = TcpProxy("127.0.0.1", echo.port)
    address = proxy.address
    with connect(proxy) as sock:
        sock.sendall(b"x")
        assert recv_exactly(sock, 1) == b"x"
        started = time.monotonic()
        proxy.close()
        assert time.monotonic() - started < WAIT
        sock.settimeout(WAIT)
        with pytest.raises(ConnectionResetError):
            sock.recv(1)
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=WAIT).close()
    proxy.close()  # idempotent
    with pytest.raises(RuntimeError):
        proxy.sever()


# --------------------------------------------------------------------------- DSN helpers


def test_with_search_path_on_uri_is_parsed_by_libpq() -> None:
    dsn = with_search_path("postgresql://postgres@127.0.0.1:5432/test", "t_abc123")
    assert dsn.startswith("postgresql://postgres@127.0.0.1:5432/test?")
    params = conninfo_to_dict(dsn)
    assert params["options"] == "-csearch_path=t_abc123"
    assert params["host"] == "127.0.0.1"
    assert params["dbname"] == "test"


def test_with_search_path_keeps_existing_query_and_options() -> None:
    base = "postgresql://u:secret@localhost/db?sslmode=disable&options=-cstatement_timeout%3D5000"
    params = conninfo_to_dict(with_search_path(base, "t_x"))
    assert params["sslmode"] == "disable"
    assert params["options"] == "-cstatement_timeout=5000 -csearch_path=t_x"
    assert params["password"] == "secret"


def test_with_search_path_on_socket_uri_and_keyword_dsn() -> None:
    params = conninfo_to_dict(
        with_search_path("postgresql://postgres:@/postgres?host=/var/run/postgresql", "s1")
    )
    assert params["host"] == "/var/run/postgresql"
    assert params["options"] == "-csearch_path=s1"
    params = conninfo_to_dict(with_search_path("host=127.0.0.1 port=5432 dbname=test", "s2"))
    assert params == {
        "host": "127.0.0.1",
        "port": "5432",
        "dbname": "test",
        "options": "-csearch_path=s2",
    }


def test_with_search_path_rejects_unsafe_names() -> None:
    for bad in ("", "a b", "x;drop", 'q"'):
        with pytest.raises(ValueError):
            with_search_path("postgresql://h/db", bad)


def test_with_host_port() -> None:
    uri = "postgresql://postgres:pw@127.0.0.1:5432/test?options=-csearch_path%3Dt_1&port=5432"
    params = conninfo_to_dict(with_host_port(uri, "127.0.0.1", 6000))
    assert (params["host"], params["port"]) == ("127.0.0.1", "6000")
    assert params["password"] == "pw"
    assert params["options"] == "-csearch_path=t_1"
    params = conninfo_to_dict(with_host_port("host=db port=5432 dbname=x", "127.0.0.1", 7))
    assert (params["host"], params["port"], params["dbname"]) == ("127.0.0.1", "7", "x")


def test_redact_hides_passwords() -> None:
    assert redact("postgresql://u:secret@h/db") == "postgresql://***@h/db"
    assert redact("host=h password=secret") == "host=h password=***"
    assert redact("postgresql://u@h/db") == "postgresql://***@h/db"  # user-info: all of it
    assert redact("postgresql://h/db") == "postgresql://h/db"
