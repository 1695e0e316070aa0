"""Every code block of the docs and the README is checked, and the generated pages build.

- ``python`` blocks are type-checked with ``mypy --strict`` (names a snippet uses without
  defining, such as ``ctx`` or ``conn``, are declared with their types first); blocks
  after a ``<!-- test: run -->`` line are also run, each in its own process, and blocks
  after a ``<!-- test: pytest -->`` line are pytest test modules, run by pytest in their
  own process (which must collect and pass at least one test). The snippets of "Test
  your tasks" are all pytest modules.
- ``sh`` blocks and the ``$`` lines of ``console`` blocks are commands: ``rselection``
  commands must parse with the command's own parser, scripts and their options must
  exist, extras must be in ``pyproject.toml``.
- ``gunicorn`` and ``uvicorn`` commands must parse with the server's own parser, name an
  app that exists (``module:attribute``) and files that exist.
- ``yaml``, ``ini``, ``toml`` and ``json`` blocks must parse; ``text`` blocks are output,
  not code. The logging page's JSON block is ``examples/logging.json``, verbatim.

CHANGELOG.md follows Keep a Changelog with lines of at most 100 characters and working
link references.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import configparser
import contextlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"
PAGES = [*sorted(p for p in DOCS.rglob("*.md") if "gen" not in p.relative_to(DOCS).parts)]
PAGES.append(README)
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[^\n]*$")
DIRECTIVE = re.compile(r"^<!-- test: (?P<what>[\w-]+) -->$")


# -- collecting blocks --------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    lang: str
    code: str
    directive: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def module(self) -> str:
        """A module name for this block, unique across the pages."""
        return re.sub(r"\W", "_", self.id.replace(".md:", "_l"))


def blocks_of(page: Path) -> list[Block]:
    """The fenced code blocks of one Markdown page, in order."""
    lines = page.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang")
        j = i + 1
        while j < len(lines) and not (
            lines[j].startswith(indent + fence) and not lines[j].strip().strip(fence[0])
        ):
            j += 1
        assert j < len(lines), f"{page.relative_to(ROOT)}:{i + 1}: unclosed code block"
        prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        d = DIRECTIVE.match(prev)
        code = textwrap.dedent("\n".join(lines[i + 1 : j])) + "\n"
        found.append(Block(page, i + 1, lang, code, d.group("what") if d else None))
        i = j + 1
    return found


BLOCKS = [b for page in PAGES for b in blocks_of(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
RUN = [b for b in PYTHON if b.directive == "run"]
PYTEST = [b for b in PYTHON if b.directive == "pytest"]
TESTING_PAGE = DOCS / "how-to" / "testing.md"
COMMANDS = [b for b in BLOCKS if b.lang in ("sh", "console")]
CHECKED = {"python", "sh", "console", "yaml", "ini", "toml", "json", "text"}


def test_every_block_has_a_language_the_test_checks() -> None:
    unknown = [f"{b.id} ({b.lang or 'no language'})" for b in BLOCKS if b.lang not in CHECKED]
    assert not unknown, f"code blocks nobody checks: {unknown}"
    directives = {b.directive for b in BLOCKS}
    assert directives <= {None, "run", "pytest"}, "unknown <!-- test: ... --> directive"
    assert all(b.lang == "python" for b in BLOCKS if b.directive), "only python blocks run"


def test_the_docs_have_code_to_check() -> None:
    assert len(PYTHON) >= 30 and len(RUN) >= 2 and len(PYTEST) >= 4 and len(COMMANDS) >= 15


# -- python: type-checked, and run where marked --------------------------------------------

# Names a snippet may use without defining them: what a reader has at hand at that point.
GIVEN = {
    "rs": "import rselection as rs",
    "psycopg": "import psycopg",
    "redis": "import redis",
    "datetime": "from datetime import datetime",
    "Any": "from typing import Any",
    "ctx": "ctx: rs.TaskContext",
    "conn": "conn: psycopg.Connection[Any]",
    "conninfo": "conninfo: str",
    "tasks": "tasks: rs.TaskHandler",
    "leader": "leader: rs.PostgresLeader",
    "state": "state: dict[str, Any]",
    "term": "term: int",
    "scheduled_at": "scheduled_at: datetime",
    # stand-ins for the reader's own code
    "handle_next_item": "def handle_next_item(after: int) -> int: return after + 1",
    "mail_digest": "def mail_digest(at: datetime | None) -> None: ...",
    "bill_day_before": "def bill_day_before(at: datetime | None) -> None: ...",
    "build_report": "def build_report() -> None: ...",
    "send_reports": "def send_reports() -> None: ...",
    "purge": "def purge() -> None: ...",
    "alert": "def alert(message: str) -> None: ...",
    "MyLease": "def MyLease(name: str, ttl: float) -> rs.LeaseBackend:\n    raise TypeError",
}
NEEDS = {  # a given that refers to others
    "ctx": ["rs"],
    "conn": ["psycopg", "Any"],
    "tasks": ["rs"],
    "leader": ["rs"],
    "state": ["Any"],
    "scheduled_at": ["datetime"],
    "mail_digest": ["datetime"],
    "bill_day_before": ["datetime"],
    "MyLease": ["rs"],
}


def free_names(code: str) -> set[str]:
    """Names a snippet reads but never binds (approximately, which is enough here)."""
    tree = ast.parse(code)
    bound: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def preamble(block: Block) -> str:
    names = free_names(block.code)
    unknown = names - GIVEN.keys()
    assert not unknown, f"{block.id} uses {sorted(unknown)}: define them in the snippet"
    wanted: list[str] = []

    def want(name: str) -> None:
        for need in NEEDS.get(name, []):
            want(need)
        if name not in wanted:
            wanted.append(name)

    for name in sorted(names):
        want(name)
    imports = [GIVEN[n] for n in wanted if GIVEN[n].startswith(("import ", "from "))]
    rest = [GIVEN[n] for n in wanted if not GIVEN[n].startswith(("import ", "from "))]
    return "\n".join(["from __future__ import annotations", *imports, *rest, ""])


MYPY_CONFIG = f"""\
[mypy]
strict = True
python_version = 3.11
mypy_path = {ROOT}

[mypy-django.*,apscheduler.*,uvicorn.*]
ignore_missing_imports = True
"""


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Type-check every python block at once; the errors of each block by block id."""
    api = pytest.importorskip("mypy.api")
    where = tmp_path_factory.mktemp("doc_snippets")
    files: dict[str, Block] = {}
    offsets: dict[str, int] = {}
    errors: dict[str, list[str]] = {b.id: [] for b in PYTHON}
    for block in PYTHON:
        try:
            head = preamble(block)
        except (SyntaxError, AssertionError) as exc:
            errors[block.id].append(f"{block.id}: error: {exc}")
            continue
        path = where / f"{block.module}.py"
        path.write_text(head + block.code)
        files[path.name] = block
        offsets[path.name] = head.count("\n")
    config = where / "mypy.ini"
    config.write_text(MYPY_CONFIG)
    cache = ROOT / ".mypy_cache" / "docs"
    options = ["--config-file", str(config), "--cache-dir", str(cache), "--no-error-summary"]
    out, err, _ = api.run([*options, *sorted(str(where / name) for name in files)])
    assert not err.strip(), err
    for line in out.splitlines():
        m = re.match(r"^(?:.*/)?([\w]+\.py):(\d+): (error|note): (.*)$", line)
        if m is None or m.group(1) not in files:
            if line.strip():
                errors.setdefault("mypy", []).append(line)
            continue
        block = files[m.group(1)]
        lineno = int(m.group(2)) - offsets[m.group(1)] + block.line
        errors[block.id].append(f"{block.page.name}:{lineno}: {m.group(3)}: {m.group(4)}")
    return errors


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_type_checks(block: Block, mypy_errors: dict[str, list[str]]) -> None:
    assert not mypy_errors.get("mypy"), "\n".join(mypy_errors["mypy"])
    problems = [e for e in mypy_errors[block.id] if ": error: " in e]
    assert not problems, "\n" + "\n".join(mypy_errors[block.id])


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    assert not free_names(block.code), f"{block.id} must define everything it uses to run"
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr


# Stand-ins a pytest snippet may use for the reader's own code, made to really run here.
RUN_GIVEN = {
    "MyLease": (
        "from rselection.memory import MemoryLease\n"
        "_LEASES: dict[str, MemoryLease] = {}\n"
        "def MyLease(name: str, ttl: float) -> rs.LeaseBackend:\n"
        "    # one in-memory lease per name, shared by the nodes of a scenario\n"
        "    return _LEASES.setdefault(name, MemoryLease(name=name, ttl=ttl))\n"
    ),
}


def test_every_snippet_of_the_testing_page_is_a_pytest_module() -> None:
    blocks = [b for b in PYTHON if b.page == TESTING_PAGE]
    assert blocks, "the testing page lost its snippets"
    for block in blocks:
        assert block.directive == "pytest", f"{block.id}: mark it <!-- test: pytest -->"
        tree = ast.parse(block.code)
        tests = [
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.ClassDef)
            and node.name.startswith(("test_", "Test"))
        ]
        assert tests, f"{block.id}: no test function or Test class for pytest to collect"


@pytest.mark.parametrize("block", PYTEST, ids=lambda b: b.id)
def test_python_block_passes_as_a_pytest_module(block: Block, tmp_path: Path) -> None:
    free = free_names(block.code)
    assert free <= RUN_GIVEN.keys(), f"{block.id} must define {sorted(free - RUN_GIVEN.keys())}"
    head = "".join(RUN_GIVEN[name] for name in sorted(free))
    if head:
        head = "from __future__ import annotations\nimport rselection as rs\n" + head
    module = tmp_path / f"test_{block.module}.py"
    module.write_text(head + block.code)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module.name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    report = f"{block.id}:\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, report  # 5 would mean that pytest collected nothing
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 1, report
    assert not re.search(r"\d+ (failed|error|skipped)", result.stdout), report


# -- shell commands -----------------------------------------------------------------------


def load_hooks() -> ModuleType:
    """The docs' generator module (docs/gen/hooks.py)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "gen" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = load_hooks()
EXTRAS = set(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
)
# Programs the docs may run whose arguments there is nothing here to check against.
OTHER_PROGRAMS = {
    "cd",
    "curl",
    "docker",
    "export",
    "kill",
    "kubectl",
    "openssl",
    "psql",
    ".",
    "git",
    "systemctl",
}


def commands(block: Block) -> Iterator[list[str]]:
    """The command lines of a block: ``$`` lines of a console block, every line of sh."""
    lines = block.code.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    joined = "\n".join(lines).replace("\\\n", " ")
    for line in joined.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            yield shlex.split(line, comments=True)


def script_options(path: Path) -> set[str]:
    """Options a script (or the package a script runs) defines with add_argument."""
    sources = [path] if path.is_file() else []
    if path.name == "manage.py":
        sources += sorted(path.parent.rglob("*.py"))
    text = "\n".join(p.read_text() for p in sources)
    return set(re.findall(r"add_(?:argument|parser)\(\s*\"(-{0,2}[\w-]+)\"", text))


def check_rselection(argv: list[str]) -> None:
    parser = HOOKS.cli_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 0, f"`rselection {shlex.join(argv)}` does not parse"


def check_script(block: Block, args: list[str]) -> None:
    """``python SCRIPT ARGS``: the script exists (or the page says to save it) and has
    the options and subcommands the command uses."""
    script = ROOT / args[0]
    if not script.is_file():
        assert f"as `{args[0]}`" in block.page.read_text(), f"no such script: {args[0]}"
        return
    defined = script_options(script)
    commands_dir = script.parent / "leaderapp" / "management" / "commands"
    previous = ""
    for arg in args[1:]:
        if arg.startswith("-"):
            assert arg.split("=")[0] in defined, f"{args[0]} has no option {arg}"
        elif not previous.startswith("-") and re.fullmatch(r"[a-z]+", arg):
            assert arg in defined or (commands_dir / f"{arg}.py").is_file(), (
                f"{args[0]} has no subcommand {arg!r}"
            )
        previous = arg if "=" not in arg else ""


def check_app(target: str, *where: Path) -> None:
    """``module:attribute``: a module found in one of ``where`` assigns ``attribute``."""
    module, _, attr = target.partition(":")
    relative = module.replace(".", "/") + ".py"
    sources = [base / relative for base in where if (base / relative).is_file()]
    assert sources, f"{target}: no {relative} in {[str(b.relative_to(ROOT)) for b in where]}"
    assert attr and re.search(rf"^{re.escape(attr)}\b.*=", sources[0].read_text(), re.M), (
        f"{target}: {relative} assigns no {attr!r}"
    )


def check_uvicorn(args: list[str]) -> None:
    """uvicorn's own parser accepts the command (files it names exist, from the root of
    the repository, where the docs' commands run); the app exists."""
    import click
    from uvicorn.main import main as uvicorn_main

    with contextlib.chdir(ROOT):
        try:
            context = uvicorn_main.make_context("uvicorn", list(args))
        except click.ClickException as exc:
            raise AssertionError(f"`uvicorn {shlex.join(args)}`: {exc.format_message()}") from None
    check_app(context.params["app"], ROOT / context.params["app_dir"])


def check_gunicorn(args: list[str]) -> None:
    """gunicorn's own parser accepts the command; its app, worker class and the files it
    names exist (paths from the root of the repository, or ``--chdir``)."""
    from gunicorn.config import Config

    try:
        options = Config().parser().parse_args(args)
    except SystemExit:
        raise AssertionError(f"`gunicorn {shlex.join(args)}` does not parse") from None
    here = ROOT / options.chdir if options.chdir else ROOT
    paths = [here / p for p in (options.pythonpath or "").split(",") if p]
    assert len(options.args) == 1, f"one app, not {options.args}"
    check_app(options.args[0], *paths, here)
    for name in (options.config, options.logconfig, options.logconfig_json):
        if name is not None and not name.startswith("python:"):
            assert (here / name).is_file(), f"gunicorn: no such file {name}"
    if options.worker_class and "." in options.worker_class:
        module, _, cls = options.worker_class.rpartition(".")
        with warnings.catch_warnings():  # uvicorn.workers says it is deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            loaded = importlib.import_module(module)
        assert hasattr(loaded, cls), f"gunicorn: no worker class {options.worker_class}"


def check_command(block: Block, argv: list[str]) -> None:
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv = argv[1:]  # VAR=value prefixes
    program, args = argv[0], argv[1:]
    if program == "rselection":
        check_rselection(args)
    elif program == "python" and args[:2] == ["-m", "rselection"]:
        check_rselection(args[2:])
    elif program == "python" and args[:1] == ["-m"]:
        assert args[1] in ("venv", "pytest", "build"), f"python -m {args[1]}?"
    elif program == "python":
        check_script(block, args)
    elif program == "pip":
        assert args[0] == "install"
        for arg in args[1:]:
            m = re.fullmatch(r"(?:\.|rselection)\[([\w,]+)\]", arg)
            if m:
                missing = set(m.group(1).split(",")) - EXTRAS
                assert not missing, f"no extra {missing} in pyproject.toml"
            else:
                assert arg in {".", "-e", "-q"} or re.fullmatch(r"[a-z][\w-]*", arg), arg
    elif program == "pytest":
        paths = iter(args)
        for arg in paths:
            if arg in ("-n", "-m"):  # options that take a value
                next(paths)
            else:
                assert arg.startswith("-") or (ROOT / arg).exists(), f"no such test path {arg}"
    elif program == "uvicorn":
        check_uvicorn(args)
    elif program == "gunicorn":
        check_gunicorn(args)
    elif program == "mkdocs":
        assert args[0] in ("build", "serve"), args
    elif program.startswith((".ci/", "./")):
        assert (ROOT / program).is_file(), f"no such program {program}"
    else:
        assert program in OTHER_PROGRAMS, f"unknown program {program!r}: teach the test"


@pytest.mark.parametrize("block", COMMANDS, ids=lambda b: b.id)
def test_commands_exist_and_parse(block: Block) -> None:
    lines = list(commands(block))
    assert lines, f"{block.id}: no command in a {block.lang} block"
    for argv in lines:
        check_command(block, argv)


# -- other languages ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.lang in ("yaml", "ini", "toml", "json")], ids=lambda b: b.id
)
def test_config_blocks_parse(block: Block) -> None:
    if block.lang == "ini":
        configparser.ConfigParser(inline_comment_prefixes=(";",)).read_string(block.code)
    elif block.lang == "json":
        json.loads(block.code)
    elif block.lang == "toml":
        tomllib.loads(block.code)
    else:
        yaml = pytest.importorskip("yaml")
        docs = list(yaml.safe_load_all(block.code))
        for doc in docs:
            if doc.get("kind") == "Deployment":
                # The grace period must cover stop_grace plus the release.
                from rselection.timing import Timings

                spec = doc["spec"]["template"]["spec"]
                assert spec["terminationGracePeriodSeconds"] >= Timings().stop_grace(None) + 5


def test_the_logging_page_shows_the_logging_configuration_of_the_examples() -> None:
    shown = [json.loads(b.code) for b in BLOCKS if b.lang == "json" and b.page.name == "logging.md"]
    assert json.loads((ROOT / "examples" / "logging.json").read_text()) in shown


# -- generated pages ----------------------------------------------------------------------


def test_every_generated_section_exists_and_renders() -> None:
    for page in PAGES:
        text = page.read_text()
        for name in HOOKS.MARKER.findall(text):
            assert name in HOOKS.SECTIONS, f"{page}: unknown generated section {name!r}"
        expanded = HOOKS.expand(text)
        assert "<!-- generate:" not in expanded


def test_the_signals_table_lists_every_signal() -> None:
    from blinker import NamedSignal

    from rselection import signals

    text = HOOKS.gen_signals()
    for name in signals.__all__:
        if isinstance(getattr(signals, name), NamedSignal):
            assert f"`signals.{name}`" in text


def test_the_cli_reference_lists_every_subcommand_and_option() -> None:
    text = HOOKS.gen_cli()
    parser = HOOKS.cli_parser()
    for name, sub in HOOKS.subcommands(parser).items():
        assert f"## `rselection {name}`" in text
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in text, f"{name} {option}"


def test_the_timings_table_shows_the_defaults_of_the_code() -> None:
    from rselection.timing import Timings

    text = HOOKS.gen_timings()
    defaults = Timings()
    for field in ("ttl", "renew_interval", "renew_deadline", "retry_interval"):
        assert f"| `{field}` | {getattr(defaults, field):g} s |" in text
    assert f"({defaults.stop_grace(None):g} s with the defaults)" in text


def test_the_loggers_page_lists_every_logger() -> None:
    text = HOOKS.gen_loggers()
    for path in (ROOT / "rselection").rglob("*.py"):
        if "getLogger(__name__)" in path.read_text():
            assert f"### `{HOOKS.module_name(path)}`" in text


def public_callables() -> Iterator[tuple[str, Any]]:
    import rselection
    import rselection.postgres
    import rselection.redis
    import rselection.testing

    for module in (rselection, rselection.postgres, rselection.redis, rselection.testing):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                yield f"{module.__name__}.{name}", obj
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and inspect.isfunction(member):
                        yield f"{module.__name__}.{name}.{attr}", member
            elif inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj


def test_documented_arguments_exist() -> None:
    """A parameter documented under ``Args:`` is a parameter of the signature."""
    wrong = []
    for label, obj in public_callables():
        try:
            params = set(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            continue
        documented = set(HOOKS.docstring_args(obj))
        if inspect.isclass(obj):
            documented |= set(HOOKS.docstring_args(obj.__init__))
        extra = documented - params - {"args", "kwargs"}
        if extra:
            wrong.append(f"{label}: {sorted(extra)}")
    assert not wrong, "documented arguments that do not exist:\n" + "\n".join(wrong)


def test_every_example_has_a_section_on_the_examples_page() -> None:
    page = (DOCS / "how-to" / "examples.md").read_text()
    for example in sorted((ROOT / "examples").iterdir()):
        if example.name.startswith((".", "_")):
            continue
        name = f"examples/{example.name}" + ("/" if example.is_dir() else "")
        assert re.search(rf"^## .*`{re.escape(name)}`", page, re.M), f"{name} is not shown"


# -- CHANGELOG ----------------------------------------------------------------------------


def test_changelog_lines_are_at_most_100_characters() -> None:
    long = [
        f"{n}: {len(line)}"
        for n, line in enumerate(CHANGELOG.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert not long, f"CHANGELOG.md lines over 100 characters: {long}"


def test_changelog_follows_keep_a_changelog_with_working_links() -> None:
    text = CHANGELOG.read_text()
    assert text.startswith("# Changelog\n")
    assert "keepachangelog.com" in text
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions and versions[0] in ("Unreleased", "0.1.0"), versions
    for heading in re.findall(r"^## .*$", text, re.M):
        assert re.fullmatch(
            r"## \[(Unreleased|\d+\.\d+\.\d+)\]( - (\d{4}-\d\d-\d\d|unreleased))?", heading
        ), heading
    for heading in re.findall(r"^### (.*)$", text, re.M):
        assert heading in ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
    definitions = dict(re.findall(r"^\[([^\]]+)\]: (\S+)$", text, re.M))
    for version in versions:
        assert version in definitions, f"no link reference for [{version}]"
    used = set(re.findall(r"\[([^\]]+)\](?!\(|:)", text))
    for label, url in definitions.items():
        assert label in used, f"link reference [{label}] is never used"
        assert url.startswith("https://"), url
