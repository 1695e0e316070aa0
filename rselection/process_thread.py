"""A per-process service with one worker thread that runs only while there is work.

The drain watch, the succession watch and the task desk each serve every leader of the
process from one thread: started by the first call that hands it work, ended by itself
once nothing is left, so an idle process keeps no thread of theirs.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from . import forks

__all__ = ["ProcessThread"]


class ProcessThread(forks.PerProcess):
    """Base of a :class:`~rselection.forks.PerProcess` service with a thread of its own.

    ``_cond`` guards the service's work and ``_thread``. A subclass sets
    :attr:`THREAD_NAME`, hands work over under ``_cond`` and then calls
    :meth:`_start_thread`; its :meth:`_run` sets ``_thread`` to ``None`` under
    ``_cond`` when it finds no work left, and returns.
    """

    THREAD_NAME: ClassVar[str]
    """The name of the service's thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def _start_thread(self) -> None:
        """Under ``_cond``: have the thread running (start it unless it runs)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        """The thread's work, until none is left (see the class docstring)."""
        raise NotImplementedError
