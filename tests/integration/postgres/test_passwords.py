"""No output, log line or exception shows any part of a Postgres password (DESIGN 8).

A generated password may hold an unescaped ``/`` or ``@``: libpq then reads pieces of it
as a host, a port or a database name, and its messages quote them. Every subcommand of
the command line, and every object that takes a connection string, is run with such
strings and with well-formed ones that lead to unreachable servers.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from rselection import cli
from rselection.postgres import (
    PostgresBroadcaster,
    PostgresCheckpointStore,
    PostgresClaimer,
    PostgresElector,
    PostgresLeader,
    PostgresLease,
    PostgresShardedLeader,
    cancel_handover,
    current_holder,
    migrate,
    request_handover,
)
from tests.support.waiting import wait_until

# The spellings of the reported defect, and the pieces of their passwords.
MISREAD = {
    "postgresql://u:hunter2/sekrit@127.0.0.1:5432/test": ("hunter2", "sekrit"),
    "postgresql://u:p@ss@127.0.0.1:5432/test": ("ss@",),
}
# The same passwords percent-encoded, as they should be written: read right, but the
# server is not there (port 1), so every path that reports a failure runs.
ENCODED = {
    "postgresql://u:hunter2%2Fsekrit@127.0.0.1:1/test?connect_timeout=2": ("hunter2", "sekrit"),
    "postgresql://u:p%40ss@127.0.0.1:1/test?connect_timeout=2": ("ss@", "p%40ss"),
}
FAST: dict[str, Any] = {
    "ttl": 3.0,
    "renew_interval": 0.5,
    "renew_deadline": 2.0,
    "retry_interval": 0.2,
}


def subcommands() -> list[list[str]]:
    """Every subcommand of the command line, with the arguments it needs, and ``--json``
    where it has it (``status`` and ``task history`` only)."""
    made = []
    for module in cli.SUBCOMMANDS:
        name = module.__name__.rsplit(".", 1)[-1]
        args = [name, "billing"] if name in ("history", "resign", "forget") else [name]
        if name in ("drain", "undrain"):
            args = [name, "billing", "n1"]
        if name == "resign":
            args += ["--timeout", "2"]
        if name == "task":
            made.append([name, "pause", "billing", "tick"])
            args = [name, "history", "billing", "tick", "--json"]
        made.append(args)
        if name == "status":
            made += [[*args, "--json"], [*args, "--json", "--watch", "0.1", "--count", "2"]]
    return made


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    clean.pop("RSELECTION_DSN", None)
    return subprocess.run(
        [sys.executable, "-m", "rselection", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


def shown(out: subprocess.CompletedProcess[str]) -> str:
    return out.stdout + out.stderr


@pytest.mark.parametrize("command", subcommands(), ids=" ".join)
@pytest.mark.parametrize("dsn", MISREAD)
def test_a_misread_uri_is_refused_by_every_subcommand_without_a_piece_of_its_password(
    command: list[str], dsn: str
) -> None:
    for out in (run([*command, "--dsn", dsn]), run(command, RSELECTION_DSN=dsn)):
        assert not any(piece in shown(out) for piece in MISREAD[dsn]), shown(out)
        assert out.returncode == 2, shown(out)  # a usage error, found before connecting
        assert "percent-encode" in out.stderr and "%2F" in out.stderr, out.stderr
        assert "postgresql://***@127.0.0.1:5432/test" in out.stderr
        if "--json" in command:
            assert out.stdout.startswith('{"error": ')


@pytest.mark.parametrize("command", [c for c in subcommands() if c[0] != "demo"], ids=" ".join)
@pytest.mark.parametrize("dsn", ENCODED)
def test_an_unreachable_server_is_reported_by_every_subcommand_without_the_password(
    command: list[str], dsn: str
) -> None:
    out = run([*command, "--dsn", dsn])
    assert out.returncode == 3, shown(out)
    assert "host=127.0.0.1 port=1 dbname=test user=u" in out.stderr
    assert not any(piece in shown(out) for piece in ENCODED[dsn]), shown(out)


def test_a_password_on_the_command_line_is_warned_about_once_and_not_from_the_environment(
    pg_dsn: str,
) -> None:
    from psycopg.conninfo import make_conninfo

    migrate(pg_dsn)
    with_password = make_conninfo(pg_dsn, password="hunter2")  # a trusting server ignores it
    given = run(["status", "--dsn", with_password, "--json", "--watch", "0.1", "--count", "3"])
    assert given.returncode in (0, 1), given.stderr  # read: with or without leaders
    assert given.stderr.count("warning: --dsn holds a password") == 1, given.stderr
    assert "ps" in given.stderr and "RSELECTION_DSN" in given.stderr
    from_env = run(["status"], RSELECTION_DSN=with_password)
    assert from_env.returncode in (0, 1) and "warning" not in from_env.stderr, from_env.stderr
    without = run(["status", "--dsn", pg_dsn])
    assert without.returncode in (0, 1) and "warning" not in without.stderr, without.stderr
    for out in (given, from_env, without):
        assert "hunter2" not in shown(out)


# -- the library -----------------------------------------------------------------------


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record of every rselection logger, debug ones included."""
    with caplog.at_level(logging.DEBUG, logger="rselection"):
        yield caplog


def everything(caplog: pytest.LogCaptureFixture) -> str:
    """The log records, their messages and the exceptions logged with them."""
    lines = []
    for record in caplog.records:
        lines.append(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:
            lines.append(repr(record.exc_info[1]))
    return "\n".join(lines)


ENTRY_POINTS: dict[str, Callable[[str], Any]] = {
    "PostgresLeader": lambda dsn: PostgresLeader(dsn, rs.TaskHandler(), **FAST),
    "PostgresShardedLeader": lambda dsn: PostgresShardedLeader(
        dsn, rs.TaskHandler(), name="x", shards=2
    ),
    "PostgresLease": lambda dsn: PostgresLease(dsn),
    "PostgresElector": lambda dsn: PostgresElector(dsn),
    "PostgresClaimer": lambda dsn: PostgresClaimer(dsn),
    "PostgresCheckpointStore": lambda dsn: PostgresCheckpointStore(dsn),
    "PostgresBroadcaster": lambda dsn: PostgresBroadcaster(dsn),
    "migrate": lambda dsn: migrate(dsn, timeout=2),
    "request_handover": lambda dsn: request_handover(dsn, "x", valid_for=2),
    "cancel_handover": lambda dsn: cancel_handover(dsn, "x", 1),
    "current_holder": lambda dsn: current_holder(dsn, "x"),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("dsn", MISREAD)
def test_every_object_refuses_a_misread_uri_without_a_piece_of_its_password(
    entry: str, dsn: str, logs: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(rs.ConfigError) as refused:
        made = ENTRY_POINTS[entry](dsn)
        close = getattr(made, "close", None)
        if callable(close):
            close()
    message = str(refused.value)
    assert "postgresql://***@127.0.0.1:5432/test" in message and "%40" in message
    assert not any(piece in message + everything(logs) for piece in MISREAD[dsn])


@pytest.mark.parametrize("dsn", ENCODED)
def test_a_leader_retrying_an_unreachable_server_logs_no_piece_of_the_password(
    dsn: str, logs: pytest.LogCaptureFixture
) -> None:
    handler = rs.TaskHandler()
    leader = PostgresLeader(dsn, handler, **FAST)
    leader.start()
    try:

        def attempts() -> int:
            return sum("backend unavailable" in r.getMessage() for r in logs.records)

        wait_until(lambda: attempts() >= 3, 20, "three failed attempts")
        assert not leader.is_leader
    finally:
        leader.stop(timeout=10)
    text = everything(logs)
    assert "host=127.0.0.1 port=1 dbname=test user=u" in text
    assert not any(piece in text for piece in ENCODED[dsn]), text
