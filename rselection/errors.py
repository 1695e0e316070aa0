"""Exceptions raised by rselection; every one derives from :class:`RSelectionError`."""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "LeadershipLost",
    "RSelectionError",
    "StaleLeaderError",
]


class RSelectionError(Exception):
    """Root of every error rselection raises."""


class ConfigError(RSelectionError, ValueError):
    """Bad input at construction: the message says what is wrong and how to fix it."""


class LeadershipLost(RSelectionError):
    """Raised by :meth:`TaskContext.check` once the term that runs the task has ended."""


class StaleLeaderError(RSelectionError):
    """A fenced write was refused because its term no longer holds the lease."""


class BackendUnavailable(RSelectionError):
    """The lease server (Postgres or Redis) cannot be reached or answered with an error."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none): what a
    log line or an error of ours quotes of a driver's error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
