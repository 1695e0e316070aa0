"""``rselection web``: serve the operator's console (see :mod:`rselection.web`).

It reads the leases through the backend's admin API as the other subcommands do
(``--dsn`` or ``--redis-url``, and their table and key options) and serves the console
with uvicorn on ``--bind`` (loopback by default), answering only to loopback names, the
bound address and the ``--allow-host`` names. Without ``--token-file`` the console is
read-only; a non-loopback address is served only after a loud warning, since anyone who
reaches it sees the fleet (and, with a token sent over plain HTTP, could read it).
"""

from __future__ import annotations

import argparse
import ipaddress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailable, ConfigError
from ..redaction import redact
from .connections import (
    Unreachable,
    describe,
    postgres_admin,
    reason,
    redis_admin,
    resolve_dsn,
    wants_redis,
)
from .options import add_lease_options, node_timeout, subcommand
from .output import EXIT_OK, EXIT_UNREACHABLE, UsageError, say

if TYPE_CHECKING:
    from ..admin import LeaseAdmin

__all__ = ["DEFAULT_BIND", "add_parser", "parse_bind", "read_token", "run"]

DEFAULT_BIND = "127.0.0.1:8780"
"""Where the console listens unless ``--bind`` says otherwise."""


@subcommand("web", help="serve the operator's console (overview, timelines, nodes, tasks, actions)")
def add_parser(parser: argparse.ArgumentParser) -> None:
    """Serve the operator's console over the leases of --dsn (or --redis-url): an overview with
    alerts, each lease's timeline of terms, its nodes and tasks, sharded leases' grids and
    tasks' run histories. Read-only unless started with --token-file: then an operator who
    logs in with the token (or a script that sends it as a bearer token) can step leaders
    down, hand leases over, drain nodes and pause, resume or trigger tasks. Needs the web
    extra: pip install 'rselection[web]'."""
    add_lease_options(parser, redis_nodes=True)
    parser.add_argument("--claims-table", default="rselection_claims", help="fire claims table")
    parser.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="HOST:PORT",
        help=f"where to listen (default {DEFAULT_BIND}; [::1]:PORT for IPv6)",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding the operator token (surrounding whitespace stripped); "
        "without it the console is read-only",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a host name the console answers to besides loopback and the --bind "
        "address (a proxy's name, ops.example.com or ops.example.com:8443; repeat it "
        "for more); other Host headers are refused (DNS rebinding)",
    )
    parser.set_defaults(run=run)


def parse_bind(value: str) -> tuple[str, int]:
    """``"127.0.0.1:8780"`` -> ``("127.0.0.1", 8780)``; ``"[::1]:8780"`` -> ``("::1", 8780)``.

    Raises:
        UsageError: not ``HOST:PORT`` with a port from 0 to 65535.
    """
    host, _, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--bind needs HOST:PORT (such as {DEFAULT_BIND}), got {value!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: str) -> str:
    """The operator token in the file ``path``, its surrounding whitespace (and a byte
    order mark) stripped.

    Raises:
        UsageError: the file cannot be read, holds nothing but whitespace, or holds a
            token that is not printable ASCII.
    """
    from ..web.auth import check_token

    try:
        token = Path(path).read_text(encoding="utf-8-sig").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --token-file {path!r}: {exc.__class__.__name__}") from None
    if not token:
        raise UsageError(
            f"--token-file {path!r} is empty: write the operator token in it, or leave "
            "--token-file out for a read-only console"
        )
    try:
        return check_token(token) or token
    except ConfigError as exc:
        raise UsageError(f"--token-file {path!r}: {exc}") from None


def _admin(args: argparse.Namespace) -> LeaseAdmin:
    """The admin API the console reads through.

    Raises:
        UsageError: a bad connection string or option.
        Unreachable: the server does not answer.
    """
    if wants_redis(args):
        return redis_admin(args, node_timeout(args))
    dsn = resolve_dsn(args)
    admin = postgres_admin(dsn, args)
    try:
        found = admin.lease_table_exists()
    except BackendUnavailable as exc:
        admin.close()
        raise Unreachable(f"cannot reach {describe(dsn)}: {redact(reason(exc), dsn)}") from exc
    if not found:
        say(
            f"rselection web: warning: no lease table {args.table!r} on {describe(dsn)} "
            "yet (run `rselection migrate`, or pass the right --table)",
            err=True,
        )
    return admin


def run(args: argparse.Namespace) -> int:
    """Serve the console until interrupted; return the exit code."""
    host, port = parse_bind(args.bind)
    try:
        import uvicorn

        from ..web import create_app
        from ..web.app import build_app  # noqa: F401 (Starlette and Jinja2 are there)
    except ImportError as exc:
        raise UsageError(
            f"the console needs the web extra ({exc.name} is missing): "
            "pip install 'rselection[web]'"
        ) from None
    token = None if args.token_file is None else read_token(args.token_file)
    try:
        admin = _admin(args)
    except Unreachable as exc:
        say(str(exc), err=True)
        return EXIT_UNREACHABLE
    # The bound address is one of the console's hosts (a wildcard is no host's name).
    hosts = [*args.allow_host, *([] if host in ("0.0.0.0", "::") else [host])]
    try:
        app = create_app(admin=admin, token=token, allowed_hosts=hosts)
    except ConfigError as exc:
        admin.close()
        raise UsageError(str(exc)) from None
    if not is_loopback(host):
        say(
            f"rselection web: WARNING: listening on {host}, not on loopback: anyone who "
            "reaches this address sees every lease, node and task"
            + (
                "; the operator token travels in clear unless a proxy with TLS is in front"
                if token
                else ""
            ),
            err=True,
        )
    mode = "operator token required to act" if token else "read-only (no --token-file)"
    shown = f"[{host}]" if ":" in host else host
    say(f"rselection console on http://{shown}:{port}/ over {admin.where}: {mode}")
    config: Any = uvicorn.Config(app, host=host, port=port, log_level="warning")
    try:
        uvicorn.Server(config).run()
    finally:
        admin.close()
    return EXIT_OK
