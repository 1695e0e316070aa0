"""``RedisAdmin``: read and operate a fleet's Redis leases from outside it.

What ``rselection status --redis-url``, ``resign``, ``forget``, ``drain``, ``undrain``
and ``task`` do, for programs: a status snapshot (:mod:`.snapshot`), handover requests
(:mod:`.handover`), retiring a lease (:mod:`.retire`), drained nodes (:mod:`.drains`),
task controls and run histories (:mod:`.task_runs`) and waiting for a new term.
Answers are the shapes of :mod:`rselection.admin`, the same as
:class:`~rselection.postgres.PostgresAdmin`'s.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import redis
from redis.cluster import RedisCluster

from ..admin import DEFAULT_HISTORY_ROWS, LeaseAdmin, Retirement, StatusSnapshot, TermWatch
from ..errors import BackendUnavailable
from ..history import TermRecord, check_history_limit
from ..lease import LeaderInfo
from ..members import NodeInfo
from ..validation import check_name, check_seconds
from . import drains, handover
from ._conn import check_client, describe, unavailable
from .history import read_history
from .keys import DEFAULT_KEY_PREFIX, check_key_prefix, lease_keys
from .membership import read_nodes
from .retire import retire_lease
from .snapshot import lease_names, read_snapshot
from .task_runs import RedisTaskStore

__all__ = ["RedisAdmin", "RedisTermWatch"]


class RedisAdmin(LeaseAdmin):
    """The leases under one key prefix, read and operated from outside the fleet.

    Every method raises :class:`~rselection.errors.BackendUnavailable` when Redis
    cannot be reached or fails, :class:`~rselection.errors.ConfigError` on bad
    arguments.

    Args:
        client: a ``redis.Redis``, a ``RedisCluster`` or a ``redis://`` URL (a client
            made from a URL is closed by :meth:`close`; one passed in stays open).
        key_prefix: the leaders' ``key_prefix``.
        node_timeout: a node is alive when seen within this many seconds (the leaders'
            default: 30).
    """

    def __init__(
        self, client: Any, *, key_prefix: str = DEFAULT_KEY_PREFIX, node_timeout: float = 30.0
    ) -> None:
        self.client, self._owned = check_client(client, "RedisAdmin")
        self.key_prefix = check_key_prefix(key_prefix)
        self.node_timeout = check_seconds(node_timeout, "node_timeout")
        self.where = describe(self.client)
        """Where the leases are, for messages (never with a password)."""
        self._tasks = RedisTaskStore(self.client, key_prefix=self.key_prefix)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key_prefix={self.key_prefix!r}, {self.where})"

    def close(self) -> None:
        """Close the client if it was made from a URL."""
        if self._owned:
            self.client.close()

    def leases(self) -> list[str]:
        """The names of the leases that ever had a term or have members, sorted (found
        with ``SCAN``)."""
        try:
            return lease_names(self.client, self.key_prefix)
        except redis.RedisError as exc:
            raise unavailable("list the leases", self.where, exc) from exc

    def exists(self, name: str) -> bool:
        """Whether lease ``name`` ever had a term (its term key outlives every holder)."""
        term_key = lease_keys(check_name(name, "lease name"), self.key_prefix)[1]
        try:
            return bool(self.client.exists(term_key))
        except redis.RedisError as exc:
            raise unavailable(f"read the term of lease {name!r}", self.where, exc) from exc

    def status(self, names: Iterable[str] | None = None) -> StatusSnapshot:
        """See :meth:`~rselection.admin.LeaseAdmin.status`; no last fires (``fires`` is
        ``None``)."""
        asked = None if names is None else [check_name(n, "lease name") for n in names]
        return read_snapshot(
            self.client, key_prefix=self.key_prefix, node_timeout=self.node_timeout, names=asked
        )

    def nodes(self, name: str) -> list[NodeInfo]:
        """See :meth:`~rselection.admin.LeaseAdmin.nodes`."""
        name = check_name(name, "lease name")
        lease_key = lease_keys(name, self.key_prefix)[0]
        return read_nodes(
            self.client,
            name,
            key_prefix=self.key_prefix,
            node_timeout=self.node_timeout,
            lease_key=lease_key,
        )

    def live_nodes(self, name: str) -> list[str] | None:
        """The ids of the nodes whose keeper for lease ``name`` is connected, sorted;
        ``None`` when the server does not allow ``PUBSUB CHANNELS``."""
        return handover.live_nodes(self.client, name, key_prefix=self.key_prefix)

    def current_holder(self, name: str) -> LeaderInfo | None:
        """See :meth:`~rselection.admin.LeaseAdmin.current_holder`."""
        return handover.current_holder(self.client, name, key_prefix=self.key_prefix)

    def request_handover(
        self, name: str, *, to: str | None = None, valid_for: float = 10.0
    ) -> LeaderInfo | None:
        """See :meth:`~rselection.admin.LeaseAdmin.request_handover` and
        :func:`rselection.redis.request_handover`."""
        self.refuse_handover(name, to)
        return handover.request_handover(
            self.client, name, to=to, valid_for=valid_for, key_prefix=self.key_prefix
        )

    def drained(self, name: str) -> set[str]:
        """See :meth:`~rselection.admin.LeaseAdmin.drained`: the lease's drains set."""
        return drains.drained_nodes(self.client, check_name(name, "lease name"), self.key_prefix)

    def _set_drained(self, name: str, node_id: str, drained: bool) -> bool:
        change = drains.drain if drained else drains.undrain
        return change(self.client, name, node_id, self.key_prefix)

    def _task_store(self) -> RedisTaskStore:
        # The hashes and lists beside the lease's keys (see rselection.redis.task_runs).
        return self._tasks

    def cancel_handover(self, name: str, term: int) -> bool:
        """See :meth:`~rselection.admin.LeaseAdmin.cancel_handover`."""
        return handover.cancel_handover(self.client, name, term, key_prefix=self.key_prefix)

    def history(self, name: str, *, limit: int = DEFAULT_HISTORY_ROWS) -> list[TermRecord]:
        """See :meth:`~rselection.admin.LeaseAdmin.history` (read from the lease's
        stream ``<prefix>{<name>}:history``)."""
        name = check_name(name, "lease name")
        limit = check_history_limit(limit, "limit", least=1)
        try:
            return read_history(self.client, name, key_prefix=self.key_prefix, limit=limit)
        except redis.RedisError as exc:
            raise unavailable("read the leadership history", describe(self.client), exc) from exc

    def retire(self, name: str, *, check_nodes: bool = True) -> Retirement:
        """Retire lease ``name``, which no service uses any more (``rselection forget``).

        Its term key stays and a key marks it retired at that term: :meth:`status`
        snapshots still show it; the next acquisition brings it back.

        Args:
            name: the lease name.
            check_nodes: also refuse while a keeper of the lease is connected.

        Raises:
            Refused: no such lease (it never had a term), a live holder, or live nodes.
        """
        name = check_name(name, "lease name")
        return retire_lease(self.client, name, key_prefix=self.key_prefix, check_nodes=check_nodes)

    def watch_terms(self, name: str) -> RedisTermWatch:
        """See :meth:`~rselection.admin.LeaseAdmin.watch_terms`."""
        return RedisTermWatch(self, check_name(name, "lease name"))


class RedisTermWatch(TermWatch):
    """Waits for a new term of one lease: woken by the acquire script's ``PUBLISH``, and
    re-reading the lease every half second in case a message was missed.

    Args:
        admin: the admin of the lease's key prefix.
        name: the lease name.
    """

    def __init__(self, admin: RedisAdmin, name: str) -> None:
        self._admin, self._name = admin, name
        key, _, self._channel = lease_keys(name, admin.key_prefix)
        client = admin.client
        if isinstance(client, RedisCluster):
            # Plain pub/sub reaches every cluster node; listen on the lease slot's master.
            cluster: Any = client
            client = cluster.get_redis_connection(cluster.get_node_from_key(key))
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)

    def __enter__(self) -> RedisTermWatch:
        """Subscribe to the lease's channel."""
        try:
            self._pubsub.subscribe(self._channel)
        except redis.RedisError as exc:
            self.close()
            raise BackendUnavailable(f"cannot subscribe to {self._channel!r}: {exc}") from exc
        return self

    def close(self) -> None:
        """Unsubscribe (close the subscription's connection)."""
        self._pubsub.close()

    def wait(self, after_term: int, timeout: float) -> LeaderInfo | None:
        """See :meth:`~rselection.admin.TermWatch.wait`."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self._pubsub.get_message(timeout=min(left, 0.5))
            except redis.RedisError as exc:
                raise BackendUnavailable(f"lost the subscription: {exc}") from exc
            data = message.get("data") if message else None
            text = data.decode() if isinstance(data, bytes) else str(data or "")
            if message is not None and not text.startswith("acquired:"):
                continue  # other news: no need to read the lease
            holder = self._admin.current_holder(self._name)
            if holder is not None and holder.term > after_term:
                return holder
        return None
