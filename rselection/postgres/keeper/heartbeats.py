"""Membership heartbeats on the keeper session.

A node of :class:`~rselection.postgres.membership.PostgresMembership` heartbeats through
the keeper session of its process, connection string and lease table
(:meth:`~.shared.SharedKeeper.beat_through`): the keeper's thread sends every heartbeat
due (or due within a quarter of its interval, so that the nodes of a process beat
together) in one statement per kind and table, bounded on the server by
:data:`~.session.HEARTBEAT_BOUND` so that a locked nodes table never holds the renewals
queued behind it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import psycopg
from psycopg import sql

from ... import clock
from ...errors import BackendUnavailable, ConfigError, first_line
from .._lease_sql import bounded_sql
from ..schema import create_tables
from .session import HEARTBEAT_BOUND, KeeperSession

__all__ = ["HEARTBEAT_LIMIT", "Heartbeat", "KeeperHeartbeats"]

logger = logging.getLogger(__name__)

HEARTBEAT_LIMIT = 10.0  # seconds a batch of heartbeats may take on the client's side


class Heartbeat(Protocol):
    """A node whose heartbeats ride on the keeper session (see
    :class:`~rselection.postgres.membership.PostgresMembership`)."""

    @property
    def table(self) -> str:
        """The nodes table."""

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats."""

    @property
    def create_tables(self) -> bool:
        """Create the nodes table before the first heartbeat."""

    def heartbeat_sql(self, batch: Sequence[Heartbeat]) -> sql.Composable:
        """One statement that records a heartbeat of every node of ``batch`` (all of
        them of this kind and table)."""


class KeeperHeartbeats(KeeperSession):
    """The heartbeats of the nodes that beat through the keeper session."""

    def __init__(self, conninfo: str, table: str) -> None:
        super().__init__(conninfo, table)
        # Nodes that heartbeat through the session: node -> when its next beat is due.
        self._beats: dict[Heartbeat, float] = {}
        # The most seconds a node's heartbeat goes out before it is due (a quarter of the
        # longest interval of a node that beat here): none is due while the earliest
        # beat is further off than this.
        self._beat_early = 0.0
        self._beating = threading.RLock()  # held while a batch of heartbeats is sent

    def _beat_due(self) -> None:
        """Heartbeat every node due now (or within a quarter of its interval: nodes of
        one process beat together), one statement per kind and table."""
        now = clock.monotonic()
        with self._state:
            if not self._beats or min(self._beats.values()) > now + self._beat_early:
                return  # the pump loops often: most loops find no beat due, in one pass
            due = [n for n, at in self._beats.items() if at <= now + n.heartbeat_interval / 4]
        groups: dict[tuple[type, str], list[Heartbeat]] = {}
        for node in due:
            groups.setdefault((type(node), node.table), []).append(node)
        for (_, table), batch in groups.items():
            try:
                if any(n.create_tables for n in batch) and table not in self._created:
                    with self._lock:
                        conn = self._conn
                        if conn is None:
                            return
                        # Bounded on the server: renewals wait behind this round trip
                        # (a migration holding the lock only delays the creation).
                        with self._io.guard(conn, self._timeout + 10.0, held=self.holding):
                            create_tables(conn, nodes=table, timeout=HEARTBEAT_BOUND)
                    self._created.add(table)
                with self._beating:
                    with self._state:  # a node that stopped beating meanwhile is left out
                        batch = [node for node in batch if node in self._beats]
                    if batch:
                        self._run(
                            sql.SQL("{}; {}").format(
                                bounded_sql(HEARTBEAT_BOUND), batch[0].heartbeat_sql(batch)
                            ),
                            "record heartbeats",
                            limit=HEARTBEAT_LIMIT,
                            tolerate=True,
                        )
                failed = False
            except (BackendUnavailable, ConfigError, psycopg.Error) as exc:
                failed = True
                logger.warning("keeper: could not record heartbeats: %s", first_line(exc))
            with self._state:
                for node in batch:
                    if node in self._beats:
                        # After a failure, try again soon; else at the next interval.
                        wait = (
                            min(1.0, node.heartbeat_interval) if failed else node.heartbeat_interval
                        )
                        self._beats[node] = now + wait
