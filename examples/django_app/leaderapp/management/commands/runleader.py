"""``manage.py runleader``: compete for the lease and run the project's tasks while leading."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand

import rselection as rs
from leaderapp.leading import build_leader


class Command(BaseCommand):
    """Run the leader until SIGTERM, Ctrl-C or ``--seconds``; then hand over."""

    help = "Run rselection's leader: this process runs leaderapp's tasks while it leads."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
        parser.add_argument("--node-id", default=None, help="this node's id")
        parser.add_argument(
            "--name",
            default=None,
            help="the lease (default: settings.RSELECTION_LEASE, from $RSELECTION_NAME)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        leader = build_leader(name=options["name"], node_id=options["node_id"])

        def elected(sender: object, **kw: Any) -> None:
            self.stdout.write(f"elected: {kw['node_id']} leads with term {kw['term']}")

        def demoted(sender: object, **kw: Any) -> None:
            self.stdout.write(f"demoted: term {kw['term']} ended ({kw['reason']})")

        rs.signals.elected.connect(elected, sender=leader)
        rs.signals.demoted.connect(demoted, sender=leader)

        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()  # stop() joins threads: do it in the main loop below, not here

        # call_command() may run in a thread that cannot install signal handlers.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)

        leader.start()
        self.stdout.write(f"node {leader.node_id} started; SIGTERM or Ctrl-C stops it")
        seconds = options["seconds"]
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            # Short waits, so the signal handler's flag is seen promptly.
            while not stop.wait(0.2):
                if deadline is not None and time.monotonic() >= deadline:
                    break
        finally:
            leader.stop()  # cancel and join the tasks, then release the lease
            rs.signals.elected.disconnect(elected, sender=leader)
            rs.signals.demoted.disconnect(demoted, sender=leader)
        self.stdout.write("stopped cleanly")
