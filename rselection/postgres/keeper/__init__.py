"""The shared keeper: one Postgres session per process, connection string and lease table.

Every :class:`~rselection.postgres.PostgresLease` of a process that uses the same
connection string and lease table is a client of one :class:`SharedKeeper`, whose
session (the *keeper session*) acquires, renews and releases all of them and holds each
led term's advisory lock, its ``holder_pid`` and the server identity recorded with it.
The package holds that one concept in parts, each a module:

* :mod:`.session`: the session itself, opened on a thread of its own (:mod:`.opening`,
  with the checks and settings of :mod:`.session_setup`), listening on every client's
  lease channel, never closed while a term taken through it may still run, and its
  round trips one at a time;
* :mod:`.batches`: renewals, acquisition attempts and releases, each kind sent in one
  statement for every lease due;
* :mod:`.heartbeats`: the heartbeats of the nodes of the process's memberships;
* :mod:`.pump`: the keeper's own thread, which sends all of it and acts on the
  notifications the session receives;
* :mod:`.shared`: :class:`SharedKeeper`, one per process, connection string and table.

See ``docs/explanation/how-it-works.md`` ("The lease", "Fast failover after a crash")
and ``docs/explanation/sessions.md`` for the design and why each step is safe.
"""

from __future__ import annotations

from .batches import GATHER, RELEASE_REFUSED, RENEWAL_SKIPPED, Attempt, Queued
from .heartbeats import Heartbeat
from .session import KeptLease
from .shared import SharedKeeper

__all__ = [
    "GATHER",
    "RELEASE_REFUSED",
    "RENEWAL_SKIPPED",
    "Attempt",
    "Heartbeat",
    "KeptLease",
    "Queued",
    "SharedKeeper",
]
