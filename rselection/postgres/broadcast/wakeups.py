"""What a NOTIFY on an outbox table's channel tells a listener: that it may fetch.

Anyone who can connect may NOTIFY on a broadcaster's channel, so a NOTIFY is a wake-up,
never data; its payload (the last id a publish committed) only lets a listener skip a
fetch that could find nothing new. :func:`notified_id` reads a payload without ever
raising; :class:`IgnoredPayloads` counts the others and logs them at most once a
minute. See ``docs/explanation/broadcaster.md`` ("What a NOTIFY carries, and what a
listener trusts").
"""

from __future__ import annotations

import logging
import time

__all__ = ["MAX_ID", "IgnoredPayloads", "notified_id", "shown"]

logger = logging.getLogger(__name__)

MAX_ID = 2**63 - 1
"""The largest outbox id (a ``bigint``)."""

#: Digits of MAX_ID: a longer payload is no id, and is never converted.
_MAX_DIGITS = len(str(MAX_ID))

#: Seconds between two reports of ignored payloads.
_REPORT_EVERY = 60.0

#: Characters of a payload shown in a report (escaped: it may hold anything).
_SHOWN = 40


def notified_id(payload: str) -> int | None:
    """The outbox id ``payload`` names, or ``None`` when it is not one.

    An id is 1 to 19 ASCII digits of at most :data:`MAX_ID` (no sign, no space, no
    other script's digits, which ``int()`` would read). Never raises, and converts
    nothing longer than an id.
    """
    if not 0 < len(payload) <= _MAX_DIGITS or not (payload.isascii() and payload.isdigit()):
        return None
    value = int(payload)
    return value if value <= MAX_ID else None


def shown(payload: str) -> str:
    """``payload`` for a log line: its first characters, every one that is not printable
    ASCII escaped (a terminal shows no escape sequence from it), and its length."""
    head = ascii(payload[:_SHOWN])
    return head if len(payload) <= _SHOWN else f"{head}... ({len(payload)} characters)"


class IgnoredPayloads:
    """Counts the NOTIFY payloads on a table's channel that are not ids, and reports
    them: at once the first time, then at most once every minute, with how many came
    since.

    Args:
        table: the outbox table, for the log line.
        where: the server, for the log line.
    """

    def __init__(self, table: str, where: str) -> None:
        """Nothing counted yet."""
        self._table = table
        self._where = where
        self.count = 0
        """Payloads ignored since the broadcaster was created."""
        self._unreported = 0
        self._report_at = 0.0  # monotonic seconds; 0: report the next one at once

    def add(self, payload: str, pid: int) -> None:
        """Count one payload that is not an id, sent by backend ``pid``; log when due."""
        self.count += 1
        self._unreported += 1
        now = time.monotonic()
        if now < self._report_at:
            return
        if self._report_at == 0.0:
            logger.warning(
                "broadcast listener of table %r on %s ignored a NOTIFY on the table's "
                "channel whose payload is not an outbox id (%s, sent by backend pid %d): "
                "no broadcaster sends that, and any role that can connect may NOTIFY; "
                "look that pid up in pg_stat_activity. Such payloads are counted in "
                "stats().ignored_notifies and reported at most once a minute",
                self._table,
                self._where,
                shown(payload),
                pid,
            )
        else:
            logger.warning(
                "broadcast listener of table %r on %s ignored %d more NOTIFY payload(s) "
                "that are not outbox ids (the last %s, sent by backend pid %d)",
                self._table,
                self._where,
                self._unreported,
                shown(payload),
                pid,
            )
        self._unreported = 0
        self._report_at = now + _REPORT_EVERY
