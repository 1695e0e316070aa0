"""The configuration of a :class:`~rselection.postgres.PostgresBroadcaster`, checked once.

The broadcaster, its writer, its listener and the sessions they open all read the same
:class:`Settings`; nothing changes it after construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...validation import check_seconds

__all__ = ["MAX_MESSAGE_LIMIT", "Settings"]

MAX_MESSAGE_LIMIT = 256 * 1024 * 1024
"""Largest ``max_message_bytes`` accepted (Postgres text holds at most 1 GB, and a whole
fetch batch is held in memory)."""


def _count(value: object, label: str, *, minimum: int, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int in range, else raise :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{label} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{label} must be at most {maximum}, got {value!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """What a broadcaster was configured with (see
    :class:`~rselection.postgres.PostgresBroadcaster` for each field).

    Raises:
        ConfigError: a duration that is not a positive finite number of seconds, or a
            limit out of range.
    """

    retention: float
    probe_interval: float
    io_timeout: float
    close_timeout: float
    max_message_bytes: int
    max_pending: int
    synchronous_commit: bool
    create_tables: bool

    def __post_init__(self) -> None:
        """Check and normalise every field (raises :class:`ConfigError`)."""
        for name in ("retention", "probe_interval", "io_timeout", "close_timeout"):
            object.__setattr__(self, name, check_seconds(getattr(self, name), name))
        _count(self.max_message_bytes, "max_message_bytes", minimum=1, maximum=MAX_MESSAGE_LIMIT)
        _count(self.max_pending, "max_pending", minimum=1)
        object.__setattr__(self, "synchronous_commit", bool(self.synchronous_commit))
        object.__setattr__(self, "create_tables", bool(self.create_tables))
