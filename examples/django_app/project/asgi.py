"""The ASGI application: Django's, wrapped so that each server worker runs a leader.

    gunicorn --pythonpath examples/django_app -k uvicorn.workers.UvicornWorker -w 3 \\
        --log-config-json examples/logging.json project.asgi:application
    uvicorn --app-dir examples/django_app --workers 3 \\
        --log-config examples/logging.json project.asgi:application

Django's ASGI handler refuses the ASGI lifespan protocol, so :class:`LeaderLifespan`
answers it: at a worker's startup it builds and starts that worker's leader, at
shutdown (SIGTERM to the server) it stops it, which cancels and joins the tasks and
releases the lease before the worker exits.
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

django_application = get_asgi_application()  # sets Django up: import the app's code after

from leaderapp.lifespan import LeaderLifespan  # noqa: E402

application = LeaderLifespan(django_application)
"""What the ASGI server serves: ``project.asgi:application``."""
