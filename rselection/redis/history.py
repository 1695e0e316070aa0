"""Read a Redis lease's leadership history: its stream ``<prefix>{<name>}:history``.

The acquire, release and retire scripts (:mod:`rselection.redis._scripts`) append two
entries per term, ``began`` (node, version, host, pid) and ``ended`` (reason, the node
it was handed to, who ended it), with the server's time; the acquisition caps the
stream at two entries per term kept. This module folds the entries back into
:class:`~rselection.history.TermRecord` rows for ``rselection history``, ``status`` and
the admin API.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from ..history import TermRecord
from .keys import history_key

__all__ = ["last_change", "read_history"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _at(fields: dict[str, str]) -> datetime:
    return datetime.fromtimestamp(int(fields["at"]) / 1000, UTC)


def _fields(raw: Any) -> dict[str, str] | None:
    """An entry's fields as text, or ``None`` when they are not UTF-8."""
    try:
        return {_text(k): _text(v) for k, v in raw.items()}
    except (AttributeError, UnicodeDecodeError):
        return None


def _end(
    fields: dict[str, str] | None,
) -> tuple[datetime | None, str | None, str | None, str | None]:
    """An end entry's time, reason, node handed to and ``by``; all ``None`` without one
    (or for one whose time does not parse: the term shows as running)."""
    if fields is None:
        return None, None, None, None
    try:
        at = _at(fields)
    except (KeyError, ValueError, OverflowError, OSError):
        return None, None, None, None
    return at, fields.get("reason") or None, fields.get("to") or None, fields.get("by") or None


def fold(name: str, entries: Sequence[Any], limit: int) -> list[TermRecord]:
    """The terms of a lease's stream ``entries`` (as ``XREVRANGE`` returns them, newest
    first), newest first, at most ``limit``; an end whose beginning was trimmed is
    left out, and so is an entry that does not parse."""
    ends: dict[str, dict[str, str]] = {}
    records: list[TermRecord] = []
    for _id, raw in entries:
        fields = _fields(raw)
        term = "" if fields is None else fields.get("term", "")
        if fields is None or not term.isdigit():
            continue
        if fields.get("kind") == "ended":
            ends.setdefault(term, fields)
            continue
        if fields.get("kind") != "began" or len(records) >= limit:
            continue
        ended_at, reason, handed_to, by = _end(ends.get(term))
        try:
            records.append(
                TermRecord(
                    name=name,
                    term=int(term),
                    node_id=fields["node"],
                    version=fields.get("version") or None,
                    hostname=fields.get("host") or None,
                    pid=int(fields["pid"]) if fields.get("pid", "").isdigit() else None,
                    began_at=_at(fields),
                    ended_at=ended_at,
                    end_reason=reason,
                    handed_to=handed_to,
                    by=by,
                )
            )
        except (KeyError, ValueError, OverflowError, OSError):
            continue
    return records


def read_history(client: Any, name: str, *, key_prefix: str, limit: int) -> list[TermRecord]:
    """The last ``limit`` terms of lease ``name``, newest first.

    Raises:
        redis.RedisError: Redis failed.
    """
    # Two entries a term, and the newest term's end may follow its beginning's pair.
    entries = client.xrevrange(history_key(name, key_prefix), count=2 * limit + 1)
    return fold(name, entries, limit)


def last_change(client: Any, name: str, *, key_prefix: str) -> TermRecord | None:
    """The newest ended term of lease ``name`` (the last change of holder), or ``None``.

    Raises:
        redis.RedisError: Redis failed.
    """
    # The newest term's beginning, then the pair of the one before (at most 4 entries).
    entries = client.xrevrange(history_key(name, key_prefix), count=4)
    return next((r for r in fold(name, entries, 2) if r.ended_at is not None), None)
