"""``Elector``: what the electors of every backend share.

An elector (:class:`~rselection.postgres.PostgresElector`,
:class:`~rselection.redis.RedisElector`) leads for ``ttl`` seconds from its last
successful :meth:`~Elector.is_leader` call, without a thread. Its node id is the one
given or a new one of its own, taken anew in a forked child, and its ``with`` block
resigns if leading before it closes.
"""

from __future__ import annotations

import logging

from .closeable import Closeable
from .node_identity import NodeIdentity

__all__ = ["Elector"]

logger = logging.getLogger(__name__)


class Elector(Closeable, NodeIdentity):
    """Base of the electors: node id, term, fork and ``with`` block.

    A subclass calls :meth:`_take_node_id` from its constructor (after setting
    :attr:`name`), and implements :meth:`is_leader`, :meth:`resign` and
    :meth:`~rselection.closeable.Closeable.close`; closing never resigns.

    Attributes:
        name: the election's name.
    """

    name: str
    node_id: str
    """This candidate's node id, recorded as the holder."""
    term: int | None = None
    """The term this elector leads with after a ``True`` from :meth:`is_leader`, else None."""

    def is_leader(self) -> bool:
        """Acquire or renew the leadership; ``True`` while this elector holds it."""
        raise NotImplementedError

    def resign(self) -> bool:
        """Give the leadership up at once; ``True`` if this elector held it."""
        raise NotImplementedError

    def reset_after_fork(self) -> None:
        """In a forked child (see :mod:`rselection.forks`): a default node id is the
        parent's, so the child takes one of its own (with the same id, both processes
        would lead at once); it leads nothing yet. The connections reset themselves."""
        super().reset_after_fork()
        self.term = None

    def _exit_block(self) -> None:
        """Resign if leading (errors are logged, not raised), then close."""
        try:
            if self.term is not None:
                self.resign()
        except Exception as err:  # the leadership then simply expires after ttl
            logger.warning("elector %r: resign on exit failed: %s", self.name, err)
        finally:
            self.close()
