"""The keeper's thread: the notification pump.

One thread per shared keeper waits on the session's socket and on its wake-up, and in
turn: reads the notifications the session brought (:meth:`KeeperPump._read_inbox`),
sends the queued batches (:mod:`.batches`), delivers the wake-ups the rate limit held
back, leaves the channels of closed leases, reads the ring's members and sends the
heartbeats due (:mod:`.heartbeats`). It believes what a notification says only from a
trusted peer's keeper session and rate-limits what the others wake (see
:mod:`~rselection.postgres.notice_gate`); a keeper that dies is announced on the ring
channel (see :mod:`rselection.postgres.ring`) and wakes every follower at once.
"""

from __future__ import annotations

import logging
import selectors
import time

from ... import clock
from .. import notices
from ..notices import lease_notice, ring_notice
from ..session_pool import SessionPool
from .batches import KeeperBatches
from .heartbeats import KeeperHeartbeats

__all__ = ["KeeperPump"]

logger = logging.getLogger(__name__)

_READ_PER_ROUND = 500  # notifications read between two sends of the queued batches


class KeeperPump(KeeperBatches, KeeperHeartbeats):
    """The keeper's thread over its session, batches and heartbeats (see the module)."""

    def _pump_loop(self) -> None:
        """Send the queued batches, read notifications (and see a dead session) while the
        session is idle, and send the heartbeats due."""
        while True:
            with self._state:
                if self._closed:
                    return
                conn = self._conn if not self._holds.broken else None
            wake = self._wakeup.socket
            try:
                with selectors.DefaultSelector() as sel:
                    if wake is not None:
                        sel.register(wake, selectors.EVENT_READ, "wake")
                    if conn is not None and not conn.closed:
                        sel.register(conn.pgconn.socket, selectors.EVENT_READ, "db")
                    events = sel.select(0.0 if self._inbox else self._until_beat(1.0))
                self._wakeup.clear()
                if conn is not None and any(key.data == "db" for key, _ in events):
                    self._poll(conn)
                self._read_inbox()
                self._send_queued()
                self._wake_deferred()
                if conn is not None:
                    self._leave_channels()
                    self._free_overdue()
                    self._read_members()
                    self._beat_due()
                SessionPool.close_idle(self._conninfo)
            except Exception:  # never let the pump die: it wakes every follower
                logger.exception("keeper: error reading notifications; going on")
                time.sleep(0.1)

    def _until_beat(self, cap: float) -> float:
        """Seconds until the next heartbeat, locked release or unlock is due (at most
        ``cap``)."""
        with self._state:
            due = min(self._beats.values(), default=None)
            retry = min((at for at, _ in self._retries), default=None)
            usable = self._conn is not None and not self._holds.broken
            unlocks = self._unlocks_due() if usable else None  # none sent on a broken one
        for at in (retry, unlocks, self._gate.next_due(reading=usable)):
            if at is not None:
                due = at if due is None else min(due, at)
        return cap if due is None else max(0.0, min(cap, due - clock.monotonic()))

    def _read_inbox(self) -> None:
        """Act on the notifications received, at most :data:`_READ_PER_ROUND` of them
        (then the queued batches go out, and the rest are read next round)."""
        inbox = self._inbox
        for _ in range(min(len(inbox), _READ_PER_ROUND)):
            self._dispatch(*inbox.popleft())
        overflow, self._overflow = self._overflow, None
        if overflow is None:
            return
        count, channel, payload, sender = overflow
        notices.dropped.add(channel, payload, sender, count=count)
        # Which of them mattered is unknown: every client looks, as after a death.
        with self._state:
            ring = self._ring_channel
            clients = list(self._clients)
        if self._admit(ring, False, "down"):
            for client in clients:
                client.wake()

    def _dispatch(self, channel: str, payload: str, sender: int) -> None:
        """Act on one notification (on the keeper's thread); never raises."""
        try:
            self._notice(channel, payload, sender)
        except Exception:  # counted and reported as a dropped notice: at most once a minute
            logger.debug("keeper: error acting on a notification", exc_info=True)
            notices.dropped.add(channel, payload, sender)

    def _notice(self, channel: str, payload: str, sender: int) -> None:
        """Wake the clients ``channel``'s notice concerns, believing what it says only
        from a proven sender (see :mod:`.notice_gate`)."""
        with self._state:
            ring = channel == self._ring_channel
            clients = list(self._clients) if ring else list(self._by_channel.get(channel, ()))
        proven = self._gate.proven(sender)
        if ring:
            announced = ring_notice(channel, payload, sender)
            if announced is None:
                return
            if announced.kind == "up":
                self._gate.joined()
                if self._ring is not None and not self._gate.is_own(announced.pid):
                    self._ring.ring_changed(announced.pid)
                self._wakeup.wake()  # the pump reads the members
                return
            # "down": a keeper died; the followers of its leases attempt at once.
            if self._admit(channel, proven, "down"):
                for client in clients:
                    client.holder_died(announced.pid)
            return
        notice = lease_notice(channel, payload, sender)
        if notice is None:
            return
        if not proven and notice.event == "acquired" and notice.holder_pid == sender:
            self._gate.joined()  # a keeper not known yet, perhaps: the next one counts
        if not self._admit(channel, proven, notice.event):
            return
        own = self._gate.is_own(sender)
        for client in clients:
            client.notified(notice, sender=sender, own_session=own, proven=proven)

    def _admit(self, channel: str, proven: bool, kind: str) -> bool:
        """Whether a notice may wake now (else the pump wakes for it later)."""
        if self._gate.admit(channel, proven, kind):
            return True
        self._wakeup.wake()  # the pump's next wait ends when the deferred wake-up is due
        return False

    def _wake_deferred(self) -> None:
        """Deliver the wake-ups the rate limit held back, now due: on the ring, as a
        keeper's death that names nobody; on a lease channel, as notices of the kinds
        held back, believing none."""
        due = self._gate.due()
        if not due:
            return
        with self._state:
            ring = self._ring_channel
            woken = [
                (
                    channel,
                    kinds,
                    list(self._clients if channel == ring else self._by_channel.get(channel, ())),
                )
                for channel, kinds in due
            ]
        for channel, kinds, clients in woken:
            for client in clients:
                if channel == ring:
                    client.wake()
                else:
                    client.nudged(kinds)
