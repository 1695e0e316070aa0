"""A web server serving an example app (gunicorn or uvicorn), as a deployment runs it.

The server runs as a subprocess in a session of its own, its output (stdout and stderr)
read line by line and stamped with the time it arrived. Its workers are the master's
children; their Postgres sessions are found from the server's side
(``pg_stat_activity``), by the local ports of the workers' TCP connections.

    with Server(["gunicorn", ...], env) as server:
        server.wait_line(ELECTED, 30)
        server.workers()        # the worker pids, now
        status(dsn, name)       # ``rselection status --json`` as a subprocess
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import psutil  # type: ignore[import-untyped]
import psycopg

from tests.support.sessions import local_ports, server_port

__all__ = ["Server", "backends_of", "backends_left", "leading_nodes", "status", "worker_nodes"]

Backend = tuple[int, datetime]
"""A Postgres session: the server process's pid and when it started (pids are reused)."""


class Server:
    """A server command started in its own session; every line of its output kept.

    Args:
        argv: the command line.
        env: its environment.
        cwd: its working directory (default: this one).
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.argv = list(argv)
        self.popen = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: the cleanup reaches the workers
        )
        self._lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The master's pid."""
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._lock:
                self._lines.append((time.monotonic(), line.rstrip("\n")))

    def lines(self) -> list[tuple[float, str]]:
        """Every ``(arrival time, line)`` read so far."""
        with self._lock:
            return list(self._lines)

    def output(self) -> str:
        """The output so far, for messages."""
        return "\n".join(line for _, line in self.lines())

    def find(
        self, pattern: re.Pattern[str], since: float = 0.0
    ) -> list[tuple[float, re.Match[str]]]:
        """Every line that arrived at or after ``since`` and matches ``pattern``."""
        return [(at, m) for at, line in self.lines() if at >= since and (m := pattern.search(line))]

    def wait_line(
        self, pattern: re.Pattern[str], timeout: float, since: float = 0.0
    ) -> tuple[float, re.Match[str]]:
        """The first line matching ``pattern`` that arrived at or after ``since``.

        Fails after ``timeout`` seconds, or as soon as the server has exited.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self.find(pattern, since)
            if found:
                return found[0]
            if self.popen.poll() is not None:
                self._reader.join(5)
                found = self.find(pattern, since)
                if found:
                    return found[0]
                raise AssertionError(
                    f"the server exited ({self.popen.returncode}) before printing "
                    f"{pattern.pattern!r}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no line matching {pattern.pattern!r} within {timeout}s:\n{self.output()}"
                )
            time.sleep(0.02)

    def workers(self) -> set[int]:
        """The pids of the master's live worker processes, now.

        Every child except multiprocessing's resource tracker (uvicorn starts its workers
        with multiprocessing, which starts one) and zombies not reaped yet.
        """
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return set()
        pids = set()
        for child in children:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                if any("resource_tracker" in part for part in child.cmdline()):
                    continue
            except psutil.NoSuchProcess:
                continue
            pids.add(child.pid)
        return pids

    def close(self) -> None:
        """Kill the whole process group if the master still runs; close the pipe."""
        if self.popen.poll() is None:
            # The master is not reaped yet, so its pid is still its group's id: the
            # workers (forked or spawned, same group) go with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(10)
        finally:
            self._reader.join(5)
            if self.popen.stdout is not None:
                self.popen.stdout.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# -- rselection status ----------------------------------------------------------------------


def status(dsn: str, name: str) -> dict[str, Any] | None:
    """``rselection status --dsn DSN --json NAME``, run as a subprocess; its JSON document.

    ``None`` while the lease table does not exist yet (no worker has created it).
    """
    result = subprocess.run(
        [sys.executable, "-m", "rselection", "status", "--dsn", dsn, "--json", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode == 3 and "does not exist" in result.stderr:
        return None
    # 0: the lease has a leader; 1: it has none (not an error here).
    assert result.returncode in (0, 1), f"status exited {result.returncode}: {result.stderr}"
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def worker_nodes(document: dict[str, Any], pids: Iterable[int]) -> list[dict[str, Any]]:
    """The nodes of a status document that are processes among ``pids``, alive."""
    wanted = set(pids)
    # "nodes" is None while the nodes table does not exist yet
    return [n for n in document["nodes"] or [] if n["pid"] in wanted and n["alive"]]


def leading_nodes(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes of a status document that hold the lease."""
    return [n for n in document["nodes"] or [] if n["is_leader"]]


# -- Postgres sessions --------------------------------------------------------------------


def backends_of(dsn: str, pids: Iterable[int]) -> set[Backend]:
    """The Postgres sessions that processes ``pids`` hold on the server of ``dsn``."""
    port = server_port(dsn)
    ports: set[int] = set()
    for pid in pids:
        try:
            ports |= local_ports(pid, port)
        except psutil.NoSuchProcess:
            continue
    if not ports:
        return set()
    with psycopg.connect(dsn, autocommit=True, application_name="rselection-tests") as conn:
        rows = conn.execute(
            "SELECT pid, backend_start FROM pg_stat_activity"
            " WHERE client_port = ANY(%s) AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'",
            (sorted(ports),),
        ).fetchall()
    return {(int(pid), started) for pid, started in rows}


def backends_left(dsn: str, backends: Iterable[Backend]) -> set[Backend]:
    """Which of ``backends`` still exist on the server of ``dsn``."""
    wanted = set(backends)
    if not wanted:
        return set()
    with psycopg.connect(dsn, autocommit=True, application_name="rselection-tests") as conn:
        rows = conn.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = ANY(%s)",
            (sorted(pid for pid, _ in wanted),),
        ).fetchall()
    return {(int(pid), started) for pid, started in rows} & wanted
