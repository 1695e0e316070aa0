"""A node whose wall clock runs ``--skew`` seconds ahead, for the fire-key skew test.

It leads ``--lease`` with a 200 ms interval task that records each fire key in a ledger
table (unique on the key, so a fire run twice fails loudly), and prints one JSON line
per event (``elected``, ``ran``, ``skipped``, ``duplicate``, ``stopped``) on stdout. It
stops gracefully (releasing the lease) when its stdin closes.

    python -m tests.support.skewed_node DSN --lease NAME --node ID [--skew 30]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from tests.support.node_process import emit

LEDGER = "skew_ledger"
EVERY = 0.2


@contextlib.contextmanager
def clock_ahead(seconds: float) -> Iterator[None]:
    """Shift the wall clock (time.time, datetime.now) by ``seconds``, still ticking."""
    if not seconds:
        yield
        return
    import freezegun

    # By default freezegun hands the real time to any call made under a thread's
    # bootstrap frame, that is to every thread but the main one; shift them all.
    freezegun.configure(default_ignore_list=[])
    start = datetime.now(UTC) + timedelta(seconds=seconds)
    with freezegun.freeze_time(start, tick=True):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dsn")
    parser.add_argument("--lease", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--skew", type=float, default=0.0)
    args = parser.parse_args(argv)

    with clock_ahead(args.skew):
        import rselection as rs
        from rselection.postgres import PostgresLeader

        handler = rs.TaskHandler()
        ledger = psycopg.connect(args.dsn, autocommit=True)
        lock = threading.Lock()

        @handler.interval(EVERY, name="tick")
        def tick(ctx: rs.TaskContext) -> None:
            try:
                with lock:
                    ledger.execute(
                        f"INSERT INTO {LEDGER} (fire_key, node) VALUES (%s, %s)",
                        (ctx.fire_key, args.node),
                    )
            except psycopg.errors.UniqueViolation:
                emit("duplicate", key=ctx.fire_key)
                return
            emit("ran", key=ctx.fire_key, term=ctx.term)

        def skipped(sender: object, **kw: Any) -> None:
            emit("skipped", key=kw["fire_key"], reason=kw["reason"])

        def elected(sender: object, **kw: Any) -> None:
            emit("elected", term=kw["term"], now=datetime.now(UTC).isoformat())

        rs.signals.fire_skipped.connect(skipped, sender=handler)
        leader = PostgresLeader(
            args.dsn,
            handler,
            name=args.lease,
            node_id=args.node,
            ttl=3,
            renew_interval=0.5,
            renew_deadline=2,
            retry_interval=0.5,
        )
        rs.signals.elected.connect(elected, sender=leader)
        leader.start()
        emit("started")
        sys.stdin.read()  # until the test closes our stdin
        leader.stop(timeout=10)
        ledger.close()
    emit("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
