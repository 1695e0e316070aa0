"""The console in a real browser: Debian's headless Chromium, driven by Playwright,
against the console on a loopback port with a real fleet behind it.

The overview shows the leader; "hand over" moves the lease to the node chosen and the
page shows the new term within 2 s; drain and undrain on the page; "pause" stops a
task's fires until "resume" and "trigger" runs one fire (read in the run history);
without the token no action is shown and a forged post is refused; the timeline's bars
are the leadership history's terms; a hostile lease name is shown as text. A fresh
browser profile (context) per test.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import pytest

from tests.conftest import in_ci, unavailable
from tests.support.console import chromium_path, launch_chromium, serve
from tests.support.waiting import wait_until

if not in_ci():
    pytest.importorskip("playwright")
    pytest.importorskip("starlette")

import rselection as rs
from rselection.postgres import PostgresAdmin

# Timed against a bound (the new term shown within 2 s), and a browser's worth of CPU.
pytestmark = pytest.mark.serial

FAST = {"ttl": 3, "renew_interval": 0.5, "renew_deadline": 2, "retry_interval": 0.5}
TOKEN = "browser-op-token"
SHOWN_WITHIN = 2.0  # the bound: the page shows the new term within 2 s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module (each test gets a fresh profile)."""
    executable = chromium_path()
    if executable is None:
        unavailable("no chromium for the browser tests: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright, launch_chromium(playwright, executable) as made:
        yield made


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A page in a fresh browser context: no cookie, no cache of another test's."""
    context = browser.new_context()
    context.set_default_timeout(10_000)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[PostgresAdmin]:
    made = PostgresAdmin(pg_dsn)
    yield made
    made.close()


@pytest.fixture
def make(pg_dsn: str) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def build(lease: str, node_id: str) -> Any:
        tasks = rs.TaskHandler()

        @tasks.persistent(name="work")
        def work(ctx: rs.TaskContext) -> None:
            while ctx.sleep(0.05):
                pass

        @tasks.interval(0.5, name="tick")
        def tick(ctx: rs.TaskContext) -> None:
            pass

        leader = rs.PostgresLeader(
            pg_dsn, tasks, name=lease, node_id=node_id, heartbeat_interval=0.2, **FAST
        )
        made.append(leader)
        leader.start()
        return leader

    yield build
    for leader in made:
        leader.stop(timeout=10)


@pytest.fixture
def name() -> str:
    return f"web-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def fleet(make: Callable[..., Any], name: str, admin: PostgresAdmin) -> list[Any]:
    """Nodes a, b and c of lease ``name``; a leads."""
    a = make(name, "a")
    assert a.wait_until_leader(10)
    nodes = [a, make(name, "b"), make(name, "c")]
    wait_until(lambda: len(admin.live_nodes(name) or ()) == 3, 10, "three nodes", interval=0.05)
    return nodes


@pytest.fixture
def console(pg_dsn: str) -> Iterator[str]:
    """The console with the operator token, served on loopback; its base URL."""
    from rselection.web import create_app

    with serve(create_app(conninfo=pg_dsn, token=TOKEN)) as url:
        yield url


def lease_page(base: str, lease: str, *rest: str) -> str:
    return "/".join([base, "leases", quote(lease, safe=""), *(quote(r, safe="") for r in rest)])


def log_in(page: Any, base: str, then: str) -> None:
    """Log in on the console's form, landing on ``then``."""
    page.goto(f"{base}/login?next={quote(then.removeprefix(base), safe='')}")
    page.fill("input[name=token]", TOKEN)
    page.click("form.login button")
    page.wait_for_url(then)


def holder(admin: PostgresAdmin, lease: str) -> Any:
    return admin.current_holder(lease)


def test_the_overview_shows_the_leader(
    page: Any, console: str, fleet: list[Any], name: str
) -> None:
    from playwright.sync_api import expect

    page.goto(console + "/")
    row = page.locator(f'tr[data-lease="{name}"]')
    expect(row.locator("td.holder")).to_have_text("a")
    expect(row.locator("td.term")).to_have_text("1")
    expect(page.locator("#no-alerts")).to_be_visible()


def test_hand_over_moves_the_lease_and_the_page_shows_the_new_term_within_2_s(
    page: Any, console: str, fleet: list[Any], name: str, admin: PostgresAdmin
) -> None:
    from playwright.sync_api import expect

    url = lease_page(console, name)
    log_in(page, console, url)
    expect(page.locator("#summary .holder")).to_have_text("a")
    page.select_option("select[name=to]", "c")
    clicked = time.monotonic()
    page.click("#lease-actions button:has-text('Hand over')")
    expect(page.locator("#summary .holder")).to_have_text("c", timeout=SHOWN_WITHIN * 1000)
    shown = time.monotonic() - clicked
    now = holder(admin, name)
    assert now is not None and now.node_id == "c"
    expect(page.locator("#summary .term")).to_have_text(str(now.term))
    expect(page.locator("#said")).to_contain_text("c leads")
    assert shown < SHOWN_WITHIN
    ended = next(r for r in admin.history(name) if r.node_id == "a")
    assert (ended.end_reason, ended.handed_to, ended.by) == ("handed_over", "c", "operator")


def test_drain_and_undrain_on_the_page(
    page: Any, console: str, fleet: list[Any], name: str, admin: PostgresAdmin
) -> None:
    from playwright.sync_api import expect

    url = lease_page(console, name)
    log_in(page, console, url)
    page.click('tr[data-node="a"] button:has-text("Drain")')
    expect(page.locator("#said")).to_contain_text("drained node a")
    wait_until(lambda: (holder(admin, name) or fleet[0]).node_id in ("b", "c"), 10, "a move")
    assert admin.drained(name) == {"a"}
    page.reload()  # the new leader's heartbeat is in: a is drained and leads no more
    expect(page.locator('tr[data-node="a"]')).to_have_class("state-drained")
    page.click('tr[data-node="a"] button:has-text("Undrain")')
    expect(page.locator("#said")).to_contain_text("undrained node a")
    assert admin.drained(name) == set()
    # the node reads its undrain within about a second, then heartbeats as eligible
    wait_until(
        lambda: any(n.node_id == "a" and n.eligible for n in admin.nodes(name) or ()),
        10,
        "node a to heartbeat as eligible",
    )
    page.reload()
    expect(page.locator('tr[data-node="a"]')).to_have_class("state-alive")


def test_without_the_token_no_action_is_shown_and_a_forged_post_is_refused(
    page: Any, pg_dsn: str, fleet: list[Any], name: str, admin: PostgresAdmin
) -> None:
    from rselection.web import create_app

    with serve(create_app(conninfo=pg_dsn)) as url:
        page.goto(lease_page(url, name))
        assert page.locator("#summary .holder").inner_text() == "a"
        assert page.locator("form[method=post]").count() == 0
        assert page.locator("main button").count() == 0
        forged = page.evaluate(
            """async (path) => (await fetch(path, {method: "POST",
                 headers: {"content-type": "application/json"},
                 body: JSON.stringify({to: "b"})})).status""",
            f"/api/leases/{quote(name, safe='')}/handover",
        )
        assert forged == 403
    assert holder(admin, name).node_id == "a"


def test_a_wrong_token_or_a_post_from_another_site_is_refused(
    page: Any, console: str, fleet: list[Any], name: str, admin: PostgresAdmin
) -> None:
    from playwright.sync_api import expect

    page.goto(console + "/login")
    page.fill("input[name=token]", "not-the-token")
    page.click("form.login button")
    expect(page.locator("p.said.danger")).to_contain_text("not the operator token")
    wrong = page.request.post(
        f"{console}/api/leases/{quote(name, safe='')}/step-down",
        headers={"authorization": "Bearer not-the-token"},
    )
    assert wrong.status == 401
    # logged in, a page of another origin posts to the console: refused
    log_in(page, console, lease_page(console, name))
    target = f"{console}/api/leases/{quote(name, safe='')}/step-down"
    page.set_content(f'<form method="post" action="{target}"><button>go</button></form>')
    with page.expect_navigation() as navigation:
        page.click("button")
    assert navigation.value.status in (401, 403)
    assert holder(admin, name).node_id == "a"


def test_the_timelines_bars_are_the_terms_of_the_history(
    page: Any, console: str, fleet: list[Any], name: str, admin: PostgresAdmin
) -> None:
    from rselection.resigning import hand_over

    for to in ("b", "a", "c"):
        assert hand_over(admin, name, to=to).done
    page.goto(lease_page(console, name))
    bars = page.locator("svg rect.bar")
    shown = {
        (
            int(bar.get_attribute("data-term")),
            bar.get_attribute("data-node"),
            bar.get_attribute("data-end"),
        )
        for bar in bars.all()
    }
    recorded = {(r.term, r.node_id, r.end_reason or "leading") for r in admin.history(name)}
    assert shown == recorded and len(shown) == 4
    legend = page.locator("figcaption.legend").inner_text()
    assert "leading" in legend and "handed over" in legend


def test_a_hostile_lease_name_is_shown_as_text(
    page: Any, console: str, make: Callable[..., Any]
) -> None:
    hostile = f"<script>alert(1)</script><img src=x onerror=alert(2)>{uuid.uuid4().hex[:4]}"
    assert make(hostile, "n1").wait_until_leader(10)
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(console + "/")
    page.get_by_role("link", name=hostile).click()
    assert page.locator("h1.name").inner_text() == hostile
    assert page.locator("main script, main img").count() == 0
    assert dialogs == []


def test_leases_named_dot_and_dot_dot_open_from_their_links(
    page: Any, console: str, make: Callable[..., Any]
) -> None:
    from playwright.sync_api import expect

    for lease in (".", ".."):
        assert make(lease, "n1").wait_until_leader(10)
    for lease in (".", ".."):
        page.goto(console + "/")
        page.locator(f'tr[data-lease="{lease}"] a').first.click()
        expect(page.locator("h1.name")).to_have_text(lease)
        expect(page.locator("#summary .holder")).to_have_text("n1")


def test_pause_stops_a_tasks_fires_until_resume_and_trigger_runs_one_fire(
    page: Any, console: str, fleet: list[Any], name: str, admin: PostgresAdmin
) -> None:
    from playwright.sync_api import expect

    def runs() -> list[Any]:
        return admin.task_runs(name, "tick", limit=100)

    wait_until(lambda: any(r.outcome == "ok" for r in runs()), 10, "a run of tick")
    url = lease_page(console, name, "tasks", "tick")
    log_in(page, console, url)
    page.click("#task-actions button:has-text('Pause')")
    expect(page.locator("#task-actions button:has-text('Resume')")).to_be_visible()
    wait_until(
        lambda: any(r.reason == "paused" and r.by == "operator" for r in runs()),
        10,
        "a fire skipped as paused",
    )
    skipped_at = len(runs())
    wait_until(lambda: len(runs()) >= skipped_at + 2, 10, "two more fires")
    paused = runs()[: len(runs()) - skipped_at + 1]
    assert all(r.outcome == "skipped" for r in paused), paused
    page.click("#task-actions button:has-text('Trigger now')")
    wait_until(
        lambda: any(r.outcome == "ok" and r.by == "operator" for r in runs()),
        10,
        "the triggered fire",
    )
    page.click("#task-actions button:has-text('Resume')")
    expect(page.locator("#task-actions button:has-text('Pause')")).to_be_visible()
    wait_until(lambda: runs()[0].outcome == "ok" and runs()[0].by is None, 10, "fires again")
    page.reload()
    expect(page.locator("tr.run[data-by=operator][data-outcome=ok]")).to_have_count(1)
    assert page.locator("tr.run[data-reason=paused]").count() >= 2


def test_on_redis_the_page_shows_the_leader_and_hands_over(page: Any, redis_url: str) -> None:
    from playwright.sync_api import expect

    from rselection.redis import RedisAdmin, RedisLeader
    from rselection.web import create_app
    from tests.support.backends import Backend

    lease = f"web-redis-{uuid.uuid4().hex[:6]}"
    leaders = [
        RedisLeader(redis_url, rs.TaskHandler(), name=lease, node_id=node, **FAST)
        for node in ("a", "b")
    ]
    admin = RedisAdmin(redis_url)
    try:
        leaders[0].start()
        assert leaders[0].wait_until_leader(10)
        leaders[1].start()
        wait_until(lambda: len(admin.live_nodes(lease) or ()) == 2, 10, "two nodes")
        with serve(create_app(client=redis_url, token=TOKEN)) as url:
            log_in(page, url, lease_page(url, lease))
            expect(page.locator("#summary .holder")).to_have_text("a")
            page.click("#lease-actions button:has-text('Hand over')")  # to b, the only one
            expect(page.locator("#summary .holder")).to_have_text("b", timeout=SHOWN_WITHIN * 1000)
        found = admin.current_holder(lease)
        assert found is not None and found.node_id == "b"
    finally:
        for leader in leaders:
            leader.stop(timeout=10)
        admin.close()
        Backend("redis", redis_url).forget(lease)
