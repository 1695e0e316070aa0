"""Node versions and eligibility: what a leader's ``version=`` and ``eligible=`` accept.

A node's version is the release of the application it runs, a PEP 440 string compared
with :mod:`packaging.version`; ``None`` (the default) is a node that gave none, which
never counts as newer or older than another. An ineligible node (``eligible=False``) is
a member of its lease that never leads. See ``docs/explanation/how-it-works.md``
("Versions and eligibility").
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from .errors import ConfigError

__all__ = ["MAX_VERSION", "check_eligible", "check_version"]

MAX_VERSION = 100
"""Most characters of a version: it travels with every heartbeat."""


def check_version(version: object) -> str | None:
    """Return ``version`` if it is ``None`` or a PEP 440 version, else raise.

    The string is kept as given (``"1.10.0"`` stays ``"1.10.0"``, not normalised), so
    that ``nodes()`` and ``status`` show what the node was started with.

    Raises:
        ConfigError: not a string, longer than :data:`MAX_VERSION`, or not PEP 440.
    """
    if version is None:
        return None
    if not isinstance(version, str):
        raise ConfigError(f"version must be a string or None, got {type(version).__name__}")
    if len(version) > MAX_VERSION:
        raise ConfigError(f"version must be at most {MAX_VERSION} characters, got {len(version)}")
    try:
        Version(version)
    except InvalidVersion:
        raise ConfigError(
            f"version {version!r} is not a PEP 440 version (such as '1.4.2', '2.0rc1' or "
            "'2024.6.1'): versions are compared to let the newest release lead"
        ) from None
    return version


def check_eligible(eligible: object) -> bool:
    """Return ``eligible`` if it is a bool, else raise :class:`ConfigError`."""
    if not isinstance(eligible, bool):
        raise ConfigError(f"eligible must be True or False, got {eligible!r}")
    return eligible
