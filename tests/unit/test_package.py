"""Packaging promises: the core imports no driver, and every public name is documented."""

from __future__ import annotations

import inspect
import subprocess
import sys

import rselection as rs


def test_core_import_loads_neither_psycopg_nor_redis() -> None:
    code = (
        "import sys, rselection as rs\n"
        "rs.SingleNodeLeader(rs.TaskHandler())\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('psycopg', 'redis'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_postgres_leader_loads_on_demand() -> None:
    from rselection.postgres.leader import PostgresLeader

    assert rs.PostgresLeader is PostgresLeader


def test_every_public_name_has_a_docstring() -> None:
    missing = [
        name
        for name in rs.__all__
        if not inspect.getdoc(getattr(rs, name)) and not inspect.ismodule(getattr(rs, name))
    ]
    assert missing == []
