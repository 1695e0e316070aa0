"""Shards: the stable key-to-shard hash and the sticky, balanced assignment of shards.

Both are pure functions, shared by every backend: :func:`shard_of` maps a user's key
(a tenant, a queue partition) to a shard number the same way in every process, Python
version and language; :func:`plan_moves` decides which shards a sharded leader's
coordinator moves, and to which nodes, so that every node owns ``floor(S/N)`` or
``ceil(S/N)`` shards with as few moves as possible; :func:`takeover_plan` decides which
node takes each shard over first when its holder dies, so that a dead node's shards are
spread over the others at once rather than moved twice.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from .errors import ConfigError
from .validation import MAX_NAME, check_name, name_bytes

__all__ = [
    "MAX_SHARDS",
    "Move",
    "check_shard_name",
    "check_shards",
    "plan_moves",
    "quotas",
    "shard_lease_name",
    "shard_of",
    "takeover_plan",
]

MAX_SHARDS = 4096
"""Most shards a sharded leader takes: each shard is a lease of its own, and the
sessions budget and failover times are measured up to 1,024 shards."""


def check_shards(shards: object) -> int:
    """Return ``shards`` if it is a usable number of shards, else raise :class:`ConfigError`.

    Args:
        shards: an ``int`` (not a bool) from 1 to :data:`MAX_SHARDS`.
    """
    if isinstance(shards, bool) or not isinstance(shards, int):
        raise ConfigError(f"shards must be an int from 1 to {MAX_SHARDS}, got {shards!r:.40}")
    if not 1 <= shards <= MAX_SHARDS:
        raise ConfigError(
            f"shards must be from 1 to {MAX_SHARDS}, got {shards}: use 1 for a single "
            "leader, or fewer shards with several keys each (see shard_of)"
        )
    return shards


def check_shard_name(name: object, shards: int) -> str:
    """Return ``name`` if a sharded leader may use it, else raise :class:`ConfigError`.

    A sharded name is a lease name (see :func:`~rselection.validation.check_name`)
    without ``/``, so that the shards' leases ``"<name>/<shard>"`` never collide with
    another sharded name's and the shard is read back from a lease name unambiguously.

    Args:
        name: the sharded leader's name.
        shards: its number of shards (the longest shard lease name must fit).
    """
    name = check_name(name, "sharded leader name")
    if "/" in name:
        raise ConfigError(
            f"a sharded leader's name may not contain '/', got {name!r:.60}: its shards "
            f"are the leases '<name>/<shard>'; use another separator such as '.' or ':'"
        )
    if name_bytes(shard_lease_name(name, shards - 1)) > MAX_NAME:
        raise ConfigError(
            f"sharded leader name {name[:40]!r}... is too long: its shards' lease names "
            f"'<name>/<shard>' must have at most {MAX_NAME} bytes as UTF-8"
        )
    return name


def shard_lease_name(name: str, shard: int) -> str:
    """The lease name of shard ``shard`` of sharded name ``name``: ``"<name>/<shard>"``."""
    return f"{name}/{shard}"


def shard_of(key: str | bytes, shards: int) -> int:
    """The shard (``0 .. shards - 1``) that ``key`` belongs to, the same everywhere.

    The first 8 bytes of the SHA-256 digest of the key (a ``str`` is encoded as UTF-8),
    read as an unsigned big-endian integer, modulo ``shards``. It never depends on the
    process, ``PYTHONHASHSEED`` or the Python version (unlike :func:`hash`), and any
    language can compute it. Changing ``shards`` moves most keys to other shards: choose
    it once, larger than the number of nodes you expect.

    Example::

        shard = rs.shard_of("tenant-42", 64)

    Args:
        key: the key, a ``str`` or ``bytes``.
        shards: the number of shards (1 to :data:`MAX_SHARDS`).

    Raises:
        ConfigError: ``shards`` is not an int from 1 to :data:`MAX_SHARDS`.
        TypeError: ``key`` is neither ``str`` nor ``bytes``.
    """
    shards = check_shards(shards)
    if isinstance(key, str):
        data = key.encode("utf-8")
    elif isinstance(key, bytes | bytearray | memoryview):
        data = bytes(key)
    else:
        raise TypeError(
            f"shard_of() takes a str or bytes key, got {type(key).__name__}: convert it "
            "first (str(key)) so that every process maps it the same way"
        )
    digest = hashlib.sha256(data).digest()
    return int.from_bytes(digest[:8], "big") % shards


@dataclass(frozen=True)
class Move:
    """One shard to hand over from the node that owns it to another.

    Attributes:
        shard: the shard number.
        source: the node that owns it now.
        target: the node it goes to.
    """

    shard: int
    source: str
    target: str


def quotas(shards: int, owned: Mapping[str, int]) -> dict[str, int]:
    """How many shards each node should own: ``floor(S/N)`` or ``ceil(S/N)``.

    The ``S % N`` larger quotas go to the nodes that own the most now (ties by node id),
    so that as few shards as possible move.

    Args:
        shards: the number of shards ``S``.
        owned: each node counted (``N`` of them) and how many shards it owns now.
    """
    if not owned:
        return {}
    base, extra = divmod(shards, len(owned))
    ranked = sorted(owned, key=lambda node: (-owned[node], node))
    return {node: base + (1 if rank < extra else 0) for rank, node in enumerate(ranked)}


def plan_moves(
    shards: int,
    holders: Mapping[int, str],
    members: Iterable[str],
    *,
    targets: Collection[str] | None = None,
    recent: Mapping[int, float] | None = None,
    limit: int | None = None,
    leaving: Collection[str] = (),
) -> list[Move]:
    """The moves that bring ``members`` to a balanced share, each shard moved at most once.

    Sticky: a shard stays with its owner unless the owner owns more than its quota
    (:func:`quotas`); only that surplus moves, to the targets below their quota. A shard
    that no member owns (free, or owned by a node that is not a member) is left alone.
    When every target below quota can be filled, the result is balanced and no plan
    with fewer moves is: each move fills one missing shard of a target. After one node
    joins a balanced fleet of ``N``, at most ``ceil(S / (N + 1))`` shards move; after one
    leaves, none of the others' shards move.

    Args:
        shards: the number of shards ``S``.
        holders: the owner of each owned shard (shards missing are free).
        members: the nodes counted for the balance (``N`` of them).
        targets: the members that may receive shards now (default: every member); the
            others keep what they own and are not given more.
        recent: a number per shard, larger for shards their owner took more recently;
            an owner gives away its most recent shards first (default: the highest
            shard numbers first).
        limit: the most moves to return (the rest wait for a later round).
        leaving: nodes that give every shard they hold (drained), first, and are
            neither counted nor given any.
    """
    gone = set(leaving)
    counted = sorted(set(members) - gone)
    owned: dict[str, list[int]] = {node: [] for node in counted}
    held_by_leaving: dict[str, list[int]] = {node: [] for node in sorted(gone)}
    for shard, node in holders.items():
        if node in owned:
            owned[node].append(shard)
        elif node in held_by_leaving:
            held_by_leaving[node].append(shard)
    quota = quotas(shards, {node: len(held) for node, held in owned.items()})
    allowed = set(counted) if targets is None else set(targets) & set(counted)
    order = recent or {}

    surplus: list[list[tuple[int, str]]] = []  # per source, the shards it gives, in order
    for node, held in held_by_leaving.items():
        surplus.append([(shard, node) for shard in sorted(held)])
    for node in sorted(counted, key=lambda n: (-len(owned[n]), n)):
        extra = len(owned[node]) - quota[node]
        if extra > 0:
            giving = sorted(owned[node], key=lambda s: (-order.get(s, 0.0), -s))[:extra]
            surplus.append([(shard, node) for shard in giving])
    # Take from the sources in turn, so that a source that is slow to hand over delays
    # the fewest targets.
    pool: list[tuple[int, str]] = []
    while any(surplus):
        for queue in surplus:
            if queue:
                pool.append(queue.pop(0))

    wanting = sorted(
        (n for n in allowed if len(owned[n]) < quota[n]),
        key=lambda n: (len(owned[n]) - quota[n], n),
    )
    need = {node: quota[node] - len(owned[node]) for node in wanting}
    moves: list[Move] = []
    while pool and any(need.values()):
        for node in wanting:
            if need[node] and pool:
                shard, source = pool.pop(0)
                moves.append(Move(shard, source, node))
                need[node] -= 1
    return moves if limit is None else moves[: max(0, limit)]


def takeover_plan(held: Mapping[str, Collection[int]]) -> dict[int, str]:
    """For each held shard, the node that takes it over first if its holder dies.

    Each node's shards are spread over the other nodes as the coordinator would balance
    them: in order, each to the node that then owns the fewest (ties broken by a stable
    hash of shard and node, so that every process that sees the same holders computes the
    same plan). A node that is not the planned one waits a little before it competes
    (see ``docs/explanation/sharding.md``).

    Args:
        held: the shards each node holds, as this node last saw them (nodes that hold
            nothing may be listed with an empty collection: they take shards too).

    Returns:
        The planned taker of every shard in ``held`` (none when there is one node only).
    """
    plan: dict[int, str] = {}
    for holder, shards in held.items():
        others = {node: len(theirs) for node, theirs in held.items() if node != holder}
        if not others:
            continue
        for shard in sorted(shards):
            taker = min(others, key=lambda node: (others[node], _tiebreak(shard, node)))
            plan[shard] = taker
            others[taker] += 1
    return plan


def _tiebreak(shard: int, node: str) -> int:
    """A stable pseudo-random order of the nodes for one shard (the same everywhere)."""
    return zlib.crc32(f"{shard}/{node}".encode())
