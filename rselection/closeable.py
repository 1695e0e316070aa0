"""The ``with`` block of every object that owns a connection: close on exit."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Closeable"]


class Closeable:
    """Base of the objects that open connections of their own.

    ``with Thing(...) as thing:`` returns the object and calls :meth:`close` on exit,
    whatever ends the block. A subclass implements :meth:`close`; it closes only what
    the object opened itself, never a connection or client the caller passed in.
    """

    def close(self) -> None:
        """Close what this object opened itself."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        """Return the object itself."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close what the object opened itself (see :meth:`close`)."""
        self.close()
