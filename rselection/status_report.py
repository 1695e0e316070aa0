"""A status snapshot as JSON-ready values: what ``rselection status --json`` prints and
the console's ``GET /api/status`` answers.

:func:`status_document` reads a :class:`~rselection.admin.StatusSnapshot` (from any
backend's admin API) into the leases shown, their handover requests, nodes, last fires
and sharded names, and which leases have no leader; :func:`sharded_names` finds the
sharded names among leases (a lease ``NAME`` with leases ``NAME/<k>`` beside it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import fields
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .text import iso

if TYPE_CHECKING:
    from .admin import StatusSnapshot

__all__ = ["shard_of_name", "shard_ranges", "sharded_names", "status_document"]

_SHARD = re.compile(r"0|[1-9][0-9]*")  # a shard's number in its lease name, as written


def shard_of_name(name: str) -> tuple[str, int] | None:
    """``("pollers", 17)`` for a shard's lease name ``"pollers/17"``, else ``None``.

    Args:
        name: a lease name.
    """
    base, _, tail = name.rpartition("/")
    if base and "/" not in base and _SHARD.fullmatch(tail):
        return base, int(tail)
    return None


def status_document(
    snapshot: StatusSnapshot,
    where: str,
    *,
    names: Iterable[str] = (),
    show_all: bool = False,
    not_recorded: str = "",
    drained: set[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """What a status shows of a snapshot, as JSON-ready values: the leases asked for,
    their handover requests, nodes, last fires and shards, and which leases have no
    leader (``headless``).

    Args:
        snapshot: the snapshot the backend's admin read for ``names``.
        where: the server, for people (never with a password).
        names: the leases asked for (retired or not); empty for every lease but the
            retired ones.
        show_all: also show the retired leases (they are not judged).
        not_recorded: what the status cannot show, said in it.
        drained: the (lease, node) pairs drained (``rselection drain``).
    """
    named: list[str] = list(dict.fromkeys(names))  # in the order given, once each
    wanted = set(named)
    pending = {h.lease: h for h in snapshot.handovers or ()}
    leases: list[dict[str, Any]] = []
    handovers = []
    hidden: list[str] = []
    judged: list[dict[str, Any]] = []
    for found in snapshot.leases:
        if wanted and found.name not in wanted:
            continue
        if found.retired and not wanted and not show_all:
            hidden.append(found.name)
            continue
        lease = {**_values(found), "live": found.live}
        leases.append(lease)
        if wanted or not found.retired:
            judged.append(lease)
        if found.name in pending:
            handovers.append(_values(pending[found.name]))
    shown = {lease["name"] for lease in leases}
    unknown = [name for name in named if name not in shown]
    hidden_set = set(hidden)

    def selected(lease: str) -> bool:
        return lease in wanted if wanted else lease not in hidden_set

    checked_at = snapshot.checked_at
    nodes = None
    if snapshot.nodes is not None:
        nodes = [
            {
                **_values(node, name="lease"),
                "seen_ago": round(max(0.0, (checked_at - node.last_seen).total_seconds()), 3),
                "drained": (node.name, node.node_id) in (drained or ()),
            }
            for node in snapshot.nodes
            if selected(node.name)
        ]
    rows = [  # every lease read, the shards of a name asked for among them
        (lease.name, lease.holder, lease.term, None, None, lease.expires_in)
        for lease in snapshot.leases
    ]
    fires = None
    if snapshot.fires is not None:
        fires = [_values(fire, fire="last_fire") for fire in snapshot.fires if selected(fire.lease)]
    return {
        "database": where,
        "checked_at": iso(snapshot.checked_at),
        "names": named or None,
        "leases": leases,
        "unknown": unknown,
        "hidden": hidden,
        "headless": [lease["name"] for lease in judged if not lease["live"]] + unknown,
        "handovers": None if snapshot.handovers is None else handovers,
        "nodes": nodes,
        "tasks": fires,
        "shards": sharded_names(rows, shown, selected),
        "not_recorded": not_recorded,
    }


def _values(record: Any, **renamed: str) -> dict[str, Any]:
    """The fields of the dataclass ``record`` as JSON-ready values (times in RFC 3339,
    seconds to the millisecond), keyed by name or as ``renamed`` (``field="key"``)."""
    values = {}
    for field in fields(record):
        value = getattr(record, field.name)
        if isinstance(value, datetime):
            value = iso(value)
        elif isinstance(value, float):
            value = round(value, 3)
        elif hasattr(value, "as_json"):  # a lease's last change, a TermRecord
            value = value.as_json()
        values[renamed.get(field.name, field.name)] = value
    return values


def sharded_names(
    lease_rows: list[tuple[Any, ...]], shown: set[str], selected: Callable[[str], bool]
) -> list[dict[str, Any]]:
    """The sharded names among the leases, with the shards each node leads.

    A sharded name is a lease ``NAME`` (its coordinator) with leases ``NAME/<k>`` beside
    it (its shards, see ``PostgresShardedLeader``).

    Args:
        lease_rows: the lease rows (name, holder, term, acquired_at, expires_at, seconds
            to expiry, ...).
        shown: the leases the status shows.
        selected: whether a lease was asked for.
    """
    held: dict[str, dict[int, str | None]] = {}
    for row in lease_rows:
        name, holder, expires_in = row[0], row[1], row[5]
        found = shard_of_name(name)
        if found is not None:
            live = holder is not None and expires_in is not None and expires_in > 0
            held.setdefault(found[0], {})[found[1]] = holder if live else None
    out = []
    for name in sorted(held):
        if name not in shown or not selected(name):
            continue
        owners: dict[str, list[int]] = {}
        for shard, holder in sorted(held[name].items()):
            if holder is not None:
                owners.setdefault(holder, []).append(shard)
        out.append(
            {
                "name": name,
                "shards": len(held[name]),
                "unled": sorted(k for k, v in held[name].items() if v is None),
                "nodes": {node: mine for node, mine in sorted(owners.items())},
            }
        )
    return out


def shard_ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
