"""Handover on request for Redis leases (what ``rselection resign --redis-url`` does).

:func:`request_handover` records a request for the current term in one script: the key
``<prefix>{<name>}:resign`` (same hash slot as the lease) gets the term, the holder and
the node asked for, with ``PX`` = the timeout, and a ``resign:<term>`` message goes out on
the lease's channel. The leader's keeper wakes on it, renews at once, and its renewal
script reports the request when it is for the term being renewed; the leader then steps
down through the normal release. Until another node acquired (the acquire script deletes
the request) or the key expired, the acquire script refuses the lease to the resigning
node and, when a node was named, to every node but that one. A request only narrows who
may acquire, so it cannot make two leaders.

Every node's keeper stays subscribed to ``<prefix>{<name>}:node:<node id>``:
:func:`live_nodes` lists those channels (``PUBSUB CHANNELS``), which is how the command
checks that ``--to`` names a connected node.
"""

from __future__ import annotations

import math
from typing import Any

import redis
from redis.cluster import RedisCluster

from ..errors import BackendUnavailable, ConfigError
from ..lease import LeaderInfo
from ._conn import check_client, describe, unavailable
from ._scripts import CANCEL_HANDOVER, READ, REQUEST_HANDOVER
from .lease import handover_key, lease_keys, parse_holder

__all__ = ["cancel_handover", "current_holder", "live_nodes", "request_handover"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Client:
    """A client for one call: the caller's, or one made from a URL and closed after."""

    def __init__(self, client_or_url: Any, owner: str) -> None:
        self.client, self.owned = check_client(client_or_url, owner)
        self.where = describe(self.client)

    def __enter__(self) -> Any:
        return self.client

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            self.client.close()


def request_handover(
    client_or_url: Any,
    name: str,
    *,
    to: str | None = None,
    timeout: float = 10.0,
    key_prefix: str = "rselection:",
) -> LeaderInfo | None:
    """Ask the leader of Redis lease ``name`` to hand over; return the holder asked.

    One script: records the request for the current term (``<prefix>{<name>}:resign``,
    expiring after ``timeout``) and publishes ``resign:<term>`` on the lease's channel,
    which wakes the leader. The leader sees the request in the renewal that follows,
    cancels and drains its tasks and releases; a follower takes over. Until the next
    acquisition or the end of ``timeout``, the lease is reserved: the old holder may not
    take it back, and with ``to`` only that node may take it. Returns ``None`` when
    nobody holds the lease. A request for a term that has ended is ignored.

    Args:
        client_or_url: a ``redis://`` URL, a ``redis.Redis`` or a ``RedisCluster``.
        name: the lease name.
        to: node id that should take over, or ``None`` for any other node.
        timeout: seconds the request (and the reservation for ``to``) stays valid.
        key_prefix: the leaders' ``key_prefix``.

    Raises:
        ConfigError: bad arguments, or the lease key holds something else.
        BackendUnavailable: Redis cannot be reached or refused the script.
    """
    if isinstance(timeout, bool) or not (
        isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout)
    ):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if to is not None and (not isinstance(to, str) or not to):
        raise ConfigError(f"to must be a node id (a non-empty string) or None, got {to!r}")
    key, _, channel = lease_keys(name, key_prefix)
    holder = _Client(client_or_url, "request_handover")
    with holder as client:
        try:
            reply = client.eval(
                REQUEST_HANDOVER,
                2,
                key,
                handover_key(name, key_prefix),
                to or "",
                max(1, round(timeout * 1000)),
                channel,
            )
        except redis.RedisError as exc:
            raise unavailable("record the handover request", holder.where, exc) from exc
    status = int(reply[0])
    if status == 0:
        return None
    if status < 0:
        raise ConfigError(
            f"key {key!r} holds a value that is not an rselection lease "
            f"({_text(reply[1])!r:.60}); check the lease name and key_prefix"
        )
    info, _ = parse_holder(reply[1], reply[2], reply[3])
    return info


def cancel_handover(
    client_or_url: Any, name: str, term: int, *, key_prefix: str = "rselection:"
) -> bool:
    """Withdraw a handover request made for ``term`` of lease ``name``; ``True`` if one was.

    Publishes ``cancelled:<term>`` so that nodes waiting on the reservation try again.

    Raises:
        BackendUnavailable: Redis cannot be reached or refused the script.
    """
    _, _, channel = lease_keys(name, key_prefix)
    holder = _Client(client_or_url, "cancel_handover")
    with holder as client:
        try:
            reply = client.eval(
                CANCEL_HANDOVER, 1, handover_key(name, key_prefix), str(term), channel
            )
        except redis.RedisError as exc:
            raise unavailable("withdraw the handover request", holder.where, exc) from exc
    return int(reply) == 1


def current_holder(
    client_or_url: Any, name: str, *, key_prefix: str = "rselection:"
) -> LeaderInfo | None:
    """The live holder of Redis lease ``name``, or ``None``.

    Raises:
        BackendUnavailable: Redis cannot be reached.
    """
    key = lease_keys(name, key_prefix)[0]
    holder = _Client(client_or_url, "current_holder")
    with holder as client:
        try:
            raw, pttl, now = client.eval(READ, 1, key)
        except redis.RedisError as exc:
            raise unavailable("read the lease holder", holder.where, exc) from exc
    return parse_holder(raw, pttl, now)[0]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def live_nodes(
    client_or_url: Any, name: str, *, key_prefix: str = "rselection:"
) -> list[str] | None:
    """The ids of the nodes whose keeper for lease ``name`` is connected, sorted.

    ``None`` when the server does not allow ``PUBSUB CHANNELS`` (an ACL without it):
    then nobody can tell. A node counts while its keeper's connection is open, also
    when its process is paused.

    Raises:
        BackendUnavailable: Redis cannot be reached.
    """
    key = lease_keys(name, key_prefix)[0]
    prefix = f"{key_prefix}{{{name}}}:node:"
    pattern = _glob_escape(prefix) + "*"
    holder = _Client(client_or_url, "live_nodes")
    with holder as client:
        try:
            if isinstance(client, RedisCluster):
                # Plain PUBSUB state is per cluster node; the keepers subscribe on the
                # master of the lease's slot.
                cluster: Any = client
                cluster.exists(key)
                node = cluster.get_node_from_key(key)
                reply = cluster.execute_command("PUBSUB", "CHANNELS", pattern, target_nodes=node)
            else:
                reply = client.execute_command("PUBSUB", "CHANNELS", pattern)
        except redis.ResponseError:
            return None
        except redis.RedisError as exc:
            raise unavailable("list the connected nodes", holder.where, exc) from exc
    if not isinstance(reply, list):
        raise BackendUnavailable(f"unexpected PUBSUB CHANNELS reply from {holder.where}")
    return sorted({_text(c)[len(prefix) :] for c in reply if _text(c).startswith(prefix)})
