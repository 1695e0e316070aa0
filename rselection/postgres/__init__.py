"""Postgres backend: the lease, its tables and fenced writes (needs psycopg 3).

Importing :mod:`rselection` does not import this package (nor psycopg); importing this
package does.
"""

from __future__ import annotations

from .fencing import afenced, fenced
from .lease import PostgresLease
from .schema import migrate

__all__ = ["PostgresLease", "afenced", "fenced", "migrate"]
