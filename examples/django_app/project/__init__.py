"""The Django project of the example: settings, URLs and the ASGI application."""
