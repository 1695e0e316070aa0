"""Asking a lease's leader to hand over, and waiting for the new term.

What ``rselection resign`` and the console's "step down" and "hand over" do, over any
backend's admin API (:class:`~rselection.admin.LeaseAdmin`): :func:`check_handover`
checks the lease, its holder and the node asked for against the live nodes (refusing
what could only leave a lease reserved for a node that never takes it), and
:func:`hand_over` asks, waits for the new term and withdraws a request nobody answered.
Both record nothing themselves: the admin API marks the term's end ``by: "operator"``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .admin import Refused
from .text import printable

if TYPE_CHECKING:
    from .admin import LeaseAdmin
    from .lease import LeaderInfo

__all__ = ["HandoverCheck", "Resignation", "check_handover", "hand_over", "live_nodes_of"]

LiveNodes = Callable[[], tuple[list[str] | None, bool]]
"""The ids of a lease's live nodes (``None``: they cannot be told), and whether the lease
has nodes at all."""


@dataclass(frozen=True)
class HandoverCheck:
    """What :func:`check_handover` found.

    Attributes:
        holder: the lease's holder now.
        already: the node asked for already leads (nothing to do).
        warning: a reason the check was incomplete (the request may go unanswered),
            else ``None``.
    """

    holder: LeaderInfo
    already: bool = False
    warning: str | None = None


@dataclass(frozen=True)
class Resignation:
    """What :func:`hand_over` did.

    Attributes:
        name: the lease name.
        asked: the holder asked to hand over.
        to: the node asked for, ``None`` for any other node.
        new: the holder of the first term after ``asked``'s, ``None`` when none began
            in time (the request was then withdrawn).
        took: seconds from the request to the new term (or to giving up).
    """

    name: str
    asked: LeaderInfo
    to: str | None
    new: LeaderInfo | None
    took: float

    @property
    def done(self) -> bool:
        """Whether another node (the one asked for, if any) leads now."""
        new = self.new
        if new is None or new.node_id == self.asked.node_id:
            return False
        return self.to is None or new.node_id == self.to

    def new_term_line(self) -> str | None:
        """The line that reports the new term (``None`` when none began in time): who
        leads now, the term and how long the handover took, as the command line and
        the console say it."""
        new = self.new
        if new is None:
            return None
        return (
            f"{printable(new.node_id)} leads {self.name!r} now with term {new.term} "
            f"(handover took {self.took * 1000:.0f} ms)"
        )


def live_nodes_of(admin: LeaseAdmin, name: str) -> LiveNodes:
    """The live nodes of lease ``name`` as ``admin.live_nodes`` tells them.

    Args:
        admin: the lease's backend.
        name: the lease name.
    """

    def alive() -> tuple[list[str] | None, bool]:
        nodes = admin.live_nodes(name)
        return nodes, bool(nodes)

    return alive


def check_handover(
    admin: LeaseAdmin,
    name: str,
    to: str | None,
    *,
    missing: str,
    alive: LiveNodes,
    unchecked: str | None,
    not_live: str,
) -> HandoverCheck:
    """Check the lease, its holder and ``to`` against the live nodes before a handover.

    Args:
        admin: the backend's admin API.
        name: the lease name.
        to: the node that should take over, ``None`` for any other node.
        missing: what to say when the lease does not exist.
        alive: the live nodes (see :data:`LiveNodes`).
        unchecked: why ``to`` cannot be checked when the live nodes cannot be told
            (refused); ``None``: go on, with a warning.
        not_live: why a node that is not live does not count as one.

    Raises:
        Refused: no such lease, no leader, ``to`` may not lead or is not live, or no
            other node may lead.
    """
    holder = admin.current_holder(name)
    if holder is None:
        if not admin.exists(name):
            raise Refused(missing)
        raise Refused(f"lease {name!r} has no leader: nothing to hand over")
    if to is not None and to == holder.node_id:
        return HandoverCheck(holder, already=True)
    nodes, tracked = alive()
    ineligible = admin.ineligible(name)
    if nodes is not None:
        nodes = [node for node in nodes if node not in ineligible]
    warning = None
    if to is not None:
        if to in ineligible:
            why = (
                "it is drained (`rselection undrain` makes it eligible again)"
                if to in admin.drained(name)
                else "it was started with eligible=False"
            )
            raise Refused(
                f"{printable(to)} may not lead {name!r}: {why}; hand over to another node"
            )
        cannot = f"cannot check that {printable(to)} is a live node"
        if nodes is None and unchecked is not None:
            raise Refused(f"{cannot}: {unchecked}")
        if nodes is None:
            warning = (
                f"{cannot} (PUBSUB CHANNELS is not allowed); asking anyway: if it is not "
                "running, no node takes over in time"
            )
        elif to not in nodes:
            others = ", ".join(printable(n) for n in nodes if n != holder.node_id) or "none"
            raise Refused(
                f"{printable(to)} is not a live node of lease {name!r} ({not_live}); "
                f"live followers: {others}"
            )
    elif tracked and not [n for n in nodes or [] if n != holder.node_id]:
        raise Refused(
            f"no other live node of lease {name!r} that may lead to hand over to "
            f"({printable(holder.node_id)} leads term {holder.term}); start another node first"
        )
    return HandoverCheck(holder, warning=warning)


def hand_over(
    admin: LeaseAdmin,
    name: str,
    *,
    to: str | None = None,
    timeout: float = 10.0,
    asked: Callable[[LeaderInfo], None] | None = None,
) -> Resignation:
    """Ask the leader of lease ``name`` to hand over and wait for the new term; withdraw
    the request when no new term began within ``timeout``.

    Args:
        admin: the lease's backend.
        name: the lease name.
        to: the node that should take over, ``None`` for any other node.
        timeout: seconds to wait for the new term; also how long the lease stays
            reserved for ``to``.
        asked: called with the holder asked, once the request is recorded.

    Raises:
        Refused: nobody holds the lease, or the admin API refused the request.
        ConfigError: bad arguments.
        BackendUnavailable: the server failed.
    """
    with admin.watch_terms(name) as watch:
        asked_at = time.monotonic()
        holder = admin.request_handover(name, to=to, valid_for=timeout)
        if holder is None:
            raise Refused(f"lease {name!r} has no leader: nothing to hand over")
        if asked is not None:
            asked(holder)
        new = watch.wait(holder.term, asked_at + timeout - time.monotonic())
        took = time.monotonic() - asked_at
    if new is None:
        admin.cancel_handover(name, holder.term)
    return Resignation(name, holder, to, new, took)
