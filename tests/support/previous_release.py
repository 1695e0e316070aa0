"""The previous release of rselection in a virtual environment of its own, for mixed fleets.

:func:`previous_release` exports the tree of a fixed commit of the repository the tests
run from (``git archive``), creates a venv for it (``python -m venv``) and installs the
old package into it, non-editable, without network:

* the venv sees this environment's dependencies (psycopg, blinker, croniter) through a
  ``.pth`` file that lists this interpreter's site-packages, after its own: only the
  old ``rselection`` is installed in the venv itself, so it is the one imported;
* the old tree is packed into a wheel here (its ``[project]`` name, version and console
  scripts, every file of its ``rselection*`` packages: what its setuptools build would
  put in the wheel) and installed with ``pip install --no-index --no-deps``. Building it
  with setuptools would need setuptools >= 77 and ``wheel``, which a development
  environment does not have to provide, and fetching them would need the network.

The venv is kept in the temporary directory, keyed by the commit and by this
environment, and reused: building it takes about 2.2 s on an idle 2-core machine (7 s
under heavy load), finding it built about 0.2 s (the check that the old package imports
from the venv). A file lock makes concurrent test processes build it once; venvs built
for environments that are gone (a CI run's own venv) are removed.

A process of the old release must not see this checkout: :meth:`PreviousRelease.command`
runs its interpreter with ``-P`` (no script or working directory on ``sys.path``) and
:meth:`PreviousRelease.env` drops ``PYTHONPATH``.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import fcntl
import fnmatch
import hashlib
import io
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PREVIOUS_RELEASE",
    "BuildFailed",
    "PreviousRelease",
    "RefMissing",
    "previous_release",
]

PREVIOUS_RELEASE = "8ce633b"
"""The last commit of lease protocol 1 (lease table schema version 4)."""

REPO = Path(__file__).resolve().parents[2]
"""The checkout the tests run from."""


class RefMissing(RuntimeError):
    """The commit is not in the repository (a shallow clone, or not a git checkout)."""


class BuildFailed(RuntimeError):
    """Exporting, creating the venv or installing failed; the message says which step."""


@dataclass(frozen=True)
class PreviousRelease:
    """A venv with the previous release installed.

    Attributes:
        commit: the full commit id installed.
        root: the cache directory (``venv/``, ``src/`` the exported tree, ``build.json``).
        python: the venv's interpreter.
        version: the installed package's ``__version__``.
        module: the installed package's ``__init__.py`` (inside the venv).
        build_seconds: how long building the venv took (when it was built).
        cached: the venv was found built (this call only checked it).
    """

    commit: str
    root: Path
    python: Path
    version: str
    module: Path
    build_seconds: float
    cached: bool

    @property
    def venv(self) -> Path:
        """The venv directory."""
        return self.root / "venv"

    def command(self, *args: str) -> list[str]:
        """``python -P ARGS`` of the venv: no script directory or cwd on ``sys.path``."""
        return [str(self.python), "-P", *args]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) without ``PYTHONPATH``, which
        would put this checkout's ``rselection`` before the old one."""
        env = dict(os.environ if base is None else base)
        for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH"):
            env.pop(name, None)
        return env


def previous_release(
    ref: str = PREVIOUS_RELEASE, *, repo: Path = REPO, cache: Path | None = None
) -> PreviousRelease:
    """Build (once) or find the venv of ``ref`` and check that it imports the old package.

    Args:
        ref: a commit of ``repo``.
        repo: the git repository.
        cache: where venvs are kept (default: ``<tmp>/rselection-previous-release``).

    Raises:
        RefMissing: ``ref`` is not a commit of ``repo``.
        BuildFailed: a step of the build failed.
    """
    commit = _resolve(repo, ref)
    parent = cache or Path(tempfile.gettempdir()) / "rselection-previous-release"
    parent.mkdir(parents=True, exist_ok=True)
    root = parent / f"{commit[:12]}-{_environment_key(commit)}"
    with _locked(parent / f"{root.name}.lock"):
        marker = root / "build.json"
        cached = marker.exists()
        if not cached:
            shutil.rmtree(root, ignore_errors=True)  # an interrupted build
            began = time.monotonic()
            _build(repo, commit, root)
            record = {"commit": commit, "seconds": time.monotonic() - began, "sites": _site_dirs()}
            marker.write_text(json.dumps(record))
        built = json.loads(marker.read_text())
    _prune(parent, keep=root)
    python = root / "venv" / "bin" / "python"
    version, module = _probe(python, root)
    return PreviousRelease(commit, root, python, version, module, float(built["seconds"]), cached)


def _prune(parent: Path, keep: Path) -> None:
    """Remove the venvs built for environments that are gone (a CI run's own venv)."""
    for marker in parent.glob("*/build.json"):
        root = marker.parent
        if root == keep:
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            sites = json.loads(marker.read_text())["sites"]
            if not all(Path(site).is_dir() for site in sites):
                with _locked(parent / f"{root.name}.lock"):
                    shutil.rmtree(root, ignore_errors=True)


def _run(what: str, cmd: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, timeout=120, **kw)  # type: ignore[call-overload, no-any-return]
    except subprocess.CalledProcessError as exc:
        out = (exc.stderr or b"").decode(errors="replace")[-2000:]
        raise BuildFailed(f"{what} failed (exit {exc.returncode}): {out}") from exc
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildFailed(f"{what} failed: {exc}") from exc


def _resolve(repo: Path, ref: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RefMissing(f"cannot run git in {repo}: {exc}") from exc
    if done.returncode != 0:
        raise RefMissing(
            f"commit {ref} is not in the repository at {repo} (a shallow clone? "
            "fetch the full history)"
        )
    return done.stdout.strip()


def _environment_key(commit: str) -> str:
    """What a cached venv depends on besides the commit: this interpreter and the
    site-packages its ``.pth`` file lists."""
    parts = [commit, sys.version, str(Path(sys.base_prefix).resolve()), *_site_dirs()]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=6).hexdigest()


def _site_dirs() -> list[str]:
    return [d for d in site.getsitepackages() if Path(d).is_dir()]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _without_pythonpath(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name != "PYTHONPATH"}


def _build(repo: Path, commit: str, root: Path) -> None:
    src, venv = root / "src", root / "venv"
    src.mkdir(parents=True)
    archive = _run("git archive", ["git", "-C", str(repo), "archive", "--format=tar", commit])
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
            tar.extractall(src, filter="data")
        else:  # our own commit's tree: trusted
            tar.extractall(src)
    _run("python -m venv", [sys.executable, "-m", "venv", "--without-pip", str(venv)])
    purelib = _purelib(venv)
    # This environment's packages, after the venv's own (which hold only the old package).
    (purelib / "_rselection_current_env.pth").write_text("\n".join(_site_dirs()) + "\n")
    wheel = _pack_wheel(src, root)
    _run(
        "pip install",
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "--disable-pip-version-check",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            str(wheel),
        ],
        # Without PYTHONPATH: pip would find this checkout's package there, take it
        # for the one installed, and install nothing.
        env={**_without_pythonpath(os.environ), "PIP_NO_INPUT": "1"},
    )


def _purelib(venv: Path) -> Path:
    found = list((venv / "lib").glob("python*/site-packages"))
    if len(found) != 1:
        raise BuildFailed(f"no single site-packages in the new venv {venv}: {found}")
    return found[0]


def _pack_wheel(src: Path, out: Path) -> Path:
    """A pure-Python wheel of the tree at ``src`` (its ``rselection*`` packages)."""
    project = tomllib.loads((src / "pyproject.toml").read_text())
    meta = project["project"]
    name, version = meta["name"], meta["version"]
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    files = [
        path
        for top in sorted(src.iterdir())
        if top.is_dir() and (top / "__init__.py").exists()
        if any(fnmatch.fnmatch(top.name, p) for p in patterns)
        for path in sorted(top.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    ]
    if not files:
        raise BuildFailed(f"no package matching {patterns} in {src}")
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    scripts = "".join(f"{k} = {v}\n" for k, v in meta.get("scripts", {}).items())
    extra = {
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            f"Requires-Python: {meta.get('requires-python', '')}\n"
        ),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: rselection-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
        f"{dist_info}/entry_points.txt": f"[console_scripts]\n{scripts}" if scripts else "",
    }
    wheel = out / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        entries = [(p.relative_to(src).as_posix(), p.read_bytes()) for p in files]
        entries += [(k, v.encode()) for k, v in extra.items() if v]
        for arcname, data in entries:
            zf.writestr(arcname, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            writer.writerow([arcname, f"sha256={digest.decode()}", len(data)])
        writer.writerow([f"{dist_info}/RECORD", "", ""])
        zf.writestr(f"{dist_info}/RECORD", record.getvalue())
    return wheel


def _probe(python: Path, root: Path) -> tuple[str, Path]:
    """Import the package in the venv as its nodes will, and check where it comes from."""
    code = (
        "import json, rselection; print(json.dumps([rselection.__version__, rselection.__file__]))"
    )
    env = PreviousRelease("", root, python, "", Path(), 0.0, True).env()
    done = _run("import rselection in the venv", [str(python), "-P", "-c", code], env=env, cwd=root)
    version, module = json.loads(done.stdout)
    if not Path(module).resolve().is_relative_to((root / "venv").resolve()):
        raise BuildFailed(f"the venv imports rselection from {module}, not from its own install")
    return str(version), Path(module)
