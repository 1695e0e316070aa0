"""Tests without servers."""
