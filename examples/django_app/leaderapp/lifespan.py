"""An ASGI wrapper that gives Django's application a lifespan: one leader per worker.

Django's ASGI handler serves HTTP and refuses the ASGI ``lifespan`` protocol, and
Django has no start-up or shut-down hook of its own. An ASGI server (uvicorn, or
gunicorn with uvicorn's worker) sends ``lifespan.startup`` in each worker once it
runs, and ``lifespan.shutdown`` when the worker is asked to stop (SIGTERM): that is
where the worker's leader starts and stops. It is built there too, in the worker
itself, so gunicorn's ``--preload`` (the app imported once in the master, then forked)
changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .leading import build_leader, set_running_leader

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class LeaderLifespan:
    """Serve ``app`` and answer the lifespan protocol by starting and stopping a leader.

    Args:
        app: Django's ASGI application (``get_asgi_application()``).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass HTTP and websockets on to ``app``; run the leader for the lifespan."""
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        async with contextlib.AsyncExitStack() as stack:
            message = await receive()
            assert message["type"] == "lifespan.startup", message
            try:
                # ``async with leader``: async def tasks would run on this worker's loop.
                leader = await stack.enter_async_context(build_leader())
            except Exception as exc:
                log.exception("the leader could not start")
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
            set_running_leader(leader)
            stack.callback(set_running_leader, None)
            await send({"type": "lifespan.startup.complete"})
            message = await receive()
            assert message["type"] == "lifespan.shutdown", message
        # Leaving the block stopped the leader: tasks cancelled and joined, lease released.
        await send({"type": "lifespan.shutdown.complete"})
