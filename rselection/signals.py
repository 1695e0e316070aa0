"""Blinker signals that rselection sends; connect receivers to observe leadership and tasks.

Every signal is sent with the leader (or task handler) as sender and these keyword
arguments:

- ``started``: ``node_id``, ``name`` (lease name), when a leader starts competing for
  its lease (it follows until ``elected``).
- ``elected``: ``node_id``, ``term``, ``name``.
- ``demoted``: ``node_id``, ``term``, ``name``, ``reason`` (``"stopped"``, ``"lost"``,
  ``"deadline"``, ``"connection"``, ``"step_down"``, ``"handover"``: an operator asked
  with ``rselection resign``).
- ``leader_changed``: ``name``, ``leader`` (:class:`~rselection.LeaderInfo` or ``None``).
- ``task_started``: ``task``, ``term``, ``scheduled_at`` (``None`` for persistent tasks).
- ``task_failed``: ``task``, ``term``, ``error`` (the exception).
- ``task_finished``: ``task``, ``term``, ``scheduled_at``, ``duration`` (seconds),
  ``error`` (``None`` unless it failed), after every run.
- ``task_stuck``: ``task``, ``term``, ``waited`` (seconds waited after cancelling).
- ``fire_skipped``: ``task``, ``scheduled_at``, ``fire_key``, ``reason`` (``"overlap"``,
  ``"not-leader"``, ``"already-claimed"``, ``"misfire"``, ``"claim-error"``,
  ``"no-thread"``: no thread could be started to run it; ``"paused"``: an operator
  paused the task; ``"expired"``: a trigger older than the claim ttl).
- ``node_joined``: ``name`` (lease name), ``node`` (:class:`~rselection.NodeInfo`), sent
  by a :class:`~rselection.HeartbeatMonitor` on the leader.
- ``node_lost``: ``name``, ``node`` (its last heartbeat), sent the same way.
- ``lease_renewed``: ``name``, ``term``, ``latency`` (seconds the renewal took),
  ``remaining`` (seconds left on the lease once renewed, by the leader's own deadline).

The leaders of a sharded leader's shards (:class:`~rselection.PostgresShardedLeader`)
also send ``shard`` (the shard number) with ``elected``, ``demoted`` and
``leader_changed``; their ``name`` is the shard's lease, ``"<name>/<shard>"``.

Receivers run in the thread that sends the signal: keep them short and never block. The
task signals of an ``async def`` task are sent on the term's event loop, which every
async task of the term shares: a receiver that blocks there delays the others, and their
cancellation when the term ends (they may then be reported stuck). A
receiver that raises is logged with its traceback and ignored: it cannot stop the leader's
machinery nor keep the other receivers from running.
"""

from __future__ import annotations

import logging
from typing import Any

from blinker import NamedSignal, Namespace

logger = logging.getLogger(__name__)

__all__ = [
    "demoted",
    "elected",
    "fire_skipped",
    "leader_changed",
    "lease_renewed",
    "namespace",
    "node_joined",
    "node_lost",
    "started",
    "task_failed",
    "task_finished",
    "task_started",
    "task_stuck",
]

namespace = Namespace()
"""The blinker namespace that holds every rselection signal."""

started = namespace.signal(
    "started", doc="A leader started competing for its lease (kwargs: node_id, name)."
)
elected = namespace.signal("elected", doc="This node became leader (kwargs: node_id, term, name).")
demoted = namespace.signal(
    "demoted", doc="This node stopped leading (kwargs: node_id, term, name, reason)."
)
leader_changed = namespace.signal(
    "leader_changed", doc="The lease holder changed (kwargs: name, leader)."
)
task_started = namespace.signal(
    "task_started", doc="A task run began (kwargs: task, term, scheduled_at)."
)
task_failed = namespace.signal("task_failed", doc="A task raised (kwargs: task, term, error).")
task_finished = namespace.signal(
    "task_finished",
    doc="A task run ended (kwargs: task, term, scheduled_at, duration, error).",
)
task_stuck = namespace.signal(
    "task_stuck", doc="A task ignored cancellation past stop_grace (kwargs: task, term, waited)."
)
fire_skipped = namespace.signal(
    "fire_skipped",
    doc="A scheduled fire did not run (kwargs: task, scheduled_at, fire_key, reason).",
)
node_joined = namespace.signal(
    "node_joined", doc="A node of the lease came alive (kwargs: name, node)."
)
node_lost = namespace.signal(
    "node_lost", doc="A node of the lease stopped heartbeating (kwargs: name, node)."
)
lease_renewed = namespace.signal(
    "lease_renewed",
    doc="The leader renewed its lease (kwargs: name, term, latency, remaining).",
)


def emit(signal: NamedSignal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal`` to each receiver in turn; one that raises is logged and ignored.

    rselection sends every signal this way: blinker lets a receiver's exception reach the
    sender, and the sender here is the leader's keeper, watchdog or scheduler.

    Args:
        signal: one of this module's signals.
        sender: the leader or task handler sending it.
        kwargs: the signal's documented keyword arguments.
    """
    if not signal.receivers:
        return
    for receiver in signal.receivers_for(sender):
        try:
            receiver(sender, **kwargs)
        except (Exception, SystemExit):
            # sys.exit() in a receiver would only end the sending thread (a keeper or
            # watchdog), never the process.
            logger.exception("a receiver of the %r signal raised; ignored", signal.name)
