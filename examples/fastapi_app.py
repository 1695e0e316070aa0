"""A FastAPI app whose lifespan runs a leader: every replica serves, one runs the tasks.

    pip install 'rselection[prometheus]' fastapi uvicorn
    RSELECTION_DSN=postgresql://app@db/app uvicorn examples.fastapi_app:app

Without ``RSELECTION_DSN`` the app leads alone (a single node, no database). The
lifespan starts the leader with ``async with``, so ``async def`` tasks run on the app's
own event loop, and stops it on shutdown: tasks are cancelled and joined and the lease
is released, so another replica takes over at once.

``GET /healthz`` reports this replica's view: whether it leads, the term, the current
holder, and ``handler.health()`` per task. It answers 503 only when this replica leads
and a task's last run failed (a follower runs nothing, so it is healthy). With
``RSELECTION_METRICS=1`` (and prometheus-client installed) ``GET /metrics`` serves the
rselection metrics.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

import rselection as rs

log = logging.getLogger("fastapi_app")


def build_tasks() -> rs.TaskHandler:
    """The leader-scoped tasks of this app."""
    tasks = rs.TaskHandler()

    @tasks.interval(1, name="refresh-cache")
    async def refresh_cache(ctx: rs.TaskContext) -> None:
        # Runs on the app's event loop, on the leading replica only.
        log.info("refreshing the cache for fire %s", ctx.fire_key)

    @tasks.persistent("outbox-relay")
    async def outbox_relay(ctx: rs.TaskContext) -> None:
        while await ctx.asleep(0.5):
            pass  # relay pending rows here; asleep() returns False once leadership ends

    return tasks


def build_leader(
    tasks: rs.TaskHandler, dsn: str | None, *, name: str = "fastapi-app", **options: Any
) -> rs.PostgresLeader | rs.SingleNodeLeader:
    """A PostgresLeader when a DSN is given, else a SingleNodeLeader."""
    if dsn:
        return rs.PostgresLeader(dsn, tasks, name=name, **options)
    return rs.SingleNodeLeader(tasks, name=name)


def create_app(dsn: str | None = None, *, metrics: bool = False, **options: Any) -> FastAPI:
    """Build the app around its own handler and leader.

    Args:
        dsn: Postgres DSN of the lease (``None``: lead alone).
        metrics: enable ``rselection.metrics`` and serve them at ``/metrics``.
        options: passed to ``PostgresLeader`` (``node_id``, ``ttl``, ...).
    """
    tasks = build_tasks()
    leader = build_leader(tasks, dsn, **options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if metrics:
            import rselection.metrics

            rselection.metrics.enable()
        async with leader:
            yield
        # Leaving the block cancelled and joined the tasks and released the lease.

    app = FastAPI(lifespan=lifespan)
    app.state.tasks = tasks
    app.state.leader = leader

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        # A plain def endpoint: leader.leader() may query the database, so it runs in
        # the threadpool instead of on the event loop.
        health = tasks.health()
        holder = leader.leader()
        failing = sorted(name for name, report in health.items() if report["state"] == "failed")
        ok = not (leader.is_leader and failing)
        body = {
            "status": "ok" if ok else "failing",
            "node_id": leader.node_id,
            "is_leader": leader.is_leader,
            "term": leader.term,
            "holder": None
            if holder is None
            else {"node_id": holder.node_id, "term": holder.term, "expires_at": holder.expires_at},
            "failing": failing,
            "tasks": health,
        }
        return JSONResponse(jsonable_encoder(body), status_code=200 if ok else 503)

    if metrics:
        from prometheus_client import make_asgi_app

        app.mount("/metrics", make_asgi_app())

    return app


app = create_app(
    os.environ.get("RSELECTION_DSN"), metrics=os.environ.get("RSELECTION_METRICS") == "1"
)
"""The app for ``uvicorn examples.fastapi_app:app``."""
