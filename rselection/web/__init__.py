"""The operator's console: ``rselection web``, or an ASGI app to mount in yours.

:func:`create_app` returns a Starlette app that shows a fleet's leases (overview and
alerts, each lease's timeline of terms, its nodes and tasks, a sharded lease's grid, a
task's run history) and, with an operator token, lets an operator step a leader down,
hand a lease over, drain and undrain nodes and pause, resume or trigger tasks. It reads
and acts through the backend's admin API (:class:`~rselection.postgres.PostgresAdmin`,
:class:`~rselection.redis.RedisAdmin`). Extra ``web``: ``pip install 'rselection[web]'``.
See the docs' "Console" how-to for mounting it in FastAPI or Django.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from ..admin import LeaseAdmin

__all__ = ["INSTALL_HINT", "create_app"]

INSTALL_HINT = "pip install 'rselection[web]'"
"""What installs the console's dependencies."""


def create_app(
    *,
    conninfo: Any = None,
    client: Any = None,
    token: str | None = None,
    admin: LeaseAdmin | None = None,
    allowed_hosts: Iterable[str] | None = None,
) -> Starlette:
    """The console as an ASGI app (Starlette): mount it, or serve it with uvicorn.

    Give exactly one of ``conninfo``, ``client`` and ``admin``.

    Args:
        conninfo: the Postgres leases' database, as the leaders take it (a connection
            string, a ``psycopg.Connection`` or a pool), with the default table names.
        client: the Redis leases' server (a redis-py client or a URL), with the default
            key prefix.
        token: the operator token; ``None`` (the default) makes the console read-only:
            it shows no action forms and refuses every action. Surrounding whitespace
            is stripped.
        admin: an admin API you made (a ``PostgresAdmin`` of other tables, a
            ``RedisAdmin`` of another key prefix); the console never closes it.
        allowed_hosts: more hosts it answers to, besides this machine's loopback names
            (``127.0.0.1``, ``localhost``, ``[::1]``, any port) and the address a request
            came in on: ``"ops.example.com"`` (any port), ``"ops.example.com:8443"``, or
            ``"*"`` for any (leaving the ``Host`` check to what is in front of it).
            A request for another host is answered ``400`` (DNS rebinding).

    Raises:
        ConfigError: not exactly one of ``conninfo``, ``client`` and ``admin``; a blank
            token; an allowed host that is not a non-blank string.
        ImportError: the ``web`` extra is not installed (the message says what to
            install).
    """
    given = [x is not None for x in (conninfo, client, admin)]
    if sum(given) != 1:
        raise ConfigError(
            "create_app needs exactly one of conninfo= (Postgres), client= (Redis) and "
            "admin= (an admin API you made)"
        )
    try:
        from .app import build_app
    except ImportError as exc:
        raise ImportError(
            f"the console needs Starlette and Jinja2 ({exc.name} is missing): {INSTALL_HINT}"
        ) from exc
    from .auth import check_token
    from .hosts import AllowedHosts

    token = check_token(token)
    hosts = AllowedHosts(allowed_hosts or ())
    owned = admin is None
    made: LeaseAdmin
    if admin is not None:
        made = admin
    elif conninfo is not None:
        from ..postgres import PostgresAdmin

        made = PostgresAdmin(conninfo)
    else:
        from ..redis import RedisAdmin

        made = RedisAdmin(client)
    shown = conninfo if isinstance(conninfo, str) else client if isinstance(client, str) else ""
    return build_app(made, token=token, owned=owned, conninfo=shown, allowed_hosts=hosts)
