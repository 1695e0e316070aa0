"""Count one process's Postgres sessions, from the server's ``pg_stat_activity``.

A session belongs to a process when its ``client_port`` is the local port of one of the
process's TCP connections to the server (same machine, loopback): the server's view,
so it counts what the process really holds, whatever the library calls its sessions.
Sessions are grouped by ``application_name``.

    from tests.support.sessions import process_sessions, grouped
    counts = process_sessions(dsn, pid)          # Counter({'rselection:nodes': 100, ...})
    grouped(counts)                              # 'rselection:p1/*' for 'rselection:p1/0'..
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

import psutil  # type: ignore[import-untyped]
import psycopg
from psycopg.conninfo import conninfo_to_dict

__all__ = ["fold", "grouped", "local_ports", "process_sessions", "server_port", "sessions_on_ports"]

_NUMBERED = re.compile(r"/\d+(?=:|$)")


def server_port(dsn: str) -> int:
    """The TCP port that ``dsn`` connects to (5432 when it names none)."""
    port = conninfo_to_dict(dsn).get("port")
    return int(str(port).split(",")[0]) if port else 5432


def local_ports(pid: int, remote_port: int | None = None) -> set[int]:
    """Local ports of ``pid``'s TCP connections (to ``remote_port`` only, when given)."""
    ports: set[int] = set()
    for conn in psutil.Process(pid).net_connections(kind="tcp"):
        if not conn.raddr or conn.status != psutil.CONN_ESTABLISHED:
            continue  # a listening socket, or one closing
        if remote_port is None or conn.raddr.port == remote_port:
            ports.add(conn.laddr.port)
    return ports


def sessions_on_ports(dsn: str, ports: Iterable[int]) -> Counter[str]:
    """Sessions of the server whose client port is one of ``ports``, by application_name.

    Only TCP sessions from this machine can match; this query's own session never does.
    """
    wanted = sorted(set(ports))
    if not wanted:
        return Counter()
    with psycopg.connect(dsn, autocommit=True, application_name="rselection-tests") as conn:
        rows = conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity"
            " WHERE client_port = ANY(%s) AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend' GROUP BY 1",
            (wanted,),
        ).fetchall()
    return Counter({str(name): int(n) for name, n in rows})


def process_sessions(dsn: str, pid: int) -> Counter[str]:
    """The sessions process ``pid`` holds on the server of ``dsn``, by application_name."""
    return sessions_on_ports(dsn, local_ports(pid, server_port(dsn)))


def fold(name: str) -> str:
    """``rselection:p/12`` -> ``rselection:p/*`` (and ``.../12:probe`` -> ``.../*:probe``)."""
    return _NUMBERED.sub("/*", name)


def grouped(counts: Counter[str]) -> dict[str, int]:
    """``counts`` with per-lease names (``.../<number>``, ``.../<number>:probe``) folded
    into ``.../*`` (``.../*:probe``), for messages."""
    out: Counter[str] = Counter()
    for name, n in counts.items():
        out[fold(name)] += n
    return dict(out.most_common())
