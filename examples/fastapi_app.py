"""A FastAPI app whose lifespan runs a leader: every replica serves, one runs the tasks.

    pip install 'rselection[prometheus]' fastapi uvicorn
    python examples/fastapi_app.py --port 8001             # leads alone, no database
    RSELECTION_DSN=postgresql://app@db/app python examples/fastapi_app.py --port 8001
    RSELECTION_DSN=postgresql://app@db/app python examples/fastapi_app.py --port 8002

The second replica is the same command with another ``--port``: both serve requests,
one leads. ``uvicorn examples.fastapi_app:app --port 8001`` runs the same app, with the
lease name from ``RSELECTION_NAME`` (default ``fastapi-app``). Without
``RSELECTION_DSN`` (or ``--dsn``) the app leads alone (a single node, no database).
With several workers, each worker is a node of its own and one of them leads;
``logging.json`` makes the servers show rselection's INFO lines (elections)::

    uvicorn examples.fastapi_app:app --workers 3 --log-config examples/logging.json
    gunicorn -k uvicorn.workers.UvicornWorker -w 3 --preload \
        --log-config-json examples/logging.json examples.fastapi_app:app
The lifespan starts the leader with ``async with``, so ``async def`` tasks run on the
app's own event loop, and stops it on shutdown (Ctrl-C or SIGTERM): tasks are cancelled
and joined and the lease is released, so another replica takes over at once.

``GET /healthz`` reports this replica's view: whether it leads, the term, the current
holder, and ``handler.health()`` per task. It answers 503 only when this replica leads
and a task's last run failed (a follower runs nothing, so it is healthy). With
``RSELECTION_METRICS=1`` or ``--metrics`` (and prometheus-client installed) ``GET
/metrics`` serves the rselection metrics.
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
        # last_failed, not state: a failing task's next run shows state "running"
        failing = sorted(name for name, report in health.items() if report["last_failed"])
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
        from fastapi import Response
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        # A route, not app.mount("/metrics", make_asgi_app()): a mount answers /metrics
        # with a redirect to /metrics/, which scrapers and probes do not all follow.
        @app.get("/metrics")
        def serve_metrics() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


app = create_app(
    os.environ.get("RSELECTION_DSN"),
    metrics=os.environ.get("RSELECTION_METRICS") == "1",
    name=os.environ.get("RSELECTION_NAME") or "fastapi-app",
)
"""The app for ``uvicorn examples.fastapi_app:app``."""


def main(argv: list[str] | None = None) -> None:
    """Serve the app with uvicorn on ``--port``; Ctrl-C or SIGTERM stops it cleanly."""
    import argparse
    import contextlib
    import signal

    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("RSELECTION_DSN"), help="the lease's DB")
    parser.add_argument(
        "--name", default=os.environ.get("RSELECTION_NAME") or "fastapi-app", help="lease name"
    )
    parser.add_argument("--port", type=int, default=8001, help="another one per replica")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--metrics", action="store_true", help="serve /metrics")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    served = create_app(
        args.dsn,
        metrics=args.metrics or os.environ.get("RSELECTION_METRICS") == "1",
        name=args.name,
    )
    # uvicorn shuts down gracefully on SIGINT and SIGTERM (the lifespan stops the leader),
    # then raises the signal again for the previous handler: SIGTERM, like Ctrl-C, then
    # ends in a KeyboardInterrupt here instead of killing the process.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(served, host=args.host, port=args.port)
    print("stopped cleanly", flush=True)


if __name__ == "__main__":
    main()
