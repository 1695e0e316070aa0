"""What a fresh interpreter loads and sees: imports, optional drivers, hash seeds."""

from __future__ import annotations

import os
import subprocess
import sys


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


def test_the_command_line_loads_no_driver_until_a_subcommand_runs() -> None:
    code = (
        "import sys; from rselection import cli; cli.build_parser(); "
        "print(sorted(m for m in ('psycopg', 'redis') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_importing_costs_nothing_while_off() -> None:
    code = (
        "import sys, rselection, rselection.metrics, rselection.testing\n"
        "from rselection import signals\n"
        "assert 'prometheus_client' not in sys.modules, 'imported prometheus_client'\n"
        "names = [n for n in signals.__all__ if n != 'namespace']\n"
        "busy = [n for n in names if getattr(signals, n).receivers]\n"
        "assert not busy, busy\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_shard_of_is_the_same_in_other_processes_whatever_the_hash_seed() -> None:
    code = "import rselection as rs; print(rs.shard_of('tenant-42', 1024), rs.shard_of('é', 1024))"
    for seed in ("0", "1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        ).stdout.split()
        assert out == ["200", "851"]
