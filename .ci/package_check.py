"""Build the release files, check them, and run the quickstart from what they install.

    python .ci/package_check.py

Run it with an interpreter that has the ``dev`` extra (``build``, ``twine``,
``trove-classifiers``); the checkout is the directory above this file. Steps, each timed:

1. ``python -m build``: the sdist, then the wheel built from the sdist.
2. ``twine check --strict`` on both.
3. The wheel holds ``rselection/py.typed``, the console's templates and static files, and
   the ``rselection`` command, no tests, and only classifiers PyPI knows.
4. A fresh virtual environment with the wheel alone (psycopg over the system libpq; the
   ``binary`` extra only where this machine has no libpq), used from an empty directory
   so nothing can be imported from the checkout: ``rselection --help``,
   ``python -m rselection --help``, ``from rselection import *`` without redis-py, and
   ``.ci/quickstart.py`` against Postgres.
5. A fresh virtual environment where ``pip install .`` (not editable) ran in a copy of
   the checkout's files: ``rselection --help`` from there too.

Postgres, as for the tests: ``RSELECTION_TEST_DSN``, else 127.0.0.1:5432 (database
``test``), else a private server from pgserver. The quickstart works in a schema of its
own, dropped at the end. Exits 1 with the reason on the first failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import trove_classifiers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.pg import (  # noqa: E402  (the checkout's test support, found above)
    DEFAULT_DSN,
    PrivatePostgres,
    postgres_answers,
    redact,
    with_search_path,
)

COMMAND_TIMEOUT = 300.0  # seconds for any one command (a pip install that has to download)


CONSOLE_FILES = (
    "rselection/web/templates/base.html",
    "rselection/web/templates/lease.html",
    "rselection/web/static/console.css",
    "rselection/web/static/console.js",
)
"""Package data the console cannot serve a page without (``rselection web``)."""


class CheckFailed(Exception):
    """One check failed; the message says which and why."""


@contextlib.contextmanager
def step(title: str) -> Iterator[None]:
    """Print a step's title, then how long it took."""
    print(f"--> {title}", flush=True)
    started = time.monotonic()
    yield
    print(f"    ({time.monotonic() - started:.1f} s)", flush=True)


def clean_env() -> dict[str, str]:
    """This environment without what would let the checkout or another venv be imported."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def run(
    cmd: Sequence[str | Path], *, cwd: Path, timeout: float = COMMAND_TIMEOUT, quiet: bool = False
) -> str:
    """Run a command; return its output, or raise CheckFailed showing the output."""
    words = [str(c) for c in cmd]
    try:
        out = subprocess.run(
            words,
            cwd=cwd,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"{' '.join(words)} did not finish within {timeout:.0f} s") from exc
    if out.returncode != 0:
        raise CheckFailed(
            f"{' '.join(words)} exited with {out.returncode} (in {cwd}):\n{out.stdout[-6000:]}"
        )
    if not quiet and out.stdout.strip():
        print(out.stdout.rstrip(), flush=True)
    return out.stdout


def fresh_venv(path: Path) -> Path:
    """Create a virtual environment at ``path``; return its interpreter."""
    run([sys.executable, "-m", "venv", path], cwd=path.parent)
    return path / "bin" / "python"


def pip_install(python: Path, *requirements: str | Path, cwd: Path) -> None:
    """Install into the environment of ``python``."""
    run([python, "-m", "pip", "install", "--quiet", *requirements], cwd=cwd, quiet=True)


def copy_checkout(dest: Path) -> None:
    """Copy the files a clean checkout has (with local edits, without build leftovers)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.split("\0")):
            source = ROOT / name
            if source.is_file():  # a tracked file deleted in the work tree is left out
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)
        return
    leftovers = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".*_cache"
    )
    shutil.copytree(ROOT, dest, ignore=leftovers, dirs_exist_ok=True)


# --------------------------------------------------------------------------- checks


def build(dist: Path) -> tuple[Path, Path]:
    """Build the sdist and the wheel (from the sdist); return their paths."""
    log = run([sys.executable, "-m", "build", "--outdir", dist, ROOT], cwd=ROOT, quiet=True)
    print(log.strip().splitlines()[-1])
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        raise CheckFailed(f"expected one sdist and one wheel in {dist}, found {os.listdir(dist)}")
    return sdists[0], wheels[0]


def check_wheel(wheel: Path) -> None:
    """The wheel ships the typing marker and the command, and no tests."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), "")
        scripts = zf.read(entry_points).decode() if entry_points else ""
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        classifiers = [
            line.removeprefix("Classifier: ")
            for line in zf.read(metadata).decode().splitlines()
            if line.startswith("Classifier: ")
        ]
    problems = []
    unknown = [c for c in classifiers if c not in trove_classifiers.classifiers]
    if unknown:
        problems.append(f"classifiers PyPI would refuse: {unknown}")
    if "rselection/py.typed" not in names:
        problems.append("no rselection/py.typed")
    console = [n for n in CONSOLE_FILES if n not in names]
    if console:
        problems.append(f"the console's files are missing: {console}")
    tests = [n for n in names if n.split("/")[0] in ("tests", "examples", "bench")]
    if tests:
        problems.append(f"tests or examples inside: {tests[:5]}")
    if "rselection = rselection.cli:main" not in scripts:
        problems.append("no console script 'rselection = rselection.cli:main'")
    if problems:
        raise CheckFailed(f"{wheel.name}: " + "; ".join(problems))
    print(
        f"{wheel.name}: {len(names)} files, py.typed, the console's templates and static "
        "files, the rselection command, no tests, "
        f"{len(classifiers)} known classifiers"
    )


def has_libpq(python: Path, cwd: Path) -> bool:
    """Whether psycopg in that environment finds a libpq (its pure-Python wrapper does)."""
    probe = "import psycopg; print(psycopg.pq.__impl__, psycopg.pq.version())"
    try:
        out = run([python, "-c", probe], cwd=cwd, quiet=True)
    except CheckFailed:
        return False
    print(f"psycopg {out.strip()} (implementation, libpq version)")
    return True


def check_installed(venv: Path, elsewhere: Path) -> None:
    """rselection imports from ``venv`` (not the checkout) and both commands answer."""
    python = venv / "bin" / "python"
    where = run([python, "-c", "import rselection; print(rselection.__file__)"], cwd=elsewhere)
    if not Path(where.strip()).resolve().is_relative_to(venv.resolve()):
        raise CheckFailed(f"rselection was imported from {where.strip()}, not from {venv}")
    commands = {
        "rselection --help": [venv / "bin" / "rselection", "--help"],
        "python -m rselection --help": [python, "-m", "rselection", "--help"],
    }
    for label, cmd in commands.items():
        usage = run(cmd, cwd=elsewhere, quiet=True)
        if not usage.startswith("usage: rselection"):
            raise CheckFailed(f"{label} printed no usage:\n{usage}")
        print(f"{label}: ok")


WITHOUT_REDIS = """
import importlib.util
from rselection import *
import rselection as rs
assert importlib.util.find_spec("redis") is None, "redis-py is installed"
try:
    rs.RedisLeader
except ImportError as exc:
    print(exc)
else:
    raise SystemExit("rs.RedisLeader imported without redis-py")
"""


def check_without_redis(python: Path, elsewhere: Path) -> None:
    """Without the ``redis`` extra the star import works and Redis names say what to add."""
    said = run([python, "-c", WITHOUT_REDIS], cwd=elsewhere, quiet=True).strip()
    if "pip install 'rselection[redis]'" not in said:
        raise CheckFailed(f"rs.RedisLeader without redis-py does not say what to install: {said}")
    print(f"without the redis extra: from rselection import * works; rs.RedisLeader: {said}")


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A DSN for a schema of its own on the test server, dropped afterwards."""
    import psycopg
    from psycopg import sql

    with contextlib.ExitStack() as stack:
        server = os.environ.get("RSELECTION_TEST_DSN", "").strip()
        if not server and postgres_answers(DEFAULT_DSN, timeout=2):
            server = DEFAULT_DSN
        if not server:
            print("no Postgres configured or local: starting a private one from pgserver")
            server = stack.enter_context(PrivatePostgres()).dsn
        schema = f"rselection_quickstart_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        print(f"Postgres: {redact(server)}, schema {schema}")
        try:
            yield with_search_path(server, schema)
        finally:
            with psycopg.connect(server, autocommit=True, connect_timeout=10) as conn:
                conn.execute("SET lock_timeout = '10s'")
                drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                conn.execute(drop.format(sql.Identifier(schema)))


def main() -> int:
    """Run every check; return the exit code."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rselection-package-") as tmp_name:
        tmp = Path(tmp_name)
        elsewhere = tmp / "elsewhere"  # an empty working directory: no checkout on sys.path
        elsewhere.mkdir()
        try:
            with step("build the sdist and the wheel (python -m build)"):
                sdist, wheel = build(tmp / "dist")
            with step("twine check --strict"):
                run(
                    [
                        sys.executable,
                        "-m",
                        "twine",
                        "--no-color",
                        "check",
                        "--strict",
                        sdist,
                        wheel,
                    ],
                    cwd=tmp,
                )
            with step("wheel contents"):
                check_wheel(wheel)
            with step("install the wheel into a fresh virtual environment"):
                venv = tmp / "wheel-venv"
                python = fresh_venv(venv)
                pip_install(python, wheel, cwd=elsewhere)
                if not has_libpq(python, elsewhere):
                    print("no libpq on this machine: installing the binary extra (psycopg[binary])")
                    pip_install(python, f"{wheel}[binary]", cwd=elsewhere)
                    if not has_libpq(python, elsewhere):
                        raise CheckFailed("psycopg finds no libpq even with the binary extra")
                check_installed(venv, elsewhere)
                check_without_redis(python, elsewhere)
            with step("the quickstart from the installed wheel, against Postgres"):
                script = elsewhere / "quickstart.py"
                shutil.copy2(ROOT / ".ci" / "quickstart.py", script)
                with postgres() as dsn:
                    run([python, script, dsn], cwd=elsewhere, timeout=150)
            with step("pip install . (not editable) from a copy of the checkout"):
                source = tmp / "checkout"
                source.mkdir()
                copy_checkout(source)
                venv = tmp / "source-venv"
                python = fresh_venv(venv)
                pip_install(python, ".", cwd=source)
                check_installed(venv, elsewhere)
        except CheckFailed as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
    print(f"release files build, check, install and run ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
