"""A private PgBouncer in front of the test Postgres, in session, transaction or statement mode.

``PgBouncer`` runs the ``pgbouncer`` binary (Debian package ``pgbouncer``) from a
temporary directory, listening on a free port on 127.0.0.1, with trust authentication
towards its clients. Every database name a client asks for is forwarded to the same
name on the upstream server, with the upstream user (and password, if the DSN has one).
PgBouncer refuses to run as root; as root, it runs as the same unprivileged user as the
private Postgres servers.

    with PgBouncer(server_dsn, pool_mode="transaction") as bouncer:
        psycopg.connect(bouncer.dsn("test"))
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from psycopg.conninfo import conninfo_to_dict

from tests.support.pg import (
    ServerStartError,
    _finalize_server,
    _run_as_kwargs,
    _ServerProcess,
    _tail,
    find_free_port,
)

__all__ = ["PgBouncer", "PoolMode", "pgbouncer_binary"]

PoolMode = Literal["session", "transaction", "statement"]

HOW_TO_PGBOUNCER = "apt-get install pgbouncer"


def pgbouncer_binary() -> str | None:
    """The ``pgbouncer`` executable: on ``PATH``, or where Debian installs it."""
    found = shutil.which("pgbouncer")
    if found is None and os.access("/usr/sbin/pgbouncer", os.X_OK):
        found = "/usr/sbin/pgbouncer"
    return found


def _quote(value: str) -> str:
    """A value for a PgBouncer ``[databases]`` entry (single quotes, doubled inside)."""
    return "'" + value.replace("'", "''") + "'"


class PgBouncer(_ServerProcess):
    """A throwaway PgBouncer on 127.0.0.1 in front of the Postgres at ``server_dsn``.

    Parameters:
        server_dsn: the upstream Postgres (host, port, user and password are used).
        pool_mode: ``"session"``, ``"transaction"`` or ``"statement"``.
        pool_size: ``default_pool_size``: server connections per database and user.
        settings: more ``[pgbouncer]`` settings, written verbatim (e.g.
            ``{"server_round_robin": "1"}``).
        start_timeout: bound in seconds for a start.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        server_dsn: str,
        *,
        pool_mode: PoolMode = "session",
        pool_size: int = 2,
        settings: Mapping[str, str] | None = None,
        start_timeout: float = 15.0,
    ) -> None:
        binary = pgbouncer_binary()
        if binary is None:
            raise ServerStartError(f"pgbouncer is not installed ({HOW_TO_PGBOUNCER})")
        self.binary = binary
        params = conninfo_to_dict(server_dsn)
        self.upstream = {
            "host": str(params.get("host") or params.get("hostaddr") or "127.0.0.1"),
            "port": str(params.get("port") or "5432"),
            "user": str(params.get("user") or "postgres"),
            "password": str(params.get("password") or ""),
        }
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.settings = dict(settings or {})
        self.start_timeout = start_timeout
        self.port = find_free_port(self.host)
        self._run_as = _run_as_kwargs()
        self._tmp = tempfile.mkdtemp(prefix="rselection-pgbouncer-")
        self.log_path = Path(self._tmp) / "pgbouncer.log"
        self.config_path = Path(self._tmp) / "pgbouncer.ini"
        if self._run_as:
            os.chown(self._tmp, self._run_as["user"], self._run_as["group"])
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer = weakref.finalize(self, _finalize_server, None, None, self._tmp)
        self._closed = False

    def dsn(self, dbname: str) -> str:
        """A libpq URI for database ``dbname`` through this PgBouncer."""
        return f"postgresql://{self.upstream['user']}@{self.host}:{self.port}/{dbname}"

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<PgBouncer {self.host}:{self.port} pool_mode={self.pool_mode} {state}>"

    # -- lifecycle

    def start(self) -> PgBouncer:
        """Write the configuration, start PgBouncer and wait until it forwards a query.

        Raises ``ServerStartError`` (with the end of its log) when it does not answer
        within ``start_timeout`` seconds.
        """
        if self._closed:
            raise RuntimeError("this PgBouncer is closed; create a new one")
        if self.is_running():
            return self
        for attempt in range(3):
            self._write_config()
            log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
            try:
                self._proc = subprocess.Popen(
                    [self.binary, str(self.config_path)],
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
            try:
                self._wait_ready()
                return self
            except ServerStartError:
                in_use = "Address already in use" in _tail(self.log_path)
                if not in_use or attempt == 2:
                    raise
                self.port = find_free_port(self.host)  # taken meanwhile: another port
        raise AssertionError("unreachable")

    def stop(self, mode: object = "immediate", timeout: float = 10.0) -> None:
        """Shut PgBouncer down (SIGTERM: clients are disconnected); SIGKILL after ``timeout``."""
        self._signal_and_wait(signal.SIGTERM, timeout)

    # -- internals

    def _write_config(self) -> None:
        up = self.upstream
        target = f"host={up['host']} port={up['port']} user={up['user']}"
        if up["password"]:
            target += f" password={_quote(up['password'])}"
        settings = {
            "listen_addr": self.host,
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(Path(self._tmp) / "users.txt"),
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.pool_size),
            "max_client_conn": "200",
            "pidfile": str(Path(self._tmp) / "pgbouncer.pid"),
            # psycopg sends none of these, other clients might
            "ignore_startup_parameters": "extra_float_digits",
            **self.settings,
        }
        lines = ["[databases]", f"* = {target}", "", "[pgbouncer]"]
        lines += [f"{key} = {value}" for key, value in settings.items()]
        self.config_path.write_text("\n".join(lines) + "\n")
        users = Path(self._tmp) / "users.txt"
        users.write_text(f'"{up["user"]}" ""\n')
        if self._run_as:
            for path in (self.config_path, users):
                os.chown(path, self._run_as["user"], self._run_as["group"])

    def _wait_ready(self) -> None:
        self._wait_answers(self.dsn("postgres"), "pgbouncer")

    def log_tail(self, lines: int = 30) -> str:
        """The end of PgBouncer's log (for failure messages)."""
        with contextlib.suppress(OSError):
            return _tail(self.log_path, lines)
        return "(no log)"
