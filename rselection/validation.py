"""Checks of user input shared by every backend: names, node ids and durations.

One rule each, so a name or a duration accepted by one class is accepted by all of
them, and refused with the same message everywhere. Nothing is trimmed: a name with
surrounding spaces is a different name, on Postgres and Redis alike.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
from datetime import timedelta

from .errors import ConfigError

__all__ = [
    "MAX_NAME",
    "MAX_TERM",
    "check_name",
    "check_node_id",
    "check_optional_seconds",
    "check_optional_term",
    "check_seconds",
    "check_term",
    "name_bytes",
    "new_node_id",
]

MAX_NAME = 1000
"""Longest name (lease name, node id, task name) any backend accepts, in bytes as a
notification carries it (see :func:`name_bytes`): 1,000 ASCII characters, 250 four-byte
ones.

Postgres refuses a ``NOTIFY`` payload of 8,000 bytes or more, and the largest lease
notification (a release) carries three names (the lease, its holder and the node the
lease is reserved for) and under 100 bytes of event, term and field names: at most
3,092 bytes. A limit in characters let 1,000 four-byte characters through, which no
notification could carry. (A claim key holds a lease name, a task name and an instant,
about 2,030 bytes, within :data:`~rselection.claiming.MAX_FIRE_KEY_BYTES`; only a lease
name full of ``%`` or ``/``, written as three bytes each there, can take it over.)
"""


def name_bytes(value: str) -> int:
    """The size of a name as a notification carries it: its UTF-8 bytes, with the
    characters JSON escapes counted escaped (``"``, ``\\`` and ``\b \f \n \r \t``
    count 2 bytes, other control characters 6).

    Args:
        value: the name (valid Unicode, as :func:`check_name` makes sure).
    """
    return len(json.dumps(value, ensure_ascii=False).encode()) - 2


MAX_TERM = 2**63 - 1
"""The largest fencing term (a Postgres ``bigint``, a Redis integer)."""


def check_term(value: object) -> int:
    """Return ``value`` if it is a fencing term, else raise :class:`ConfigError`: an
    ``int`` from 1 to :data:`MAX_TERM` (a ``bool`` is refused), as every class takes one
    (``ctx.term``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TERM:
        raise ConfigError(f"term must be an int from 1 to 2**63 - 1 (ctx.term), got {value!r:.40}")
    return value


def check_optional_term(value: object) -> int | None:
    """:func:`check_term`, where ``None`` says that no term applies."""
    return None if value is None else check_term(value)


def check_name(value: object, what: str = "name") -> str:
    """Return ``value`` if it is a usable name, else raise :class:`ConfigError`.

    A name is a string that is not blank, has at most :data:`MAX_NAME` bytes (as
    :func:`name_bytes` counts them: UTF-8, 1 to 4 bytes a character, escapes counted),
    no NUL character (Postgres text cannot hold one) and no lone surrogate (no server can
    store it as UTF-8).

    Args:
        value: the name to check.
        what: what the name names, for the message (``"lease name"``, ``"node_id"``).
    """
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise ConfigError(
            f"{what} must be a non-blank string without NUL of at most {MAX_NAME} bytes "
            f"as UTF-8, got {value!r:.60}"
        )
    try:
        value.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate: no server can store it
        raise ConfigError(f"{what} must be valid Unicode text, got {value!r:.60}") from exc
    size = name_bytes(value)
    if size > MAX_NAME:
        raise ConfigError(
            f"{what} must have at most {MAX_NAME} bytes as UTF-8, got {size} (a character "
            "takes 1 to 4 bytes; quotes, backslashes and control characters count as "
            f"notifications escape them, 2 or 6): {value!r:.60}..."
        )
    return value


def check_node_id(value: object) -> str:
    """Return ``value`` if it is a usable node id (see :func:`check_name`)."""
    return check_name(value, "node_id")


def new_node_id() -> str:
    """A node id unique per call, also behind NAT: ``"<host>-<pid>-<6 hex digits>"``."""
    host = socket.gethostname() or "host"
    return f"{host[:200]}-{os.getpid()}-{secrets.token_hex(3)}"


def check_seconds(
    value: object, what: str, *, minimum: float = 0.0, allow_zero: bool = False
) -> float:
    """Return a duration as float seconds, or raise :class:`ConfigError`.

    Args:
        value: seconds as an int or a float (not a bool), or a :class:`~datetime.timedelta`;
            finite.
        what: the parameter's name, for the message.
        minimum: the smallest positive value accepted (for example 0.001 where a server
            counts whole milliseconds).
        allow_zero: accept exactly 0 (for example a jitter or a grace that may be off).
    """
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number of seconds, got {value!r}")
    if value == 0 and allow_zero:
        return 0.0
    if value <= 0 or value < minimum:
        least = f"at least {minimum:g} s" if minimum > 0 else "positive"
        zero = " (or 0)" if allow_zero else ""
        raise ConfigError(f"{what} must be {least}{zero}, got {value!r}")
    return float(value)


def check_optional_seconds(
    value: object, what: str, *, minimum: float = 0.0, allow_zero: bool = False
) -> float | None:
    """Like :func:`check_seconds`, where ``None`` (returned as is) means off or default."""
    if value is None:
        return None
    return check_seconds(value, what, minimum=minimum, allow_zero=allow_zero)
