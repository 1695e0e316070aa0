"""``ReadOnly``: a public attribute that an object keeps elsewhere and callers only read
(a leader's node id, kept in its leadership state and changed only by the leader)."""

from __future__ import annotations

from operator import attrgetter
from typing import Generic, Never, Self, TypeVar, overload

__all__ = ["ReadOnly"]

T = TypeVar("T")


class ReadOnly(Generic[T]):
    """A read-only attribute whose value is read from ``source``, a dotted path from the
    object (``"_state.node_id"``), on every access: ``node_id = ReadOnly[str](...)``
    followed by the attribute's docstring. Setting it raises ``AttributeError``, as for a
    property without a setter (and type checkers refuse it)."""

    def __init__(self, source: str) -> None:
        self._read = attrgetter(source)
        self._name = source

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = f"{owner.__name__}.{name}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Self: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object, owner: type | None = None) -> T | Self:
        if obj is None:
            return self
        value: T = self._read(obj)
        return value

    def __set__(self, obj: object, value: Never) -> Never:
        raise AttributeError(f"{self._name} is read-only")
