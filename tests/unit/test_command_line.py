"""The command line without a server: how it is assembled, what it accepts, what it hides."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from rselection import cli
from rselection.commands import connections

COMMANDS = pathlib.Path(cli.__file__).parent / "commands"


def test_every_subcommand_is_a_module_with_its_own_parser_and_run() -> None:
    names = []
    for module in cli.SUBCOMMANDS:
        assert callable(module.add_parser) and callable(module.run), module.__name__
        names.append(module.__name__.rsplit(".", 1)[-1])
    assert names == ["status", "migrate", "resign", "forget", "demo"]
    parser = cli.build_parser()
    for name in names:
        args = parser.parse_args([name, "x"] if name in ("resign", "forget") else [name])
        assert args.run.__module__ == f"rselection.commands.{name}"


def test_the_demo_moved_under_commands() -> None:
    assert not (COMMANDS.parent / "demo.py").exists()
    assert (COMMANDS / "demo.py").exists() and (COMMANDS / "demo_fleet.py").exists()


def test_no_underscore_name_is_imported_across_modules() -> None:
    files = [*COMMANDS.glob("*.py"), pathlib.Path(cli.__file__)]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"


def test_status_takes_lease_names_and_an_all_flag() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["status", "billing", " spaced ", "--all"])
    assert args.names == ["billing", " spaced "] and args.all  # names are never trimmed
    assert parser.parse_args(["status"]).names == []


@pytest.mark.parametrize("command", [["status", "  "], ["forget", ""], ["resign", "x" * 1001]])
def test_a_blank_or_overlong_lease_name_is_refused_with_the_rule(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(command)
    assert exited.value.code == 2
    assert "lease name" in capsys.readouterr().err


def test_forget_needs_a_name_and_takes_dsn_or_redis() -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["forget"])
    args = parser.parse_args(["forget", "old", "--redis-url", "redis://h/0", "--key-prefix", "p:"])
    assert (args.name, args.redis_url, args.key_prefix) == ("old", "redis://h/0", "p:")


def test_forget_refuses_dsn_and_redis_url_together() -> None:
    args = cli.build_parser().parse_args(
        ["forget", "old", "--dsn", "postgresql://h/x", "--redis-url", "redis://h/0"]
    )
    with pytest.raises(SystemExit, match="not both"):
        args.run(args)


def test_redis_url_passwords_are_redacted() -> None:
    url = "redis://user:hunter2@127.0.0.1:1/0"
    assert connections.redact_url(f"cannot reach {url}", url) == (
        "cannot reach redis://user:***@127.0.0.1:1/0"
    )
    assert connections.redact_url("no password here", "redis://127.0.0.1/0") == "no password here"
    with pytest.raises(SystemExit) as exited:
        connections.redis_client("http://:hunter2@h")
    assert "hunter2" not in str(exited.value)


def test_the_command_line_loads_no_driver_until_a_subcommand_runs() -> None:
    code = (
        "import sys; from rselection import cli; cli.build_parser(); "
        "print(sorted(m for m in ('psycopg', 'redis') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
