"""A Django app that owns leader-scoped tasks and the ``runleader`` command."""
