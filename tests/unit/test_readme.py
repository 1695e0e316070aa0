"""The README's quickstart runs as written (with lead() bounded for the test)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_runs_and_its_tasks_do_something(capsys: Any) -> None:
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None, "the README lost its quickstart"
    source = code.group(1).replace("leader.lead()", "leader.start()")
    namespace: dict[str, Any] = {}
    exec(compile(source, "README quickstart", "exec"), namespace)
    leader = namespace["leader"]
    try:
        assert leader.wait_until_leader(5)
        # The monitor subscribes once its term starts: publish until it has printed.
        deadline = time.monotonic() + 5
        out = ""
        while "saw hello" not in out:
            assert time.monotonic() < deadline, "the monitor never printed the heartbeat"
            leader.broadcaster.publish("heartbeats", "hello")
            time.sleep(0.05)
            out += capsys.readouterr().out
    finally:
        leader.stop(timeout=10)
    assert not [t for t in threading.enumerate() if t.name.startswith("rselection-")]
