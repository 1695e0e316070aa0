"""The console's ASGI app: pages, JSON routes and actions over a :class:`.reading.Console`.

Pages: ``/`` (overview and alerts), ``/leases/{name}`` (timeline, nodes, tasks, recent
terms), ``/leases/{name}/shards`` (a sharded lease's grid), ``/leases/{name}/tasks/
{task}`` (run history), ``/login``. JSON: ``GET /api/status``, ``GET /api/leases/
{name}``, ``GET /api/leases/{name}/tasks/{task}``, and the actions, ``POST /api/leases/
{name}/step-down``, ``/handover`` (``to``), ``/nodes/{node}/drain`` and ``/undrain``,
``/tasks/{task}/pause``, ``/resume`` and ``/trigger``. A name is one path segment,
percent-encoded whole (see :mod:`.paths`). The admin API blocks: every call runs in a
worker thread, never on the event loop.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, quote

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..admin import LeaseAdmin, Refused
from ..errors import BackendUnavailable, ConfigError
from ..history import END_REASONS
from ..redaction import redact
from ..task_runs import OUTCOMES
from ..text import iso, printable
from .auth import SESSION_SECONDS, Guard, Throttled, cookie_name, same_origin
from .calls import Calls, NotAnswering
from .hosts import AllowedHosts, HostCheck
from .paths import NAMES, href, segments
from .reading import Action, Console
from .timeline import WINDOW

__all__ = ["build_app"]

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 5  # the pages' live refresh (the script's; without it, none)
MAX_BODY = 64 * 1024  # an action's body is a few names

SECURITY_HEADERS = {
    # The pages load their own stylesheet and script and nothing else; nobody frames them.
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}

WINDOWS = {"5m": timedelta(minutes=5), "15m": timedelta(minutes=15), "1h": WINDOW}
"""The lease page's timeline windows (``?window=5m``); the last hour by default."""

LEASE_ACTIONS = {"step-down", "handover"}
NODE_ACTIONS = {"drain", "undrain"}
TASK_ACTIONS = {"pause", "resume", "trigger"}


class HttpError(Exception):
    """A request the console answers with an error status and a message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}

    @classmethod
    def throttled(cls, exc: Throttled) -> HttpError:
        """429: no token is tried now."""
        return cls(429, str(exc), {"retry-after": str(math.ceil(exc.retry_after))})


def _templates() -> Environment:
    env = Environment(
        loader=PackageLoader("rselection.web", "templates"),
        # Every template is HTML (the timeline's SVG is inline HTML): every value is
        # escaped, in text and in attributes.
        autoescape=select_autoescape(default=True, default_for_string=True),
        finalize=_shown,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["exact"] = escape  # Markup: written as it is, not made printable
    env.filters["iso"] = iso
    env.filters["ago"] = _ago
    env.filters["clock"] = lambda value: "-" if value is None else value.strftime("%H:%M:%S")
    return env


def _shown(value: Any) -> Any:
    """Every value a template writes, as people should see it: a name's bidirectional
    overrides, zero-width and control characters as escapes (:func:`printable`), so no
    name can pass for another. Markup (a macro's output, a form's ``exact`` value) is
    written as it is; URLs are ASCII already."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return printable(value)
    return value


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def build_app(
    admin: LeaseAdmin,
    *,
    token: str | None,
    owned: bool,
    conninfo: str = "",
    allowed_hosts: AllowedHosts | None = None,
) -> Starlette:
    """The console's ASGI app over ``admin``.

    Args:
        admin: the leases' admin API.
        token: the operator token, ``None`` for a read-only console.
        owned: close ``admin`` when the app shuts down (it was made for the app).
        conninfo: the connection string it was made from, kept out of every message.
        allowed_hosts: the hosts it answers to (see :mod:`.hosts`); by default this
            machine's loopback names and the address a request came in on.
    """
    console = Console(admin)
    calls = Calls()
    guard = Guard(token)
    hosts = allowed_hosts or AllowedHosts()
    env = _templates()

    def shown(text: str) -> str:
        return redact(text, conninfo) if conninfo else text

    # -- helpers ---------------------------------------------------------------------

    def session_of(request: Request) -> str | None:
        cookie = request.cookies.get(cookie_name(request.headers.get("host")))
        return cookie if guard.session_ok(cookie) else None

    def page(request: Request, template: str, code: int = 200, **context: Any) -> Response:
        root = request.scope.get("root_path", "")
        session = session_of(request)
        # The result of the session's last form, kept by the console (a cookie could be
        # set by a page of another port of this host, and outgrows 4 KiB).
        said = guard.told(session) if session is not None else None
        body = env.get_template(template).render(
            url=lambda *parts: href(root, *parts),
            # This page's own URL, made again from its names: the decoded path would
            # split a name holding a "/" (and a browser would fold a ".." away).
            here=href(root, *segments(request.scope)),
            where=console.where,
            read_only=guard.read_only,
            logged_in=session is not None,
            can_act=session is not None,
            csrf=guard.csrf_for(session) if session is not None else "",
            refresh=REFRESH_SECONDS,
            said=said,
            end_reasons=("leading", *END_REASONS),
            outcomes=OUTCOMES,
            **context,
        )
        return HTMLResponse(body, status_code=code, headers=SECURITY_HEADERS)

    async def call(
        function: Callable[..., Any], *args: Any, action: bool = False, **kw: Any
    ) -> Any:
        """Run a blocking admin call in a thread (see :mod:`.calls`); its errors become
        answers."""
        bound = calls.action_timeout if action else calls.read_timeout
        try:
            return await calls.run(functools.partial(function, *args, **kw), timeout=bound)
        except NotAnswering as exc:
            said = f"{exc} (the action may still be carried out)" if action else str(exc)
            raise HttpError(503, said) from exc
        except Refused as exc:
            raise HttpError(409, shown(str(exc))) from exc
        except ConfigError as exc:
            raise HttpError(400, shown(str(exc))) from exc
        except BackendUnavailable as exc:
            raise HttpError(503, shown(f"cannot read or act on {console.where}: {exc}")) from exc

    async def lease_call(function: Callable[..., Any], name: str, *args: Any, **kw: Any) -> Any:
        """:func:`call` of ``function(name, ...)``, which finds no lease ``name``: 404."""
        found = await call(function, name, *args, **kw)
        if found is None:
            raise HttpError(404, f"no lease {name!r} in {console.where}")
        return found

    def error_page(request: Request, error: HttpError) -> Response:
        response = page(request, "error.html", code=error.status, message=str(error))
        response.headers.update(error.headers)
        return response

    # -- pages -----------------------------------------------------------------------

    async def overview(request: Request) -> Response:
        try:
            found = await call(console.overview)
        except HttpError as exc:
            return error_page(request, exc)
        return page(request, "overview.html", overview=found, status=found.status)

    async def status(request: Request) -> Response:
        try:
            found = await call(console.overview)
        except HttpError as exc:
            return _json_error(exc)
        return JSONResponse(found.status, headers=SECURITY_HEADERS)

    async def lease_pages(request: Request) -> Response:
        parts = segments(request.scope)[1:]  # below "leases"
        try:
            if len(parts) == 1:
                window = WINDOWS.get(request.query_params.get("window", ""), WINDOW)
                found = await lease_call(console.lease, parts[0], window=window)
                return page(request, "lease.html", lease=found, windows=WINDOWS)
            if len(parts) == 2 and parts[1] == "shards":
                grid = await call(console.shards, parts[0])
                if grid is None:
                    raise HttpError(404, f"lease {parts[0]!r} has no shards")
                return page(request, "shards.html", grid=grid)
            if len(parts) == 3 and parts[1] == "tasks":
                task = await lease_call(console.task, parts[0], parts[2])
                return page(request, "task.html", task=task)
        except HttpError as exc:
            return error_page(request, exc)
        return error_page(request, HttpError(404, "no such page"))

    async def lease_api(request: Request) -> Response:
        parts = segments(request.scope)[2:]  # below "api/leases"
        try:
            if request.method == "POST":  # only a POST acts: HEAD reads, as GET does
                return await act(request, parts)
            return await read_api(parts)
        except HttpError as exc:
            if _is_form(request):  # a page's form: answer with a page
                return error_page(request, exc)
            return _json_error(exc)

    async def read_api(parts: list[str]) -> Response:
        if len(parts) == 1:
            found = await lease_call(console.lease, parts[0])
            document = {
                "name": found.name,
                "checked_at": iso(found.checked_at),
                "lease": found.lease,
                "nodes": found.nodes,
                "handover": found.handover,
                "terms": [t.as_json() for t in found.terms],
                "tasks": None if found.tasks is None else [t.as_json() for t in found.tasks],
            }
            return JSONResponse(document, headers=SECURITY_HEADERS)
        if len(parts) == 3 and parts[1] == "tasks":
            task = await lease_call(console.task, parts[0], parts[2])
            runs = {"runs": [r.as_json() for r in task.runs]}
            return JSONResponse(runs, headers=SECURITY_HEADERS)
        raise HttpError(404, "no such route")

    # -- actions ---------------------------------------------------------------------

    async def act(request: Request, parts: list[str]) -> Response:
        body, session = await authorised(request)
        run: Callable[[], Action]
        if len(parts) == 2 and parts[1] in LEASE_ACTIONS:
            to = _text(body.get("to")) if parts[1] == "handover" else None
            if parts[1] == "handover" and not to:
                raise HttpError(400, "handover needs the node to hand over to: {'to': NODE}")
            run = functools.partial(console.hand_over, parts[0], to)
        elif len(parts) == 4 and parts[1] == "nodes" and parts[3] in NODE_ACTIONS:
            run = functools.partial(console.drain, parts[0], parts[2], drained=parts[3] == "drain")
        elif len(parts) == 4 and parts[1] == "tasks" and parts[3] in TASK_ACTIONS:
            run = functools.partial(console.control, parts[0], parts[2], parts[3])
        else:
            raise HttpError(404, "no such action")
        logger.info(
            "console: operator action %s on %s (%s)",
            "/".join(parts[1:]),
            printable(parts[0]),
            "form" if session else "bearer token",
        )
        if session is not None:  # a page's form: back to the page, which says what happened
            back = _local(request, _text(body.get("next")))
            try:
                done = await call(run, action=True)
            except HttpError as exc:
                guard.tell(session, "danger", str(exc))
            else:
                guard.tell(session, "ok" if done.ok else "danger", done.message)
            return RedirectResponse(back, status_code=303, headers=SECURITY_HEADERS)
        done = await call(run, action=True)
        document = {"ok": done.ok, "message": done.message, **done.document}
        return JSONResponse(document, status_code=200 if done.ok else 409)

    async def authorised(request: Request) -> tuple[dict[str, Any], str | None]:
        """The action's body, and the session of the logged-in browser that sent it
        (``None``: a script with the bearer token); raises :class:`HttpError` for anyone
        else."""
        if guard.read_only:
            raise HttpError(
                403, "this console is read-only: start it with an operator token to act"
            )
        authorization = request.headers.get("authorization")
        if authorization is not None:
            try:
                if not guard.bearer_ok(authorization):
                    raise HttpError(401, "wrong token")
            except Throttled as exc:
                raise HttpError.throttled(exc) from None
            return await _body(request), None
        cookie = session_of(request)
        if cookie is None:
            raise HttpError(401, "log in first, or send Authorization: Bearer <token>")
        if not same_origin(request.headers, hosts):
            raise HttpError(403, "refused: the request did not come from this console")
        body = await _body(request)
        if not guard.csrf_ok(cookie, _text(body.get("csrf"))):
            raise HttpError(403, "refused: the form is stale or forged (reload the page)")
        return body, cookie

    # -- login -----------------------------------------------------------------------

    async def login(request: Request) -> Response:
        if request.method != "POST":  # GET, or HEAD
            return page(
                request, "login.html", next=_local(request, request.query_params.get("next"))
            )
        if guard.read_only:
            return page(request, "error.html", code=403, message="this console is read-only")
        if not same_origin(request.headers, hosts):
            return page(request, "error.html", code=403, message="refused: cross-site login")
        try:
            body = await _body(request)
        except HttpError as exc:
            return error_page(request, exc)
        back = _local(request, _text(body.get("next")))
        try:
            # No await from here to the verdict: tries are counted one after the other.
            matches = guard.log_in(_text(body.get("token")) or "")
        except Throttled as exc:
            error = HttpError.throttled(exc)
            response = page(request, "login.html", code=429, next=back, waiting=str(error))
            response.headers.update(error.headers)
            return response
        if not matches:
            return page(request, "login.html", code=401, next=back, failed=True)
        response = RedirectResponse(back, status_code=303, headers=SECURITY_HEADERS)
        response.set_cookie(
            cookie_name(request.headers.get("host")),
            guard.new_session(),
            max_age=SESSION_SECONDS,
            path=_cookie_path(request),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(request: Request) -> Response:
        if not same_origin(request.headers, hosts):
            return page(request, "error.html", code=403, message="refused: cross-site logout")
        response = RedirectResponse(href(request.scope.get("root_path", ""), ""), status_code=303)
        name = cookie_name(request.headers.get("host"))
        guard.end_session(request.cookies.get(name))  # a copy of the cookie ends with it
        response.delete_cookie(name, path=_cookie_path(request))
        return response

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if owned:
            await run_in_threadpool(admin.close)

    routes = [
        Route("/", overview),
        Route("/api/status", status),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route(f"/leases/{{rest:{NAMES}}}", lease_pages),
        Route(f"/api/leases/{{rest:{NAMES}}}", lease_api, methods=["GET", "POST"]),
        Mount("/static", StaticFiles(packages=[("rselection.web", "static")]), name="static"),
    ]
    # Every request, the static files' included, is for one of the console's hosts.
    middleware = [Middleware(HostCheck, hosts=hosts)]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.console = console
    app.state.calls = calls
    return app


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _is_form(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/x-www-form-urlencoded"


def _json_error(error: HttpError) -> Response:
    headers = {**SECURITY_HEADERS, **error.headers}
    if error.status == 401:
        headers["www-authenticate"] = 'Bearer realm="rselection"'
    return JSONResponse({"error": str(error)}, status_code=error.status, headers=headers)


async def _body(request: Request) -> dict[str, Any]:
    """An action's body: a JSON object, or a form's fields (one value each).

    A body over :data:`MAX_BODY` is refused (413) on its ``Content-Length``, or as soon
    as that much of it has arrived: never read whole, so nobody fills the memory."""
    declared = request.headers.get("content-length", "0")  # none: a chunked body
    if not declared.isdigit():
        raise HttpError(400, "the Content-Length is not a number")
    if int(declared) > MAX_BODY:
        raise HttpError(413, "the request body is too large")
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > MAX_BODY:
            raise HttpError(413, "the request body is too large")
    raw = bytes(received)
    if not raw:
        return {}
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if kind == "application/x-www-form-urlencoded":
            fields = parse_qs(raw.decode(), keep_blank_values=True)
            return {key: values[-1] for key, values in fields.items()}
        found = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # deep JSON recurses
        raise HttpError(400, "the body is neither a JSON object nor a form") from exc
    if not isinstance(found, dict):
        raise HttpError(400, "the body must be a JSON object")
    return found


def _cookie_path(request: Request) -> str:
    root: str = request.scope.get("root_path", "")
    return quote(root, safe="/") or "/"


def _local(request: Request, target: str | None) -> str:
    """``target`` if it is a path of this console's, else the overview (never another
    site: a redirect goes only where the console's own pages are)."""
    root = _cookie_path(request).rstrip("/")
    if (
        target
        and target.startswith(root + "/")
        and not target.startswith("//")
        and "\\" not in target
        and not any(ord(c) < 32 for c in target)
    ):
        return target
    return root + "/"
