"""Names a package loads on first use: :func:`lazy_names`.

The backends' leaders pull in the task runtime (threads, event loops, the scheduler),
which code that only claims fires or fences writes never needs: a backend package
names them in ``__all__`` and imports them when first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, modules: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each name of ``modules``
    from its module (relative to ``package``) when first asked for.

    Args:
        package: the package's ``__name__``.
        modules: each lazy name, and the module that defines it (``".leader"``).
    """

    def __getattr__(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(modules[name], package), name)

    return __getattr__
