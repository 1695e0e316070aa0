"""The JSON text of what a user stores or sends (a checkpoint state, a broadcast
message): :func:`strict_json`, compact and refused with advice when JSON has no form
for it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .errors import ConfigError

__all__ = ["strict_json"]


def strict_json(
    value: Any,
    subject: str,
    *,
    type_error: Callable[[str], Exception] = TypeError,
    value_error: Callable[[str], Exception] = ConfigError,
    ensure_ascii: bool = False,
) -> str:
    """``value`` as compact JSON text, NaN and infinities refused.

    Args:
        value: what to encode.
        subject: what fails, for messages (``"checkpoint state for 'k' cannot be
            stored"``); the message goes on with ``" as JSON: <why>"``.
        type_error: makes the error for a value of a type JSON cannot encode.
        value_error: makes the error for NaN, an infinity, or a circular or too deeply
            nested structure.
        ensure_ascii: escape every non-ASCII character (as :func:`json.dumps` does).
    """
    try:
        return json.dumps(value, allow_nan=False, ensure_ascii=ensure_ascii, separators=(",", ":"))
    except TypeError as exc:
        raise type_error(
            f"{subject} as JSON: {exc}; use dict (str keys), list, str, int, float, bool "
            "and None, and convert other values (datetimes, sets, objects) first"
        ) from exc
    except (ValueError, RecursionError) as exc:
        raise value_error(
            f"{subject} as JSON: {exc} (NaN and infinities, circular or too deeply "
            "nested structures are refused)"
        ) from exc
