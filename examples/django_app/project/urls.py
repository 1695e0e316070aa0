"""The example's URLs: ``/`` shows this worker's node and who leads."""

from __future__ import annotations

from django.urls import path
from leaderapp.views import leadership

urlpatterns = [path("", leadership, name="leadership")]
