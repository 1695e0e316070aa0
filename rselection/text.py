"""Text for people: :func:`printable` writes as escapes what a terminal could act on;
:func:`iso` writes a time as RFC 3339 in UTC.

Lease names, node ids and hostnames are anyone's text; a message that quotes one (an
error, a line of the command line) must never set a window title, hide text or move
the cursor of the terminal it ends up on.
"""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["iso", "printable"]


def iso(value: datetime | None) -> str | None:
    """``value`` as RFC 3339 in UTC with a ``Z`` (``None`` stays ``None``)."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` with every character a terminal could act on written as an escape.

    Escaped as Python writes them in a ``repr`` (``\\x1b``, ``\\x9b``, ``\\u202e``):
    control characters (``ESC``, ``CR``, tab, newline, ...), C1 controls, format
    characters such as bidirectional overrides and zero-width joiners, and separators
    other than the space (what :meth:`str.isprintable` refuses). A backslash is kept as
    it is.

    Args:
        text: what to show.
        lines: keep newlines (``text`` is several lines of our own).
    """
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or (lines and c == "\n") else c.encode("unicode_escape").decode()
        for c in text
    )
