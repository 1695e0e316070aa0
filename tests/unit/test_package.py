"""Packaging promises: the core imports no driver, a missing driver says what to install,
and every public name is documented."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import rselection as rs


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


# --------------------------------------------------------------------------- release metadata

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _ci_python_versions() -> list[str]:
    """The Python versions .ci/run runs the unit tests on."""
    loop = re.search(r"^for version in ([0-9. ]+); do$", (ROOT / ".ci/run").read_text(), re.M)
    assert loop is not None, ".ci/run no longer loops over Python versions"
    return loop.group(1).split()


def test_python_classifiers_and_requires_python_name_the_versions_ci_tests() -> None:
    project = _project()["project"]
    tested = _ci_python_versions()
    listed = [
        c.rsplit(" :: ", 1)[1]
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert listed == tested
    assert project["requires-python"] == f">={tested[0]}"
    assert sys.version_info >= tuple(int(n) for n in tested[0].split("."))


def test_package_is_marked_typed_and_ships_the_marker() -> None:
    config = _project()
    assert "Typing :: Typed" in config["project"]["classifiers"]
    assert (ROOT / "rselection" / "py.typed").is_file()
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["rselection"]


def test_licence_is_an_spdx_expression_backed_by_the_licence_file() -> None:
    project = _project()["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    # setuptools refuses a licence classifier next to a licence expression (PEP 639)
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_command_entry_point_names_a_callable() -> None:
    target = _project()["project"]["scripts"]["rselection"]
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_dev_extra_has_the_release_tools_ci_uses() -> None:
    dev = " ".join(_project()["project"]["optional-dependencies"]["dev"])
    for tool in ("build", "twine", "trove-classifiers"):
        assert re.search(rf"(^| ){re.escape(tool)}\b", dev), tool


@pytest.mark.parametrize(
    "cls",
    ["LeaseLeader", "SingleNodeLeader", "PostgresLeader", "RedisLeader", "PostgresShardedLeader"],
)
def test_the_leaders_read_only_attributes_are_properties_with_their_own_docstrings(
    cls: str,
) -> None:
    # A type checker matches a leader to the rs.Leader protocol, and a user's subclass
    # may override one of them, only when they are properties (pyright refused every
    # leader as an rs.Leader when they were descriptors of another kind); help() shows
    # a property's docstring.
    leader_cls = getattr(rs, cls)
    for name in ("node_id", "is_leader", "term", "name", "timings"):
        attribute = inspect.getattr_static(leader_cls, name)
        assert isinstance(attribute, property), f"{cls}.{name} is {type(attribute).__name__}"
        assert attribute.__doc__, f"{cls}.{name} has no docstring"
