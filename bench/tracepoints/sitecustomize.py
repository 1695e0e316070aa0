"""Trace points for ``bench/handover_trace.py``, loaded by every node of a bench run.

With ``RS_TRACE`` set to a folder, each process appends lines ``<monotonic ns> <pid>
<point> <thread>`` to ``<folder>/<pid>.txt`` as it enters (``>``) and leaves (``<``)
the methods below, which both the one engine and the tree before it have. Python puts
this module on the path of every process whose ``PYTHONPATH`` names this folder.
"""

import os

_FOLDER = os.environ.get("RS_TRACE")

POINTS = (
    ("rselection.leader", "LeaseLeader", "stop"),
    ("rselection.tasks", "TaskHandler", "end_term"),
    ("rselection.tasks", "TaskHandler", "start_term"),
    ("rselection.redis.lease", "RedisLease", "release"),
    ("rselection.redis.lease", "RedisLease", "try_acquire"),
    ("rselection.redis.lease", "RedisLease", "_drain"),
)


def _install(folder: str) -> None:
    import functools
    import importlib
    import threading
    import time

    fd = os.open(os.path.join(folder, f"{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def mark(point: str) -> None:
        thread = threading.current_thread().name
        os.write(fd, f"{time.monotonic_ns()} {os.getpid()} {point} {thread}\n".encode())

    def wrap(original, point):
        @functools.wraps(original)
        def traced(*args, **kwargs):
            mark(point + ">")
            try:
                return original(*args, **kwargs)
            finally:
                mark(point + "<")

        return traced

    for module, cls_name, method in POINTS:
        cls = getattr(importlib.import_module(module), cls_name)
        setattr(cls, method, wrap(getattr(cls, method), f"{cls_name}.{method}"))


if _FOLDER:
    _install(_FOLDER)
