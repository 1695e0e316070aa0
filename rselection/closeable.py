"""The ``with`` blocks of the objects that own connections or run in the background:
:class:`Closeable` closes on exit, :class:`Service` starts on entry and stops on exit."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self

__all__ = ["Closeable", "Service", "WithBlock"]


class WithBlock:
    """Base of :class:`Closeable` and :class:`Service`: ``with thing:`` calls
    :meth:`_enter_block` on entry and :meth:`_exit_block` on exit, whatever ends the
    block, so a subclass names what entering and leaving mean and nothing else."""

    def _enter_block(self) -> None:
        """What entering the block does (nothing by default)."""

    def _exit_block(self) -> None:
        """What leaving the block does."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        """Enter the block (see :meth:`_enter_block`); return the object itself."""
        self._enter_block()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave the block (see :meth:`_exit_block`)."""
        self._exit_block()


class Closeable(WithBlock):
    """Base of the objects that open connections of their own.

    ``with Thing(...) as thing:`` returns the object and calls :meth:`close` on exit,
    whatever ends the block. A subclass implements :meth:`close`; it closes only what
    the object opened itself, never a connection or client the caller passed in.
    """

    def close(self) -> None:
        """Close what this object opened itself."""
        raise NotImplementedError

    def _exit_block(self) -> None:
        self.close()


class Service(WithBlock):
    """Base of the objects that run in the background between :meth:`start` and
    :meth:`stop` (the leaders).

    ``with leader:`` and ``async with leader:`` start it on entry and stop it on exit,
    whatever ends the block; the ``async`` exit waits for the stop in a thread, since
    stopping joins async tasks that may run on the very loop that awaits it.
    """

    def start(self) -> None:
        """Start running in the background; return at once."""
        raise NotImplementedError

    def stop(self, timeout: float | None = None) -> None:
        """Stop, and wait up to ``timeout`` seconds (``None``: until stopped)."""
        raise NotImplementedError

    def _enter_block(self) -> None:
        self.start()

    def _exit_block(self) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        """Start, and return the object itself."""
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop, waiting in a thread (see the class)."""
        await asyncio.to_thread(self.stop)
