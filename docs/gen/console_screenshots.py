"""Take the console's screenshots for the docs, with the browser the tests use.

    python docs/gen/console_screenshots.py [--dsn URL] [--out docs/images]

Starts a small fleet of three nodes of lease ``billing`` (tasks ``ledger-sync``,
persistent, ``purge``, every 2 s, and ``report``, every 3 s, which fails) and a sharded
lease ``pollers`` of 16 shards, in a schema of its own on the Postgres of ``--dsn``
(default: ``$RSELECTION_TEST_DSN``, else the local test database); plays a minute of
operations (handovers, a drain, a pause and a trigger); serves the console on loopback
and saves ``console-overview.png``, ``console-lease.png`` and ``console-shards.png``
with Debian's headless Chromium (``/usr/bin/chromium``) driven by Playwright. The
schema is dropped at the end. Needs the ``dev`` extra and the ``chromium`` package.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

import rselection as rs  # noqa: E402
from rselection.postgres import PostgresAdmin  # noqa: E402
from rselection.resigning import hand_over  # noqa: E402
from rselection.web import create_app  # noqa: E402
from tests.support.console import chromium_path, launch_chromium, serve  # noqa: E402
from tests.support.pg import with_search_path  # noqa: E402

FAST = {"ttl": 3, "renew_interval": 0.5, "renew_deadline": 2, "retry_interval": 0.5}
TOKEN = "docs-screenshot-token"
VIEWPORT = {"width": 1280, "height": 900}


@contextlib.contextmanager
def schema(server: str) -> Iterator[str]:
    """A DSN of a schema of its own on ``server``, dropped afterwards."""
    name = f"rselection_console_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    try:
        yield with_search_path(server, name)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def handler() -> rs.TaskHandler:
    """The billing service's tasks: one of them fails every time."""
    tasks = rs.TaskHandler()

    @tasks.persistent(name="ledger-sync")
    def ledger_sync(ctx: rs.TaskContext) -> None:
        while ctx.sleep(0.2):
            pass

    @tasks.interval(2, name="purge")
    def purge(ctx: rs.TaskContext) -> None:
        ctx.sleep(0.3)

    @tasks.interval(3, name="report")
    def report(ctx: rs.TaskContext) -> None:
        raise ConnectionError("mail relay refused the connection")

    return tasks


def wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def play(admin: PostgresAdmin, leaders: list[Any]) -> None:
    """A minute of operations, so the timeline and the run history have something."""
    leaders[0].start()  # node-a leads first
    wait(lambda: leaders[0].is_leader, 15, "node-a to lead")
    for leader in leaders[1:]:
        leader.start()
    wait(lambda: len(admin.live_nodes("billing") or ()) == 3, 15, "three nodes")
    time.sleep(8)
    hand_over(admin, "billing", to="node-b")
    time.sleep(8)
    admin.drain("billing", "node-b")  # the holder: it hands over at once
    wait(lambda: (admin.current_holder("billing") or leaders[1]).node_id != "node-b", 10, "move")
    time.sleep(8)
    admin.undrain("billing", "node-b")
    admin.pause_task("billing", "purge")
    time.sleep(6)
    admin.trigger_task("billing", "purge")
    time.sleep(4)
    admin.resume_task("billing", "purge")
    holder = admin.current_holder("billing")
    if holder is not None and holder.node_id != "node-a":
        hand_over(admin, "billing", to="node-a")
    time.sleep(8)


def main() -> int:
    """Take the screenshots; the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="the Postgres server (a schema of its own is used)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"), help="where to save")
    args = parser.parse_args()
    server = (
        args.dsn
        or os.environ.get("RSELECTION_TEST_DSN")
        or ("postgresql://postgres@127.0.0.1:5432/test")
    )
    executable = chromium_path()
    if executable is None:
        print("no chromium: apt-get install chromium", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    with schema(server) as dsn, contextlib.ExitStack() as stack:
        leaders = [
            rs.PostgresLeader(
                dsn,
                handler(),
                name="billing",
                node_id=f"node-{n}",
                version=v,
                heartbeat_interval=0.5,
                **FAST,
            )
            for n, v in (("a", "2.4.1"), ("b", "2.4.1"), ("c", "2.4.1"))
        ]
        sharded = [
            rs.PostgresShardedLeader(
                dsn, rs.TaskHandler(), name="pollers", shards=16, node_id=f"poller-{n}", **FAST
            )
            for n in ("1", "2", "3")
        ]
        for leader in [*leaders, *sharded]:
            stack.callback(leader.stop, 10)
        for leader in sharded:
            leader.start()
        admin = PostgresAdmin(dsn)
        stack.callback(admin.close)
        play(admin, leaders)
        sharded[0].wait_until_balanced(20)
        app = create_app(conninfo=dsn, token=TOKEN)
        with (
            serve(app) as url,
            sync_playwright() as playwright,
            launch_chromium(playwright, executable) as browser,
        ):
            context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
            page = context.new_page()
            page.goto(f"{url}/login?next=/leases/billing%3Fwindow%3D5m")
            page.fill("input[name=token]", TOKEN)
            page.click("form.login button")
            page.wait_for_url("**/leases/billing?window=5m")
            page.screenshot(path=str(out / "console-lease.png"), full_page=True)
            page.goto(url + "/")
            page.screenshot(path=str(out / "console-overview.png"), full_page=True)
            page.goto(url + "/leases/pollers/shards")
            page.screenshot(path=str(out / "console-shards.png"), full_page=True)
    for each in ("console-overview.png", "console-lease.png", "console-shards.png"):
        print(out / each)
    return 0


if __name__ == "__main__":
    sys.exit(main())
