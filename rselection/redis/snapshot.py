"""Read a status snapshot of the Redis leases under a key prefix (``rselection status``).

Without names: every lease that ever had a term or has members (found with ``SCAN``);
with names, those and their shards (``NAME/<k>``). Each lease is read from its own keys,
its nodes from its heartbeats (:func:`~rselection.redis.membership.read_nodes`). Last
fires are not read: claims are one key each, with no index to walk.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

import redis

from ..admin import LeaseStatus, PendingHandover, StatusSnapshot
from ..members import NodeInfo
from ._conn import describe, unavailable
from ._scripts import READ
from .history import last_change
from .holder import parse_holder
from .keys import handover_key, lease_keys, lease_name_of, lease_name_patterns, retired_key
from .membership import read_nodes

__all__ = ["lease_names", "read_snapshot"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def lease_names(client: Any, key_prefix: str) -> list[str]:
    """The names of the leases under ``key_prefix``: those with a term or members, sorted.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster``.
        key_prefix: the leaders' ``key_prefix``.

    Raises:
        redis.RedisError: Redis failed.
    """
    names: set[str] = set()
    for pattern in lease_name_patterns(key_prefix):
        for key in client.scan_iter(match=pattern, count=1000):
            name = lease_name_of(_text(key), key_prefix)
            if name is not None:
                names.add(name)
    return sorted(names)


def _handover(client: Any, name: str, key_prefix: str, now: datetime) -> PendingHandover | None:
    """Lease ``name``'s pending handover request, as stored, or ``None``."""
    key = handover_key(name, key_prefix)
    request = client.get(key)
    request_ttl = int(client.pttl(key)) if request is not None else -2
    if request is None or request_ttl <= 0:
        return None
    try:
        doc = json.loads(_text(request))
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        return None
    left = request_ttl / 1000
    return PendingHandover(
        lease=name,
        term=int(doc["term"]) if str(doc.get("term", "")).isdigit() else None,
        node_id=doc.get("from"),
        to=doc.get("to") or None,
        until=datetime.fromtimestamp(now.timestamp() + left, UTC),
        expires_in=left,
    )


def _lease(client: Any, name: str, key_prefix: str) -> tuple[LeaseStatus, PendingHandover | None]:
    """One lease's holder, term and retirement, and its pending handover request."""
    key, term_key, _ = lease_keys(name, key_prefix)
    raw, pttl, now_ms = client.eval(READ, 1, key)
    holder, _doc = parse_holder(raw, pttl, now_ms)
    term = client.get(term_key)
    retired = client.get(retired_key(name, key_prefix))
    now = datetime.fromtimestamp(int(_text(now_ms)) / 1000, UTC)
    lease = LeaseStatus(
        last_change=last_change(client, name, key_prefix=key_prefix),
        name=name,
        holder=holder.node_id if holder else None,
        term=holder.term if holder else (int(_text(term)) if term is not None else None),
        acquired_at=holder.acquired_at if holder else None,
        expires_at=holder.expires_at if holder else None,
        expires_in=max(0, int(pttl)) / 1000 if holder else None,
        retired=holder is None
        and term is not None
        and retired is not None
        and _text(retired) == _text(term),
    )
    return lease, _handover(client, name, key_prefix, now)


def read_snapshot(
    client: Any, *, key_prefix: str, node_timeout: float, names: Collection[str] | None = None
) -> StatusSnapshot:
    """One snapshot of leases ``names`` (and their shards), or of every lease.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster``.
        key_prefix: the leaders' ``key_prefix``.
        node_timeout: a node is alive when seen within this many seconds.
        names: the leases asked for (with their shards ``NAME/<k>``); ``None``: all.

    Raises:
        BackendUnavailable: Redis cannot be reached or read.
    """
    try:
        seconds, micros = client.time()
        checked_at = datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)
        found = lease_names(client, key_prefix)
        if names is None:
            asked = found
        else:
            bases = set(names)
            asked = sorted(bases | {name for name in found if name.rpartition("/")[0] in bases})
        leases, handovers, nodes = [], [], []
        for name in asked:
            lease, request = _lease(client, name, key_prefix)
            members: list[NodeInfo] = read_nodes(
                client,
                name,
                key_prefix=key_prefix,
                node_timeout=node_timeout,
                lease_key=lease_keys(name, key_prefix)[0],
            )
            if lease.term is None and not members:
                continue  # never led, no members: no such lease
            leases.append(lease)
            nodes += members
            if request is not None:
                handovers.append(request)
    except redis.RedisError as exc:
        raise unavailable("read the leases", describe(client), exc) from exc
    return StatusSnapshot(
        checked_at=checked_at,
        leases=tuple(leases),
        handovers=tuple(handovers),
        nodes=tuple(nodes),
        fires=None,
    )
