"""Tests against real Postgres and Redis servers."""
