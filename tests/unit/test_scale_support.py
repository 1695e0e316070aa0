"""Tests of the scale helpers that need no database: message counting, name folding."""

from __future__ import annotations

import socket
import struct
import threading
from collections import Counter

import pytest

from tests.support.scale_fleet import percentile
from tests.support.scale_node import parse_indices
from tests.support.sessions import fold, grouped
from tests.support.wire_counter import (
    ConnectionCounts,
    CountingProxy,
    Snapshot,
    _FrontendParser,
)


def startup(**params: str) -> bytes:
    body = struct.pack("!i", 196608)
    for key, value in params.items():
        body += key.encode() + b"\0" + value.encode() + b"\0"
    body += b"\0"
    return struct.pack("!i", len(body) + 4) + body


def message(kind: str, payload: bytes = b"") -> bytes:
    return kind.encode() + struct.pack("!i", len(payload) + 4) + payload


SSL_REQUEST = struct.pack("!ii", 8, 80877103)


def test_parser_reads_the_application_name_and_counts_messages_across_chunks() -> None:
    counts = ConnectionCounts(0)
    parser = _FrontendParser(counts)
    stream = (
        startup(user="u", application_name="rselection:x/1")
        + message("Q", b"SELECT 1\0")
        + message("P", b"\0SELECT $1\0\0\0")
        + message("B", b"\0\0\0\0\0\0\0\0")
        + message("E", b"\0\0\0\0\0")
        + message("S")
    )
    for i in range(0, len(stream), 3):  # split anywhere, even inside a header
        parser.feed(stream[i : i + 3])
    assert counts.application_name == "rselection:x/1"
    assert counts.messages == Counter({"Q": 1, "P": 1, "B": 1, "E": 1, "S": 1})
    assert counts.statements == 2


def test_parser_goes_on_after_a_refused_ssl_request_and_stops_after_an_accepted_one() -> None:
    refused = ConnectionCounts(0)
    parser = _FrontendParser(refused)
    parser.feed(SSL_REQUEST)
    parser.server_replied(b"N")
    parser.feed(startup(application_name="a") + message("Q", b"x\0"))
    assert (refused.application_name, refused.statements, refused.encrypted) == ("a", 1, False)

    accepted = ConnectionCounts(1)
    parser = _FrontendParser(accepted)
    parser.feed(SSL_REQUEST)
    parser.server_replied(b"S")
    parser.feed(b"\x16\x03\x01 random TLS bytes")
    assert accepted.encrypted and accepted.statements == 0


def test_snapshot_differences_and_totals() -> None:
    before = Snapshot([ConnectionCounts(0, "k", messages=Counter({"E": 3, "S": 3}))])
    after = Snapshot(
        [
            ConnectionCounts(0, "k", messages=Counter({"E": 5, "S": 5})),
            ConnectionCounts(1, "n", open=False, messages=Counter({"Q": 1})),
        ]
    )
    delta = after.minus(before)
    assert delta.statements() == 3
    assert delta.by_application() == Counter({"k": 2, "n": 1})
    assert after.open_sessions() == Counter({"k": 1})


def test_proxy_forwards_and_counts_a_session() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(4096):
                received.extend(data)
                conn.sendall(b"ok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with CountingProxy("127.0.0.1", listener.getsockname()[1]) as proxy:
        payload = startup(application_name="app") + message("Q", b"SELECT 1\0")
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as client:
            client.sendall(payload)
            assert client.recv(2) == b"ok"
            assert len(proxy.upstream_ports()) == 1
        thread.join(5)
        snap = proxy.snapshot()
    listener.close()
    assert bytes(received) == payload
    assert [(c.application_name, c.statements) for c in snap.connections] == [("app", 1)]


def test_names_per_lease_fold_into_one() -> None:
    assert fold("rselection:p/12") == "rselection:p/*"
    assert fold("rselection:p/12:probe") == "rselection:p/*:probe"
    assert fold("rselection:nodes") == "rselection:nodes"
    counts = Counter({"rselection:p/1": 1, "rselection:p/2": 1, "rselection:nodes": 2})
    assert grouped(counts) == {"rselection:p/*": 2, "rselection:nodes": 2}


def test_index_lists_and_percentiles() -> None:
    assert parse_indices("3,5,10-12", 20) == {3, 5, 10, 11, 12}
    assert parse_indices("", 20) == set()
    with pytest.raises(SystemExit):
        parse_indices("18-20", 20)
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0
    assert percentile([1.0], 99) == 1.0
