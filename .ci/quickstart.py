"""The README's quickstart against a real Postgres, run from an installed rselection.

    python quickstart.py CONNINFO

One node with a persistent task leads a lease of its own, the task runs, the leader
stops and releases. Exits 0 when all of that happened within the bounds below, 1 (with
the reason on stderr) otherwise. Uses only the public API, so it runs the same from a
wheel, an sdist or a checkout.
"""

from __future__ import annotations

import logging
import sys
import threading
import uuid

import rselection as rs

BOUND = 30.0  # seconds for each wait: to lead, for the task to run, to stop


def main(conninfo: str) -> int:
    """Lead once, see the persistent task run, stop; return the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    tasks = rs.TaskHandler()
    ran = threading.Event()
    terms: list[int] = []

    @tasks.persistent("heartbeat")
    async def heartbeat(ctx: rs.TaskContext) -> None:
        terms.append(ctx.term)
        ran.set()
        while await ctx.asleep(0.2):
            pass

    name = f"quickstart-{uuid.uuid4().hex[:8]}"
    leader = rs.PostgresLeader(conninfo, tasks, name=name)
    print(f"rselection from {rs.__file__}; node {leader.node_id} on lease {name!r}")
    leader.start()
    try:
        if not leader.wait_until_leader(timeout=BOUND):
            print(f"FAILED: not the leader of {name!r} after {BOUND:.0f} s", file=sys.stderr)
            return 1
        if not ran.wait(BOUND):
            print(f"FAILED: the persistent task did not run within {BOUND:.0f} s", file=sys.stderr)
            return 1
    finally:
        leader.stop(timeout=BOUND)
    if leader.is_leader:
        print("FAILED: still the leader after stop()", file=sys.stderr)
        return 1
    holder = leader.leader()
    if holder is not None:
        print(f"FAILED: the lease is still held after stop(): {holder}", file=sys.stderr)
        return 1
    print(f"led term {terms[0]}, ran the persistent task, stopped and released the lease")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
