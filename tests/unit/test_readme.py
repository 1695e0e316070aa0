"""The README is a short landing page whose quickstart runs as written.

Its other code blocks are checked with the docs' (tests/process/test_docs.py).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_is_a_short_landing_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for heading in ("## Install", "## Quickstart", "## Try it", "## Guarantees by backend"):
        assert f"\n{heading}\n" in text, heading
    assert "logging.basicConfig(level=logging.INFO)" in text
    assert "pytest -n 4 tests/unit" in text and "rselection demo" in text
    # One command per purpose, in a virtual environment: use it, or work on it.
    assert "python -m venv .venv && . .venv/bin/activate" in text
    assert "pip install 'rselection[" in text, "say how to install it to use it"
    assert "pip install -e '.[dev]'" in text, "say how to install a clone to work on it"
    assert "`embedded` |" in text, "say what the embedded extra is for"


def test_readme_links_point_at_files_that_exist() -> None:
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text()):
        assert (ROOT / target).exists(), target


def start_quickstart() -> Any:
    """Run the README's quickstart with ``leader.start()`` for ``leader.lead()``; its leader."""
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None, "the README lost its quickstart"
    source = code.group(1).replace("leader.lead()", "leader.start()")
    namespace: dict[str, Any] = {}
    exec(compile(source, "README quickstart", "exec"), namespace)
    return namespace["leader"]


def test_quickstart_runs_and_its_tasks_do_something(capsys: Any) -> None:
    leader = start_quickstart()
    try:
        assert leader.wait_until_leader(5)
        # The purge log subscribes once its term starts: publish until it has printed.
        deadline = time.monotonic() + 5
        out = ""
        while "saw hello" not in out:
            assert time.monotonic() < deadline, "the purge log never printed the message"
            leader.broadcaster.publish("purges", "hello")
            time.sleep(0.05)
            out += capsys.readouterr().out
    finally:
        leader.stop(timeout=10)
    # The driver's threads end once nothing is left to drive, just after stop() returned.
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("rselection-")],
        5,
        "every rselection thread to end",
    )


def test_the_quickstart_prints_within_a_second_without_waiting_for_a_fire(capsys: Any) -> None:
    # Its interval task first fires up to 30 s after start: a reader trying it must see
    # at once that it runs, from the tasks themselves (on stdout, not only in the logs).
    started = time.monotonic()
    leader = start_quickstart()
    try:
        out = ""
        while not [line for line in out.splitlines() if " saw " not in line]:
            assert time.monotonic() - started < 1.0, f"nothing printed within 1 s: {out!r}"
            time.sleep(0.01)
            out += capsys.readouterr().out
    finally:
        leader.stop(timeout=10)


def test_the_quickstart_tasks_are_not_named_like_a_built_in_task() -> None:
    import rselection as rs

    built_in = {rs.HeartbeatMonitor().name}
    pages = [README, ROOT / "docs" / "tutorial" / "index.md", ROOT / "docs" / "how-to" / "tasks.md"]
    for page in pages:
        names = set(re.findall(r'@tasks\.\w+\((?:"([^"]+)"|[^)]*name="([^"]+)")', page.read_text()))
        found = {n for pair in names for n in pair if n}
        assert found, f"{page.name}: no task found"
        assert not found & built_in, f"{page.name} names a task like a built-in: {found & built_in}"
