"""``NodeKeys``: base of the Redis objects that, as one node, write keys of their prefix
that live for a ttl (:class:`~.claims.RedisClaimer`, :class:`~.elector.RedisElector`)."""

from __future__ import annotations

from ..node_identity import NodeIdentity
from ..validation import check_seconds
from ._conn import ClientUser, describe
from .keys import check_key_prefix

__all__ = ["NodeKeys"]


class NodeKeys(ClientUser, NodeIdentity):
    """Keeps what such an object checks the same way: its key prefix, its ttl (whole
    milliseconds on the server, at least one), its node id and its client. A subclass
    calls :meth:`_keep_keys` from its constructor."""

    key_prefix: str
    """The prefix of its keys."""
    ttl: float
    """Seconds a key it writes lives."""

    def _keep_keys(
        self, client: object, owner: str, key_prefix: str, ttl: float, node_id: str | None
    ) -> None:
        """Check and keep ``key_prefix``, ``ttl`` and ``node_id``; use ``client`` (see
        :meth:`_use_client`; ``owner`` names the class for its messages)."""
        self.key_prefix = check_key_prefix(key_prefix)
        self.ttl = check_seconds(ttl, "ttl", minimum=0.001)
        self._ttl_ms = max(1, round(self.ttl * 1000))
        self._take_node_id(node_id)
        self._use_client(client, owner)

    def _describe(self) -> str:
        """Its ttl, node id and server, for its ``repr``."""
        return f"ttl={self.ttl}, node_id={self.node_id!r}, {describe(self._client)}"
