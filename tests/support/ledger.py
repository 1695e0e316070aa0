"""Reading the ledger that node processes write: one row per fenced write, with its term."""

from __future__ import annotations

import psycopg

LEDGER = "rselection_demo_ledger"


def overlaps(dsn: str, table: str = LEDGER) -> int:
    """Rows of an older term written after a row of a newer term (must be 0)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {table} a JOIN {table} b"
            " ON a.term < b.term AND (a.id > b.id OR a.written_at > b.written_at)"
        ).fetchone()
    assert row is not None
    return int(row[0])


def terms(dsn: str, table: str = LEDGER) -> dict[int, set[str]]:
    """For each term in the ledger, the nodes that wrote with it (one each, if safe)."""
    out: dict[int, set[str]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for term, node in conn.execute(f"SELECT DISTINCT term, node FROM {table}"):
            out.setdefault(int(term), set()).add(str(node))
    return out


def writes_by(dsn: str, node: str, term: int, table: str = LEDGER) -> int:
    """How many ledger rows ``node`` wrote with ``term``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {table} WHERE node = %s AND term = %s",
            (node, term),
        ).fetchone()
    assert row is not None
    return int(row[0])
