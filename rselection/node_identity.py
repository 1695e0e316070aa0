"""``NodeIdentity``: the node id of an object that acts as one node of a fleet (an
elector, a claimer), and what a forked child does with it."""

from __future__ import annotations

from . import forks
from .validation import check_node_id, new_node_id

__all__ = ["NodeIdentity"]


class NodeIdentity:
    """Base of the objects that act under one node id: the one given, or a new one of
    their own. A forked child replaces a new one with another: under one id, parent and
    child would hold leaderships and claims as one node. A subclass calls
    :meth:`_take_node_id` from its constructor."""

    node_id: str
    """The node id this object acts under."""

    def _take_node_id(self, node_id: str | None) -> None:
        """Take ``node_id`` (checked; a new one when ``None``) and register for forks."""
        self.node_id = new_node_id() if node_id is None else check_node_id(node_id)
        self._default_node_id = node_id is None
        forks.register(self)

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): a default node id is the
        parent's, so the child takes one of its own. Connections reset themselves."""
        if self._default_node_id:
            self.node_id = new_node_id()
