"""``rselection status --redis-url``: the Redis leases, holders, handover requests and nodes.

The same snapshot as over Postgres (:func:`rselection.commands.status.read_status`), read
from the leases' keys: without names, every lease under the key prefix that ever had a
term or has members (found with ``SCAN``); with names, those leases. Nodes come from the
leases' heartbeats (:mod:`rselection.redis.membership`). The shards of each sharded name
shown (its leases ``NAME/<k>``, see ``RedisShardedLeader``) are summed up as over
Postgres (:func:`rselection.commands.status.sharded_names`). Last fires are not read from
Redis (claims are one key each, with no index to walk).
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from ..redaction import redact
from .connections import Unreachable, first_line
from .output import iso
from .status import sharded_names

__all__ = ["NOT_RECORDED_REDIS", "lease_names", "read_redis_status"]

NOT_RECORDED_REDIS = (
    "last fires, next fires, failures and persistent tasks are not read from Redis "
    "(see TaskHandler.health() on the leader)"
)
"""What ``status --redis-url`` cannot show, said in its output."""

_SUFFIXES = (":term", ":nodes")  # keys every lease that ever led, or has members, has


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def lease_names(client: Any, key_prefix: str) -> list[str]:
    """The names of the leases under ``key_prefix``: those with a term or members, sorted.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster``.
        key_prefix: the leaders' ``key_prefix``.
    """
    names: set[str] = set()
    head = key_prefix + "{"
    for suffix in _SUFFIXES:
        pattern = _glob_escape(head) + "*}" + suffix
        for key in client.scan_iter(match=pattern, count=1000):
            text = _text(key)
            if text.startswith(head) and text.endswith("}" + suffix):
                names.add(text[len(head) : -len("}" + suffix)])
    return sorted(names)


def _shard_leases(client: Any, key_prefix: str, names: list[str], named: list[str]) -> list[str]:
    """The leases ``NAME/...`` of the names among ``names`` (the shards of a sharded
    ``NAME``, which :func:`~.status.sharded_names` picks): among ``names`` themselves,
    or, with names given, found with ``SCAN``."""
    found = lease_names(client, key_prefix) if named else names
    bases = set(names)
    return [name for name in found if name.rpartition("/")[0] in bases]


def _lease(client: Any, name: str, key_prefix: str) -> dict[str, Any]:
    """One lease's holder, term, retirement and pending handover request, as stored."""
    from ..redis._scripts import READ
    from ..redis.lease import handover_key, lease_keys, parse_holder
    from .forget import retired_key

    key, term_key, _ = lease_keys(name, key_prefix)
    raw, pttl, now = client.eval(READ, 1, key)
    holder, _doc = parse_holder(raw, pttl, now)
    term = client.get(term_key)
    retired = client.get(retired_key(name, key_prefix))
    request = client.get(handover_key(name, key_prefix))
    request_ttl = client.pttl(handover_key(name, key_prefix)) if request is not None else -2
    now_at = datetime.fromtimestamp(int(_text(now)) / 1000, UTC)
    handover = None
    if request is not None and int(request_ttl) > 0:
        try:
            doc = json.loads(_text(request))
        except ValueError:
            doc = {}
        if isinstance(doc, dict):
            left = int(request_ttl) / 1000
            handover = {
                "lease": name,
                "term": int(doc["term"]) if str(doc.get("term", "")).isdigit() else None,
                "node_id": doc.get("from"),
                "to": doc.get("to") or None,
                "until": iso(datetime.fromtimestamp(now_at.timestamp() + left, UTC)),
                "expires_in": round(left, 3),
            }
    term_now = int(_text(term)) if term is not None else None
    return {
        "lease": {
            "name": name,
            "holder": holder.node_id if holder else None,
            "term": holder.term if holder else term_now,
            "acquired_at": iso(holder.acquired_at) if holder else None,
            "expires_at": iso(holder.expires_at) if holder else None,
            "expires_in": round(max(0, int(pttl)) / 1000, 3) if holder else None,
            "live": holder is not None,
            "retired": holder is None
            and term is not None
            and retired is not None
            and _text(retired) == _text(term),
        },
        "handover": handover,
        "now": now_at,
    }


def read_redis_status(client: Any, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One snapshot of the Redis leases, handover requests and nodes asked for.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster`` for ``url``.
        url: the ``--redis-url`` given (for messages, never with its password).
        args: the parsed ``status`` command line (``names``, ``all``, ``key_prefix``,
            ``node_timeout``).

    Raises:
        Unreachable: Redis cannot be reached or read.
    """
    import redis

    from ..errors import BackendUnavailable
    from ..redis._conn import describe
    from ..redis.lease import lease_keys
    from ..redis.membership import read_nodes

    prefix = args.key_prefix
    named: list[str] = list(dict.fromkeys(args.names))
    try:
        seconds, micros = client.time()
        checked_at = datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)
        names = named or lease_names(client, prefix)
        found = {name: _lease(client, name, prefix) for name in names}
        members = {
            name: read_nodes(
                client,
                name,
                key_prefix=prefix,
                node_timeout=args.node_timeout,
                lease_key=lease_keys(name, prefix)[0],
            )
            for name in names
        }
        shard_leases = _shard_leases(client, prefix, names, named)
        found.update(
            (name, _lease(client, name, prefix)) for name in shard_leases if name not in found
        )
    except (redis.RedisError, BackendUnavailable) as exc:
        raise Unreachable(
            f"cannot read the leases from Redis {describe(client)}: {redact(first_line(exc), url)}"
        ) from exc
    leases, handovers, hidden, judged, unknown = [], [], [], [], []
    for name in names:
        entry = found[name]
        lease = entry["lease"]
        if named and lease["term"] is None and not members[name]:
            unknown.append(name)  # never led, no members: no such lease
            continue
        if lease["retired"] and not named and not args.all:
            hidden.append(name)
            continue
        leases.append(lease)
        if named or not lease["retired"]:
            judged.append(lease)
        if entry["handover"] is not None:
            handovers.append(entry["handover"])
    shown = {lease["name"] for lease in leases}
    nodes = []
    for name in names:
        if name not in shown:
            continue
        for node in members[name]:
            seen_ago = max(0.0, (found[name]["now"] - node.last_seen).total_seconds())
            nodes.append(
                {
                    "lease": name,
                    "node_id": node.node_id,
                    "hostname": node.hostname,
                    "pid": node.pid,
                    "client_addr": node.client_addr,
                    "started_at": iso(node.started_at),
                    "last_seen": iso(node.last_seen),
                    "seen_ago": round(seen_ago, 3),
                    "alive": node.alive,
                    "is_leader": node.is_leader,
                }
            )
    hidden_set = set(hidden)

    def selected(lease: str) -> bool:
        return lease in named if named else lease not in hidden_set

    rows = [
        (name, found[name]["lease"]["holder"], None, None, None, found[name]["lease"]["expires_in"])
        for name in sorted(set(names) | set(shard_leases))
    ]
    return {
        "database": f"Redis {describe(client)}, key prefix {prefix!r}",
        "checked_at": iso(checked_at),
        "names": named or None,
        "leases": leases,
        "unknown": unknown,
        "hidden": hidden,
        "headless": [lease["name"] for lease in judged if not lease["live"]] + unknown,
        "handovers": handovers,
        "nodes": nodes,
        "tasks": None,
        "shards": sharded_names(rows, shown, selected),
        "not_recorded": NOT_RECORDED_REDIS,
    }
