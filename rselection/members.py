"""Who is in the fleet: :class:`NodeInfo`, one node competing for a lease, and what
every membership checks about its node (:class:`MembershipBase`)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import NotRequired, TypedDict, Unpack

from .errors import ConfigError
from .validation import check_name, check_node_id, check_optional_seconds, check_seconds
from .versions import check_eligible, check_version

__all__ = ["MembershipArgs", "MembershipBase", "NodeInfo", "node_timeout_or_default"]


@dataclass(frozen=True)
class NodeInfo:
    """One node (leader or follower) of a lease, as its heartbeats show it.

    Attributes:
        node_id: the node's id (unique per leader object: host, pid and a random suffix
            by default, so nodes behind one NAT or pooler never collapse into one).
        name: the lease it competes for.
        hostname: the host it runs on.
        pid: its process id on that host.
        client_addr: its address as the server saw it (``None`` over a Unix socket).
        started_at: its first heartbeat (server time).
        last_seen: its latest heartbeat (server time).
        alive: seen within the node timeout.
        is_leader: it holds the lease now.
        version: the release it runs (PEP 440), ``None`` when it gave none.
        eligible: whether it may lead; ``False``: a member that never leads, never gets
            a handover or a shard.
    """

    node_id: str
    name: str
    hostname: str
    pid: int
    client_addr: str | None
    started_at: datetime
    last_seen: datetime
    alive: bool
    is_leader: bool
    version: str | None = None
    eligible: bool = True


def node_timeout_or_default(heartbeat_interval: float, node_timeout: float | None) -> float:
    """The node timeout a leader gives its membership: ``node_timeout`` checked, or three
    heartbeats when ``None`` (a node is lost only once it missed a few).

    Raises:
        ConfigError: a bad number.
    """
    heartbeat = check_seconds(heartbeat_interval, "heartbeat_interval")
    given = check_optional_seconds(node_timeout, "node_timeout")
    return 3 * heartbeat if given is None else given


class MembershipArgs(TypedDict):
    """The keyword arguments of :class:`MembershipBase` (``version`` is ``None`` and
    ``eligible`` true unless given), which a backend's membership takes beside its own
    and passes on."""

    name: str
    node_id: str
    heartbeat_interval: float
    node_timeout: float
    version: NotRequired[str | None]
    eligible: NotRequired[bool]


_ARGS = MembershipArgs.__annotations__.keys()
# Not __required_keys__: under postponed annotations Python 3.11 counts NotRequired
# keys as required.
_REQUIRED = _ARGS - {"version", "eligible"}


class MembershipBase:
    """What every membership (:class:`~rselection.abc.Membership`) checks and keeps the
    same way: the name of the lease its node competes for, the node's id, the seconds
    between heartbeats and the node timeout, which must be longer (else a node would be
    lost between two heartbeats of its own), and the version and eligibility its
    heartbeats record. Raises :class:`ConfigError` for bad ones.
    """

    def __init__(self, **node: Unpack[MembershipArgs]) -> None:
        # A type checker holds a caller to MembershipArgs; at run time, as a signature
        # of named arguments would, a misspelt or missing one is a TypeError.
        problems = [
            *(f"unexpected keyword argument {k!r}" for k in sorted(node.keys() - _ARGS)),
            *(f"missing keyword argument {k!r}" for k in sorted(_REQUIRED - node.keys())),
        ]
        if problems:
            raise TypeError(f"{type(self).__name__}(): {', '.join(problems)}")
        heartbeat_interval = check_seconds(node["heartbeat_interval"], "heartbeat_interval")
        node_timeout = check_seconds(node["node_timeout"], "node_timeout")
        if not node_timeout > heartbeat_interval:
            raise ConfigError(
                f"node_timeout ({node_timeout:g} s) must be longer than heartbeat_interval "
                f"({heartbeat_interval:g} s), which must be positive: a node would be lost "
                "between two of its own heartbeats"
            )
        self.name = check_name(node["name"], "lease name")
        """The name of the lease the node competes for."""
        self.node_id = check_node_id(node["node_id"])
        """This node's id (a leader sets it again in a forked child)."""
        self.heartbeat_interval = heartbeat_interval
        """Seconds between heartbeats."""
        self.node_timeout = node_timeout
        """A node not seen for this long is lost (``alive=False``)."""
        self.version = check_version(node.get("version"))
        """The release this node runs (PEP 440), ``None`` when it gave none."""
        self.eligible = check_eligible(node.get("eligible", True))
        """Whether this node may lead (see :class:`NodeInfo`)."""
        self._token = secrets.token_hex(8)

    def set_eligible(self, eligible: bool) -> None:
        """Record ``eligible`` with this node's next heartbeats (a drain or an undrain
        changed it while the node runs)."""
        self.eligible = check_eligible(eligible)

    @property
    def incarnation(self) -> str:
        """This run of the node, recorded with its heartbeats: a node restarted under
        the same id (a crash, a container restarted in place, a worker forked anew from
        one object) is a new run, whose first heartbeat (``started_at``) is its own, so
        it settles anew. A token of this object and this process's id."""
        return f"{self._token}-{os.getpid()}"
