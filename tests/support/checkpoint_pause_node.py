"""A leader that stops itself (SIGSTOP) inside ``ctx.checkpoint.save``, for takeover tests.

A PostgresLeader (ttl 3 s, renew_deadline 2 s: a margin of 1 s) whose task saves its
checkpoint in a loop. On the fifth save, right after the fencing check (the lease row is
locked until the save's transaction ends), it prints ``paused`` with the transaction's
``idle_in_transaction_session_timeout`` and stops itself with SIGSTOP. Prints ``elected``
when it leads. With ``--own-store`` the leader is given a store of its own
(``PostgresCheckpointStore(DSN)``, whose idle bound is 5 s) instead of its default one.

    python -m tests.support.checkpoint_pause_node DSN --lease NAME [--own-store]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import psycopg

import rselection as rs
import rselection.postgres.checkpoint as checkpoint_store
from rselection.postgres import PostgresCheckpointStore, PostgresLeader
from tests.support.node_process import emit

PAUSE_AT = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dsn")
    parser.add_argument("--lease", required=True)
    parser.add_argument("--own-store", action="store_true")
    args = parser.parse_args(argv)

    real = checkpoint_store.fenced
    calls = [0]

    def pausing(conn: psycopg.Connection[Any], *a: Any, **kw: Any) -> None:
        real(conn, *a, **kw)
        calls[0] += 1
        if calls[0] == PAUSE_AT:
            row = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
            emit("paused", idle_timeout=row[0] if row else None)
            os.kill(os.getpid(), signal.SIGSTOP)

    checkpoint_store.fenced = pausing  # the store's fencing check, inside the save

    handler = rs.TaskHandler()

    @handler.persistent("saver")
    def saver(ctx: rs.TaskContext) -> None:
        n = 0
        while ctx.sleep(0.1):
            n += 1
            ctx.checkpoint.save({"n": n})

    leader = PostgresLeader(
        args.dsn,
        handler,
        name=args.lease,
        node_id="paused",
        ttl=3,
        renew_interval=0.5,
        renew_deadline=2,
        retry_interval=0.5,
        claimer=None,
        checkpoint_store=PostgresCheckpointStore(args.dsn) if args.own_store else None,
    )
    rs.signals.elected.connect(lambda sender, **kw: emit("elected", term=kw["term"]), weak=False)
    leader.start()
    sys.stdin.read()  # until the test closes stdin (or kills this process)
    leader.stop(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
