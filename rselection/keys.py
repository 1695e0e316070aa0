"""Keys scoped to one lease: ``<lease name, percent-encoded>/<key>``.

Two leases may run tasks of the same name (lease ``billing`` and lease ``shipping``, each
with a task ``cursor``); what a task stores under its name (a checkpoint, a claimed fire)
must not collide across leases. :func:`lease_scoped` puts the lease's name in front of the
key, with ``%`` and ``/`` in the lease name percent-encoded, so the first ``/`` of the
result always ends the lease part and no two (lease, key) pairs give the same string.
"""

from __future__ import annotations

__all__ = ["lease_scoped"]


def lease_scoped(lease_name: str, key: str) -> str:
    """``key`` scoped to the lease called ``lease_name``, unambiguously.

    ``%`` and ``/`` in ``lease_name`` are written as ``%25`` and ``%2F``; ``key`` is kept
    as it is (it may contain ``/``). For example ``lease_scoped("a/b", "c")`` is
    ``"a%2Fb/c"`` and ``lease_scoped("a", "b/c")`` is ``"a/b/c"``.

    Args:
        lease_name: the name of the lease.
        key: the key within that lease (a task's name, a fire key).

    Returns:
        ``<lease_name with % and / percent-encoded>/<key>``.
    """
    return lease_name.replace("%", "%25").replace("/", "%2F") + "/" + key
