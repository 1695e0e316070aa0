"""The array literals the Postgres keeper writes into its batch statements."""

from __future__ import annotations

import math

import pytest
from psycopg import sql

from rselection.postgres._lease_sql import array_literal, rows_sql


def text(composed: sql.Composable) -> str:
    return composed.as_string(None)


def test_strings_are_double_quoted_with_quotes_and_backslashes_escaped() -> None:
    # Inside the array: "b\"c" and "d\\e"; the literal then doubles the backslashes
    # (an E'' string) and the single quote.
    written = text(array_literal(["a", 'b"c', "d\\e", "NULL", "", "it's"], "text"))
    assert written == """ E'{"a","b\\\\"c","d\\\\\\\\e","NULL","","it''s"}'::text[]"""


def test_none_is_null_and_numbers_are_written_as_python_spells_them() -> None:
    assert text(array_literal([1, None, -2], "integer")) == "'{1,NULL,-2}'::integer[]"
    assert text(array_literal([15.0, 0.5], "float8")) == "'{15.0,0.5}'::float8[]"
    assert text(array_literal([], "text")) == "'{}'::text[]"


@pytest.mark.parametrize("value", [True, b"x", object(), math.inf, math.nan])
def test_values_an_array_literal_cannot_hold_are_refused(value: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        array_literal([value], "text")  # type: ignore[list-item]


def test_rows_sql_unnests_one_literal_per_column() -> None:
    assert text(rows_sql("x(a, b)", (["n"], "text"), ([2], "bigint"))) == (
        "SELECT * FROM unnest('{\"n\"}'::text[], '{2}'::bigint[]) AS x(a, b)"
    )
