"""The console's URLs: names as path segments, there and back, whatever they hold.

A lease name may hold a ``/`` (a shard's lease is ``NAME/<k>``) and any printable
character, and so may node ids and task names; each is one path segment, percent-encoded
whole (``a/b`` is ``a%2Fb``). Servers decode ``%2F`` into ``/`` in the path they route
on, so the console splits the request's raw path (ASGI ``raw_path``) into segments
before decoding each: ``/leases/a%2Fb/tasks/t`` is lease ``a/b``, task ``t``. Without a
raw path (a server that gives none) the decoded path is split, and names with a ``/``
cannot be told apart there. A name may hold any character, a newline too: the routes
that take names match whatever the path holds (:data:`NAMES`).

A browser folds a ``.`` or ``..`` segment away (``/leases/..`` is ``/``), and ``%2E`` with
it (URLs decode it as a dot), so the names ``.`` and ``..`` are written ``!.`` and
``!..``: ``quote`` escapes a ``!`` in every name (``%21``), so a segment ``!.`` or ``!..``
can only be one of these two names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote

from starlette.convertors import Convertor, register_url_convertor

__all__ = ["NAMES", "href", "segments"]


class _Names(Convertor[str]):
    """The rest of a path, whatever it holds: Starlette's ``path`` stops at a newline."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


NAMES = "rselection_names"
"""The convertor of the routes that take names: ``/leases/{rest:rselection_names}``."""

register_url_convertor(NAMES, _Names())

_DOTS = {".": "!.", "..": "!.."}
_UNDOTS = {written: name for name, written in _DOTS.items()}


def _written(name: str) -> str:
    return _DOTS.get(name) or quote(name, safe="")


def _read(segment: str) -> str:
    return _UNDOTS.get(segment) or unquote(segment)


def segments(scope: Mapping[str, Any]) -> list[str]:
    """The decoded segments of the request's path below the app's mount point.

    ``/leases/a%2Fb/tasks/t`` -> ``["leases", "a/b", "tasks", "t"]``.
    """
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    # The path the app routes on: below its mount point (Starlette's Mount keeps the
    # whole path in "path" and the mount point in "root_path").
    route = path[len(root) :] if root and path.startswith(root) else path
    raw = scope.get("raw_path")
    if isinstance(raw, bytes):
        parts = raw.decode("latin-1").split("/")
        # The raw path's tail that decodes to the route path: the mount point's own
        # segments (spelled however the client spelled them) are left out.
        for start in range(1, len(parts)):
            tail = parts[start:]
            if unquote("/" + "/".join(tail)) == route:
                return [_read(part) for part in tail if part]
    return [_UNDOTS.get(part, part) for part in route.split("/") if part]


def href(root_path: str, *parts: str) -> str:
    """The URL path of ``parts`` below the app's mount point ``root_path`` (ASGI; ``""``
    at the top), each part one segment, percent-encoded whole (``.`` and ``..`` written
    ``!.`` and ``!..``)."""
    base = quote(root_path.rstrip("/"), safe="/")
    return base + "/" + "/".join(_written(part) for part in parts)
