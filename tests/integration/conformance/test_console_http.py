"""The console over HTTP, on every backend: its pages and JSON routes against a real
fleet, who may act, and what the actions do (recorded ``by: "operator"``).

Plain HTTP through Starlette's test client (the browser tests are in
``tests/integration/test_console_browser.py``); leaders in this process.
"""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient

import rselection as rs
from rselection.web import create_app
from tests.support.backends import Backend
from tests.support.waiting import wait_until

FAST = {"ttl": 3, "renew_interval": 0.5, "renew_deadline": 2, "retry_interval": 0.5}
TOKEN = "op-token-7f3a"
ORIGIN = {"origin": "http://testserver"}


def lease_url(name: str, *rest: str) -> str:
    return "/".join(["/api/leases", quote(name, safe=""), *(quote(r, safe="") for r in rest)])


@pytest.fixture
def name(backend: Backend) -> Iterator[str]:
    lease = f"console-{uuid.uuid4().hex[:8]}"
    yield lease
    backend.forget(lease)


@pytest.fixture
def make(backend: Backend) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def build(lease: str, node_id: str, **kw: Any) -> Any:
        tasks = rs.TaskHandler()

        @tasks.persistent(name="work")
        def work(ctx: rs.TaskContext) -> None:
            while ctx.sleep(0.05):
                pass

        @tasks.interval(0.5, name="tick")
        def tick(ctx: rs.TaskContext) -> None:
            pass

        leader = backend.leader(tasks, lease, node_id=node_id, heartbeat_interval=0.2, **FAST, **kw)
        made.append(leader)
        leader.start()
        return leader

    yield build
    for leader in made:
        leader.stop(timeout=10)


@pytest.fixture
def fleet(make: Callable[..., Any], name: str, backend: Backend) -> list[Any]:
    """Three nodes of lease ``name``; ``a`` leads, all three heartbeat."""
    a = make(name, "a")
    assert a.wait_until_leader(10)
    nodes = [a, make(name, "b"), make(name, "c")]
    admin = backend.admin()
    try:
        wait_until(
            lambda: len(admin.live_nodes(name) or ()) == 3, 10, "three live nodes", interval=0.05
        )
    finally:
        admin.close()
    return nodes


def app_of(backend: Backend, token: str | None = None, **kw: Any) -> Any:
    if backend.kind == "redis":
        return create_app(client=backend.url, token=token, **kw)
    return create_app(conninfo=backend.url, token=token, **kw)


@pytest.fixture
def client(backend: Backend) -> Iterator[TestClient]:
    with TestClient(app_of(backend, TOKEN)) as made:
        yield made


def holder_of(backend: Backend, name: str) -> str | None:
    admin = backend.admin()
    try:
        found = admin.current_holder(name)
    finally:
        admin.close()
    return None if found is None else found.node_id


def test_the_overview_and_the_status_show_the_leader(
    client: TestClient, fleet: list[Any], name: str
) -> None:
    page = client.get("/")
    assert page.status_code == 200
    row = re.search(rf'<tr[^>]*data-lease="{name}".*?</tr>', page.text, re.S)
    assert row is not None and '<td class="holder">a</td>' in row.group(0)
    status = client.get("/api/status").json()
    (lease,) = [x for x in status["leases"] if x["name"] == name]
    assert lease["holder"] == "a" and lease["live"]
    assert name not in status["headless"]
    assert {n["node_id"] for n in status["nodes"] if n["lease"] == name} == {"a", "b", "c"}
    detail = client.get(lease_url(name)).json()
    assert detail["lease"]["holder"] == "a" and detail["terms"][0]["node_id"] == "a"


def test_a_read_only_console_shows_no_action_and_refuses_every_one(
    backend: Backend, fleet: list[Any], name: str
) -> None:
    with TestClient(app_of(backend)) as client:
        page = client.get("/leases/" + quote(name, safe=""))
        assert page.status_code == 200 and "read-only" in page.text
        assert 'method="post"' not in page.text
        for route, body in [
            (lease_url(name, "step-down"), {}),
            (lease_url(name, "handover"), {"to": "b"}),
            (lease_url(name, "nodes", "b", "drain"), {}),
            (lease_url(name, "nodes", "b", "undrain"), {}),
            (lease_url(name, "tasks", "work", "pause"), {}),
            (lease_url(name, "tasks", "work", "resume"), {}),
            (lease_url(name, "tasks", "work", "trigger"), {}),
        ]:
            for headers in ({}, {"authorization": f"Bearer {TOKEN}"}, ORIGIN):
                answer = client.post(route, json=body, headers=headers)
                assert answer.status_code == 403, (route, headers, answer.text)
    assert holder_of(backend, name) == "a"


def test_an_action_without_the_token_or_from_another_site_is_refused(
    client: TestClient, fleet: list[Any], name: str, backend: Backend
) -> None:
    route = lease_url(name, "step-down")
    assert client.post(route).status_code == 401
    wrong = client.post(route, headers={"authorization": "Bearer not-the-token"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"].startswith("Bearer")
    assert client.post("/login", data={"token": "wrong"}, headers=ORIGIN).status_code == 401
    # logged in: the cookie alone, without the page's CSRF value, or from another site
    login = client.post("/login", data={"token": TOKEN}, headers=ORIGIN, follow_redirects=False)
    assert login.status_code == 303
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
    assert TOKEN not in cookie
    page = client.get("/leases/" + quote(name, safe=""))
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert csrf is not None
    assert client.post(route, data={"csrf": "0" * 64}, headers=ORIGIN).status_code == 403
    foreign = {"origin": "http://evil.example"}
    assert client.post(route, data={"csrf": csrf.group(1)}, headers=foreign).status_code == 403
    assert client.post(route, data={"csrf": csrf.group(1)}).status_code == 403  # no origin
    assert holder_of(backend, name) == "a"
    # the page's own form, from the page's own origin, steps the leader down
    done = client.post(
        route, data={"csrf": csrf.group(1), "next": "/"}, headers=ORIGIN, follow_redirects=False
    )
    assert done.status_code == 303 and done.headers["location"] == "/"
    wait_until(lambda: holder_of(backend, name) not in (None, "a"), 10, "a new leader")


def test_a_handover_moves_the_lease_to_the_node_chosen_and_is_the_operators(
    client: TestClient, fleet: list[Any], name: str, backend: Backend
) -> None:
    bearer = {"authorization": f"Bearer {TOKEN}"}
    answer = client.post(lease_url(name, "handover"), json={"to": "c"}, headers=bearer)
    assert answer.status_code == 200, answer.text
    done = answer.json()
    assert done["ok"] and done["new"]["node_id"] == "c" and done["asked"]["node_id"] == "a"
    assert holder_of(backend, name) == "c"
    admin = backend.admin()
    try:
        ended = next(r for r in admin.history(name) if r.node_id == "a")
    finally:
        admin.close()
    assert (ended.end_reason, ended.handed_to, ended.by) == ("handed_over", "c", "operator")
    # refused: to an unknown node, or with no node named
    refused = client.post(lease_url(name, "handover"), json={"to": "zz"}, headers=bearer)
    assert refused.status_code == 409 and "not a live node" in refused.json()["error"]
    assert client.post(lease_url(name, "handover"), json={}, headers=bearer).status_code == 400


def test_draining_the_holder_moves_the_lease_and_undraining_lets_it_lead_again(
    client: TestClient, fleet: list[Any], name: str, backend: Backend
) -> None:
    bearer = {"authorization": f"Bearer {TOKEN}"}
    drained = client.post(lease_url(name, "nodes", "a", "drain"), headers=bearer)
    assert drained.status_code == 200 and drained.json()["changed"]
    wait_until(lambda: holder_of(backend, name) in ("b", "c"), 10, "another leader")
    status = client.get("/api/status").json()
    (node,) = [n for n in status["nodes"] if n["lease"] == name and n["node_id"] == "a"]
    assert node["drained"]
    page = client.get("/leases/" + quote(name, safe=""))
    assert re.search(r'data-node="a" class="state-drained"', page.text)
    again = client.post(lease_url(name, "nodes", "a", "drain"), headers=bearer)
    assert again.status_code == 200 and not again.json()["changed"]
    undrained = client.post(lease_url(name, "nodes", "a", "undrain"), headers=bearer)
    assert undrained.status_code == 200 and undrained.json()["changed"]
    unknown = client.post(lease_url(name, "nodes", "nobody", "drain"), headers=bearer)
    assert unknown.status_code == 409


def test_names_with_slashes_spaces_markup_and_unicode_round_trip(
    make: Callable[..., Any], backend: Backend
) -> None:
    suffix = uuid.uuid4().hex[:6]
    names = [f"a/b-{suffix}", f"with space {suffix}", f"<script>alert(1)</script>{suffix}"]
    names.append(f"ünï ✓ {suffix}")
    leaders = [make(lease, "n1") for lease in names]
    for leader in leaders:
        assert leader.wait_until_leader(10)
    try:
        with TestClient(app_of(backend, TOKEN)) as client:
            overview = client.get("/").text
            assert "<script>alert(1)</script>" not in overview
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" + suffix in overview
            for lease in names:
                page = client.get("/leases/" + quote(lease, safe=""))
                assert page.status_code == 200, lease
                assert "<script>alert" not in page.text
                detail = client.get(lease_url(lease)).json()
                assert detail["name"] == lease and detail["lease"]["holder"] == "n1"
                link = 'href="/leases/' + quote(lease, safe="") + '"'
                assert link.replace("&", "&amp;") in overview
    finally:
        for lease in names:
            backend.forget(lease)


def test_an_unknown_lease_is_404_and_an_unknown_route_too(
    client: TestClient, fleet: list[Any], name: str
) -> None:
    assert client.get("/leases/" + quote(f"{name}-nope", safe="")).status_code == 404
    assert client.get(lease_url(f"{name}-nope")).status_code == 404
    assert client.get("/leases/" + quote(name, safe="") + "/elsewhere").status_code == 404
    assert client.get("/leases/" + quote(name, safe="") + "/shards").status_code == 404


def test_pause_trigger_and_resume_through_the_json_routes(
    client: TestClient, fleet: list[Any], name: str, backend: Backend
) -> None:
    bearer = {"authorization": f"Bearer {TOKEN}"}

    def runs() -> list[dict[str, Any]]:
        answer = client.get(lease_url(name, "tasks", "tick"))
        assert answer.status_code == 200, answer.text
        found: list[dict[str, Any]] = answer.json()["runs"]
        return found

    wait_until(lambda: any(r["outcome"] == "ok" for r in runs()), 10, "a run of tick")
    page = client.get("/leases/" + quote(name, safe=""))
    assert re.search(r'<tr data-task="tick">', page.text) and "every 0.5s" in page.text
    paused = client.post(lease_url(name, "tasks", "tick", "pause"), headers=bearer)
    assert paused.status_code == 200 and paused.json()["paused"] and paused.json()["changed"]
    wait_until(
        lambda: runs()[0]["reason"] == "paused" and runs()[0]["by"] == "operator",
        10,
        "a fire skipped as paused",
    )
    fired = client.post(lease_url(name, "tasks", "tick", "trigger"), headers=bearer)
    assert fired.status_code == 200 and fired.json()["fire_key"].startswith("tick@")
    wait_until(
        lambda: any(r["outcome"] == "ok" and r["by"] == "operator" for r in runs()),
        10,
        "the triggered fire",
    )
    resumed = client.post(lease_url(name, "tasks", "tick", "resume"), headers=bearer)
    assert resumed.status_code == 200 and not resumed.json()["paused"]
    wait_until(lambda: runs()[0]["outcome"] == "ok" and runs()[0]["by"] is None, 10, "fires again")
    history = client.get("/leases/" + quote(name, safe="") + "/tasks/tick")
    assert history.status_code == 200 and 'data-reason="paused"' in history.text
    persistent = client.post(lease_url(name, "tasks", "work", "trigger"), headers=bearer)
    assert persistent.status_code == 409
    unknown = client.post(lease_url(name, "tasks", "nope", "pause"), headers=bearer)
    assert unknown.status_code == 409


def test_a_request_for_another_host_is_refused(backend: Backend) -> None:
    rebound = {"host": "rebound.example:8780"}  # a site's name made to resolve to loopback
    with TestClient(app_of(backend, TOKEN)) as client:
        for path in ("/", "/api/status", "/login", "/static/console.css"):
            assert client.get(path, headers=rebound).status_code == 400, path
        login = client.post("/login", data={"token": TOKEN}, headers={**rebound, **ORIGIN})
        assert login.status_code == 400
        for host in ("127.0.0.1:8780", "localhost:1234", "LOCALHOST", "[::1]:8780"):
            assert client.get("/login", headers={"host": host}).status_code == 200, host
        assert client.get("/login", headers={"host": "ops.example.com"}).status_code == 400
    # behind a proxy under its own name: that name is allowed, as Host and as Origin
    told = app_of(backend, TOKEN, allowed_hosts=["ops.example.com"])
    with TestClient(told) as client:
        assert client.get("/login", headers={"host": "ops.example.com"}).status_code == 200
        assert client.get("/login", headers=rebound).status_code == 400
        proxied = {"host": "127.0.0.1:8780", "origin": "https://ops.example.com"}
        login = client.post(
            "/login", data={"token": TOKEN}, headers=proxied, follow_redirects=False
        )
        assert login.status_code == 303
        foreign = {"host": "127.0.0.1:8780", "origin": "https://rebound.example"}
        assert client.post("/login", data={"token": TOKEN}, headers=foreign).status_code == 403


def test_wrong_tokens_are_slowed_down(client: TestClient) -> None:
    def log_in(token: str) -> int:
        answer = client.post(
            "/login", data={"token": token}, headers=ORIGIN, follow_redirects=False
        )
        return answer.status_code

    assert [log_in(f"guess-{n}") for n in range(5)] == [401] * 5
    waiting = client.post("/login", data={"token": "guess-6"}, headers=ORIGIN)
    assert waiting.status_code == 429 and int(waiting.headers["retry-after"]) >= 1
    # while it waits no token is tried, not even the right one, nor as a bearer token
    assert log_in(TOKEN) == 429
    bearer = {"authorization": f"Bearer {TOKEN}"}
    assert client.post(lease_url("x", "step-down"), headers=bearer).status_code == 429
    wait_until(lambda: log_in(TOKEN) == 303, 10, "the login once the wait is over")


def test_a_lease_pages_own_links_keep_a_name_with_a_slash_whole(
    make: Callable[..., Any], backend: Backend
) -> None:
    lease = f"pollers-{uuid.uuid4().hex[:6]}/0"
    assert make(lease, "a").wait_until_leader(10)
    path = "/leases/" + quote(lease, safe="")
    try:
        with TestClient(app_of(backend, TOKEN)) as client:
            anonymous = client.get(path).text
            login = re.search(r'href="(/login\?next=[^"]*)"', anonymous)
            assert login is not None
            assert parse_qs(urlsplit(html.unescape(login.group(1))).query)["next"] == [path]
            client.post("/login", data={"token": TOKEN}, headers=ORIGIN)
            page = client.get(path).text
            windows = re.findall(r'href="([^"]*\?window=\w+)"', page)
            assert windows and all(html.unescape(w).startswith(path + "?") for w in windows)
            assert client.get(html.unescape(windows[0])).status_code == 200
            nexts = set(re.findall(r'name="next" value="([^"]*)"', page))
            assert {html.unescape(n) for n in nexts} == {path}
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
            assert csrf is not None
            done = client.post(
                lease_url(lease, "tasks", "tick", "trigger"),
                data={"csrf": csrf.group(1), "next": path},
                headers=ORIGIN,
                follow_redirects=False,
            )
            assert done.status_code == 303 and done.headers["location"] == path
            back = client.get(done.headers["location"])
            assert back.status_code == 200 and "triggered task" in back.text
    finally:
        backend.forget(lease)


def test_names_with_control_characters_are_reachable(backend: Backend) -> None:
    lease = f"line1\nline2\t{uuid.uuid4().hex[:6]}"
    task = "purge\nold\x1b[31m"

    def handler() -> rs.TaskHandler:
        tasks = rs.TaskHandler()

        @tasks.interval(3600, name=task)
        def purge(ctx: rs.TaskContext) -> None:
            pass

        return tasks

    leaders = [
        backend.leader(handler(), lease, node_id=node, heartbeat_interval=0.2, **FAST)
        for node in ("a\n1", "b\r2")
    ]
    admin = backend.admin()
    try:
        leaders[0].start()
        assert leaders[0].wait_until_leader(10)
        leaders[1].start()
        wait_until(lambda: len(admin.live_nodes(lease) or ()) == 2, 10, "two live nodes")
        wait_until(lambda: admin.tasks(lease), 10, "the published task")
        with TestClient(app_of(backend, TOKEN)) as client:
            bearer = {"authorization": f"Bearer {TOKEN}"}
            page = "/leases/" + quote(lease, safe="")
            assert client.get(page).status_code == 200
            assert client.get(page + "/tasks/" + quote(task, safe="")).status_code == 200
            assert client.get(lease_url(lease)).json()["lease"]["holder"] == "a\n1"
            drained = client.post(lease_url(lease, "nodes", "b\r2", "drain"), headers=bearer)
            assert drained.status_code == 200 and drained.json()["node_id"] == "b\r2"
            paused = client.post(lease_url(lease, "tasks", task, "pause"), headers=bearer)
            assert paused.status_code == 200 and paused.json()["paused"]
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
        admin.close()
        backend.forget(lease)


def test_logging_out_ends_the_session_for_whoever_holds_its_cookie(client: TestClient) -> None:
    login = client.post("/login", data={"token": TOKEN}, headers=ORIGIN, follow_redirects=False)
    assert login.status_code == 303
    (cookie,) = [(k, v) for k, v in client.cookies.items() if k.startswith("rselection_console")]
    assert "log out" in client.get("/login").text
    assert client.post("/logout", headers=ORIGIN, follow_redirects=False).status_code == 303
    with TestClient(client.app) as thief:  # a copy of the cookie, taken before the log-out
        thief.cookies.set(*cookie)
        assert "log in to act" in thief.get("/login").text
        stolen = thief.post(lease_url("nope", "step-down"), data={"csrf": "0"}, headers=ORIGIN)
        assert stolen.status_code == 401  # not logged in (a live session: 403, stale form)


def test_a_deeply_nested_json_body_is_a_400(client: TestClient) -> None:
    deep = b"[" * 60_000  # under the size limit; too deep for the parser
    json_from_here = {"content-type": "application/json", **ORIGIN}
    assert client.post("/login", content=deep, headers=json_from_here).status_code == 400
    bearer = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    action = client.post(lease_url("x", "step-down"), content=deep, headers=bearer)
    assert action.status_code == 400 and "JSON" in action.json()["error"]


def test_head_acts_on_nothing_and_reads_as_get_does(
    client: TestClient, make: Callable[..., Any], name: str, backend: Backend
) -> None:
    assert make(name, "a").wait_until_leader(10)
    admin = backend.admin()
    try:
        wait_until(lambda: admin.tasks(name), 10, "the published tasks")
        bearer = {"authorization": f"Bearer {TOKEN}"}
        for route in (lease_url(name, "tasks", "tick", "pause"), lease_url(name, "step-down")):
            head = client.head(route, headers=bearer)
            assert head.status_code == client.get(route, headers=bearer).status_code == 404
        assert not any(task.paused for task in admin.tasks(name))
        assert holder_of(backend, name) == "a"
        read = client.head(lease_url(name))
        assert read.status_code == 200 and read.content == b""
        assert client.head("/login").status_code == 200
    finally:
        admin.close()


def test_a_result_message_is_the_consoles_own(client: TestClient) -> None:
    # a cookie that any page of another port of this host can set
    forged = quote("ok:the token changed: log in again at http://evil.example", safe="")
    client.cookies.set("rselection_console_said", forged)
    page = client.get("/login")
    assert page.status_code == 200 and "evil.example" not in page.text


def test_the_result_of_an_action_on_long_unicode_names_is_shown(
    client: TestClient, backend: Backend
) -> None:
    lease = "\U0001f600" * 240 + uuid.uuid4().hex[:6]  # names of up to 1,000 bytes
    task = "\U0001f4a5" * 240
    tasks = rs.TaskHandler()

    @tasks.interval(3600, name=task)
    def burst(ctx: rs.TaskContext) -> None:
        pass

    leader = backend.leader(tasks, lease, node_id="a", **FAST)
    leader.start()
    path = "/leases/" + quote(lease, safe="")
    try:
        assert leader.wait_until_leader(10)
        admin = backend.admin()
        try:
            wait_until(lambda: admin.tasks(lease), 10, "the published task")
        finally:
            admin.close()
        client.post("/login", data={"token": TOKEN}, headers=ORIGIN)
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', client.get(path).text)
        assert csrf is not None
        done = client.post(
            lease_url(lease, "tasks", task, "trigger"),
            data={"csrf": csrf.group(1), "next": path},
            headers=ORIGIN,
            follow_redirects=False,
        )
        assert done.status_code == 303
        # browsers drop a cookie over 4 KiB, and the message with it
        assert all(len(c) < 4096 for c in done.headers.get_list("set-cookie"))
        back = client.get(done.headers["location"])
        said = re.search(r'<p class="said ok"[^>]*>(.*?)</p>', back.text, re.S)
        assert said is not None and "triggered task" in said.group(1)
    finally:
        leader.stop(timeout=10)
        backend.forget(lease)


def test_invisible_and_bidi_characters_of_names_are_shown_as_escapes(
    make: Callable[..., Any], backend: Backend
) -> None:
    # shown raw, "exe.txt" with U+202E before it reads "txt.exe"; U+200B is invisible
    lease = f"report\u202eexe.txt\u200b-{uuid.uuid4().hex[:6]}"
    first, second = "n\u200d1", "n\u200d2"
    assert make(lease, first).wait_until_leader(10)
    make(lease, second)
    admin = backend.admin()
    try:
        wait_until(lambda: len(admin.live_nodes(lease) or ()) == 2, 10, "two live nodes")
        with TestClient(app_of(backend, TOKEN)) as client:
            client.post("/login", data={"token": TOKEN}, headers=ORIGIN)
            path = "/leases/" + quote(lease, safe="")
            for url in ("/", path):
                page = client.get(url)
                assert page.status_code == 200, url
                shown = re.sub(r'value="[^"]*"', "", page.text)  # form values stay exact
                for hidden in ("\u202e", "\u200b", "\u200d"):
                    assert hidden not in shown, (url, hidden)
                assert "report\\u202eexe.txt\\u200b" in shown
            assert "n\\u200d1" in shown and "n\\u200d2" in shown  # the lease page's nodes
            # the handover form names the node exactly
            option = re.search(r'<option value="([^"]*)">', page.text)
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
            assert option is not None and html.unescape(option.group(1)) == second
            assert csrf is not None
            done = client.post(
                lease_url(lease, "handover"),
                data={"csrf": csrf.group(1), "to": html.unescape(option.group(1)), "next": path},
                headers=ORIGIN,
                follow_redirects=False,
            )
            assert done.status_code == 303
            assert holder_of(backend, lease) == second
    finally:
        admin.close()
        backend.forget(lease)


def test_the_tasks_of_a_lease_that_does_not_exist_are_a_404(
    client: TestClient, make: Callable[..., Any], name: str
) -> None:
    assert make(name, "a").wait_until_leader(10)  # a lease beside it: the tables exist
    missing = quote(f"{name}-missing", safe="")
    assert client.get(f"/leases/{quote(name, safe='')}/tasks/tick").status_code == 200
    assert client.get(f"/leases/{missing}/tasks/t").status_code == 404
    assert client.get(f"/api/leases/{missing}/tasks/t").status_code == 404
