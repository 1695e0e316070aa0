"""A PostgresLeader node for mixed-release fleets: runs on this release and the previous one.

Run it as a script (``python -P tests/support/release_node.py ...``), never as a module
of this checkout: it imports nothing but the standard library and whichever
``rselection`` the interpreter has, so the previous release's venv runs it with the old
package (see :mod:`tests.support.previous_release`). It uses only the API both releases
share. The connection string comes in ``RSELECTION_DSN`` (not on the command line).

Prints one JSON line per event on stdout, each with ``ev`` and the wall clock ``t``:

* ``started``: the package it runs (``file``, ``version``), the lease table schema
  version (``schema``) and lease protocol (``protocol``) that release speaks;
* ``elected`` / ``demoted`` with the term;
* ``activity``: its persistent task ``work`` started (``end`` null) or ended, in the
  format of :mod:`tests.support.activity`, so a test can check that no two terms ran;
* ``lead-error``: ``lead()`` raised (``error`` is ``"<type>: <message>"``); the node
  then exits with status 3, the message also on stderr.

Stops gracefully (exit 0) when stdin closes.

    RSELECTION_DSN=... python -P tests/support/release_node.py --lease NAME --node ID \
        [--no-create-tables]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from typing import Any

import rselection as rs
from rselection.postgres import PostgresLeader

TTL, RENEW_INTERVAL, RENEW_DEADLINE, RETRY_INTERVAL = 4.0, 0.5, 2.0, 0.5
STOP_GRACE = 1.0  # renew_deadline + stop_grace + 0.5 s <= ttl
REFUSED = 3  # exit status when lead() raised

_lock = threading.Lock()
_runs = itertools.count(1)


def emit(event: str, **fields: Any) -> None:
    """One JSON line, written whole (tasks, receivers and the main thread all report)."""
    line = json.dumps({"ev": event, "t": time.time(), **fields}, default=str) + "\n"
    with _lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def release_info() -> dict[str, Any]:
    """What release this interpreter imports: file, version, schema version, protocol."""
    from rselection.postgres import _lease_sql, schema

    return {
        "file": rs.__file__,
        "version": rs.__version__,
        "schema": schema.LEASES_VERSION,
        # Protocol 1 did not name itself.
        "protocol": getattr(_lease_sql, "LEASE_PROTOCOL", 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lease", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--no-create-tables", action="store_true")
    args = parser.parse_args(argv)
    node = args.node

    handler = rs.TaskHandler(stop_grace=STOP_GRACE)

    @handler.persistent("work")
    def work(ctx: rs.TaskContext) -> None:
        # The start is written before anything else: a node killed mid-run leaves it.
        run, start = next(_runs), time.time()
        fields = {"node": node, "term": ctx.term, "task": "work", "run": run, "start": start}
        emit("activity", **fields, end=None)
        try:
            ctx.cancelled.wait()
        finally:
            emit("activity", **fields, end=time.time())

    def elected(sender: Any, **kw: Any) -> None:
        emit("elected", node=node, term=kw["term"])

    def demoted(sender: Any, **kw: Any) -> None:
        emit("demoted", node=node, term=kw.get("term"), reason=kw.get("reason"))

    rs.signals.elected.connect(elected)
    rs.signals.demoted.connect(demoted)
    emit("started", node=node, **release_info())
    leader = PostgresLeader(
        os.environ["RSELECTION_DSN"],
        handler,
        name=args.lease,
        node_id=node,
        claimer=None,
        create_tables=not args.no_create_tables,
        ttl=TTL,
        renew_interval=RENEW_INTERVAL,
        renew_deadline=RENEW_DEADLINE,
        retry_interval=RETRY_INTERVAL,
    )
    failed: list[str] = []

    def lead() -> None:
        try:
            leader.lead()
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
            emit("lead-error", node=node, error=failed[0])

    thread = threading.Thread(target=lead, daemon=True)
    thread.start()

    def until_stdin_closes() -> None:
        sys.stdin.read()  # until the test closes our stdin
        leader.stop(timeout=10)

    # lead() returns when stdin closes, or on its own when it raised.
    threading.Thread(target=until_stdin_closes, daemon=True).start()
    thread.join()
    leader.stop(timeout=10)
    if failed:
        print(failed[0], file=sys.stderr)
        return REFUSED
    emit("stopped", node=node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
