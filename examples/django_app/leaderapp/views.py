"""``GET /``: this worker's node id, whether it leads, and who does."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from .leading import running_leader


def leadership(request: HttpRequest) -> JsonResponse:
    """This worker's view of the lease (503 when no leader runs in this process)."""
    leader = running_leader()
    if leader is None:
        return JsonResponse(
            {
                "error": "no leader runs in this process: serve project.asgi:application "
                "with an ASGI server (uvicorn, or gunicorn -k uvicorn.workers.UvicornWorker), "
                "or run manage.py runleader next to it"
            },
            status=503,
        )
    # A plain (sync) view: leader.leader() may query the database, and Django runs sync
    # views in a thread under ASGI, off the event loop.
    holder = leader.leader()
    return JsonResponse(
        {
            "node_id": leader.node_id,
            "is_leader": leader.is_leader,
            "term": leader.term,
            "holder": None if holder is None else {"node_id": holder.node_id, "term": holder.term},
        }
    )
