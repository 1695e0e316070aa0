"""Packaging promises: the core imports no driver, a missing driver says what to install,
and every public name is documented."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

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


LAZY = ["PostgresLeader", "RedisLeader"]


def test_every_public_name_has_a_docstring() -> None:
    missing = [
        name
        for name in [*rs.__all__, *LAZY]
        if not inspect.getdoc(getattr(rs, name)) and not inspect.ismodule(getattr(rs, name))
    ]
    assert missing == []


def test_lazy_names_are_listed_by_dir_and_left_out_of_star_imports() -> None:
    assert set(LAZY) <= set(dir(rs))
    assert not set(LAZY) & set(rs.__all__)  # a star import needs no driver
    assert rs.RedisLeader.__name__ == "RedisLeader"
    with pytest.raises(AttributeError, match="NoSuchThing"):
        rs.NoSuchThing  # noqa: B018


# Runs in a fresh interpreter where redis-py cannot be imported, as without the extra.
WITHOUT_REDIS = r"""
import sys

class NoRedis:
    def find_spec(self, name, path=None, target=None):
        if name == "redis" or name.startswith("redis."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoRedis())
from rselection import *
import rselection as rs

assert TaskHandler is rs.TaskHandler and "RedisLeader" not in globals()
assert {"PostgresLeader", "RedisLeader"} <= set(dir(rs))
errors = []
for attempt in (
    lambda: rs.RedisLeader,
    lambda: __import__("rselection", fromlist=["RedisLeader"]).RedisLeader,
    lambda: __import__("rselection.redis"),
):
    try:
        attempt()
    except ImportError as exc:
        errors.append(str(exc))
    else:
        errors.append("no error")
assert rs.PostgresLeader.__name__ == "PostgresLeader"
assert not [m for m in sys.modules if m.split(".")[0] == "redis"]
print("\n".join(errors))
"""


def test_without_redis_py_the_core_works_and_redis_names_say_what_to_install() -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_REDIS], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3
    for line in lines:
        assert "pip install 'rselection[redis]'" in line, line
