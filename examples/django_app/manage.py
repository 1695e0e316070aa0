"""A minimal Django project whose ``runleader`` command runs rselection's leader.

    python examples/django_app/manage.py runleader            # leads alone
    export RSELECTION_DSN=postgresql://app@db/app
    python examples/django_app/manage.py runleader --node-id a
    python examples/django_app/manage.py runleader --node-id b

The second replica is the same command in another terminal (or on another host): the
processes with the same ``--name`` (default ``$RSELECTION_NAME``, else ``django-app``)
compete for one lease.

Run ``runleader`` as its own process (next to the web workers, one per host or
several): the processes compete for the lease, one runs the tasks of
``leaderapp/tasks.py``, and SIGTERM hands leadership over at once. The settings live in
this file to keep the example small; in a real project they go in ``settings.py``.
"""

from __future__ import annotations

import os
import sys

from django.conf import settings
from django.core.management import execute_from_command_line

settings.configure(
    DEBUG=False,
    SECRET_KEY="example-only-not-secret",
    USE_TZ=True,
    INSTALLED_APPS=["leaderapp.apps.LeaderAppConfig"],
    DATABASES={},
    # rselection: the lease lives in Postgres when a DSN is set, else lead alone.
    RSELECTION_DSN=os.environ.get("RSELECTION_DSN") or None,
    RSELECTION_LEASE=os.environ.get("RSELECTION_NAME") or "django-app",
)

if __name__ == "__main__":
    execute_from_command_line(sys.argv)
