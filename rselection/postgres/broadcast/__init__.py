"""``PostgresBroadcaster``: the in-process :class:`~rselection.Broadcaster`, across nodes.

Every node of a fleet creates one on the same database and table; a message published on
any node reaches the subscribers of its channel on every node, once and in one order,
through an outbox table and ``NOTIFY``. The package holds that one concept in parts,
each an object that owns its state: the public API (:mod:`.broadcaster`), the writer
(:mod:`.writer`, :mod:`.statements`, :mod:`.turns`), the listener (:mod:`.listener`,
:mod:`.listening`, :mod:`.fetches`, :mod:`.wakeups`), the outbox's statements
(:mod:`.outbox`), the table's location (:mod:`.location`), the sessions
(:mod:`.sessions`) and the checked settings (:mod:`.settings`).

See ``docs/explanation/broadcaster.md`` for how delivery, ordering, catch-up and gaps
work.
"""

from __future__ import annotations

from .broadcaster import MessageEncodeError, PostgresBroadcaster, PostgresBroadcastStats
from .listener import Gap, GapHook

__all__ = [
    "Gap",
    "GapHook",
    "MessageEncodeError",
    "PostgresBroadcastStats",
    "PostgresBroadcaster",
]
