"""Keys scoped to a lease never collide across leases."""

from __future__ import annotations

import itertools

from rselection.keys import lease_scoped


def test_lease_scoped_examples() -> None:
    assert lease_scoped("billing", "cursor") == "billing/cursor"
    assert lease_scoped("a/b", "c") == "a%2Fb/c"
    assert lease_scoped("a", "b/c") == "a/b/c"
    assert lease_scoped("50%", "x") == "50%25/x"


def test_lease_scoped_is_unambiguous() -> None:
    parts = ["a", "b", "a/b", "b/c", "a%2Fb", "%", "/", "%2F", "a%", "x/y/z"]
    seen: dict[str, tuple[str, str]] = {}
    for lease, key in itertools.product(parts, parts):
        scoped = lease_scoped(lease, key)
        assert seen.setdefault(scoped, (lease, key)) == (lease, key)
