"""The console served for tests and screenshots: uvicorn on a loopback port in a thread,
and a headless Chromium (Debian's ``chromium``) driven by Playwright.

Playwright's own browser download is never used: :func:`launch_chromium` points it at
the system's browser (``/usr/bin/chromium``, or ``$RSELECTION_CHROMIUM``). Under
``CI=true`` a missing browser fails the tests instead of skipping them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["CHROMIUM_ARGS", "chromium_path", "launch_chromium", "serve"]

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""How the tests start the browser: headless, as root, with nothing of its own to fetch."""


def chromium_path() -> str | None:
    """The system's Chromium: ``$RSELECTION_CHROMIUM``, else ``chromium`` on ``PATH``."""
    found = os.environ.get("RSELECTION_CHROMIUM") or shutil.which("chromium")
    if found is None and os.path.exists("/usr/bin/chromium"):
        found = "/usr/bin/chromium"
    return found


@contextlib.contextmanager
def launch_chromium(playwright: Any, executable: str) -> Iterator[Any]:
    """A headless Chromium of the system's, closed after the block.

    Args:
        playwright: a started ``sync_playwright()``.
        executable: the browser's path (:func:`chromium_path`).
    """
    browser = playwright.chromium.launch(
        executable_path=executable, headless=True, args=CHROMIUM_ARGS
    )
    try:
        yield browser
    finally:
        browser.close()


@contextlib.contextmanager
def serve(app: Any, *, timeout: float = 15.0) -> Iterator[str]:
    """Serve the ASGI ``app`` on a free loopback port in a thread; yield its base URL.

    Args:
        app: the ASGI app.
        timeout: seconds to wait for the server to start, and to stop.
    """
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="console-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the console did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
