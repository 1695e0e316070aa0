"""A small Django site whose server workers run rselection's leader, or ``runleader`` does.

    python examples/django_app/manage.py runleader            # leads alone
    export RSELECTION_DSN=postgresql://app@db/app
    python examples/django_app/manage.py runleader --node-id a
    python examples/django_app/manage.py runleader --node-id b

Two ways to run the leader, for the same tasks (``leaderapp/tasks.py``):

- In the web server's workers: ``project.asgi:application`` is Django's ASGI app
  wrapped in ``leaderapp.lifespan.LeaderLifespan``, which starts a leader in each
  worker at startup and stops it at shutdown. Serve it with gunicorn and uvicorn's
  worker, or with uvicorn (see ``project/asgi.py``); ``GET /`` shows the worker's node
  id and who leads.
- As a process of its own, ``runleader`` (next to the web workers, one per host or
  several): the processes compete for the lease, one runs the tasks, and SIGTERM hands
  leadership over at once.

The processes with the same ``--name`` (default ``$RSELECTION_NAME``, else
``django-app``) compete for one lease. The settings are in ``project/settings.py``.
"""

from __future__ import annotations

import os
import sys

from django.core.management import execute_from_command_line

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    execute_from_command_line(sys.argv)
