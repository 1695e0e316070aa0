"""What a Redis lease's channels carry, parsed without ever raising.

Any client allowed to ``PUBLISH`` can send anything on a lease's channels, so a message
is a wake-up, never data, unless its sender is proven; and parsing one never raises.

* The events channel (``<prefix>{<name>}:events``) carries ``acquired:<term>``,
  ``released:<term>``, ``cancelled:<term>`` and ``resign:<term>``. :func:`event_kind`
  accepts exactly these (a term of at most 19 ASCII digits); the keeper only wakes up on
  them (rate-limited, see :mod:`rselection.redis.lease`) and reads the lease itself.
* The liveness channel (``<prefix>{<name>}:alive``) carries the holder's beats,
  ``alive:<term>:<interval ms>:<seq>:<mac>``: ``seq`` counts the term's beats from 0
  and ``mac`` is an HMAC-SHA256 (first 128 bits, hex) of the rest keyed by the holder's
  random token, which is stored in the lease value only (a client that cannot read the
  lease key cannot sign a beat). :func:`sign_beat` and :func:`read_beat` make and check
  them; a follower also takes a beat only if its ``seq`` is above every one it took for
  the term (:class:`rselection.redis.lease.RedisLease` keeps that), so a beat heard
  once is never taken again.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

__all__ = [
    "MAX_MESSAGE",
    "Beat",
    "beat_term",
    "event_kind",
    "read_beat",
    "sign_beat",
    "unsigned_beat",
]

#: Longest message either channel carries, bytes; anything longer is dropped unread.
MAX_MESSAGE = 128

_EVENT = re.compile(rb"(acquired|released|cancelled|resign):[0-9]{1,19}")
_BEAT = re.compile(rb"alive:([0-9]{1,19}):([0-9]{1,9}):([0-9]{1,19}):([0-9a-f]{32})")
_UNSIGNED_BEAT = re.compile(rb"alive:[0-9]{1,19}:[0-9]{1,9}")


@dataclass(frozen=True)
class Beat:
    """A liveness beat whose signature checked out.

    Args:
        term: the holder's term.
        interval: the holder's ``liveness_interval``, seconds.
        seq: the beat's number in its term (0, 1, ...).
    """

    term: int
    interval: float
    seq: int


def _payload(message: object) -> bytes | None:
    if isinstance(message, str):
        message = message.encode("utf-8", "replace")
    if not isinstance(message, bytes) or len(message) > MAX_MESSAGE:
        return None
    return message


def event_kind(message: object) -> str | None:
    """``"acquired"``, ``"released"``, ``"cancelled"`` or ``"resign"`` for a well-formed
    message of the events channel, else ``None`` (never raises).

    Args:
        message: the payload as read (``bytes``, or ``str`` from a decoding client).
    """
    payload = _payload(message)
    match = _EVENT.fullmatch(payload) if payload is not None else None
    return match.group(1).decode("ascii") if match else None


def _mac(token: str, signed: bytes) -> str:
    return hmac.new(token.encode("utf-8"), signed, hashlib.sha256).hexdigest()[:32]


def sign_beat(token: str, term: int, interval_ms: int, seq: int) -> str:
    """The beat ``seq`` of ``term``, signed with the holder's token.

    Args:
        token: the holder's token (in the lease value, random per acquisition).
        term: the held term.
        interval_ms: the holder's ``liveness_interval``, milliseconds.
        seq: the beat's number in the term.
    """
    signed = f"alive:{term}:{interval_ms}:{seq}"
    return f"{signed}:{_mac(token, signed.encode('ascii'))}"


def read_beat(message: object, token: str) -> Beat | None:
    """The beat a message carries when it is signed with ``token``, else ``None`` (a
    beat of another holder, a forgery, an older release's unsigned beat, or anything
    else; never raises).

    Args:
        message: the payload as read.
        token: the token of the holder the follower times (from the lease value).
    """
    payload = _payload(message)
    if payload is None or not token:
        return None
    match = _BEAT.fullmatch(payload)
    if match is None:
        return None
    signed, mac = payload[: match.start(4) - 1], match.group(4).decode("ascii")
    if not hmac.compare_digest(_mac(token, signed), mac):
        return None
    return Beat(int(match.group(1)), int(match.group(2)) / 1000, int(match.group(3)))


def beat_term(message: object) -> int | None:
    """The term of a message shaped as a signed beat, whoever signed it; else ``None``
    (never raises).

    Args:
        message: the payload as read.
    """
    payload = _payload(message)
    match = _BEAT.fullmatch(payload) if payload is not None else None
    return int(match.group(1)) if match else None


def unsigned_beat(message: object) -> bool:
    """Whether a message is a beat of an older release (``alive:<term>:<interval ms>``,
    unsigned): never taken, and not counted as dropped (never raises).

    Args:
        message: the payload as read.
    """
    payload = _payload(message)
    return payload is not None and _UNSIGNED_BEAT.fullmatch(payload) is not None
