"""Throwaway database servers and DSN helpers for the test suite.

``PrivatePostgres`` runs a Postgres from the binaries bundled with the
``pgserver`` package (extra ``embedded``) in its own temporary data directory,
listening on a free TCP port on 127.0.0.1 with trust authentication.
``PrivateRedis`` does the same with a ``redis-server`` found on ``PATH``.
Both can be stopped, restarted on the same port with the same data, and killed
with SIGKILL, so fault-injection tests never touch a shared server.
``PrivatePostgres.make_standby()`` builds a streaming standby of a private server
(``pg_basebackup -R``) that a test can promote (``pg_ctl promote``), for failover tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

__all__ = [
    "DEFAULT_DSN",
    "DEFAULT_REDIS_URL",
    "PrivatePostgres",
    "PrivateRedis",
    "ServerStartError",
    "TEST_PASSWORD",
    "connection_or_pool",
    "find_free_port",
    "pgserver_bin_dir",
    "postgres_answers",
    "redact",
    "redis_answers",
    "with_host_port",
    "with_search_path",
]

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
"""The local server the suite tries when ``RSELECTION_TEST_DSN`` is not set."""

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
"""The local Redis the suite tries when ``RSELECTION_TEST_REDIS_URL`` is not set."""

# pgserver runs its servers as this system user when started as root, because
# initdb and postgres refuse to run as root; we reuse the same user.
_UNPRIVILEGED_USER = "pgserver"

StopMode = Literal["smart", "fast", "immediate"]

_STOP_SIGNALS: dict[str, signal.Signals] = {
    "smart": signal.SIGTERM,
    "fast": signal.SIGINT,
    "immediate": signal.SIGQUIT,
}


class ServerStartError(RuntimeError):
    """A private server did not start; the message carries the end of its log."""


# --------------------------------------------------------------------------- helpers


TEST_PASSWORD = "hunter2"
"""The password :func:`connection_or_pool` gives (the test servers trust their clients:
they never ask for it, and libpq reports it as the one a session connected with)."""


@contextlib.contextmanager
def connection_or_pool(kind: str, dsn: str) -> Iterator[Any]:
    """A ``psycopg.Connection`` (``kind="connection"``) or a ``psycopg_pool.ConnectionPool``
    (``kind="pool"``) on ``dsn``, given :data:`TEST_PASSWORD` (in the connection's
    parameters, or in the pool's ``kwargs``); closed after."""
    import psycopg

    if kind == "connection":
        with psycopg.connect(dsn, password=TEST_PASSWORD, autocommit=True) as conn:
            yield conn
        return
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(
        dsn, min_size=1, max_size=2, kwargs={"password": TEST_PASSWORD}, open=True
    )
    try:
        yield pool
    finally:
        pool.close()


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def redact(dsn: str) -> str:
    """Return ``dsn`` fit for messages: the library's own redaction (no password, no
    user-info of a URI)."""
    from rselection.redaction import redact_dsn

    return redact_dsn(dsn)


def _is_uri(dsn: str) -> bool:
    return dsn.startswith(("postgresql://", "postgres://"))


def _uri_with_params(dsn: str, updates: Callable[[dict[str, str]], None]) -> str:
    """Rewrite the query string of a libpq URI; values are percent-encoded fully."""
    parts = urllib.parse.urlsplit(dsn)
    params = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    updates(params)
    # libpq rejects a second "=" inside a query value, so encode every reserved
    # character (quote with safe="") rather than relying on urlencode defaults.
    query = "&".join(
        f"{urllib.parse.quote(k, safe='')}={urllib.parse.quote(v, safe='')}"
        for k, v in params.items()
    )
    return urllib.parse.urlunsplit(parts._replace(query=query))


def with_search_path(dsn: str, schema: str) -> str:
    """Return ``dsn`` with ``options=-csearch_path=<schema>`` added.

    Works for libpq URIs (the option is percent-encoded into the query string)
    and for ``key=value`` strings. Existing ``options`` are kept. The result is a
    plain string for ``psycopg.connect`` or any libpq client, in any process.

    Parameters:
        dsn: a libpq connection string or URI.
        schema: the schema name, or several separated by commas (a search path);
            each a plain identifier (letters, digits, underscores), which is what
            the fixtures generate.
    """
    if not all(part and all(c.isalnum() or c == "_" for c in part) for part in schema.split(",")):
        raise ValueError(f"schema must be plain identifiers (comma-separated), got {schema!r}")
    option = f"-csearch_path={schema}"

    def add_option(params: dict[str, str]) -> None:
        previous = params.get("options", "").strip()
        params["options"] = f"{previous} {option}".strip()

    if _is_uri(dsn):
        return _uri_with_params(dsn, add_option)
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    add_option(params)
    return make_conninfo("", **params)


def with_host_port(dsn: str, host: str, port: int) -> str:
    """Return ``dsn`` pointing at ``host:port`` instead (e.g. a ``TcpProxy``).

    Parameters:
        dsn: a libpq connection string or URI.
        host: the new host (an IP address or name; not a socket directory).
        port: the new TCP port.
    """
    if _is_uri(dsn):
        parts = urllib.parse.urlsplit(dsn)
        userinfo = parts.netloc.rpartition("@")[0]
        hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        netloc = f"{userinfo}@{hostport}" if userinfo else hostport

        def drop_host(params: dict[str, str]) -> None:
            for key in ("host", "hostaddr", "port"):
                params.pop(key, None)

        return _uri_with_params(urllib.parse.urlunsplit(parts._replace(netloc=netloc)), drop_host)
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, host=host, port=str(port), hostaddr=None)


def postgres_answers(dsn: str, timeout: float = 2.0) -> bool:
    """Return True if a Postgres at ``dsn`` accepts a connection and ``select 1``.

    Parameters:
        dsn: the server to try.
        timeout: seconds; libpq rounds ``connect_timeout`` up to at least 2.
    """
    import psycopg

    try:
        with psycopg.connect(dsn, connect_timeout=max(2, round(timeout)), autocommit=True) as conn:
            conn.execute("select 1").fetchone()
    except psycopg.Error:
        return False
    return True


def redis_answers(url: str, timeout: float = 2.0) -> bool:
    """Return True if a Redis at ``url`` answers PING within ``timeout`` seconds."""
    try:
        import redis
    except ImportError:
        return False
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def pgserver_bin_dir() -> Path | None:
    """Return the ``bin`` directory of pgserver's bundled Postgres, or None.

    Locates the package without importing it (importing pgserver creates lock
    files in the user's runtime directory).
    """
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        bin_dir = Path(location) / "pginstall" / "bin"
        if (bin_dir / "postgres").exists() and (bin_dir / "initdb").exists():
            return bin_dir
    return None


def _pid_alive(pid: int) -> bool:
    """Return True if ``pid`` runs and is not a zombie (Linux-aware)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # the state follows the parenthesised command name
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _wait_dead(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``pid`` to be gone; True if it is."""
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run_as_kwargs() -> dict[str, Any]:
    """Return ``subprocess`` keyword arguments that drop root, as pgserver does.

    When the tests run as root, Postgres binaries refuse to start; pgserver then
    creates (or reuses) the system user ``pgserver`` and runs them as that user.
    We do the same. As a normal user, nothing changes.
    """
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam(_UNPRIVILEGED_USER)
    except KeyError:
        result = subprocess.run(
            ["useradd", "-s", "/bin/bash", _UNPRIVILEGED_USER],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        try:  # a concurrent process may have created it first
            entry = pwd.getpwnam(_UNPRIVILEGED_USER)
        except KeyError:
            raise ServerStartError(
                f"running as root and could not create the user {_UNPRIVILEGED_USER!r} "
                f"to run Postgres as: {result.stderr.strip()}"
            ) from None
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


_USABLE_BIN_DIRS: set[Path] = set()


def _ensure_binaries_usable(bin_dir: Path, run_as: Mapping[str, Any]) -> None:
    """Check the unprivileged user can run the binaries; widen permissions like pgserver."""
    probe = [str(bin_dir / "postgres"), "--version"]
    if not run_as or bin_dir in _USABLE_BIN_DIRS:
        return
    try:
        usable = subprocess.run(probe, capture_output=True, timeout=30, check=False, **run_as)
    except PermissionError:  # a folder on the way (e.g. a 0700 venv) blocks the user
        usable = None
    if usable is not None and usable.returncode == 0:
        _USABLE_BIN_DIRS.add(bin_dir)
        return
    from pgserver.utils import (
        ensure_folder_permissions,
        ensure_prefix_permissions,
    )

    readable = 0o044
    ensure_prefix_permissions(bin_dir)
    ensure_folder_permissions(bin_dir, readable | 0o011)
    ensure_folder_permissions(bin_dir.parent / "lib", readable)
    ensure_folder_permissions(bin_dir.parent / "share", readable)
    subprocess.run(probe, capture_output=True, timeout=30, check=True, **run_as)
    _USABLE_BIN_DIRS.add(bin_dir)


def _children(pid: int) -> list[int]:
    """Return the ids of the direct children of ``pid`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its children at once, like a crash of the whole server.

    Postgres workers call ``setsid()``, so a process-group kill would miss them.
    The parent is stopped first so it cannot fork while its children are listed.
    """
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    children = _children(pid) if Path("/proc").is_dir() else []
    for target in [pid, *children]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    for child in children:
        _wait_dead(child, 5.0)


def _finalize_server(proc: subprocess.Popen[bytes] | None, pid: int | None, tmp: str) -> None:
    """Last-resort cleanup run at garbage collection or interpreter exit."""
    if pid is not None and (proc is None or proc.poll() is None):
        _kill_tree(pid)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- Postgres


class _ServerProcess:
    """What the private servers share: one child process, killed and cleaned up alike."""

    _proc: subprocess.Popen[bytes] | None
    _closed: bool
    _finalizer: weakref.finalize[Any, Any]
    start_timeout: float
    log_path: Path

    def start(self) -> Self:
        """Start the server and wait until it answers."""
        raise NotImplementedError

    def stop(self, mode: Any = "fast", timeout: float = 15.0) -> None:
        """Stop the server (``mode`` as the subclass documents)."""
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, else None."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc.pid
        return None

    def is_running(self) -> bool:
        """Return True while the server process is alive."""
        return self.pid is not None

    def _signal_and_wait(self, sig: int, timeout: float) -> None:
        """Send ``sig``; SIGKILL the server if it has not exited after ``timeout``."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server and its child processes at once, like a crash."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        _kill_tree(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def _wait_answers(self, dsn: str, what: str) -> None:
        """Wait until ``dsn`` answers a query; kill the server and raise
        ``ServerStartError`` (with the end of its log) if it exits or stays silent."""
        import psycopg

        start_timeout: float = self.start_timeout
        log_path: Path = self.log_path
        deadline = time.monotonic() + start_timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise ServerStartError(
                    f"{what} exited with code {code} during start:\n{_tail(log_path)}"
                )
            try:
                with psycopg.connect(dsn, connect_timeout=2, autocommit=True) as conn:
                    conn.execute("select 1").fetchone()
                return
            except psycopg.Error as exc:
                last_error = exc
                time.sleep(0.05)
        self.kill()
        raise ServerStartError(
            f"{what} did not answer within {start_timeout}s ({last_error}):\n{_tail(log_path)}"
        )

    def restart(self, mode: Any = "fast") -> Self:
        """Stop (``mode``) and start again on the same port with the same data."""
        self.stop(mode)
        return self.start()

    def close(self) -> None:
        """Stop the server at once and delete its directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.stop("immediate", timeout=10)
        self._finalizer()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class PrivatePostgres(_ServerProcess):
    """A throwaway Postgres on 127.0.0.1 for tests that stop, restart or kill it.

    Uses the binaries bundled with ``pgserver`` (``pip install -e '.[embedded]'``)
    unless ``bin_dir`` is given. The cluster lives in a temporary directory that
    is removed by ``close()`` (or at interpreter exit). ``restart()`` keeps the
    port and the data, so clients can reconnect to the same DSN. Durability
    settings are relaxed for speed (``fsync=off``): data survives ``stop``,
    ``restart`` and ``kill`` of the server, not a crash of the machine.

    Parameters:
        port: TCP port; a free one is chosen when None.
        bin_dir: directory holding ``initdb`` and ``postgres``.
        start_timeout: bound in seconds for ``initdb`` and for each start.
        settings: extra ``postgresql.conf`` settings, e.g.
            ``{"max_connections": "300"}``; values are written verbatim.

    Use as a context manager (``with PrivatePostgres() as pg:`` starts it and
    closes it) or call ``start()`` and ``close()``.
    """

    host = "127.0.0.1"
    user = "postgres"
    dbname = "postgres"

    def __init__(
        self,
        *,
        port: int | None = None,
        bin_dir: Path | str | None = None,
        start_timeout: float = 60.0,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        found = Path(bin_dir) if bin_dir is not None else pgserver_bin_dir()
        if found is None:
            raise ServerStartError(
                "no Postgres binaries: install the embedded extra "
                "(pip install -e '.[embedded]') or pass bin_dir="
            )
        self.bin_dir = found
        self.port = port if port is not None else find_free_port(self.host)
        self.start_timeout = start_timeout
        self.settings = dict(settings or {})
        self._run_as = _run_as_kwargs()
        self._tmp = tempfile.mkdtemp(prefix="rselection-pg-")
        self.data_dir = Path(self._tmp) / "data"
        self.log_path = Path(self._tmp) / "postgres.log"
        if self._run_as:
            os.chown(self._tmp, self._run_as["user"], self._run_as["group"])
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer = weakref.finalize(self, _finalize_server, None, None, self._tmp)
        self._closed = False
        self._primary: PrivatePostgres | None = None  # set by make_standby()

    # -- properties

    @property
    def dsn(self) -> str:
        """A libpq URI for the ``postgres`` database as user ``postgres``."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{self.dbname}"

    # -- lifecycle

    def start(self) -> PrivatePostgres:
        """Initialise the cluster if needed and start the server; wait until it answers.

        Raises ``ServerStartError`` (with the end of the server log) if it does
        not accept connections within ``start_timeout`` seconds.
        """
        if self._closed:
            raise RuntimeError("this PrivatePostgres is closed; create a new one")
        if self.is_running():
            return self
        _ensure_binaries_usable(self.bin_dir, self._run_as)
        if not (self.data_dir / "PG_VERSION").exists():
            if self._primary is not None:
                self._basebackup(self._primary)
            else:
                self._initdb()
        self._remove_stale_pidfile()
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                [str(self.bin_dir / "postgres"), "-D", str(self.data_dir)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not hit by a Ctrl-C meant for the test runner
                **self._run_as,
            )
        finally:
            log.close()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, _finalize_server, self._proc, self._proc.pid, self._tmp
        )
        self._wait_ready()
        return self

    def stop(self, mode: StopMode = "fast", timeout: float = 30.0) -> None:
        """Stop the server like ``pg_ctl stop -m <mode>``; SIGKILL it after ``timeout``.

        Parameters:
            mode: ``"smart"`` waits for clients, ``"fast"`` disconnects them and
                shuts down cleanly, ``"immediate"`` aborts (crash recovery on
                the next start).
            timeout: seconds to wait before falling back to ``kill()``.
        """
        if mode not in _STOP_SIGNALS:
            raise ValueError(f"mode must be one of {sorted(_STOP_SIGNALS)}, got {mode!r}")
        self._signal_and_wait(_STOP_SIGNALS[mode], timeout)

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        role = " standby" if self._primary is not None else ""
        return f"<PrivatePostgres{role} {self.dsn} {state}>"

    # -- replication

    def make_standby(self, *, settings: Mapping[str, str] | None = None) -> PrivatePostgres:
        """A streaming standby of this server, not started yet; ``start()`` builds it.

        Its first ``start()`` copies this (running) server with ``pg_basebackup -R``
        (``primary_conninfo`` and ``standby.signal`` written for it) into a directory of
        its own, on a port of its own, then starts it as a hot standby that streams from
        this server. Close it like any ``PrivatePostgres``.

        Parameters:
            settings: extra ``postgresql.conf`` settings of the standby.
        """
        standby = PrivatePostgres(
            bin_dir=self.bin_dir,
            start_timeout=self.start_timeout,
            settings={**self.settings, **(settings or {})},
        )
        standby._primary = self
        return standby

    def in_recovery(self) -> bool:
        """True while the server is a standby (``pg_is_in_recovery()``)."""
        import psycopg

        with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def wait_replayed(self, primary: PrivatePostgres, timeout: float = 30.0) -> None:
        """Wait until this standby has replayed everything ``primary`` has written so far.

        Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        import psycopg

        with psycopg.connect(primary.dsn, connect_timeout=2, autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
            while True:
                done = conn.execute(
                    "SELECT coalesce(pg_last_wal_replay_lsn() >= %s::pg_lsn, false)", (target,)
                ).fetchone()
                if done and done[0]:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the standby did not replay up to {target} within {timeout}s"
                    )
                time.sleep(0.02)

    def promote(self, timeout: float = 30.0) -> None:
        """Promote this standby to a primary (``pg_ctl promote -w``); returns once it writes.

        Raises ``ServerStartError`` (with the end of the server log) when it fails.
        """
        result = subprocess.run(
            [
                str(self.bin_dir / "pg_ctl"),
                "promote",
                "-D",
                str(self.data_dir),
                "-w",
                "-t",
                str(max(1, math.ceil(timeout))),
            ],
            capture_output=True,
            text=True,
            timeout=timeout + 10,
            check=False,
            **self._run_as,
        )
        if result.returncode != 0:
            raise ServerStartError(
                f"pg_ctl promote failed ({result.returncode}): {result.stdout}"
                f"{result.stderr}\n{_tail(self.log_path)}"
            )

    # -- internals

    def _run_tool(self, cmd: list[str], what: str) -> None:
        """Run a server binary as the server's user; ``ServerStartError`` if it fails."""
        result = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=self.start_timeout,
            check=False,
            **self._run_as,
        )
        if result.returncode != 0:
            raise ServerStartError(
                f"{what} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )

    def _basebackup(self, primary: PrivatePostgres) -> None:
        if not primary.is_running():
            raise ServerStartError("the primary of a standby must run when the standby is built")
        cmd = [
            str(self.bin_dir / "pg_basebackup"),
            "-D",
            str(self.data_dir),
            "-R",  # primary_conninfo + standby.signal
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
            "-h",
            primary.host,
            "-p",
            str(primary.port),
            "-U",
            primary.user,
        ]
        self._run_tool(cmd, "pg_basebackup")
        # The copy carries the primary's postgresql.conf; later lines win.
        settings = {"port": str(self.port), "hot_standby": "on", **self.settings}
        lines = "".join(f"{k} = {v}\n" for k, v in settings.items())
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write("\n# rselection standby settings\n" + lines)

    def _initdb(self) -> None:
        cmd = [
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            self.user,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-locale",
            "--no-sync",
            "--no-instructions",
        ]
        self._run_tool(cmd, "initdb")
        settings = {
            "listen_addresses": f"'{self.host}'",
            "port": str(self.port),
            "unix_socket_directories": "''",
            "max_connections": "200",
            "shared_buffers": "32MB",
            "fsync": "off",
            # on: a commit is written to the kernel before it is acknowledged, so
            # it survives a kill of the server (fsync=off only risks a machine
            # crash). Off, a kill lost the lease row written just before it.
            "synchronous_commit": "on",
            "full_page_writes": "off",
            "log_min_messages": "warning",
            "log_line_prefix": "'%m [%p] '",
            **self.settings,
        }
        lines = "".join(f"{k} = {v}\n" for k, v in settings.items())
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write("\n# rselection test settings\n" + lines)

    def _remove_stale_pidfile(self) -> None:
        """Drop a postmaster.pid left by a killed server whose pid is gone or a zombie."""
        pidfile = self.data_dir / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return
        if not _pid_alive(pid):
            pidfile.unlink(missing_ok=True)

    def _wait_ready(self) -> None:
        self._wait_answers(self.dsn, "postgres")


# --------------------------------------------------------------------------- Redis


def _redis_ping(host: str, port: int, timeout: float) -> bool:
    """PING over a raw socket, so no client library is needed."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class PrivateRedis(_ServerProcess):
    """A throwaway ``redis-server`` on 127.0.0.1 for tests that stop, restart or kill it.

    With ``appendonly=True`` (the default) every write is fsynced to an
    append-only file in the temporary directory, so ``restart()`` and even
    ``kill()`` followed by ``start()`` keep the data, like ``PrivatePostgres``.

    Parameters:
        port: TCP port; a free one is chosen when None.
        binary: path of ``redis-server``; looked up on ``PATH`` when None.
        start_timeout: bound in seconds for each start.
        appendonly: persist writes across restarts.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        port: int | None = None,
        binary: str | None = None,
        start_timeout: float = 15.0,
        appendonly: bool = True,
    ) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise ServerStartError("redis-server is not on PATH; install Redis to run these tests")
        self.binary = found
        self.port = port if port is not None else find_free_port(self.host)
        self.start_timeout = start_timeout
        self.appendonly = appendonly
        self._tmp = tempfile.mkdtemp(prefix="rselection-redis-")
        self.log_path = Path(self._tmp) / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer = weakref.finalize(self, _finalize_server, None, None, self._tmp)
        self._closed = False

    @property
    def url(self) -> str:
        """A ``redis://`` URL for database 0."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> PrivateRedis:
        """Start the server and wait until it answers PING (bounded by ``start_timeout``)."""
        if self._closed:
            raise RuntimeError("this PrivateRedis is closed; create a new one")
        if self.is_running():
            return self
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            self._tmp,
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
            "--daemonize",
            "no",
            "--logfile",
            str(self.log_path),
        ]
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, _finalize_server, self._proc, self._proc.pid, self._tmp
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"redis-server exited with code {self._proc.returncode}:\n"
                    f"{_tail(self.log_path)}"
                )
            if _redis_ping(self.host, self.port, timeout=1.0):
                return self
            time.sleep(0.02)
        self.kill()
        raise ServerStartError(
            f"redis-server did not answer within {self.start_timeout}s:\n{_tail(self.log_path)}"
        )

    def stop(self, mode: Literal["fast", "immediate"] = "fast", timeout: float = 15.0) -> None:
        """Stop the server: ``"fast"`` is SIGTERM (clean shutdown), ``"immediate"`` SIGKILL.

        Falls back to SIGKILL if a fast stop takes longer than ``timeout`` seconds.
        """
        if mode not in ("fast", "immediate"):
            raise ValueError(f"mode must be 'fast' or 'immediate', got {mode!r}")
        if mode == "immediate":
            self.kill()
        else:
            self._signal_and_wait(signal.SIGTERM, timeout)

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<PrivateRedis {self.url} {state}>"
