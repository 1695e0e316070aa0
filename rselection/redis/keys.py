"""Where the Redis backend keeps things: the key prefix every key starts with (not public
API).

Every object of the backend takes ``key_prefix`` (``"rselection:"`` by default), so that
several applications can share one Redis; the leases' own keys are laid out in
:mod:`rselection.redis.lease`.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..validation import MAX_NAME

__all__ = ["DEFAULT_KEY_PREFIX", "check_key_prefix"]

DEFAULT_KEY_PREFIX = "rselection:"
"""The ``key_prefix`` of every Redis object unless told otherwise."""


def check_key_prefix(value: object) -> str:
    """Return ``value`` if it is a usable key prefix, else raise :class:`ConfigError`.

    A key prefix is a string of at most :data:`~rselection.validation.MAX_NAME`
    characters; it may be empty and is used verbatim (never trimmed).

    Args:
        value: the prefix to check.
    """
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise ConfigError(
            f"key_prefix must be a string of at most {MAX_NAME} characters, got {value!r:.60}"
        )
    return value
