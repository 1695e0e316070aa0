"""Durable task state fenced by term: snapshots, keys and the encoding of states.

A checkpoint store (:class:`~rselection.abc.CheckpointStore`) keeps snapshots (JSON
documents under keys) whose saves are fenced: ``save(key, state, term=T, name=lease)``
commits only while term ``T`` still holds the lease. This module holds the values the
stores exchange (:class:`Snapshot`, :data:`Key`) and how states are encoded, the same
for :class:`~rselection.postgres.PostgresCheckpointStore` and
:class:`~rselection.MemoryCheckpointStore`. See ``docs/how-to/checkpoints.md``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

# The store role and its ability moved to one module; their names stay importable here.
from .errors import ConfigError
from .json_text import strict_json

__all__ = [
    "DEFAULT_MAX_STATE_BYTES",
    "FORMAT_VERSION",
    "Key",
    "Snapshot",
    "check_key",
    "decode_state",
    "encode_state",
    "key_of",
]

FORMAT_VERSION = 1
"""Envelope format of stored snapshots that this release writes and understands."""

DEFAULT_MAX_STATE_BYTES = 64 * 2**20
"""Largest encoded state a store accepts by default (64 MiB)."""

# A \u0000 escape in JSON text (an even number of backslashes before it is text).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

Key = str | tuple[str, ...]
"""A checkpoint key: a string, or a tuple of strings such as ``("owner", "repo", "main")``.

A one-element tuple is the same key as its string.
"""


@dataclass(frozen=True)
class Snapshot:
    """One stored state of a key, as loaded or just saved.

    Attributes:
        key: the key (a ``str`` for one-part keys, else a tuple of strings).
        state: the decoded JSON state (dicts, lists, str, int, float, bool, None).
        version: 1 for the first save of the key, +1 on every save or delete after.
        term: the fencing term the save was made under (``save(..., term=T)`` and
            ``ctx.checkpoint.save``; a store's own per-key leases record their term
            too), ``None`` for an unfenced save.
        updated_at: the store's time of the save (aware, UTC).
        format_version: the envelope format the state was stored with.
    """

    key: Key
    state: Any
    version: int
    term: int | None
    updated_at: datetime
    format_version: int = FORMAT_VERSION


def check_key(key: object) -> list[str]:
    """The parts of a checkpoint key, checked; raise :class:`ConfigError` if unusable.

    Args:
        key: a non-empty string, or a non-empty tuple of non-empty strings, without NUL.
    """
    parts: Any = (key,) if isinstance(key, str) else key
    if not isinstance(parts, tuple) or not parts or not all(isinstance(p, str) for p in parts):
        raise ConfigError(
            f"checkpoint key must be a non-empty str or a non-empty tuple of str, got {key!r:.80}"
        )
    for part in parts:
        if not part:
            raise ConfigError(f"checkpoint key {key!r:.80} has an empty part")
        if "\x00" in part:
            raise ConfigError(f"checkpoint key {key!r:.80} contains a NUL character")
    return list(parts)


def key_of(parts: list[str]) -> Key:
    """The key made of ``parts``: a ``str`` for one part, else a tuple."""
    return parts[0] if len(parts) == 1 else tuple(parts)


def encode_state(key: Key, state: Any, max_bytes: int) -> str:
    """``state`` as compact JSON text, refused as every store refuses it.

    Args:
        key: the checkpoint key, for messages.
        state: the value to store.
        max_bytes: the largest encoded size accepted (UTF-8 bytes).

    Raises:
        TypeError: ``state`` holds a value JSON cannot encode.
        ConfigError: NaN or an infinity, a circular or too deeply nested structure, a
            lone surrogate, a NUL character (Postgres ``jsonb`` cannot hold one, so no
            store accepts it), or more than ``max_bytes``.
    """
    text = strict_json(state, f"checkpoint state for {key!r:.80} cannot be stored")
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"checkpoint state for {key!r:.80} holds a string that is not valid "
            f"Unicode (a lone surrogate): {exc}"
        ) from exc
    if _NUL_ESCAPE.search(text):
        raise ConfigError(
            f"checkpoint state for {key!r:.80} contains a NUL character (\\u0000), which "
            "Postgres jsonb cannot store"
        )
    if size > max_bytes:
        raise ConfigError(
            f"checkpoint state for {key!r:.80} is {size} bytes as JSON, more than "
            f"max_state_bytes={max_bytes}: store less, or raise the limit "
            "(Postgres jsonb holds at most 255 MB)"
        )
    return text


def decode_state(text: str) -> Any:
    """The state stored as JSON ``text``, as Postgres ``jsonb`` gives it back.

    ``jsonb`` keeps a number as ``numeric`` and an object's keys in its own order, so a
    state does not always come back as it was saved: a float whose JSON text has no
    fractional digits (``1e+16``, ``1e300``) comes back as an ``int``, ``-0.0`` as
    ``0.0``, and dict keys sorted shorter first, then by their UTF-8 bytes. Both stores
    that ship return states so (tuples come back as lists already through JSON).

    Args:
        text: JSON text, as :func:`encode_state` makes it.
    """
    return json.loads(text, parse_float=_jsonb_number, object_pairs_hook=_jsonb_object)


def _jsonb_number(text: str) -> int | float:
    """A JSON number with a fraction or exponent, as ``numeric`` prints it back."""
    exponent = Decimal(text).as_tuple().exponent
    if isinstance(exponent, int) and exponent >= 0:  # no digits after the point
        return int(Decimal(text))
    return float(text) + 0.0  # numeric has no negative zero


def _jsonb_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object with its keys in ``jsonb`` order (the last of equal keys wins)."""
    merged = dict(pairs)
    return {key: merged[key] for key in sorted(merged, key=_jsonb_key)}


def _jsonb_key(key: str) -> tuple[int, bytes]:
    raw = key.encode()
    return len(raw), raw
