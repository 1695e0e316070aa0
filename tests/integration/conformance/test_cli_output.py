"""What the command line prints for people never drives the terminal, on both backends.

Lease names and node ids are anyone's text (any string without NUL), and hostnames come
from the machines: with escape sequences in them, ``rselection status`` set the
terminal's window title and hid the text that followed. Every human-readable output
escapes the characters a terminal could act on (controls, ``ESC`` sequences, C1
controls, bidirectional overrides), and ``--json`` stays exact JSON (its strings carry
the names exactly).
"""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

import rselection as rs
from tests.support.backends import Backend
from tests.support.resign_cli import cli
from tests.support.waiting import wait_until

FAST = {"ttl": 3.0, "renew_interval": 0.5, "renew_deadline": 2.0, "retry_interval": 0.5}

#: Sets the window title (OSC 0), hides what follows (SGR 8), then reverses the rest.
LEASE = "jobs\x1b]0;pwned\x07\x1b[8m\u202eevil"
#: Clears the screen, returns the cursor, a C1 CSI, a bidirectional isolate, a newline.
NODE = "node\x1b[2J\r\x9b31m\u2066x\ny"
#: A hostname with a backspace and a bell.
HOST = "host\x08\x07\x1b[1A"


def raw_controls(text: str) -> list[str]:
    """The characters of ``text`` a terminal could act on (all but printable and ``\\n``)."""
    return [c for c in text if not c.isprintable() and c != "\n"]


@pytest.fixture
def hostile(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A live leader of lease ``LEASE``, node ``NODE`` on host ``HOST`` (heartbeating);
    yields the command-line options that reach it."""
    monkeypatch.setattr(socket, "gethostname", lambda: HOST)
    options: dict[str, Any] = {"heartbeat_interval": 0.2, **FAST}
    where = list(backend.cli_args)
    if backend.kind == "redis":
        options["key_prefix"] = backend.key_prefix
        where += ["--key-prefix", backend.key_prefix]
    else:
        backend.create_tables()
    leader = backend.leader(rs.TaskHandler(), LEASE, node_id=NODE, **options)
    try:
        leader.start()
        assert leader.wait_until_leader(10)
        wait_until(lambda: leader.nodes(), 10, "the leader's heartbeat")
        yield where
    finally:
        leader.stop(timeout=10)


def _outputs(where: list[str]) -> dict[str, subprocess.CompletedProcess[str]]:
    return {
        "status": cli("status", *where),
        "status NAME": cli("status", LEASE, "no\x1b[5mpe", *where),
        "resign": cli("resign", LEASE, *where, "--timeout", "1"),
        "resign --to": cli("resign", LEASE, "--to", "x\x1b]2;t\x07", *where, "--timeout", "1"),
        "resign --to holder": cli("resign", LEASE, "--to", NODE, *where, "--timeout", "1"),
        "forget": cli("forget", LEASE, *where),
        "forget unknown": cli("forget", "gone\x1b[31m", *where),
    }


def test_human_readable_output_escapes_names_node_ids_and_hostnames(
    hostile: list[str],
) -> None:
    outputs = _outputs(hostile)
    for what, out in outputs.items():
        for stream, text in (("stdout", out.stdout), ("stderr", out.stderr)):
            assert not raw_controls(text), f"{what}: raw {raw_controls(text)} on {stream}:\n{text}"
            assert "x\ny" not in text, f"{what}: the node id's newline is raw on {stream}"
    table = outputs["status"].stdout
    assert r"jobs\x1b]0;pwned\x07\x1b[8m\u202eevil" in table, table
    assert r"node\x1b[2J\r\x9b31m\u2066x\ny" in table, table
    assert r"host\x08\x07\x1b[1A" in table, table


def test_json_output_carries_the_names_exactly(hostile: list[str]) -> None:
    out = cli("status", *hostile, "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert not raw_controls(out.stdout)  # JSON escapes them itself
    (lease,) = [lease for lease in shown["leases"] if lease["name"] == LEASE]
    assert lease["holder"] == NODE
    (node,) = [n for n in shown["nodes"] if n["node_id"] == NODE]
    assert node["hostname"] == HOST
