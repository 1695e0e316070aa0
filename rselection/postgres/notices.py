"""What the keeper reads from a notification on a lease channel or the ring channel.

Any role that can connect may NOTIFY on any channel, and the channel names are public,
so a payload may hold anything. The functions here read one without ever raising (no
``RecursionError`` from deep JSON, no ``ValueError`` from digits of another script):
what is not a well-formed notice of a kind rselection sends is ``None``, counted in
:data:`dropped` and reported in a log line at most once a minute. What a well-formed
notice says is still only a claim: the keeper decides whom to believe (see
:mod:`.notice_gate`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .. import forks
from ..lease import LeaderInfo
from ..validation import MAX_TERM
from ._lease_sql import utc

__all__ = [
    "LeaseNotice",
    "RingNotice",
    "dropped",
    "lease_notice",
    "parse_lease_notice",
    "pid_of",
    "ring_notice",
]

logger = logging.getLogger(__name__)

#: The longest payload read: NOTIFY allows 8,000 bytes; rselection's own notices of
#: names of at most 1,000 bytes each stay far below.
_MAX_PAYLOAD = 8000

#: Digits of a backend pid (a 32-bit int) and of a term (a bigint).
_PID_DIGITS = 10
_MAX_PID = 2**31 - 1

#: Seconds between two reports of dropped notices.
_REPORT_EVERY = 60.0

_KINDS = frozenset({"acquired", "released", "resign", "reopened", "drain", "tasks"})


@dataclass(frozen=True)
class RingNotice:
    """``up:<pid>`` (a keeper session joined the ring) or ``down:<pid>`` (one ended)."""

    kind: str
    pid: int


@dataclass(frozen=True)
class LeaseNotice:
    """A notification on a lease's channel, as its sender states it.

    ``holder`` is the new holder an ``acquired`` notice names, ``None`` when it does not
    say enough; ``holder_pid`` the keeper session it names; ``to`` the node a
    ``released`` notice reserved the lease for. A ``drain`` notice says that the drains
    of the lease (of node ``node_id``) changed: the nodes read them again. A ``tasks``
    notice says that its task controls changed: its leader reads them again.
    """

    event: str
    node_id: str | None = None
    term: int | None = None
    holder_pid: int | None = None
    holder: LeaderInfo | None = None
    to: str | None = None


class _Dropped:
    """Counts the notifications read as nothing, and reports them: at once the first
    time, then at most once a minute with how many came since."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self._unreported = 0
        self._report_at = 0.0

    def reset_after_fork(self) -> None:
        """In a forked child: a parent's thread may have held the lock at the fork."""
        self._lock = threading.Lock()

    def add(self, channel: str, payload: str, sender: int, *, count: int = 1) -> None:
        """Count ``count`` notifications dropped, the last ``payload`` on ``channel``
        from backend ``sender``; log when due."""
        with self._lock:
            self.count += count
            self._unreported += count
            now = time.monotonic()
            if now < self._report_at:
                return
            count, self._unreported = self._unreported, 0
            self._report_at = now + _REPORT_EVERY
        logger.warning(
            "keeper: dropped %d notification(s) that rselection does not send (the last "
            "on channel %s from backend pid %d: %s); any role that can connect may "
            "NOTIFY, look that pid up in pg_stat_activity. Counted in "
            "rselection_notifications_dropped_total, reported at most once a minute",
            count,
            ascii(channel[:80]),
            sender,
            _shown(payload),
        )


dropped = _Dropped()
"""The process's count of dropped notifications (:attr:`_Dropped.count`)."""
forks.register(dropped)


def _shown(payload: str) -> str:
    head = ascii(payload[:40])
    return head if len(payload) <= 40 else f"{head}... ({len(payload)} characters)"


def pid_of(text: str) -> int | None:
    """``text`` as a backend pid: 1 to 10 ASCII digits, at most ``2**31 - 1``."""
    if not 0 < len(text) <= _PID_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    pid = int(text)
    return pid if 0 < pid <= _MAX_PID else None


def ring_notice(channel: str, payload: str, sender: int) -> RingNotice | None:
    """The ring notice ``payload`` holds, or ``None`` (counted as dropped)."""
    kind, _, pid = payload.partition(":")
    value = pid_of(pid)
    if kind in ("up", "down") and value is not None:
        return RingNotice(kind, value)
    dropped.add(channel, payload, sender)
    return None


def lease_notice(channel: str, payload: str, sender: int) -> LeaseNotice | None:
    """The lease notice ``payload`` holds, or ``None`` (counted as dropped)."""
    notice = parse_lease_notice(payload)
    if notice is None:
        dropped.add(channel, payload, sender)
    return notice


def parse_lease_notice(payload: str) -> LeaseNotice | None:
    """The lease notice ``payload`` holds, or ``None``; never raises, counts nothing.

    Args:
        payload: a notification's payload on a lease channel.
    """
    if len(payload) > _MAX_PAYLOAD or not payload.startswith("{"):
        return None
    try:
        event = json.loads(payload)
    except (ValueError, RecursionError):  # deep nesting raises RecursionError
        return None
    if not isinstance(event, dict) or event.get("event") not in _KINDS:
        return None
    kind: str = event["event"]
    node, to = _text(event.get("node_id")), _text(event.get("to"))
    term, pid = _number(event.get("term"), MAX_TERM), _number(event.get("holder_pid"), _MAX_PID)
    holder = _holder(node, term, event) if kind == "acquired" else None
    return LeaseNotice(kind, node, term, pid, holder, to)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _number(value: Any, largest: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 < value <= largest else None


def _holder(node: str | None, term: int | None, event: dict[str, Any]) -> LeaderInfo | None:
    """The holder an ``acquired`` notice names, or ``None`` when it does not say enough
    (a notification of an older release of the library)."""
    acquired_at, expires_at = _text(event.get("acquired_at")), _text(event.get("expires_at"))
    if node is None or term is None or acquired_at is None or expires_at is None:
        return None
    try:
        return LeaderInfo(
            node,
            term,
            utc(datetime.fromisoformat(acquired_at)),
            utc(datetime.fromisoformat(expires_at)),
        )
    except (ValueError, OverflowError):  # a year 9999 with an offset overflows in UTC
        return None
