"""One Redis lease's side of the process's liveness hub (:mod:`.liveness`).

While the lease holds a term with fast failover, the hub beats for it; while it waits
as a follower, the hub times the holder it saw by that holder's beats, checks its
connection when they stop, and reads its lease when it is due to expire. The hub's
findings wake the lease's wait; its next attempt takes the lease over (the acquire
script checks again). See ``docs/explanation/redis.md``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .holder import Seen, is_client_id
from .liveness import LivenessHub

__all__ = ["LeaseLiveness"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LeaseLiveness:
    """The beats and the followed holder of one lease (a
    :class:`~rselection.redis.liveness.Follower` of its hub).

    Args:
        name: the lease name (for logs).
        key: the lease's key (the hub reads it when the holder's lease is due to expire).
        ttl: the lease's ttl, seconds.
        liveness_interval: see :class:`~rselection.redis.RedisLease`; ``None``: no
            beats, no following (fast crash failover off).
        wake: ends the lease's wait; safe from any thread.
    """

    name: str
    key: str
    ttl: float
    liveness_interval: float | None
    wake: Callable[[], None]
    fast: bool = field(default=False, init=False)
    """Whether a follower may take over from us when our connection is gone."""
    can_probe: bool = field(default=True, init=False)
    """Whether the server lets us run ``CLIENT LIST ID``."""
    run_id: str = field(default="", init=False)
    """The server's run id: the holders followed must be on that run."""
    hub: LivenessHub | None = field(default=None, init=False)
    """The process's hub on the lease's server, once connected."""
    seen: Seen | None = field(default=None, init=False)
    """The holder the last attempt saw."""
    seen_expires: float = field(default=0.0, init=False)
    """:func:`rselection.clock.monotonic` time at which :attr:`seen`'s lease expires."""

    def __post_init__(self) -> None:
        self._dead: Seen | None = None
        self._lock = threading.Lock()  # _dead is set by the hub's thread

    def reset_after_fork(self) -> None:
        """Forget the parent's hub and holders (the child's hub is made on connect)."""
        self.hub = None
        self.seen = self._dead = None
        self._lock = threading.Lock()

    @property
    def beacon(self) -> str:
        """What the lease's value names as its holder's beats (see
        :attr:`LivenessHub.beacon`); empty without a hub."""
        return self.hub.beacon if self.hub is not None else ""

    @property
    def dropped(self) -> int:
        """Beats the hub dropped unread (forged or replayed)."""
        return self.hub.dropped.count if self.hub is not None else 0

    @property
    def holder_gone(self) -> bool:
        """Whether the hub found the followed holder's connection gone."""
        return self._dead is not None

    def take_gone(self) -> Seen | None:
        """The holder found gone since the last attempt (once), or ``None``."""
        with self._lock:
            dead, self._dead = self._dead, None
        return dead

    def lead(self, holding: bool) -> None:
        """The lease holds a term (or not): while it does with fast takeover, the
        process beats for it."""
        if self.hub is None:
            return
        if holding and self.fast and self.liveness_interval is not None:
            self.hub.hold(self, self.liveness_interval)
        else:
            self.hub.unhold(self)

    def connection_failed(self) -> None:
        """The keeper connection of a held term failed: its followers check it now."""
        if self.hub is not None:
            self.hub.connection_failed(self)

    def follow(self, seen: Seen | None, expires: float = 0.0) -> None:
        """Set the holder the last attempt saw (``None``: nobody, or this keeper) and
        when its lease would expire (:func:`rselection.clock.monotonic`); a wait times
        it (:meth:`watch`)."""
        with self._lock:
            self.seen = seen
            if seen is None:
                self._dead = None
            else:
                self.seen_expires = expires
        if seen is None and self.hub is not None:
            self.hub.unfollow(self)

    def watch(self, leading: bool) -> None:
        """A wait begins: have the hub time the holder seen and watch its expiry."""
        seen, hub = self.seen, self.hub
        if hub is None or self.liveness_interval is None:
            return
        if leading or seen is None:
            hub.unfollow(self)
            return
        hub.watch_expiry(self, seen, self.seen_expires)
        if seen.fast and self.can_probe and is_client_id(seen.client) and seen.run == self.run_id:
            hub.follow(self, seen, self.liveness_interval, self.ttl)
        else:
            hub.stop_timing(self)

    def expiry_watched(self, leading: bool) -> bool:
        """Whether a wait ends when the lease of the holder seen expires."""
        return self.hub is not None and not leading and self.seen is not None

    def holder_found_gone(self, seen: Seen) -> None:
        """The hub found the connection of holder ``seen`` gone: the wait ends, and the
        next attempt takes the lease over. Safe from any thread."""
        with self._lock:
            if self.seen != seen:
                return  # an attempt saw another holder since
            self._dead = seen
        logger.debug("lease %r: holder of term %s has no connection", self.name, seen.term)
        self.wake()

    def probe_refused(self) -> None:
        """The server refused ``CLIENT LIST``: this node takes over only on expiry."""
        self.can_probe = False

    def lease_may_be_free(self, seen: Seen) -> None:
        """The hub found holder ``seen``'s lease expired or changed, or could not read
        it: the wait ends, and the keeper attempts. Safe from any thread."""
        with self._lock:
            if self.seen is not seen:
                return  # an attempt saw the holder since
        self.wake()
