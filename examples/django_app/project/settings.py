"""Settings of the example project, from the environment where a deployment sets them.

- ``RSELECTION_DSN``: the Postgres database of the lease (unset: each process leads
  alone, for development only).
- ``RSELECTION_NAME``: the lease's name (default ``django-app``).
- ``DJANGO_ALLOWED_HOSTS``: comma-separated host names this site answers to (default
  ``localhost,127.0.0.1,[::1]``).
- ``DJANGO_SECRET_KEY``: set one of your own in any real deployment.
"""

from __future__ import annotations

import os

DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or "example-only-not-secret"
ALLOWED_HOSTS = [
    host.strip()
    for host in (os.environ.get("DJANGO_ALLOWED_HOSTS") or "localhost,127.0.0.1,[::1]").split(",")
    if host.strip()
]
USE_TZ = True
TIME_ZONE = "UTC"  # Django sets the process's TZ from it: keep log times in UTC
INSTALLED_APPS = ["leaderapp.apps.LeaderAppConfig"]
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
ROOT_URLCONF = "project.urls"
DATABASES: dict[str, dict[str, str]] = {}

# rselection: the lease lives in Postgres when a DSN is set, else lead alone.
RSELECTION_DSN = os.environ.get("RSELECTION_DSN") or None
RSELECTION_LEASE = os.environ.get("RSELECTION_NAME") or "django-app"
