"""The examples run as documented: as a subprocess, until a deadline or Ctrl-C."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "single_node.py"
# PYTHONFAULTHANDLER: a child that does not stop in time is sent SIGABRT, and prints
# where each of its threads was (see stop_or_show_stacks).
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the single-node example to completion (bounded)."""
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )


def test_single_node_example_runs_for_a_while_and_stops_cleanly() -> None:
    result = run_example("--seconds", "2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "elected: node local leads with term 1" in out
    sent = re.findall(r"sending heartbeat (\d+) \(fire heartbeat@\S+Z, term 1\)", out)
    got = re.findall(r"monitor got heartbeat (\d+)", out)
    assert len(sent) >= 2, out  # every 0.5 s for 2 s
    assert got and set(got) <= set(sent), out
    assert "demoted: term 1 ended (stopped)" in out
    assert out.rstrip().endswith("stopped cleanly")
    assert "missed heartbeats" not in result.stderr
    assert "Traceback" not in result.stderr


def test_single_node_example_flags_missed_heartbeats() -> None:
    result = run_example("--seconds", "2", "--interval", "0.2", "--silent-after", "2")
    assert result.returncode == 0, result.stderr
    assert "sending heartbeat 2" in result.stdout
    assert "sending heartbeat 3" not in result.stdout
    assert re.search(r"WARNING single_node: missed heartbeats: none for [\d.]+ s", result.stderr)


def stop_or_show_stacks(
    proc: subprocess.Popen[str],
    reader: threading.Thread,
    lines: queue.Queue[str],
    output: list[str],
    timeout: float,
) -> int:
    """Wait up to ``timeout`` seconds for ``proc`` to exit; its exit code. A process still
    running then is sent SIGABRT (its faulthandler prints every thread's stack) and the
    test fails with what it printed."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(10)
        reader.join(10)
        while not lines.empty():
            output.append(lines.get_nowait())
        pytest.fail(f"still running {timeout} s after the signal:\n{''.join(output)}")


def read_lines(proc: subprocess.Popen[str]) -> tuple[queue.Queue[str], threading.Thread]:
    """Read ``proc``'s stdout in a thread, a line at a time, into a queue."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_single_node_example_stops_cleanly_on_a_signal(signum: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lines, reader = read_lines(proc)
    try:
        deadline = time.monotonic() + 30
        output: list[str] = []
        while not any("monitor got heartbeat" in line for line in output):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no heartbeat within 30 s: {output}")
            try:
                output.append(lines.get(timeout=remaining))
            except queue.Empty:
                continue
        proc.send_signal(signum)
        proc.wait(timeout=30)
        reader.join(10)
        while not lines.empty():
            output.append(lines.get_nowait())
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
        assert output[-1].strip() == "stopped cleanly"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


# -- every example leads alone without a database, and stops cleanly on a signal -------------

EXAMPLES = EXAMPLE.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# Each example: its command line after the interpreter, and a line it prints once it leads.
ALONE: dict[str, tuple[list[str], str]] = {
    "single_node.py": (["--name", "solo"], "elected: node local leads with term 1"),
    "worker.py": (["--name", "solo"], "elected: local leads with term 1"),
    "postgres_leader.py": (["--name", "solo"], "is now the leader (term 1)"),
    "sharded_pollers.py": (["--name", "solo"], "every tenant (term 1): poll 1 of 40 tenants"),
    "resumable_queue.py": (
        ["--name", "solo", "--items", "3", "--delay", "0.05"],
        "processed item 1",
    ),
    "heartbeat_monitor.py": (["--name", "solo"], "[alone] node_joined alone"),
    "claims_with_apscheduler.py": (["--name", "solo", "--node", "a"], "[a] ran tick@"),
    "fastapi_app.py": (["--name", "solo", "--metrics"], "leads 'solo' with term 1"),
    "django_app/manage.py": (["runleader", "--name", "solo"], "elected: local leads with term 1"),
}


def test_examples_that_lead_leave_the_stop_signals_to_lead() -> None:
    # lead() takes SIGTERM like Ctrl-C; an example ending in it needs no handler of its own.
    for path in sorted(EXAMPLES.rglob("*.py")):
        text = path.read_text()
        if ".lead()" in text:
            assert "signal.signal(" not in text, f"{path.name} installs a signal handler"


def test_every_example_is_run_alone_here() -> None:
    found = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.glob("*.py")}
    found.add("django_app/manage.py")
    assert found == set(ALONE)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("example", sorted(ALONE))
def test_the_example_leads_alone_without_a_database_and_stops_cleanly_on_a_signal(
    example: str, signum: signal.Signals
) -> None:
    args, leads = ALONE[example]
    if example == "fastapi_app.py":
        pytest.importorskip("uvicorn")
        port = free_port()
        args = [*args, "--port", str(port)]
    env = {k: v for k, v in ENV.items() if k != "RSELECTION_DSN" and not k.startswith("PG")}
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / example), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines, reader = read_lines(proc)
    output: list[str] = []
    try:
        deadline = time.monotonic() + 45
        while not any(leads in line for line in output):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (proc.poll() is not None and lines.empty()):
                pytest.fail(f"{example} did not lead alone within 45 s:\n{''.join(output)}")
            try:
                output.append(lines.get(timeout=min(remaining, 0.5)))
            except queue.Empty:
                continue
        if example == "fastapi_app.py":
            import httpx

            # Served at /metrics itself: a scraper that does not follow redirects works.
            got = httpx.get(f"http://127.0.0.1:{port}/metrics", follow_redirects=False)
            assert got.status_code == 200, got.headers
            assert 'rselection_is_leader{lease="solo"} 1.0' in got.text
        proc.send_signal(signum)
        assert stop_or_show_stacks(proc, reader, lines, output, 30) == 0, "".join(output)
        reader.join(10)
        while not lines.empty():
            output.append(lines.get_nowait())
        text = "".join(output)
        assert "Traceback" not in text, text
        assert re.search(r"\bstopped( cleanly)?$", text.strip().splitlines()[-1]), text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
