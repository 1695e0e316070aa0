"""The keeper's batch statements on a real server: array literals read back as written."""

from __future__ import annotations

import random

import psycopg
from psycopg import sql

from rselection.postgres._lease_sql import array_literal, rows_sql

TRICKY = ['"', "\\", "'", "{", "}", ",", " ", "\t", "\n", "NULL", "null", "é", "😀", "$$", "E'"]


def test_text_arrays_read_back_as_written(pg_dsn: str) -> None:
    rng = random.Random(42)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for _ in range(200):
            values = [
                "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 6)))
                for _ in range(rng.randint(0, 12))
            ]
            row = conn.execute(sql.SQL("SELECT {}").format(array_literal(values, "text")))
            assert row.fetchone() == (values,)
        conn.execute("SET standard_conforming_strings = off")
        row = conn.execute(sql.SQL("SELECT {}").format(array_literal(['a\\"b', "it's"], "text")))
        assert row.fetchone() == (['a\\"b', "it's"],)


def test_rows_read_back_with_nulls_and_numbers(pg_dsn: str) -> None:
    keys = [0, -(2**31), 2**31 - 1, None]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            rows_sql(
                "x(name, ttl, key, term)",
                (["a", "b", "c", "d"], "text"),
                ([15.0, 0.1, 1e-05, 3600.5], "float8"),
                (keys, "integer"),
                ([1, 2**63 - 1, 2, 3], "bigint"),
            )
        ).fetchall()
    assert rows == [
        ("a", 15.0, 0, 1),
        ("b", 0.1, -(2**31), 2**63 - 1),
        ("c", 1e-05, 2**31 - 1, 2),
        ("d", 3600.5, None, 3),
    ]
