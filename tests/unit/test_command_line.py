"""The command line without a server: how it is assembled, what it accepts, what it hides."""

from __future__ import annotations

import argparse
import ast
import json
import pathlib

import pytest

from rselection import cli
from rselection.commands import connections
from rselection.commands.output import UsageError, grid, printable, say
from rselection.redaction import redact

COMMANDS = pathlib.Path(cli.__file__).parent / "commands"


def test_every_subcommand_is_a_module_with_its_own_parser_and_run() -> None:
    names = []
    for module in cli.SUBCOMMANDS:
        assert callable(module.add_parser) and callable(module.run), module.__name__
        names.append(module.__name__.rsplit(".", 1)[-1])
    assert names == [
        "status",
        "history",
        "migrate",
        "resign",
        "drain",
        "undrain",
        "task",
        "forget",
        "demo",
        "web",
    ]
    parser = cli.build_parser()
    operands = {"history": ["x"], "resign": ["x"], "forget": ["x"]}
    operands |= {"drain": ["x", "n"], "undrain": ["x", "n"], "task": ["history", "x", "t"]}
    for name in names:
        args = parser.parse_args([name, *operands.get(name, [])])
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


@pytest.mark.parametrize(
    ("command", "rule"),
    [
        (["history", "x", "--limit", "0"], "from 1, got '0'"),
        (["history", "x", "--limit", "many"], "from 1, got 'many'"),
        (["task", "history", "x", "t", "--limit", "10001"], "from 1 to 10000, got '10001'"),
    ],
)
def test_a_limit_out_of_range_is_refused_with_the_rule(
    command: list[str], rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(command)
    assert exited.value.code == 2
    assert f"--limit needs a whole number {rule}" in capsys.readouterr().err
    args = cli.build_parser().parse_args([*command[:-1], "10000"])
    assert args.limit == 10_000


def test_forget_needs_a_name_and_takes_dsn_or_redis() -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["forget"])
    args = parser.parse_args(["forget", "old", "--redis-url", "redis://h/0", "--key-prefix", "p:"])
    assert (args.name, args.redis_url, args.key_prefix) == ("old", "redis://h/0", "p:")


def test_forget_refuses_dsn_and_redis_url_together(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["forget", "old", "--dsn", "postgresql://h/x", "--redis-url", "redis://h/0"]
    assert cli.main(argv) == 2  # a usage error
    assert "not both" in capsys.readouterr().err


def test_redis_url_passwords_are_redacted() -> None:
    url = "redis://user:hunter2@127.0.0.1:1/0"
    # The whole user-info goes: the user name is part of it.
    assert redact(f"cannot reach {url}", url) == "cannot reach redis://***@127.0.0.1:1/0"
    assert redact("no password here", "redis://127.0.0.1/0") == "no password here"
    with pytest.raises(UsageError) as refused:
        connections.redis_client("http://:hunter2@h")
    assert "hunter2" not in str(refused.value)


# -- exit codes, passwords in connection strings that cannot be parsed ----------------------

# libpq refuses this URI with `invalid percent-encoded token: "s3cret%zz"`: its message
# quotes the password.
UNPARSABLE = "postgresql://u:s3cret%zz@db.example/app"
NO_DATABASE = ("RSELECTION_DSN", "PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER")
COMMAND_LINES = [
    ["status"],
    ["status", "--json"],
    ["status", "--json", "--watch", "0.1", "--count", "2"],
    ["migrate"],
    ["resign", "billing"],
    ["forget", "billing"],
    ["demo"],
]


@pytest.fixture
def no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """No database in the environment: neither RSELECTION_DSN nor the PG* variables."""
    for var in (*NO_DATABASE, "PGSERVICE", "PGPASSWORD"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("command", COMMAND_LINES, ids=" ".join)
@pytest.mark.parametrize("source", ["--dsn", "RSELECTION_DSN"])
@pytest.mark.usefixtures("no_database")
def test_an_unparsable_connection_string_is_a_usage_error_that_hides_the_password(
    command: list[str],
    source: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if source == "--dsn":
        argv = [*command, "--dsn", UNPARSABLE]
    else:
        monkeypatch.setenv("RSELECTION_DSN", UNPARSABLE)
        argv = command
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert "s3cret" not in out + err
    assert "cannot be parsed" in err and "it may hold a password" in err
    assert f"of {'--dsn' if source == '--dsn' else '$RSELECTION_DSN'}" in err
    if "--json" in command:  # a script parsing stdout gets a document, without it too
        assert json.loads(out) == {"error": err.split(": error: ", 1)[1].strip(), "exit_code": 2}


@pytest.mark.parametrize("source", ["--dsn", "RSELECTION_DSN"])
@pytest.mark.usefixtures("no_database")
def test_bytes_that_are_not_utf8_are_a_usage_error_not_a_crash(
    source: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rselection.errors import ConfigError
    from rselection.postgres._conn import check_conninfo

    dsn = "postgresql://u:s3cret%80@127.0.0.1/db"  # psycopg raised UnicodeDecodeError
    if source == "--dsn":
        argv = ["status", "--dsn", dsn]
    else:
        monkeypatch.setenv("RSELECTION_DSN", dsn)
        argv = ["status"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot be parsed" in err and "s3cret" not in err
    with pytest.raises(ConfigError, match="cannot be parsed"):
        check_conninfo(dsn)


@pytest.mark.parametrize(
    "dsn, shown",
    [
        (UNPARSABLE, 'invalid percent-encoded token: "s3cret%zz"'),
        ("postgresql://u:s3%41cret%zz@h/db", "s3%41cret%zz, decoded s3Acret%zz"),
        ("host=h password=s3cret port='1", "s3cret"),
        ("host=h password='s3 cret' port='1", "s3 cret"),
    ],
)
def test_redact_hides_the_password_of_a_string_libpq_cannot_parse(dsn: str, shown: str) -> None:
    assert "s3" not in redact(f"libpq said: {shown}", dsn)


@pytest.mark.usefixtures("no_database")
@pytest.mark.parametrize("command", [["status"], ["migrate"], ["resign", "x"], ["forget", "x"]])
def test_no_database_is_a_usage_error_with_exit_code_2_not_a_missing_leader(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rselection {command[0]}: error: no database given")


def test_the_exit_codes_are_distinct_and_documented() -> None:
    from rselection.commands import output

    codes = {
        "EXIT_OK": 0,
        "EXIT_NO_LEADER": 1,
        "EXIT_REFUSED": 1,
        "EXIT_USAGE": 2,
        "EXIT_UNREACHABLE": 3,
    }
    assert {name: getattr(output, name) for name in codes} == codes
    page = (pathlib.Path(__file__).parents[2] / "docs" / "reference" / "cli.md").read_text()
    section = page.split("## Exit codes", 1)[1]
    for code in (0, 1, 2, 3):
        assert f"\n| {code} | " in section


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    import rselection

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"rselection {rselection.__version__}"


def test_every_option_of_every_subcommand_has_help_text() -> None:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, sub in subparsers.choices.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert not missing, f"options without help text: {missing}"


def test_the_demo_refuses_fewer_nodes_than_its_story_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One node is killed, the next one stopped: with two nodes nobody is left to lead.
    assert cli.main(["demo", "--nodes", "2"]) == 2
    assert "--nodes needs at least 3 nodes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("jobs", "jobs"),
        ("ünïcode 🦆 a\\b", "ünïcode 🦆 a\\b"),  # printable text, a backslash included
        ("t\x1b]0;pwned\x07", r"t\x1b]0;pwned\x07"),  # OSC: sets the window title
        ("\x1b[8mhidden", r"\x1b[8mhidden"),  # SGR 8: hides what follows
        ("a\rb\tc\nd", r"a\rb\tc\nd"),
        ("c1\x9b31m", r"c1\x9b31m"),  # a C1 CSI
        ("\u202eevil\u2066", r"\u202eevil\u2066"),  # bidirectional override and isolate
        ("nb\u00a0sp\u2028", r"nb\xa0sp\u2028"),  # separators other than the space
    ],
)
def test_printable_escapes_what_a_terminal_acts_on(raw: str, shown: str) -> None:
    assert printable(raw) == shown
    assert printable(shown) == shown  # escaped text is printable: escaping twice is once


def test_say_keeps_its_own_newlines_and_escapes_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    say("one\ntwo \x1b[2J")
    say(ValueError("bad \x07"), err=True)
    out, err = capsys.readouterr()
    assert out == "one\ntwo \\x1b[2J\n" and err == "bad \\x07\n"


def test_grid_escapes_each_cell_so_columns_stay_aligned() -> None:
    lines = grid(["NAME", "NODE"], [["a\x1b[8m", "n\nx"], ["bb", "m"]])
    assert lines == ["NAME      NODE", "a\\x1b[8m  n\\nx", "bb        m"]


def test_argparse_errors_escape_what_was_typed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["status", "--bogus\x1b[31m"])
    err = capsys.readouterr().err
    assert "--bogus\\x1b[31m" in err and "\x1b" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["task", "--dsn", "postgresql://u:hunter2/sekrit@127.0.0.1:5432/test", "pause"],
        ["task", "--dsn=postgresql://u:hunter2@127.0.0.1:5432/test", "pause"],
        ["task", "--redis-url", "redis://:hunter2?sekrit@127.0.0.1:6379/0"],
        ["status", "postgresql://u:hunter2@127.0.0.1/test", "--bogus"],
    ],
)
def test_a_usage_error_never_quotes_a_password_typed_on_the_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse quotes what it could not place: a connection string typed before the
    # action of `task` is taken for the action and quoted back in the error.
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err, err
    assert "hunter2" not in err and "sekrit" not in err, err


JSON_COMMAND_LINES = [
    ["status", "--json"],
    ["history", "billing", "--json"],
    ["task", "history", "billing", "purge", "--json"],
    ["task", "pause", "billing", "purge", "--json"],
    ["task", "trigger", "billing", "purge", "--json"],
    ["drain", "billing", "node-a", "--json"],
    ["undrain", "billing", "node-a", "--json"],
]


@pytest.mark.parametrize("command", JSON_COMMAND_LINES, ids=" ".join)
@pytest.mark.parametrize(
    "server",
    ["--dsn=postgresql://app:s3cret@127.0.0.1:1/db", "--redis-url=redis://:s3cret@127.0.0.1:1/0"],
)
@pytest.mark.usefixtures("no_database")
def test_every_json_command_prints_a_document_when_the_server_cannot_be_reached(
    command: list[str], server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 1 refuses at once: nothing listens there, and no server is needed.
    assert cli.main([*command, server]) == 3
    out, err = capsys.readouterr()
    assert "s3cret" not in out + err
    doc = json.loads(out)  # a script parsing stdout gets one document, not nothing
    assert doc["exit_code"] == 3 and "127.0.0.1" in doc["error"]
    assert doc["error"] in err
