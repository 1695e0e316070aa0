"""An example lease backend of a user's own: a lease kept in a JSON file.

It shows what :class:`rselection.LeaseBackend` asks of a backend, in about a hundred
lines, and passes the leader conformance suite
(``tests/integration/conformance/test_leader.py``). Every node on one machine opens the
same file; each read-modify-write runs under an exclusive ``flock``, which makes the
file the lease server. Expiry is this machine's wall clock, the one clock every node
shares here. No crash detection: a crashed holder's lease passes on at expiry.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rselection import Acquisition, LeaderInfo


class FileLease:
    """The lease called ``name``, kept in ``<directory>/<name>.json``.

    Args:
        directory: where the lease files live (one per lease name).
        name: the lease name.
        ttl: seconds a lease lasts after its last renewal.
        poll: seconds between looks at the file while waiting for a change.
    """

    def __init__(self, directory: Path, name: str, *, ttl: float = 15.0, poll: float = 0.02):
        self.name = name
        self.ttl = ttl
        self.poll = poll
        self.path = directory / f"{name}.json"
        self._wake = threading.Event()
        # The holder and term this object last saw under the lock: a change that lands
        # between a call and the next wait_for_change() is a change all the same.
        self._last_seen: tuple[Any, ...] | None = None

    # -- the file ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The lease state, read and (if changed) written back under an exclusive lock."""
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = self._read()
                before = dict(state)
                yield state
                if state != before:
                    tmp = self.path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(state))
                    os.replace(tmp, self.path)  # readers see the old or the new state
                self._last_seen = state["holder"], state["term"]
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self.path.read_text())
        except FileNotFoundError:
            state = {"term": 0, "holder": None, "acquired": 0.0, "expires": 0.0}
        return state

    def _holder(self, state: dict[str, Any], now: float) -> LeaderInfo | None:
        if state["holder"] is None or state["expires"] <= now:
            return None
        return LeaderInfo(
            state["holder"],
            state["term"],
            datetime.fromtimestamp(state["acquired"], UTC),
            datetime.fromtimestamp(state["expires"], UTC),
        )

    # -- LeaseBackend -----------------------------------------------------------------

    def connect(self) -> None:
        """Nothing to connect: the file is opened per call."""

    def try_acquire(self, node_id: str) -> Acquisition:
        """Take the lease when nobody holds it or its holder's ttl ran out."""
        with self._locked() as state:
            now = time.time()
            holder = self._holder(state, now)
            if holder is not None:
                return Acquisition(False, holder, state["expires"] - now)
            state.update(
                term=state["term"] + 1, holder=node_id, acquired=now, expires=now + self.ttl
            )
            return Acquisition(True, self._holder(state, now), self.ttl)

    def renew(self, node_id: str, term: int) -> bool:
        """Extend the lease by the ttl while ``node_id`` holds ``term``."""
        with self._locked() as state:
            now = time.time()
            holder = self._holder(state, now)
            if holder is None or (holder.node_id, holder.term) != (node_id, term):
                return False
            state["expires"] = now + self.ttl
            return True

    def release(self, node_id: str, term: int) -> None:
        """Clear the holder (the term counter is kept); waiting followers see it at once."""
        with self._locked() as state:
            if (state["holder"], state["term"]) == (node_id, term):
                state["holder"] = None

    def current(self) -> LeaderInfo | None:
        """The live holder, or ``None``."""
        return self._holder(self._read(), time.time())

    def wait_for_change(self, timeout: float) -> None:
        """Return when the holder changed, on :meth:`interrupt`, or after ``timeout``."""
        seen = self._last_seen if self._last_seen is not None else self._seen()
        deadline = time.monotonic() + timeout
        while not self._wake.wait(min(self.poll, max(0.0, deadline - time.monotonic()))):
            now_seen = self._seen()
            if time.monotonic() >= deadline or now_seen != seen:
                self._last_seen = now_seen
                return
        self._wake.clear()  # an interrupt that came while nobody waited is not lost

    def _seen(self) -> tuple[Any, ...]:
        state = self._read()
        return state["holder"], state["term"]

    def interrupt(self) -> None:
        """Wake the waiting keeper, or the next wait if none is waiting now."""
        self._wake.set()

    def term_ended(self, term: int) -> None:
        """Nothing to do: there is no session to keep."""

    def close(self) -> None:
        """Nothing to close."""
