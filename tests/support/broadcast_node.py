"""A node process for the cross-node broadcaster tests: publish and/or collect messages.

Run as ``python -m tests.support.broadcast_node --dsn DSN --name NAME [options]`` from
the repository root. It creates a :class:`PostgresBroadcaster`, subscribes to the
channel (when it expects messages), and reports on stdout, one JSON object per line:

* ``{"event": "ready"}`` once its listener is connected;
* then it waits for a line ``go`` on stdin;
* ``{"event": "published", "count": N}`` after publishing ``--publish`` messages
  ``{"from": NAME, "i": i, "body": body(NAME, i, --size)}`` and flushing them;
* ``{"event": "done", "received": {sender: [i, ...]}, "bodies_ok": bool, "sizes": [...],
  "overflowed": n}`` once ``--expect`` messages arrived, in arrival order per sender;
  ``bodies_ok`` says whether every body matched :func:`body`.

It exits 0 after ``done`` (or after ``published`` when it expects nothing), 3 when
``--timeout`` seconds pass first (a bounded wait).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time

from rselection.postgres import PostgresBroadcaster

__all__ = ["body", "main"]


def body(name: str, i: int, size: int) -> str:
    """The deterministic body of message ``i`` from ``name``, ``size`` characters long."""
    if size <= 0:
        return ""
    seed = hashlib.sha256(f"{name}:{i}".encode()).hexdigest()
    return (seed * (size // len(seed) + 1))[:size]


def _say(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Run the node; see the module docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--table", default="rselection_broadcast")
    parser.add_argument("--channel", default="events")
    parser.add_argument("--publish", type=int, default=0)
    parser.add_argument("--size", type=int, default=0)
    parser.add_argument("--expect", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    deadline = time.monotonic() + args.timeout
    bc = PostgresBroadcaster(args.dsn, table=args.table, max_pending=100_000)
    try:
        sub = bc.subscribe(args.channel, maxsize=max(1, args.expect)) if args.expect else None
        if not bc.wait_ready(args.timeout):
            return 3
        _say("ready")
        line = sys.stdin.readline()
        if line.strip() != "go":
            return 4

        def publish() -> None:
            for i in range(args.publish):
                bc.publish(
                    args.channel, {"from": args.name, "i": i, "body": body(args.name, i, args.size)}
                )
            flushed = bc.flush(max(0.0, deadline - time.monotonic()))
            _say("published", count=args.publish, flushed=flushed)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()

        received: dict[str, list[int]] = {}
        sizes: list[int] = []
        bodies_ok = True
        if sub is not None:
            for _ in range(args.expect):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _say("timeout", received={k: len(v) for k, v in received.items()})
                    return 3
                try:
                    msg = sub.get(remaining)
                except TimeoutError:
                    _say("timeout", received={k: len(v) for k, v in received.items()})
                    return 3
                assert isinstance(msg, dict)
                sender, i, text = msg["from"], msg["i"], msg["body"]
                received.setdefault(sender, []).append(i)
                sizes.append(len(text))
                if text != body(sender, i, len(text)):
                    bodies_ok = False
        publisher.join(max(0.0, deadline - time.monotonic()))
        if publisher.is_alive():
            return 3
        _say(
            "done",
            received=received,
            sizes=sizes,
            bodies_ok=bodies_ok,
            overflowed=bc.stats().overflowed,
        )
        return 0
    finally:
        bc.close()


if __name__ == "__main__":
    sys.exit(main())
