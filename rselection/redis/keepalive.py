"""How long Redis keeps a silent client under its ``tcp-keepalive``, and what that allows.

Fast crash failover (see :mod:`rselection.redis.lease`) lets a follower take over once the
holder's connection is gone, so the server must not drop a *partitioned* holder's
connection before that holder has stopped: ``ttl`` after its last renewal at the latest.
Redis on Linux sets, on every client socket, ``TCP_KEEPIDLE = tcp-keepalive``,
``TCP_KEEPINTVL = tcp-keepalive / 3`` (integer division, at least 1) and ``TCP_KEEPCNT =
3``: the kernel sends the first probe after ``k`` idle seconds, then one every
``max(1, k // 3)`` seconds, and drops the connection when the third goes unanswered, so
a silent client is dropped ``k + 3 * max(1, k // 3)`` seconds after it fell silent (14 s
for ``tcp-keepalive 8``, not twice the setting). Other systems keep it longer (only the
idle time is set, or none), so this is the bound to check.
"""

from __future__ import annotations

__all__ = ["KEEPALIVE_PROBES", "keepalive_drop_after", "keepalive_refusal"]

KEEPALIVE_PROBES = 3
"""Unanswered keepalive probes after which Redis's kernel drops a client (Linux)."""


def _probe_interval(tcp_keepalive: int) -> int:
    return max(1, tcp_keepalive // KEEPALIVE_PROBES)


def keepalive_drop_after(tcp_keepalive: int) -> int | None:
    """Seconds after which Redis drops a client that went silent, or ``None`` (never).

    Args:
        tcp_keepalive: the server's ``tcp-keepalive`` setting, seconds (0: off).

    Raises:
        ValueError: not a whole number of seconds >= 0, as Redis has it.
    """
    if isinstance(tcp_keepalive, bool) or not isinstance(tcp_keepalive, int) or tcp_keepalive < 0:
        raise ValueError(
            f"tcp-keepalive must be a whole number of seconds >= 0, got {tcp_keepalive!r}"
        )
    if tcp_keepalive == 0:
        return None
    return tcp_keepalive + KEEPALIVE_PROBES * _probe_interval(tcp_keepalive)


def keepalive_refusal(tcp_keepalive: int, ttl: float) -> str | None:
    """Why the server's ``tcp-keepalive`` rules fast failover out for a lease of ``ttl``
    (the math, and the settings that would do), or ``None`` when it allows it: a silent
    client must be kept longer than ``ttl``.

    Args:
        tcp_keepalive: the server's ``tcp-keepalive`` setting, seconds (0: off).
        ttl: the lease's ttl, seconds.
    """
    dropped = keepalive_drop_after(tcp_keepalive)
    if dropped is None or dropped > ttl:
        return None
    enough = tcp_keepalive + 1
    while (keepalive_drop_after(enough) or 0) <= ttl:
        enough += 1
    interval = _probe_interval(tcp_keepalive)
    return (
        f"the server's tcp-keepalive {tcp_keepalive} s drops a silent client after "
        f"{tcp_keepalive} + {KEEPALIVE_PROBES} * {interval} = {dropped} s (first probe after "
        f"{tcp_keepalive} s idle, then {KEEPALIVE_PROBES} probes {interval} s apart), which "
        f"is not longer than the lease's ttl {ttl:g} s: a partitioned leader could be "
        "dropped before its tasks are joined. Set the server's tcp-keepalive 0 or at least "
        f"{enough} ({enough} + {KEEPALIVE_PROBES} * {_probe_interval(enough)} = "
        f"{keepalive_drop_after(enough)} s)"
    )
