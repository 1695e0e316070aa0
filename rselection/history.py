"""Leadership history: one record per term, why it ended, and how many are kept.

Each backend writes the record of a term in the statements (Postgres) or scripts
(Redis) that acquire and release its lease, never on the renewal path: the acquisition
opens it, the release closes it with why the term ended, and a term nobody closed (its
holder crashed or lost its connection) is closed by the next acquisition. This module
holds what both share: the record, the reasons, the limit and how an engine's reason
for ending a term becomes the record's. See ``docs/explanation/how-it-works.md``
("Leadership history").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Final

from .errors import ConfigError

__all__ = [
    "END_REASONS",
    "HISTORY_LIMIT",
    "MAX_HISTORY_LIMIT",
    "OPERATOR",
    "TermEnding",
    "TermRecord",
    "check_history_limit",
    "end_reason_of",
]

HISTORY_LIMIT: Final = 1000
"""Terms kept per lease by default (``history_limit=``): older ones are trimmed by the
acquisition of a new term."""

MAX_HISTORY_LIMIT: Final = 1_000_000
"""The most terms a lease's history may keep (and a read may ask for)."""

OPERATOR: Final = "operator"
"""A record's ``by`` when an operator's command (``rselection resign``, ``forget``,
``drain``) ended the term."""

END_REASONS: Final = (
    "released",
    "handed_over",
    "stepped_down",
    "drained",
    "deadline",
    "session_lost",
    "expired",
    "retired",
)
"""Why a term ended: its holder stopped (``released``), handed it to ``handed_to``
(``handed_over``), stepped down or was asked to by ``rselection resign`` without
``--to`` (``stepped_down``), was drained (``drained``), ended it itself when its
renewals failed (``deadline``); or another node took over after the holder's session
died (``session_lost``) or after the lease expired (``expired``); or the lease was
forgotten (``retired``)."""

# How the engine's reasons for ending a term (those of the ``demoted`` signal) are
# recorded: a term whose lease was lost or failed ended by the node's own hand, as one
# whose renewals ran out does.
_ENGINE_REASONS: Final = {
    "stopped": "released",
    "handover": "handed_over",
    "step_down": "stepped_down",
    "drained": "drained",
    "deadline": "deadline",
    "lost": "deadline",
    "error": "deadline",
}


def end_reason_of(engine_reason: str) -> str:
    """The record's ``end_reason`` for the engine's reason for ending a term
    (``"stopped"``, ``"handover"``, ...); an unknown one is ``deadline``.

    The backend refines it with what only the lease knows: a release while a handover
    request reserves the lease for a node is ``handed_over`` to that node (unless the
    node was ``drained``), and a ``handed_over`` with nobody named is ``stepped_down``.
    """
    return _ENGINE_REASONS.get(engine_reason, "deadline")


def check_history_limit(value: object, what: str = "history_limit", *, least: int = 2) -> int:
    """Return ``value`` if it is a count of terms (an int from ``least`` to
    :data:`MAX_HISTORY_LIMIT`), else raise.

    A history keeps at least 2 terms (the current one and the one before, which the
    acquisition of the current one closed if its holder did not).

    Raises:
        ConfigError: not an int, or out of range (the message names ``what``).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not least <= value <= MAX_HISTORY_LIMIT
    ):
        raise ConfigError(
            f"{what} must be an int from {least} to {MAX_HISTORY_LIMIT:,}, got {value!r:.40}"
        )
    return value


class TermEnding:
    """Why a lease's current term ends, as its leader said (``term_ending``), kept until
    the release that records it: a lease holds one term at a time."""

    def __init__(self) -> None:
        self._said: tuple[int, str, str | None] | None = None

    def note(self, term: int, reason: str, by: str | None) -> None:
        """``term`` ends for ``reason`` (an ``end_reason``), ended by ``by``."""
        self._said = (term, reason, by)

    def of(self, term: int) -> tuple[str, str | None]:
        """Why ``term`` ends and who ended it; a release nobody explained is
        ``released``, by nobody."""
        said = self._said
        if said is None or said[0] != term:
            return "released", None
        return said[1], said[2]


@dataclass(frozen=True)
class TermRecord:
    """One term of a lease, as its leadership history keeps it.

    Attributes:
        name: the lease.
        term: the term's number.
        node_id: the node that held it.
        version: the node's version (``None``: it gave none).
        hostname: the host of the node's process.
        pid: the node's process id.
        began_at: when it was acquired (the server's clock).
        ended_at: when it ended (the server's clock); ``None`` while it runs. A term
            its holder did not end (a crash) is closed by the next acquisition, at that
            time.
        end_reason: one of :data:`END_REASONS`; ``None`` while it runs.
        handed_to: the node it was handed to (``handed_over``, or ``drained`` when
            the drained holder handed it on).
        by: ``"operator"`` when an operator's command ended it, else ``None``.
    """

    name: str
    term: int
    node_id: str
    version: str | None
    hostname: str | None
    pid: int | None
    began_at: datetime
    ended_at: datetime | None
    end_reason: str | None
    handed_to: str | None
    by: str | None

    @property
    def lasted(self) -> float | None:
        """Seconds from its beginning to its end; ``None`` while it runs."""
        return None if self.ended_at is None else (self.ended_at - self.began_at).total_seconds()

    def as_json(self) -> dict[str, Any]:
        """The record as JSON-ready values, times as RFC 3339 in UTC (``...Z``)."""
        item = asdict(self)
        for field in ("began_at", "ended_at"):
            value = item[field]
            item[field] = (
                None if value is None else value.astimezone(UTC).isoformat().replace("+00:00", "Z")
            )
        return item
