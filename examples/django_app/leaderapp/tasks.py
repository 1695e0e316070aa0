"""The leader-scoped tasks of this Django project, on one module-level handler."""

from __future__ import annotations

import logging

import rselection as rs

log = logging.getLogger(__name__)

handler = rs.TaskHandler()
"""Every task of the project; ``runleader`` runs it while this process leads."""


@handler.interval(1, name="tick")
def tick(ctx: rs.TaskContext) -> None:
    # A real task would use the ORM here; call django.db.close_old_connections()
    # first, as Django does around each request, since this runs in its own thread.
    print(f"[{ctx.node_id}] tick {ctx.fire_key} (term {ctx.term})", flush=True)


@handler.persistent("janitor")
def janitor(ctx: rs.TaskContext) -> None:
    while ctx.sleep(5):
        log.info("janitor pass in term %d", ctx.term)
