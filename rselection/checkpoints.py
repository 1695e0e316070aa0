"""Durable task state fenced by term: the checkpoint store role and ``ctx.checkpoint``.

A persistent task keeps its progress (a queue cursor, counters) in a *snapshot*: a JSON
document stored under a key. When leadership moves, the new leader loads the last
snapshot and resumes; the old leader can no longer overwrite it, because its saves are
*fenced*: ``save(key, state, term=T, lease=name)`` commits only while term ``T`` still
holds lease ``name``, so once the next term exists a stale save is refused with
:class:`~rselection.errors.StaleLeaderError` and nothing is written.

Any object with ``load``, ``save`` and ``delete`` is a :class:`CheckpointStore`; a
leader hands it to its tasks as ``ctx.checkpoint`` (a :class:`TaskCheckpoint`: the
task's name as key, the task's term as fence). Two ship with rselection:
:class:`~rselection.postgres.PostgresCheckpointStore` (durable, next to the Postgres
lease) and :class:`MemoryCheckpointStore` (this process only; the default of
:class:`~rselection.SingleNodeLeader`), which keep the same rules: versions that grow by
one on every save and delete and never repeat, JSON states with the same limits, and
saves refused once their term no longer holds the lease.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigError, StaleLeaderError
from .lease import LeaseBackend
from .validation import check_name

__all__ = [
    "DEFAULT_MAX_STATE_BYTES",
    "FORMAT_VERSION",
    "CheckpointStore",
    "Key",
    "LeaseFencedStore",
    "MemoryCheckpointStore",
    "Snapshot",
    "TaskCheckpoint",
    "check_key",
    "check_term",
    "encode_state",
    "key_of",
]

FORMAT_VERSION = 1
"""Envelope format of stored snapshots that this release writes and understands."""

DEFAULT_MAX_STATE_BYTES = 64 * 2**20
"""Largest encoded state a store accepts by default (64 MiB)."""

# A \u0000 escape in JSON text (an even number of backslashes before it is text).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

Key = str | tuple[str, ...]
"""A checkpoint key: a string, or a tuple of strings such as ``("owner", "repo", "main")``.

A one-element tuple is the same key as its string.
"""


@dataclass(frozen=True)
class Snapshot:
    """One stored state of a key, as loaded or just saved.

    Attributes:
        key: the key (a ``str`` for one-part keys, else a tuple of strings).
        state: the decoded JSON state (dicts, lists, str, int, float, bool, None).
        version: 1 for the first save of the key, +1 on every save or delete after.
        term: the fencing term the save was made under (``save(..., term=T)`` and
            ``ctx.checkpoint.save``; a store's own per-key leases record their term
            too), ``None`` for an unfenced save.
        updated_at: the store's time of the save (aware, UTC).
        format_version: the envelope format the state was stored with.
    """

    key: Key
    state: Any
    version: int
    term: int | None
    updated_at: datetime
    format_version: int = FORMAT_VERSION


def check_key(key: object) -> list[str]:
    """The parts of a checkpoint key, checked; raise :class:`ConfigError` if unusable.

    Args:
        key: a non-empty string, or a non-empty tuple of non-empty strings, without NUL.
    """
    parts: Any = (key,) if isinstance(key, str) else key
    if not isinstance(parts, tuple) or not parts or not all(isinstance(p, str) for p in parts):
        raise ConfigError(
            f"checkpoint key must be a non-empty str or a non-empty tuple of str, got {key!r:.80}"
        )
    for part in parts:
        if not part:
            raise ConfigError(f"checkpoint key {key!r:.80} has an empty part")
        if "\x00" in part:
            raise ConfigError(f"checkpoint key {key!r:.80} contains a NUL character")
    return list(parts)


def key_of(parts: list[str]) -> Key:
    """The key made of ``parts``: a ``str`` for one part, else a tuple."""
    return parts[0] if len(parts) == 1 else tuple(parts)


def check_term(term: object) -> int:
    """Return ``term`` if it is a non-negative int, else raise :class:`ConfigError`."""
    if isinstance(term, bool) or not isinstance(term, int) or term < 0:
        raise ConfigError(f"term must be a non-negative int, got {term!r}")
    return term


def encode_state(key: Key, state: Any, max_bytes: int) -> str:
    """``state`` as compact JSON text, refused as every store refuses it.

    Args:
        key: the checkpoint key, for messages.
        state: the value to store.
        max_bytes: the largest encoded size accepted (UTF-8 bytes).

    Raises:
        TypeError: ``state`` holds a value JSON cannot encode.
        ConfigError: NaN or an infinity, a circular or too deeply nested structure, a
            lone surrogate, a NUL character (Postgres ``jsonb`` cannot hold one, so no
            store accepts it), or more than ``max_bytes``.
    """
    try:
        text = json.dumps(state, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except TypeError as exc:
        raise TypeError(
            f"checkpoint state for {key!r:.80} cannot be stored as JSON: {exc}; use "
            "dict (str keys), list, str, int, float, bool and None, and convert other "
            "values (datetimes, sets, objects) first"
        ) from exc
    except (ValueError, RecursionError) as exc:
        raise ConfigError(
            f"checkpoint state for {key!r:.80} cannot be stored as JSON: {exc} "
            "(NaN and infinities, circular or too deeply nested structures are refused)"
        ) from exc
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"checkpoint state for {key!r:.80} holds a string that is not valid "
            f"Unicode (a lone surrogate): {exc}"
        ) from exc
    if _NUL_ESCAPE.search(text):
        raise ConfigError(
            f"checkpoint state for {key!r:.80} contains a NUL character (\\u0000), which "
            "Postgres jsonb cannot store"
        )
    if size > max_bytes:
        raise ConfigError(
            f"checkpoint state for {key!r:.80} is {size} bytes as JSON, more than "
            f"max_state_bytes={max_bytes}: store less, or raise the limit "
            "(Postgres jsonb holds at most 255 MB)"
        )
    return text


@runtime_checkable
class CheckpointStore(Protocol):
    """Where ``ctx.checkpoint`` keeps task state: snapshots by key, saves fenced by term.

    :class:`~rselection.postgres.PostgresCheckpointStore` and
    :class:`MemoryCheckpointStore` are two. A store of your own must keep their rules:
    ``save(key, state, term=T, lease=name)`` commits only while term ``T`` holds lease
    ``name``, atomically with the write (a takeover never lands between the check and
    the write), else raises :class:`~rselection.errors.StaleLeaderError` and writes
    nothing; without ``term`` the save is not fenced.
    """

    def load(self, key: Key) -> Snapshot | None:
        """The last saved snapshot of ``key``, or ``None`` (never saved, or deleted)."""
        ...

    def save(
        self, key: Key, state: Any, *, term: int | None = None, lease: str = "default"
    ) -> Snapshot:
        """Store ``state`` as the new snapshot of ``key``; with ``term``, only while that
        term holds ``lease`` (else :class:`~rselection.errors.StaleLeaderError`)."""
        ...

    def delete(self, key: Key, *, term: int | None = None, lease: str = "default") -> bool:
        """Delete the snapshot of ``key`` (fenced like :meth:`save`); ``True`` if one
        existed. The key's version counter is kept: versions never repeat."""
        ...


@runtime_checkable
class LeaseFencedStore(CheckpointStore, Protocol):
    """A checkpoint store that fences against lease objects it is given.

    A leader built with such a store hands it its lease at construction (the Postgres
    store needs no such step: it reads the lease table).
    """

    def add_lease(self, lease: LeaseBackend) -> None:
        """Fence saves of ``lease.name`` against ``lease`` from now on."""
        ...


class MemoryCheckpointStore:
    """Checkpoints kept in this process, with the rules of the Postgres store.

    The default store of :class:`~rselection.SingleNodeLeader`, so ``ctx.checkpoint``
    works in local development and tests. States are stored as JSON text (so a task sees
    what it would see from Postgres: tuples come back as lists, a state JSON cannot
    encode is refused at the save); versions grow by one on every save and delete and
    are never reused; ``save(key, state, term=T, lease=name)`` commits only while ``T``
    is the live holder's term of the lease called ``name``, checked and written under
    one lock, so a save of an ended term is refused with
    :class:`~rselection.errors.StaleLeaderError`. Thread-safe.

    Args:
        leases: the leases fenced saves are checked against (a leader built with this
            store adds its own lease; see :meth:`add_lease`).
        max_state_bytes: largest encoded state :meth:`save` accepts (UTF-8 bytes of the
            JSON text).

    Raises:
        ConfigError: a bad lease or limit.
    """

    def __init__(
        self,
        *,
        leases: Iterable[LeaseBackend] = (),
        max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
    ) -> None:
        if (
            isinstance(max_state_bytes, bool)
            or not isinstance(max_state_bytes, int)
            or max_state_bytes <= 0
        ):
            raise ConfigError(f"max_state_bytes must be a positive int, got {max_state_bytes!r}")
        self.max_state_bytes = max_state_bytes
        self._lock = threading.Lock()
        self._leases: dict[str, LeaseBackend] = {}
        # key parts -> (JSON text or None once deleted, version, term, updated_at)
        self._rows: dict[tuple[str, ...], tuple[str | None, int, int | None, datetime]] = {}
        for lease in leases:
            self.add_lease(lease)

    def add_lease(self, lease: LeaseBackend) -> None:
        """Fence saves of ``lease.name`` against ``lease`` (replacing any lease of that
        name given before).

        Raises:
            ConfigError: ``lease`` is not a :class:`~rselection.LeaseBackend`.
        """
        if not isinstance(lease, LeaseBackend):
            raise ConfigError(
                f"a MemoryCheckpointStore fences against a LeaseBackend, got {type(lease).__name__}"
            )
        with self._lock:
            self._leases[check_name(lease.name, "lease name")] = lease

    def load(self, key: Key) -> Snapshot | None:
        """The last saved snapshot of ``key``, or ``None`` if never saved (or deleted).

        Raises:
            ConfigError: a bad key.
        """
        parts = check_key(key)
        with self._lock:
            row = self._rows.get(tuple(parts))
        if row is None:
            return None
        text, version, term, updated_at = row
        if text is None:
            return None
        return Snapshot(key_of(parts), json.loads(text), version, term, updated_at)

    def save(
        self, key: Key, state: Any, *, term: int | None = None, lease: str = "default"
    ) -> Snapshot:
        """Store ``state`` as the new snapshot of ``key``; fenced when ``term`` is given.

        Args:
            key: a string or a tuple of strings.
            state: a JSON-encodable value.
            term: commit only while this term holds ``lease``.
            lease: the name of the lease ``term`` refers to (the leader's ``name``).

        Returns:
            The snapshot just written (its new version).

        Raises:
            StaleLeaderError: ``term`` no longer holds the lease; nothing was written.
            TypeError: ``state`` holds a value JSON cannot encode.
            ConfigError: a bad key or term, a state refused as JSON or too large, or a
                lease this store was not given.
        """
        parts = check_key(key)
        text = encode_state(key_of(parts), state, self.max_state_bytes)
        with self._lock:
            self._fence(term, lease)
            version = self._next_version(parts)
            now = datetime.now(UTC)
            self._rows[tuple(parts)] = (text, version, term, now)
        return Snapshot(key_of(parts), json.loads(text), version, term, now)

    def delete(self, key: Key, *, term: int | None = None, lease: str = "default") -> bool:
        """Delete the snapshot of ``key``; fenced like :meth:`save`.

        The version counter of the key is kept (the next save continues from it).

        Returns:
            ``True`` if a snapshot was deleted, ``False`` if there was none.

        Raises:
            StaleLeaderError: ``term`` no longer holds the lease; nothing was deleted.
            ConfigError: a bad key or term, or a lease this store was not given.
        """
        parts = check_key(key)
        with self._lock:
            self._fence(term, lease)
            row = self._rows.get(tuple(parts))
            if row is None or row[0] is None:
                return False
            self._rows[tuple(parts)] = (None, row[1] + 1, term, datetime.now(UTC))
            return True

    def _next_version(self, parts: list[str]) -> int:
        row = self._rows.get(tuple(parts))
        return 1 if row is None else row[1] + 1

    def _fence(self, term: int | None, lease: str) -> None:
        """Refuse unless ``term`` is the live holder's term of ``lease`` (under the lock,
        so no save lands after a check that a later term would fail)."""
        if term is None:
            return
        number = check_term(term)
        backend = self._leases.get(lease)
        if backend is None:
            known = ", ".join(repr(name) for name in self._leases) or "none"
            raise ConfigError(
                f"this MemoryCheckpointStore cannot fence against lease {lease!r} (it knows "
                f"{known}): build it with MemoryCheckpointStore(leases=[lease]) or hand it "
                "to the leader of that lease as checkpoint_store="
            )
        holder = backend.current()
        if holder is None or holder.term != number:
            raise StaleLeaderError(
                f"term {number} no longer holds lease {lease!r} (it was taken over, released "
                "or expired): nothing was written; stop acting as leader, the new leader's "
                "term is higher"
            )

    def __repr__(self) -> str:
        return f"MemoryCheckpointStore(leases={sorted(self._leases)!r}, keys={len(self._rows)})"


class TaskCheckpoint:
    """``ctx.checkpoint``: the snapshot of one task, fenced to the term that runs it.

    The key is the task's name; every save and delete commits only while the term still
    holds the leader's lease, so a deposed leader can never overwrite what its successor
    saved. The async variants run the call in a worker thread, so an ``async def`` task
    does not block its event loop.

    Args:
        store: the leader's checkpoint store.
        key: the key (the task's name).
        term: the fencing term of the task's run.
        lease: the name of the leader's lease.
    """

    def __init__(self, store: CheckpointStore, key: Key, term: int, lease: str) -> None:
        self.store = store
        self._key = key_of(check_key(key))
        self._term = check_term(term)
        self._lease = lease

    @property
    def key(self) -> Key:
        """The key the task's snapshot is stored under."""
        return self._key

    @property
    def term(self) -> int:
        """The term saves are fenced to."""
        return self._term

    @property
    def lease(self) -> str:
        """The name of the lease saves are fenced against."""
        return self._lease

    def load(self) -> Snapshot | None:
        """The task's last snapshot (from any term), or ``None``."""
        return self.store.load(self._key)

    def save(self, state: Any) -> Snapshot:
        """Save ``state``; :class:`~rselection.errors.StaleLeaderError` once the term is over.

        Args:
            state: a JSON-encodable value.
        """
        return self.store.save(self._key, state, term=self._term, lease=self._lease)

    def delete(self) -> bool:
        """Delete the task's snapshot (fenced like :meth:`save`); ``True`` if one existed."""
        return self.store.delete(self._key, term=self._term, lease=self._lease)

    async def aload(self) -> Snapshot | None:
        """:meth:`load` for ``async def`` tasks (runs in a worker thread)."""
        return await asyncio.to_thread(self.load)

    async def asave(self, state: Any) -> Snapshot:
        """:meth:`save` for ``async def`` tasks (runs in a worker thread).

        Args:
            state: a JSON-encodable value.
        """
        return await asyncio.to_thread(self.save, state)

    async def adelete(self) -> bool:
        """:meth:`delete` for ``async def`` tasks (runs in a worker thread)."""
        return await asyncio.to_thread(self.delete)

    def __repr__(self) -> str:
        return f"TaskCheckpoint({self._key!r}, term={self._term}, lease={self._lease!r})"
