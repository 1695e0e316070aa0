"""The keeper's batch statements: array literals read back as written on a real server,
and where an attempt reads the server's lock table."""

from __future__ import annotations

import random

import psycopg
from psycopg import sql

from rselection.postgres._lease_sql import (
    AcquireRequest,
    acquire_batch_sql,
    array_literal,
    new_lock_key,
    rows_sql,
)

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


def test_the_states_read_the_lock_table_once_and_a_takeover_reads_it_again() -> None:
    requests = [
        AcquireRequest(f"l/{i}", "n", 15.0, new_lock_key(), f"c{i}", False) for i in range(3)
    ]
    text = acquire_batch_sql(
        sql.Identifier("t"),
        requests,
        server="s",
        ring=7,
        history=sql.Identifier("t_history"),
        process=("host", 1),
    ).as_string(None)
    reads = [s.count("pg_catalog.pg_locks") for s in text.split("; ") if "pg_locks" in s]
    # The acquisition: once to find the rows it may take, and again, after locking them,
    # before it takes one (a row locked may be a term begun after the first read). The
    # states: once, however many of their columns look at locks.
    assert reads == [2, 1]
