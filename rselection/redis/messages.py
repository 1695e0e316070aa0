"""What the Redis backend's channels carry, parsed without ever raising.

Any client allowed to ``PUBLISH`` can send anything on these channels, so a message is
a wake-up, never data, unless its sender is proven. A lease's events channel carries
``acquired:<term>``, ``released:<term>``, ``cancelled:<term>``, ``resign:<term>``,
``drain:0`` (the lease's drained nodes changed: each node reads its own state again)
and ``tasks:0`` (its task controls changed: its leader reads them again)
(:func:`event_kind`); the liveness channel carries signed, numbered beats
(:func:`sign_beat`, :func:`beat_sender`, :func:`read_beat`), each taken once. See
``docs/explanation/redis.md`` ("How the lease works", fast crash failover).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_MESSAGE",
    "Beat",
    "Dropped",
    "beat_sender",
    "event_kind",
    "read_beat",
    "sign_beat",
    "unsigned_beat",
]

#: Longest message either channel carries, bytes; anything longer is dropped unread.
MAX_MESSAGE = 128

logger = logging.getLogger("rselection.redis.lease")

# Seconds between two log lines about dropped messages (each is counted).
_DROPPED_LOG_EVERY = 60.0

_EVENT = re.compile(rb"(acquired|released|cancelled|resign|drain|tasks):[0-9]{1,19}")
_BEAT = re.compile(rb"beat:([0-9a-f]{16}):([0-9]{1,9}):([0-9]{1,19}):([0-9]{1,19}):([0-9a-f]{32})")
# What the holders of earlier releases published, per lease: never taken, not counted.
_OLD_BEAT = re.compile(rb"alive:[0-9]{1,19}:[0-9]{1,9}(:[0-9]{1,19}:[0-9a-f]{32})?")


@dataclass(frozen=True)
class Beat:
    """A liveness beat whose signature checked out.

    Args:
        process: the beating process's id.
        interval: the process's shortest ``liveness_interval`` among the leases it
            holds, seconds.
        epoch: how many keeper connections of its held leases it saw fail.
        seq: the beat's number (0, 1, ...).
    """

    process: str
    interval: float
    epoch: int
    seq: int


class Dropped:
    """Messages dropped unread (no rselection node sends them): counted, and logged at
    most once a minute (anyone allowed to PUBLISH may send thousands a second).

    Args:
        who: what dropped them, for the log (``"lease 'x'"``, ``"liveness on host"``).
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.count = 0
        """Messages dropped so far."""
        self._logged_at = -math.inf

    def drop(self, channel: object, payload: Any) -> None:
        """Count one message dropped on ``channel``; log it unless one was lately."""
        self.count += 1
        now = time.monotonic()
        if now < self._logged_at + _DROPPED_LOG_EVERY:
            return
        self._logged_at = now
        name = channel.decode("utf-8", "replace") if isinstance(channel, bytes) else channel
        logger.warning(
            "%s: dropped a message on %s that no rselection node sends (%.40r; %d so far): "
            "a client allowed to PUBLISH on the channel sent it; it changes nothing "
            "(restrict PUBLISH on it, see the Redis how-to)",
            self.who,
            name,
            payload,
            self.count,
        )


def _payload(message: object) -> bytes | None:
    if isinstance(message, str):
        message = message.encode("utf-8", "replace")
    if not isinstance(message, bytes) or len(message) > MAX_MESSAGE:
        return None
    return message


def event_kind(message: object) -> str | None:
    """``"acquired"``, ``"released"``, ``"cancelled"``, ``"resign"``, ``"drain"`` or
    ``"tasks"`` for a well-formed message of the events channel, else ``None`` (never
    raises).

    Args:
        message: the payload as read (``bytes``, or ``str`` from a decoding client).
    """
    payload = _payload(message)
    match = _EVENT.fullmatch(payload) if payload is not None else None
    return match.group(1).decode("ascii") if match else None


def _mac(secret: str, signed: bytes) -> str:
    return hmac.new(secret.encode("utf-8"), signed, hashlib.sha256).hexdigest()[:32]


def sign_beat(secret: str, process: str, interval_ms: int, epoch: int, seq: int) -> str:
    """Beat ``seq`` of ``process``, signed with its secret.

    Args:
        secret: the process's secret (in the values of the leases it holds).
        process: the process's id (16 hex digits).
        interval_ms: its shortest ``liveness_interval``, milliseconds.
        epoch: how many keeper connections of its held leases it saw fail.
        seq: the beat's number.
    """
    signed = f"beat:{process}:{interval_ms}:{epoch}:{seq}"
    return f"{signed}:{_mac(secret, signed.encode('ascii'))}"


def beat_sender(message: object) -> str | None:
    """The process a message shaped as a beat names, whoever signed it; else ``None``
    (never raises).

    Args:
        message: the payload as read.
    """
    payload = _payload(message)
    match = _BEAT.fullmatch(payload) if payload is not None else None
    return match.group(1).decode("ascii") if match else None


def read_beat(message: object, secret: str) -> Beat | None:
    """The beat a message carries when it is signed with ``secret``, else ``None`` (a
    forgery, a beat of another process, or anything else; never raises).

    Args:
        message: the payload as read.
        secret: the secret of the process the follower times (from a lease value).
    """
    payload = _payload(message)
    if payload is None or not secret:
        return None
    match = _BEAT.fullmatch(payload)
    if match is None:
        return None
    signed, mac = payload[: match.start(5) - 1], match.group(5).decode("ascii")
    if not hmac.compare_digest(_mac(secret, signed), mac):
        return None
    return Beat(
        match.group(1).decode("ascii"),
        int(match.group(2)) / 1000,
        int(match.group(3)),
        int(match.group(4)),
    )


def unsigned_beat(message: object) -> bool:
    """Whether a message is a per-lease beat of an earlier release
    (``alive:<term>:<interval ms>``, signed or not): never taken, and not counted as
    dropped (never raises).

    Args:
        message: the payload as read.
    """
    payload = _payload(message)
    return payload is not None and _OLD_BEAT.fullmatch(payload) is not None
