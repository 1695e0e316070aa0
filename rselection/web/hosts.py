"""Which hosts the console answers to: the ``Host`` header, checked against DNS rebinding.

A page of another site can have a browser send requests to the console under the site's
own name (``rebound.example`` made to resolve to ``127.0.0.1``) and read the answers as
its own pages. So the console answers only a request whose ``Host`` names it: a loopback
name (``127.0.0.1``, ``localhost``, ``[::1]``) on any port, the address the connection
came in on (ASGI ``server``: an IP address that no other site can claim), or a host it
was told (``allowed_hosts=``, ``rselection web --allow-host``); anything else is ``400``.
A told host matches on any port (``ops.example.com``) or on one (``ops.example.com:8443``);
``*`` matches every host, leaving the check to what is in front of the console.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ConfigError
from ..text import printable

__all__ = ["LOOPBACK", "AllowedHosts", "HostCheck", "split_host"]

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
"""The names of this machine the console always answers to, on any port."""


def split_host(value: str) -> tuple[str, str | None]:
    """A ``Host`` header's name and port: ``"[::1]:8780"`` -> ``("::1", "8780")``.

    The name is lower-cased, without a trailing dot and an IPv6 address's brackets; the
    port is ``None`` when the header has none.
    """
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, colon, port = value.rpartition(":")
        if not colon or ":" in name:  # no port, or an IPv6 address without brackets
            name, port = value, ""
    return _canonical(name), port or None


def _canonical(name: str) -> str:
    name = name.rstrip(".")
    try:
        return str(ipaddress.ip_address(name))  # one spelling of an IPv6 address
    except ValueError:
        return name


class AllowedHosts:
    """The hosts the console answers to (see the module's docstring).

    Args:
        told: more hosts: ``NAME`` (any port), ``NAME:PORT``, or ``*`` (every host).

    Raises:
        ConfigError: a host that is not a non-blank string.
    """

    def __init__(self, told: Iterable[str] = ()) -> None:
        if isinstance(told, str):
            raise ConfigError("allowed_hosts must be a list of hosts, not one string")
        self.any = False
        self._told: set[tuple[str, str | None]] = set()
        for host in told:
            if not isinstance(host, str) or not host.strip():
                raise ConfigError(f"allowed_hosts holds {host!r}: give host names or '*'")
            if host.strip() == "*":
                self.any = True
            else:
                self._told.add(split_host(host))

    def told(self, name: str, port: str | None) -> bool:
        """Whether ``name`` on ``port`` is one of the hosts it was told (``*`` aside)."""
        return (name, None) in self._told or (port is not None and (name, port) in self._told)

    def allows(self, host: str | None, server: Any = None) -> bool:
        """Whether the console answers a request with ``Host: host``.

        Args:
            host: the ``Host`` header (``None``: none was sent, as by an HTTP/1.0 client
                that no browser is).
            server: the ASGI scope's ``server``: the address the connection came in on.
        """
        if self.any or host is None:
            return True
        name, port = split_host(host)
        if name in LOOPBACK or self.told(name, port):
            return True
        return bool(server) and name == _canonical(str(server[0]).lower())


class HostCheck:
    """ASGI middleware: answers ``400`` to a request whose ``Host`` is not allowed.

    Args:
        app: the console's app.
        hosts: the hosts it answers to.
    """

    def __init__(self, app: ASGIApp, hosts: AllowedHosts) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse the request, or hand it to the app."""
        if scope["type"] == "http":
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            shown = None if host is None else host.decode("latin-1")
            if not self.hosts.allows(shown, scope.get("server")):
                message = (
                    f"this console does not answer to host {printable(shown or '')!r}: "
                    "to serve it under that name, start it with --allow-host "
                    "(create_app(allowed_hosts=...))"
                )
                response = PlainTextResponse(
                    message, status_code=400, headers={"x-content-type-options": "nosniff"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
