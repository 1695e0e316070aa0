"""No output, log line or exception shows any part of a Redis password (DESIGN 8).

A generated password may hold an unescaped ``/``, ``?`` or ``#``: urllib (and so
redis-py) then ends the URL's user-info there, reads a piece of the password as the
port, and says so ("Port could not be cast to integer value as '...'"). Every
subcommand that takes ``--redis-url``, and every object that takes a URL, is run with
such URLs and with well-formed ones that lead to an unreachable server.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rselection as rs
from rselection.redis import (
    RedisClaimer,
    RedisElector,
    RedisFence,
    RedisLeader,
    RedisLease,
    cancel_handover,
    current_holder,
    live_nodes,
    request_handover,
)
from tests.support.waiting import wait_until

MISREAD = {
    "redis://:S3cr3t/pw@127.0.0.1:6379/0": ("S3cr3t", "pw"),
    "redis://:S3cr3t?pw@127.0.0.1:6379/0": ("S3cr3t", "pw"),
    "redis://:S3cr3t#pw@127.0.0.1:6379/0": ("S3cr3t", "pw"),
}
# The same passwords percent-encoded, as they should be written, for a server that is
# not there: every path that reports a failure runs.
ENCODED = {
    "redis://:S3cr3t%2Fpw@127.0.0.1:1/0": ("S3cr3t", "pw"),
    "redis://app:S3cr3t%3Fpw@127.0.0.1:1/0": ("S3cr3t", "pw"),
    "redis://:S3cr3t%23pw@127.0.0.1:1/0": ("S3cr3t", "pw"),
}
# Every subcommand that takes --redis-url, with the arguments it needs.
COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["status", "--json", "--watch", "0.1", "--count", "2"],
    ["resign", "billing", "--timeout", "2"],
    ["forget", "billing"],
    ["history", "billing"],
    ["history", "billing", "--json"],
    ["drain", "billing", "n1"],
    ["drain", "billing", "n1", "--json"],
    ["undrain", "billing", "n1"],
    ["task", "pause", "billing", "tick"],
    ["task", "history", "billing", "tick", "--json"],
    ["web"],
]
FAST: dict[str, Any] = {
    "ttl": 3.0,
    "renew_interval": 0.5,
    "renew_deadline": 2.0,
    "retry_interval": 0.2,
}


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rselection", *args], capture_output=True, text=True, timeout=60
    )


def shown(out: subprocess.CompletedProcess[str]) -> str:
    return out.stdout + out.stderr


def test_the_commands_listed_are_every_command_that_takes_a_redis_url() -> None:
    from rselection import cli

    parser = cli.build_parser()
    takes = set()
    for module in cli.SUBCOMMANDS:
        name = module.__name__.rsplit(".", 1)[-1]
        argv = [name, "x"] if name in ("history", "resign", "forget") else [name]
        if name in ("drain", "undrain"):
            argv = [name, "x", "n1"]
        if name == "task":
            argv = [name, "pause", "x", "t"]
        if "redis_url" in vars(parser.parse_args(argv)):
            takes.add(name)
    assert takes == {c[0] for c in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("url", MISREAD)
def test_a_misread_url_is_refused_by_every_subcommand_without_a_piece_of_its_password(
    command: list[str], url: str
) -> None:
    out = run([*command, "--redis-url", url])
    assert not any(piece in shown(out) for piece in MISREAD[url]), shown(out)
    assert out.returncode == 2, shown(out)
    assert "redis://***@127.0.0.1:6379/0" in out.stderr and "%2F" in out.stderr, out.stderr
    if "--json" in command:
        assert out.stdout.startswith('{"error": ')


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("url", ENCODED)
def test_an_unreachable_server_is_reported_by_every_subcommand_without_the_password(
    command: list[str], url: str
) -> None:
    out = run([*command, "--redis-url", url])
    assert out.returncode == 3, shown(out)
    assert "127.0.0.1:1" in out.stderr
    assert not any(piece in shown(out) for piece in ENCODED[url]), shown(out)
    assert out.stderr.count("warning: --redis-url holds a password") == 1, out.stderr


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
    "RedisLeader": lambda url: RedisLeader(url, rs.TaskHandler(), **FAST),
    "RedisLease": lambda url: RedisLease(url),
    "RedisElector": lambda url: RedisElector(url),
    "RedisClaimer": lambda url: RedisClaimer(url),
    "RedisFence": lambda url: RedisFence(url, name="x"),
    "request_handover": lambda url: request_handover(url, "x", valid_for=2),
    "cancel_handover": lambda url: cancel_handover(url, "x", 1),
    "current_holder": lambda url: current_holder(url, "x"),
    "live_nodes": lambda url: live_nodes(url, "x"),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("url", MISREAD)
def test_every_object_refuses_a_misread_url_without_a_piece_of_its_password(
    entry: str, url: str, logs: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(rs.ConfigError) as refused:
        ENTRY_POINTS[entry](url)
    message = str(refused.value)
    assert "redis://***@127.0.0.1:6379/0" in message and "%2F" in message
    assert not any(piece in message + everything(logs) for piece in MISREAD[url])


@pytest.mark.parametrize("url", ENCODED)
def test_a_leader_retrying_an_unreachable_server_logs_no_piece_of_the_password(
    url: str, logs: pytest.LogCaptureFixture
) -> None:
    leader = RedisLeader(url, rs.TaskHandler(), **FAST)
    leader.start()
    try:

        def attempts() -> int:
            return sum("backend unavailable" in r.getMessage() for r in logs.records)

        wait_until(lambda: attempts() >= 3, 20, "three failed attempts")
        assert not leader.is_leader
    finally:
        leader.stop(timeout=10)
    text = everything(logs)
    assert "127.0.0.1:1" in text
    assert not any(piece in text for piece in ENCODED[url]), text
