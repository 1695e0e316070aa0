"""Pages generated from the code when the docs are built (a mkdocs hook).

A page asks for a generated section with a marker on a line of its own::

    <!-- generate: signals -->

and :func:`on_page_markdown` replaces it with the section's Markdown. The sections read
the code, never a copy of it: the signals from :mod:`rselection.signals`, the command
line from the ``argparse`` parsers the ``rselection`` command builds, the timings from
:class:`rselection.timing.Timings` and the constructors' signatures and docstrings, the
loggers from the package's source. An unknown marker fails the build.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rselection"
MARKER = re.compile(r"^<!-- generate: ([a-z-]+) -->$", re.M)


# -- helpers ------------------------------------------------------------------------------


def rst_to_md(text: str) -> str:
    """Turn the reST bits of a docstring (``code``, :class:`~a.B`) into Markdown."""
    text = re.sub(r":[a-z]+:`~?(?:[\w.]+\.)?([\w]+)`", r"`\1`", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def cell(text: str) -> str:
    """One table cell: a single line, pipes escaped."""
    return " ".join(rst_to_md(text).split()).replace("|", "\\|")


def code_span(text: str) -> str:
    """``text`` as inline code, also when it holds backticks."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def docstring_args(obj: Any) -> dict[str, str]:
    """The ``Args:`` section of a Google-style docstring, as name -> text."""
    doc = inspect.getdoc(obj) or ""
    args: dict[str, str] = {}
    section = False
    current: list[str] | None = None
    for line in doc.splitlines():
        if re.match(r"^(Args|Arguments|Parameters):\s*$", line):
            section = True
            continue
        if not section:
            continue
        if line and not line.startswith(" "):
            break  # the next section
        entry = re.match(r"^    (\*{0,2}\w+(?:, \w+)*)(?: \([^)]*\))?:\s*(.*)$", line)
        if entry:
            current = [name.lstrip("*") for name in entry.group(1).split(", ")]
            for name in current:
                args[name] = entry.group(2)
        elif current is not None and line.strip():
            for name in current:
                args[name] += " " + line.strip()
    return args


def summary(obj: Any) -> str:
    """The first paragraph of an object's docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def resolve(dotted: str) -> Any:
    """``"rselection.postgres.PostgresLeader"`` -> the object."""
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def default_text(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    if isinstance(value, float) and value.is_integer():
        return f"`{value:g}`"
    return f"`{value!r}`" if not hasattr(value, "value") else f"{value.value}"


# -- signals ------------------------------------------------------------------------------


def signal_rows() -> list[tuple[str, str, str]]:
    """(name, what, keyword arguments) of every signal in :mod:`rselection.signals`."""
    from blinker import NamedSignal

    from rselection import signals

    rows = []
    for name in signals.__all__:
        signal = getattr(signals, name)
        if not isinstance(signal, NamedSignal):
            continue
        doc = signal.__doc__ or ""
        kwargs = re.search(r"\(kwargs: ([^)]*)\)", doc)
        what = re.sub(r"\s*\(kwargs: [^)]*\)", "", doc).strip()
        rows.append((signal.name, what, kwargs.group(1) if kwargs else ""))
    return rows


def gen_signals() -> str:
    from rselection import signals

    rows = [
        [f"`signals.{n}`", what, ", ".join(f"`{k}`" for k in kw.split(", ") if k)]
        for n, what, kw in signal_rows()
    ]
    out = [table(["signal", "sent when", "keyword arguments"], rows), ""]
    out.append(rst_to_md(inspect.getdoc(signals) or ""))
    return "\n".join(out)


# -- command line -------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def cli_parser() -> argparse.ArgumentParser:
    """The top-level parser of the ``rselection`` command, as the command builds it."""
    from rselection import cli

    for name in ("build_parser", "make_parser", "parser"):
        build = getattr(cli, name, None)
        if callable(build):
            parser = build()
            if isinstance(parser, argparse.ArgumentParser):
                return parser

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            cli.main(["--help"])
        except _Captured as captured:
            return captured.parser
    raise RuntimeError("rselection.cli.main() never parsed its arguments")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Subcommand name -> its parser, in the order the command lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def argument_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            metavar = action.metavar or action.dest.upper()
            name = f"`{metavar}`" + (" ..." if action.nargs in ("*", "+") else "")
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            default = ""
        else:
            default = f"`{action.default}`"
        help_text = (action.help or "").replace("%(default)s", str(action.default))
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            help_text += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
        rows.append([name, default, help_text])
    return rows


def gen_cli() -> str:
    parser = cli_parser()
    out = [f"`{parser.prog}`: {parser.description or ''}", ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    helps = subcommand_help(parser)
    for name, sub in subcommands(parser).items():
        out += [f"## `{parser.prog} {name}`", ""]
        text = sub.description or helps.get(name, "")
        if text:
            out += [rst_to_md(text), ""]
        out += ["```text", sub.format_usage().strip(), "```", ""]
        rows = argument_rows(sub)
        if rows:
            out += [table(["argument", "default", "meaning"], rows), ""]
        # A command with actions of its own (`rselection task pause`): each one too.
        actions = subcommand_help(sub)
        for action, nested in subcommands(sub).items():
            out += [f"### `{parser.prog} {name} {action}`", ""]
            text = nested.description or actions.get(action, "")
            if text:
                out += [rst_to_md(text), ""]
            out += ["```text", nested.format_usage().strip(), "```", ""]
            rows = argument_rows(nested)
            if rows:
                out += [table(["argument", "default", "meaning"], rows), ""]
    return "\n".join(out)


# -- settings -----------------------------------------------------------------------------

TIMING_RULES = {
    "ttl": "lease length, measured by the lease server (Postgres `now()`, Redis `PX`)",
    "renew_interval": "time between renewals; `renew_interval < renew_deadline`",
    "renew_deadline": (
        "the leader steps down when no renewal succeeded for this long, measured from when "
        "the last successful renewal was sent; `ttl - renew_deadline >= max(1 s, 10% of ttl)`"
    ),
    "retry_interval": (
        "a follower's slowest poll, jittered; a release or the holder's session ending "
        "wakes it sooner"
    ),
}

# The constructors whose keyword arguments the settings page lists, in this order.
SETTINGS_CLASSES = [
    "rselection.TaskHandler",
    "rselection.SingleNodeLeader",
    "rselection.LeaseLeader",
    "rselection.postgres.PostgresLeader",
    "rselection.postgres.PostgresShardedLeader",
    "rselection.redis.RedisLeader",
    "rselection.HeartbeatMonitor",
    "rselection.postgres.PostgresBroadcaster",
    "rselection.postgres.PostgresClaimer",
    "rselection.postgres.PostgresElector",
    "rselection.postgres.PostgresCheckpointStore",
    "rselection.redis.RedisClaimer",
    "rselection.redis.RedisElector",
]


def timing_rows() -> list[list[str]]:
    from rselection.timing import STOP_GRACE_CAP, STOP_GRACE_MARGIN, Timings

    defaults = Timings()
    rows = []
    for field in dataclasses.fields(Timings):
        if field.name not in TIMING_RULES:
            raise RuntimeError(f"docs: describe the new timing {field.name!r} in TIMING_RULES")
        rows.append([f"`{field.name}`", f"{field.default:g} s", TIMING_RULES[field.name]])
    grace = defaults.stop_grace(None)
    rows.append(
        [
            "`stop_grace` (on `TaskHandler`)",
            f"as the timings allow: `ttl - renew_deadline - {STOP_GRACE_MARGIN:g} s`, "
            f"at most {STOP_GRACE_CAP:g} s ({grace:g} s with the defaults)",
            f"how long a term's tasks get to finish once cancelled; "
            f"`renew_deadline + stop_grace + {STOP_GRACE_MARGIN:g} s <= ttl`, so a cut-off "
            "leader's tasks are joined before its lease can expire",
        ]
    )
    return rows


def refused(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as exc:  # the message is what the page shows
        return f"{type(exc).__name__}: {exc}"
    raise RuntimeError("docs: expected the timings to be refused")


def gen_timings() -> str:
    from rselection.timing import Timings

    out = [table(["setting", "default", "rule"], timing_rows()), ""]
    out.append("Timings that break a rule are refused when the leader is built, with the math:")
    out.append("")
    examples = [
        ("Timings(ttl=15, renew_deadline=14.5)", lambda: Timings(ttl=15, renew_deadline=14.5)),
        ("Timings(renew_interval=10)", lambda: Timings(renew_interval=10)),
        ("Timings().stop_grace(5)", lambda: Timings().stop_grace(5)),
    ]
    for label, call in examples:
        out += ["```text", f">>> {label}", refused(call), "```", ""]
    return "\n".join(out)


def constructor_rows(obj: Any) -> list[list[str]]:
    sig = inspect.signature(obj)
    docs = docstring_args(obj)
    if inspect.isclass(obj):
        docs = {**docstring_args(obj.__init__), **docs}
    rows = []
    for param in sig.parameters.values():
        if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        rows.append([f"`{param.name}`", default_text(param.default), docs.get(param.name, "")])
    return rows


def gen_settings() -> str:
    out = []
    for dotted in SETTINGS_CLASSES:
        try:
            obj = resolve(dotted)
        except (AttributeError, ImportError):
            continue  # not part of this release
        public = dotted.replace("rselection.", "rs.", 1) if dotted.count(".") == 1 else dotted
        out += [f"### `{public}`", "", rst_to_md(summary(obj)), ""]
        out += [table(["argument", "default", "meaning"], constructor_rows(obj)), ""]
    return "\n".join(out)


# -- loggers ------------------------------------------------------------------------------

LEVELS = ("critical", "error", "exception", "warning", "info", "debug")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def logger_calls(path: Path) -> Iterator[tuple[str, str, str]]:
    """(logger name, level, message) of each log call in one module."""
    tree = ast.parse(path.read_text(), str(path))
    loggers: dict[str, str] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "getLogger"
        ):
            arg = node.value.args[0] if node.value.args else None
            if isinstance(arg, ast.Name) and arg.id == "__name__":
                name = module_name(path)
            elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
            else:
                continue
            for target in node.targets:
                if isinstance(target, ast.Name):
                    loggers[target.id] = name
    if not loggers:
        return
    aliases: dict[str, list[str]] = {}  # log = logger.info if ... else logger.warning
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            levels = [
                n.attr
                for n in ast.walk(node.value)
                if isinstance(n, ast.Attribute)
                and n.attr in LEVELS
                and isinstance(n.value, ast.Name)
                and n.value.id in loggers
            ]
            if isinstance(target, ast.Name) and levels and target.id not in loggers:
                aliases[target.id] = levels
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        message = node.args[0]
        if not isinstance(message, ast.Constant) or not isinstance(message.value, str):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in LEVELS
            and isinstance(func.value, ast.Name)
            and func.value.id in loggers
        ):
            yield loggers[func.value.id], func.attr, message.value
        elif isinstance(func, ast.Name) and func.id in aliases:
            name = next(iter(loggers.values()))
            yield name, " or ".join(dict.fromkeys(aliases[func.id])), message.value


def logger_names() -> list[str]:
    """Every logger the package creates, sorted."""
    names = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for match in re.finditer(r"getLogger\((__name__|\"[^\"]+\")\)", text):
            arg = match.group(1)
            names.add(module_name(path) if arg == "__name__" else arg.strip('"'))
    return sorted(names)


def gen_loggers() -> str:
    calls: dict[str, list[tuple[str, str]]] = {name: [] for name in logger_names()}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, level, message in logger_calls(path):
            calls.setdefault(name, []).append((level, message))
    order = {level: i for i, level in enumerate(LEVELS)}
    out = []
    for name, entries in calls.items():
        debug = sum(1 for level, _ in entries if level == "debug")
        shown = sorted(
            {(lvl, msg) for lvl, msg in entries if lvl != "debug"},
            key=lambda e: (order.get(e[0].split()[0], 9), e[1]),
        )
        out += [f"### `{name}`", ""]
        if shown:
            rows = [
                [lvl.replace("exception", "error (with traceback)").upper(), code_span(msg)]
                for lvl, msg in shown
            ]
            out += [table(["level", "message"], rows), ""]
        elif debug:
            out += ["Nothing above DEBUG.", ""]
        else:
            out += ["No messages of its own.", ""]
        if debug:
            out += [f"And {debug} DEBUG message{'s' if debug != 1 else ''}.", ""]
    return "\n".join(out)


# -- the hook -----------------------------------------------------------------------------

SECTIONS: dict[str, Callable[[], str]] = {
    "signals": gen_signals,
    "cli": gen_cli,
    "timings": gen_timings,
    "settings": gen_settings,
    "loggers": gen_loggers,
}


def expand(markdown: str) -> str:
    """Replace every ``<!-- generate: NAME -->`` marker with its generated section."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in SECTIONS:
            raise KeyError(f"unknown generated section {name!r}; known: {sorted(SECTIONS)}")
        return SECTIONS[name]().rstrip() + "\n"

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: expand the generated sections of a page."""
    return expand(markdown)
