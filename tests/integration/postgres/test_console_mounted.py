"""The console mounted under a path of an application, as the docs' recipes mount it:
in FastAPI (``app.mount``) and beside Django (a Starlette ``Mount``). Its links, its
login cookie and its actions stay under the mount point; names with a ``/`` still
round-trip."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import fastapi
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

import rselection as rs
from rselection.web import create_app

FAST = {"ttl": 3, "renew_interval": 0.5, "renew_deadline": 2, "retry_interval": 0.5}
NAME = "jobs/eu west"


@pytest.fixture
def leaders(pg_dsn: str) -> Iterator[list[Any]]:
    made = [
        rs.PostgresLeader(
            pg_dsn, rs.TaskHandler(), name=NAME, node_id=node, heartbeat_interval=0.2, **FAST
        )
        for node in ("a", "b")
    ]
    made[0].start()
    assert made[0].wait_until_leader(10)
    made[1].start()
    yield made
    for leader in made:
        leader.stop(timeout=10)


def own_app() -> Starlette:
    """An application's own routes, beside the console (as Django's would be)."""
    return Starlette(routes=[Route("/", lambda request: PlainTextResponse("the app"))])


@pytest.mark.parametrize("host", ["fastapi", "starlette"])
def test_the_mounted_console_links_logs_in_and_acts_under_its_mount_point(
    pg_dsn: str, leaders: list[Any], host: str
) -> None:
    console = create_app(conninfo=pg_dsn, token="t0ken")
    app: Any
    if host == "fastapi":
        app = fastapi.FastAPI()
        app.mount("/ops/rselection", console)
    else:
        app = Starlette(routes=[Mount("/ops/rselection", app=console), Mount("/", own_app())])
    origin = {"origin": "http://testserver"}
    with TestClient(app) as client:
        overview = client.get("/ops/rselection/")
        assert overview.status_code == 200
        assert 'href="/ops/rselection/static/console.css"' in overview.text
        link = re.search(r'href="(/ops/rselection/leases/jobs%2Feu%20west)"', overview.text)
        assert link is not None
        page = client.get(link.group(1))
        assert page.status_code == 200 and "jobs/eu west" in page.text
        assert client.get("/ops/rselection/static/console.js").status_code == 200
        login = client.post(
            "/ops/rselection/login",
            data={"token": "t0ken", "next": link.group(1)},
            headers=origin,
            follow_redirects=False,
        )
        assert login.status_code == 303 and login.headers["location"] == link.group(1)
        assert "Path=/ops/rselection" in login.headers["set-cookie"]
        page = client.get(link.group(1))
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
        form = re.search(r'action="([^"]+/handover)"', page.text)
        assert csrf is not None and form is not None
        assert form.group(1) == "/ops/rselection/api/leases/jobs%2Feu%20west/handover"
        done = client.post(
            form.group(1),
            data={"csrf": csrf.group(1), "to": "b", "next": link.group(1)},
            headers=origin,
            follow_redirects=False,
        )
        assert done.status_code == 303 and done.headers["location"] == link.group(1)
        assert leaders[1].wait_until_leader(10)
        # a redirect never leaves the console: another site's page is refused as a target
        away = client.post(
            form.group(1),
            data={"csrf": csrf.group(1), "to": "a", "next": "https://evil.example/"},
            headers=origin,
            follow_redirects=False,
        )
        assert away.headers["location"] == "/ops/rselection/"
        if host == "starlette":
            assert client.get("/").text == "the app"
