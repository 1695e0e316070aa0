"""A Redis lease's value: who holds it, as the acquire script wrote it.

:func:`parse_holder` reads the value (never trusting it: any client may write the
key); :class:`Seen` is another holder as an attempt saw it, enough for a follower to
time its beats and check its connection (see :mod:`rselection.redis.lease_liveness`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..errors import ConfigError
from ..lease import LeaderInfo

__all__ = ["Seen", "is_client_id", "parse_holder", "text"]

logger = logging.getLogger(__name__)

#: A client id as Redis writes it (``CLIENT ID``): anything else in a lease value is not
#: checked (the server would refuse the whole ``CLIENT LIST ID``).
_CLIENT_ID = re.compile(r"[1-9][0-9]{0,18}")
#: A term as the acquire script writes it.
_WHOLE = re.compile(r"-?[0-9]+")
#: Fields every release of the acquire script wrote.
_OURS = frozenset({"token", "node", "term", "at"})


def text(value: Any) -> str:
    """``value`` (a reply, or anyone's bytes) as text; never raises."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def is_client_id(value: str) -> bool:
    """Whether ``value`` is a client id as Redis writes it (``CLIENT ID``)."""
    return _CLIENT_ID.fullmatch(value) is not None


@dataclass(frozen=True)
class Seen:
    """Another holder as the last attempt saw it: enough to probe its connection."""

    term: str
    client: str
    run: str
    fast: bool
    process: str  # the holder's process, whose beats tell it lives (see :mod:`.liveness`)
    secret: str  # signs those beats
    value: bytes  # the lease value: unchanged (renewals only extend it) while it holds

    @classmethod
    def of(cls, doc: dict[str, Any], raw: Any) -> Seen:
        """The holder of the lease value ``raw``, parsed as ``doc`` (see
        :func:`parse_holder`)."""
        process, _, secret = str(doc.get("beats", "")).partition(":")
        return cls(
            str(doc.get("term", "")),
            str(doc.get("client", "")),
            str(doc.get("run", "")),
            doc.get("fast") == "1",
            process,
            secret,
            raw if isinstance(raw, bytes) else str(raw).encode(),
        )


def parse_holder(raw: Any, pttl: Any, now_ms: Any) -> tuple[LeaderInfo | None, dict[str, Any]]:
    """Decode a lease value; ``(None, {})`` for no holder or a value we cannot read.

    Raises:
        ConfigError: the value was written by a node of an earlier rselection release
            whose term is not a whole number (such a node wrote a 16-digit term as
            ``"1.7961690294577e+15"``): every node of that release must be stopped.
    """
    value = text(raw) if raw is not None else ""
    if not value:
        return None, {}
    doc: Any = None
    try:
        doc = json.loads(value)
        now = int(text(now_ms))
        ttl_ms = max(0, int(pttl))
        info = LeaderInfo(
            str(doc["node"]),
            int(doc["term"]),
            _ms_to_utc(int(doc["at"])),
            _ms_to_utc(now + ttl_ms),
        )
    except (ValueError, KeyError, TypeError):
        if _earlier_release(doc):
            raise ConfigError(
                f"the lease holds term {doc['term']!r:.40} of node {str(doc['node'])!r:.80}, "
                "not a whole number: a node of an earlier rselection release is competing "
                "(it writes a term of 16 digits as 1.7961690294577e+15); stop every node "
                "of the earlier release before starting this one"
            ) from None
        logger.warning("lease value %.80r is not an rselection lease; ignoring it", value)
        return None, {}
    return info, doc


def _ms_to_utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _earlier_release(doc: Any) -> bool:
    """Whether a lease value that failed to parse has every field of an rselection lease
    and a term string that is not an integer: what the acquire script of an earlier
    release wrote for a term of 15 digits or more (Lua's ``tostring``)."""
    return (
        isinstance(doc, dict)
        and doc.keys() >= _OURS
        and isinstance(doc["term"], str)
        and not _WHOLE.fullmatch(doc["term"])
    )
