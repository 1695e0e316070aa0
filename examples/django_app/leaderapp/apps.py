"""The app config: registers the tasks once Django is set up; starts nothing."""

from __future__ import annotations

from django.apps import AppConfig


class LeaderAppConfig(AppConfig):
    """Imports the task module so every task is registered before a leader starts.

    The leader is not started here: ``ready()`` also runs for ``migrate``, ``shell``
    and every other command. ``manage.py runleader`` starts it.
    """

    name = "leaderapp"

    def ready(self) -> None:
        from . import tasks  # noqa: F401  # registering is the import's side effect
