"""Conformance suites: one scenario, run on every backend."""
