"""Handover on request for Redis leases (what ``rselection resign --redis-url`` does).

:func:`request_handover` records a request for the current term in one script (the
``:resign`` key, in the lease's hash slot) and publishes it on the lease's channel; the
leader's renewal reports it and the leader steps down through the normal release. A
request only narrows who may acquire. :func:`live_nodes` lists the nodes' presence
channels. See ``docs/explanation/redis.md`` ("Handover on request").
"""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import RedisCluster

from ..closeable import Closeable
from ..errors import BackendUnavailable, ConfigError
from ..lease import LeaderInfo
from ..validation import check_name, check_node_id, check_seconds, check_term
from ._conn import check_client, describe, unavailable
from ._scripts import CANCEL_HANDOVER, READ, REOPEN_HANDOVER, REQUEST_HANDOVER
from .holder import parse_holder
from .keys import DEFAULT_KEY_PREFIX, check_key_prefix, handover_key, lease_keys, node_channel

__all__ = [
    "cancel_handover",
    "current_holder",
    "live_nodes",
    "reopen_handovers",
    "request_handover",
    "request_handovers",
]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _OneCall(Closeable):
    """A client for one call: the caller's, or one made from a URL and closed after."""

    def __init__(self, client: Any, owner: str) -> None:
        self.client, self.owned = check_client(client, owner)
        self.where = describe(self.client)

    def close(self) -> None:
        """Close the client if it was made from a URL."""
        if self.owned:
            self.client.close()


def _lease(name: object, key_prefix: object) -> tuple[str, str]:
    """The checked lease name and key prefix of a call."""
    return check_name(name, "lease name"), check_key_prefix(key_prefix)


def request_handover(
    client: Any,
    name: str,
    *,
    to: str | None = None,
    valid_for: float = 10.0,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    term: int | None = None,
) -> LeaderInfo | None:
    """Ask the leader of Redis lease ``name`` to hand over; return the holder asked.

    One script: records the request for the current term (``<prefix>{<name>}:resign``,
    expiring after ``valid_for``) and publishes ``resign:<term>`` on the lease's channel,
    which wakes the leader. The leader sees the request in the renewal that follows,
    cancels and drains its tasks and releases; a follower takes over. Until the next
    acquisition or the end of ``valid_for``, the lease is reserved: the old holder may not
    take it back, and with ``to`` only that node may take it. Returns ``None`` when
    nobody holds the lease. A request for a term that has ended is ignored.

    Args:
        client: a ``redis.Redis``, a ``RedisCluster`` or a ``redis://`` URL (a client
            made from a URL is closed before the call returns).
        name: the lease name.
        to: node id that should take over, or ``None`` for any other node.
        valid_for: seconds the request (and the reservation for ``to``) stays valid.
        key_prefix: the leaders' ``key_prefix``.
        term: ask only this term (``None`` returned when another term holds the lease);
            ``None``: whichever term holds it.

    Raises:
        ConfigError: bad arguments, or the lease key holds something else.
        BackendUnavailable: Redis cannot be reached or refused the script.
    """
    name, key_prefix = _lease(name, key_prefix)
    asked_term = "" if term is None else str(check_term(term))
    valid_for = check_seconds(valid_for, "valid_for", minimum=0.001)
    if to is not None:
        to = check_node_id(to)
    key, _, channel = lease_keys(name, key_prefix)
    with _OneCall(client, "request_handover") as call:
        try:
            reply = call.client.eval(
                REQUEST_HANDOVER,
                2,
                key,
                handover_key(name, key_prefix),
                to or "",
                max(1, round(valid_for * 1000)),
                channel,
                "",
                asked_term,
            )
        except redis.RedisError as exc:
            raise unavailable("record the handover request", call.where, exc) from exc
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
    client: Any, name: str, term: int, *, key_prefix: str = DEFAULT_KEY_PREFIX
) -> bool:
    """Withdraw a handover request made for ``term`` of lease ``name``; ``True`` if one was.

    Publishes ``cancelled:<term>`` so that nodes waiting on the reservation try again.

    Args:
        client: a ``redis.Redis``, a ``RedisCluster`` or a ``redis://`` URL.
        name: the lease name.
        term: the term the request was made for (the ``term`` of
            :func:`request_handover`'s answer).
        key_prefix: the leaders' ``key_prefix``.

    Raises:
        ConfigError: bad arguments.
        BackendUnavailable: Redis cannot be reached or refused the script.
    """
    name, key_prefix = _lease(name, key_prefix)
    check_term(term)
    _, _, channel = lease_keys(name, key_prefix)
    with _OneCall(client, "cancel_handover") as call:
        try:
            reply = call.client.eval(
                CANCEL_HANDOVER, 1, handover_key(name, key_prefix), str(term), channel
            )
        except redis.RedisError as exc:
            raise unavailable("withdraw the handover request", call.where, exc) from exc
    return int(reply) == 1


def current_holder(
    client: Any, name: str, *, key_prefix: str = DEFAULT_KEY_PREFIX
) -> LeaderInfo | None:
    """The live holder of Redis lease ``name``, or ``None``.

    Args:
        client: a ``redis.Redis``, a ``RedisCluster`` or a ``redis://`` URL.
        name: the lease name.
        key_prefix: the leaders' ``key_prefix``.

    Raises:
        ConfigError: bad arguments.
        BackendUnavailable: Redis cannot be reached.
    """
    name, key_prefix = _lease(name, key_prefix)
    key = lease_keys(name, key_prefix)[0]
    with _OneCall(client, "current_holder") as call:
        try:
            raw, pttl, now = call.client.eval(READ, 1, key)
        except redis.RedisError as exc:
            raise unavailable("read the lease holder", call.where, exc) from exc
    return parse_holder(raw, pttl, now)[0]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def live_nodes(client: Any, name: str, *, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str] | None:
    """The ids of the nodes whose keeper for lease ``name`` is connected, sorted.

    ``None`` when the server does not allow ``PUBSUB CHANNELS`` (an ACL without it):
    then nobody can tell. A node counts while its keeper's connection is open, also
    when its process is paused. Arguments and errors as for :func:`current_holder`.
    """
    name, key_prefix = _lease(name, key_prefix)
    key = lease_keys(name, key_prefix)[0]
    prefix = node_channel(name, "", key_prefix)
    pattern = _glob_escape(prefix) + "*"
    with _OneCall(client, "live_nodes") as call:
        try:
            if isinstance(call.client, RedisCluster):
                # Plain PUBSUB state is per cluster node; the keepers subscribe on the
                # master of the lease's slot.
                cluster: Any = call.client
                cluster.exists(key)
                node = cluster.get_node_from_key(key)
                reply = cluster.execute_command("PUBSUB", "CHANNELS", pattern, target_nodes=node)
            else:
                reply = call.client.execute_command("PUBSUB", "CHANNELS", pattern)
        except redis.ResponseError:
            return None
        except redis.RedisError as exc:
            raise unavailable("list the connected nodes", call.where, exc) from exc
    if not isinstance(reply, list):
        raise BackendUnavailable(f"unexpected PUBSUB CHANNELS reply from {call.where}")
    return sorted({_text(c)[len(prefix) :] for c in reply if _text(c).startswith(prefix)})


def request_handovers(
    client: Any,
    targets: dict[str, str],
    *,
    valid_for: float = 10.0,
    key_prefix: str = DEFAULT_KEY_PREFIX,
) -> dict[str, LeaderInfo]:
    """:func:`request_handover` of many leases, each to a node of its own, in one
    pipeline; return the holder asked of each lease a request was recorded for.

    A lease nobody holds, or that its target holds already, is left alone (and missing
    from the answer). Each request is one script on its own lease's keys (the leases may
    live in different hash slots); unlike Postgres's ``request_handovers`` nothing makes
    the requests of one call atomic together.

    Args:
        client: a ``redis.Redis``, a ``RedisCluster`` or a ``redis://`` URL.
        targets: the node that should take over each lease, by lease name.
        valid_for: seconds each request (and its reservation) stays valid.
        key_prefix: the leaders' ``key_prefix``.

    Raises:
        ConfigError: bad arguments, or a lease key holds something else.
        BackendUnavailable: Redis cannot be reached or refused a script.
    """
    if not isinstance(targets, dict):
        raise ConfigError(f"targets must map lease names to node ids, got {type(targets).__name__}")
    checked = {_lease(name, key_prefix)[0]: check_node_id(to) for name, to in targets.items()}
    key_prefix = check_key_prefix(key_prefix)
    valid_for = check_seconds(valid_for, "valid_for", minimum=0.001)
    px = max(1, round(valid_for * 1000))
    answers: dict[str, LeaderInfo] = {}
    if not checked:
        return answers
    with _OneCall(client, "request_handovers") as call:
        try:
            pipe = call.client.pipeline(transaction=False)
            for name, to in checked.items():
                key, _, channel = lease_keys(name, key_prefix)
                pipe.eval(
                    REQUEST_HANDOVER, 2, key, handover_key(name, key_prefix), to, px, channel, "1"
                )
            replies = pipe.execute()
        except redis.RedisError as exc:
            raise unavailable("record the handover requests", call.where, exc) from exc
    for name, reply in zip(checked, replies, strict=True):
        status = int(reply[0])
        if status < 0:
            raise ConfigError(
                f"key {lease_keys(name, key_prefix)[0]!r} holds a value that is not an "
                f"rselection lease ({_text(reply[1])!r:.60}); check the lease name and key_prefix"
            )
        if status == 1:
            info, _ = parse_holder(reply[1], reply[2], reply[3])
            if info is not None:
                answers[name] = info
    return answers


def reopen_handovers(
    client: Any, names: list[str], node_id: str, *, key_prefix: str = DEFAULT_KEY_PREFIX
) -> list[str]:
    """Open to every node (but the one that gave it up) the handover requests of leases
    ``names`` reserved for ``node_id``; return the names opened.

    A node that leaves a sharded leader calls this after it stopped heartbeating: a
    request that reserved a shard for it before it left would otherwise keep every other
    node from taking that shard until the request lapsed.

    Args:
        client: a ``redis.Redis``, a ``RedisCluster`` or a ``redis://`` URL.
        names: the lease names.
        node_id: the node the requests may be reserved for.
        key_prefix: the leaders' ``key_prefix``.

    Raises:
        ConfigError: bad arguments.
        BackendUnavailable: Redis cannot be reached or refused a script.
    """
    checked = [_lease(name, key_prefix)[0] for name in names]
    key_prefix = check_key_prefix(key_prefix)
    node_id = check_node_id(node_id)
    if not checked:
        return []
    with _OneCall(client, "reopen_handovers") as call:
        try:
            pipe = call.client.pipeline(transaction=False)
            for name in checked:
                pipe.eval(
                    REOPEN_HANDOVER,
                    1,
                    handover_key(name, key_prefix),
                    node_id,
                    lease_keys(name, key_prefix)[2],
                )
            replies = pipe.execute()
        except redis.RedisError as exc:
            raise unavailable("open the handover requests", call.where, exc) from exc
    return [name for name, opened in zip(checked, replies, strict=True) if int(opened) == 1]
