"""The outbox of :class:`~rselection.postgres.PostgresBroadcaster`: its tables and statements.

One row per published message (``id`` orders delivery) and a one-row state table
(``purged_through``); every publish locks that row before its ids are drawn, so ids
become visible in order, and a NOTIFY carries only the last id: a wake-up, never data.
See ``docs/explanation/broadcaster.md`` ("How it works", "What a NOTIFY carries, and
what a listener trusts"); the DDL is in :mod:`rselection.postgres.schema`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from psycopg import sql

from ..schema import BROADCAST_TABLE, suffixed_name, table_identifier, validate_table_name

__all__ = ["BROADCAST_TABLE", "FIND_TABLE", "Outbox", "text_array"]

FIND_TABLE = (
    "SELECT c.oid FROM unnest({path}::name[]) WITH ORDINALITY AS p(name, pos)"
    " JOIN pg_catalog.pg_namespace n ON n.nspname = p.name"
    " JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = {rel}::name"
    " ORDER BY p.pos LIMIT 1"
)
"""The oid of the table a name finds through a search path (``{path}``: the schemas
in order, ``{rel}``: the table's own name), as Postgres finds a relation (temporary
tables never count): formatted with the placeholders of the statement it is part of
(see :mod:`rselection.postgres.broadcast.location`)."""


def text_array(values: Iterable[bytes]) -> bytes:
    """A Postgres array literal (text form) of UTF-8 strings, for a ``$n::text[]`` parameter.

    Every element is double-quoted, with ``\\`` and ``"`` escaped, so any text (and
    ``NULL`` spelt out) comes back unchanged; the strings hold no NUL character (callers
    refuse it, Postgres text cannot store it).
    """
    return (
        b"{"
        + b",".join(
            b'"' + value.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"' for value in values
        )
        + b"}"
    )


class Outbox:
    """Identifiers and statements of one outbox table (validated at construction).

    Args:
        table: the outbox table, optionally schema-qualified.
    """

    def __init__(self, table: str) -> None:
        """Validate ``table`` (raises :class:`ConfigError`) and build the identifiers."""
        self.table = table
        self.ident = table_identifier(table)
        self.state_ident = table_identifier(suffixed_name(table, "state"))

    # -- its NOTIFY channel -------------------------------------------------------------

    @staticmethod
    def channel(qualified: str) -> str:
        """The NOTIFY channel of the table ``schema.table``.

        Args:
            qualified: the table's schema and name, joined by a dot (unquoted).
        """
        digest = hashlib.blake2b(qualified.encode(), digest_size=8)
        # NOTIFY channel names are identifiers (at most 63 bytes): a fixed prefix and a
        # hash of the qualified table name always fit, whatever the logical channels are.
        return f"rselection_bc_{digest.hexdigest()}"

    def in_schema(self, schema: str) -> Outbox:
        """This outbox with both tables named in ``schema``: its statements then mean
        the same tables on every session, whatever its ``search_path``.

        Args:
            schema: the schema the table was resolved in (see :meth:`schema`).
        """
        pinned = Outbox(self.table)
        pinned.ident = sql.Identifier(schema, validate_table_name(self.table)[-1])
        state = validate_table_name(suffixed_name(self.table, "state"))[-1]
        pinned.state_ident = sql.Identifier(schema, state)
        return pinned

    # -- statements ------------------------------------------------------------------

    # Publish statements are prepared once per session that publishes (the process's
    # pooled sessions, or a user's pool's) and executed with text parameters through
    # libpq (see Writer.write), hence ``$n`` placeholders.
    # Parameters of both: $1 origin, $2 NOTIFY channel, $3 the transaction's
    # synchronous_commit ('on' or 'off'), $4 the search path (schemas, a name[]), $5 the
    # table's own name and $6 the oid of the table they found (see
    # rselection.postgres.broadcast.location), then the message(s): $7 channel, $8
    # payload (JSON text), $9 origin_seq, or arrays of each. One row comes back,
    # ``(first id, last id, ...)``, or none when the name no longer finds that table (or
    # its state table holds no row): nothing was inserted nor notified.
    #
    # The NOTIFY carries the last id of the transaction and nothing else: any role that
    # can connect may LISTEN on the channel (its name is a hash of the table's name), so
    # a message's channel or body never travels in it, and any role may NOTIFY on it, so
    # listeners take it as a wake-up and read the rows from the table (see
    # Listener.on_notify).
    #
    # synchronous_commit is set for the statement's own transaction (set_config(...,
    # true), read when it commits), never for the session: a pooled session carries
    # claims and checkpoints too, which must keep the server's setting.

    _FOUND = "(" + FIND_TABLE.format(path="$4", rel="$5") + ") = $6::oid"

    # The publish lock (see the module's docstring): the state table's row, locked by
    # a CTE that sets synchronous_commit too. set_config is volatile, so the CTE is
    # evaluated once, where the INSERT reads it, never folded into the INSERT.
    _LOCK = (
        "WITH l AS (SELECT set_config('synchronous_commit', $3::text, true) FROM {s} FOR UPDATE),"
    )

    def insert_one(self) -> sql.Composed:
        """Write one message and NOTIFY listeners (its id), in one statement and one
        transaction.

        Cheaper for the server than :meth:`insert_many` with one element (no arrays to
        parse and unnest, no aggregate), which is what a steady trickle of publishes
        sends.
        """
        return sql.SQL(
            # The lock CTE is the row source of the INSERT, so it is taken before the id
            # is drawn; it is held until the transaction has committed.
            self._LOCK + " ins AS (INSERT INTO {t} (channel, payload, origin, origin_seq)"
            "  SELECT $7::text, $8::text, $1::bigint, $9::bigint FROM l"
            "  WHERE " + self._FOUND + "  RETURNING id)"
            " SELECT ins.id, ins.id, pg_notify($2::text, ins.id::text) FROM ins"
        ).format(t=self.ident, s=self.state_ident)

    def insert_many(self) -> sql.Composed:
        """Write a batch and NOTIFY listeners (its last id), in one statement and one
        transaction.

        ``$7``, ``$8`` and ``$9`` are arrays (text, text, bigint) of the same length, in
        publishing order.
        """
        return sql.SQL(
            # The lock CTE is joined to every input row, so it is taken before the first
            # id is drawn; it is held until the transaction has committed.
            self._LOCK + " ins AS (INSERT INTO {t} (channel, payload, origin, origin_seq)"
            "  SELECT u.c, u.p, $1::bigint, u.s FROM l,"
            "   unnest($7::text[], $8::text[], $9::bigint[]) WITH ORDINALITY AS u(c, p, s, n)"
            "  WHERE " + self._FOUND + "  ORDER BY u.n"
            "  RETURNING id),"
            " j AS (SELECT min(id) AS first, max(id) AS last FROM ins)"
            " SELECT j.first, j.last, pg_notify($2::text, j.last::text) FROM j"
            " WHERE j.last IS NOT NULL"
        ).format(t=self.ident, s=self.state_ident)

    # The listener's statements name the table it found too, and read the oid of the
    # table the name finds now in the same snapshot (a change of table shows there).
    _FINDS = "(" + FIND_TABLE.format(path="%s", rel="%s") + ")"

    def start_position(self) -> sql.Composed:
        """Where a new listener starts: after the newest row, or the purge watermark.

        Parameters: the search path (schemas) and the table's own name. Returns
        ``(newest id, purge watermark, oid of the table the name finds)``.
        """
        return sql.SQL(
            "SELECT (SELECT coalesce(max(id), 0) FROM {t}),"
            " (SELECT coalesce(max(purged_through), 0) FROM {s}), " + self._FINDS
        ).format(t=self.ident, s=self.state_ident)

    # The listener's fetches are prepared once per listening connection and run through
    # libpq with text parameters, as the publishes are (see .fetches), hence ``$n``.

    def fetch(self) -> sql.Composed:
        """Rows after a cursor, in id order, with the purge watermark, the newest id and
        the oid of the table the name finds, in one snapshot (the last two show when
        the ids went back, or the name finds another table).

        Parameters: ``$1`` last seen id, ``$2`` row limit, ``$3`` byte limit (see
        :meth:`fetch_next`), ``$4`` the search path (schemas, a ``name[]``), ``$5`` the
        table's own name. Returns ``(purged_through, newest id, table oid, id, channel,
        payload)`` rows; ``id`` is NULL in the one row returned when nothing is new.
        """
        return self._page(sql.SQL("(" + FIND_TABLE.format(path="$4", rel="$5") + ")"))

    def fetch_next(self) -> sql.Composed:
        """:meth:`fetch` without finding the table through the search path: the oid is
        this outbox's own table's, so it shows only that table replaced. What a listener
        runs after a wake-up, once per message at a steady pace, where the search costs
        as much as the rest of the statement; its polls run :meth:`fetch`.

        A page holds at most a number of rows and about a number of bytes: rows are
        taken while the payloads before them add up to less than the bytes (so at least
        one, whatever its size). ``octet_length`` reads a stored value's size from its
        header, without decompressing or fetching it.

        Parameters: ``$1`` last seen id, ``$2`` row limit, ``$3`` byte limit. Returns
        what :meth:`fetch` returns.
        """
        name = sql.Literal(self.ident.as_string())
        return self._page(sql.SQL("to_regclass({})::oid").format(name))

    def _page(self, oid: sql.Composable) -> sql.Composed:
        """The statement of :meth:`fetch` and :meth:`fetch_next`, ``oid`` the expression
        of the table's oid."""
        return sql.SQL(
            "SELECT m.p, m.top, m.oid, r.id, r.channel, r.payload"
            " FROM (SELECT coalesce((SELECT max(purged_through) FROM {s}), 0) AS p,"
            "  coalesce((SELECT max(id) FROM {t}), 0) AS top, {oid} AS oid) m"
            " LEFT JOIN LATERAL (SELECT w.id, w.channel, w.payload FROM ("
            "   SELECT id, channel, payload,"
            "    sum(octet_length(payload)) OVER (ORDER BY id) - octet_length(payload) AS before"
            "   FROM {t} WHERE id > $1::bigint ORDER BY id LIMIT $2::bigint) w"
            "  WHERE w.before < $3::bigint) r ON true"
            " ORDER BY r.id"
        ).format(t=self.ident, s=self.state_ident, oid=oid)

    def state_row(self) -> sql.Composed:
        """Whether the state table holds its row, which every publish locks. Returns one
        row: a boolean."""
        return sql.SQL("SELECT EXISTS (SELECT FROM {s})").format(s=self.state_ident)

    def add_state_row(self) -> sql.Composed:
        """Put the state table's row back (``purged_through`` 0: see the listener's
        handling of a watermark left by older ids)."""
        return sql.SQL("INSERT INTO {s} DEFAULT VALUES ON CONFLICT DO NOTHING").format(
            s=self.state_ident
        )

    @staticmethod
    def committed(table: sql.Identifier) -> sql.Composed:
        """Whether one message of a writer is in the table (to settle a batch in doubt).

        Args:
            table: the table, wherever it is now (see :meth:`.Locator.at`).

        Parameters: origin, origin_seq. Returns one row: a boolean. By the writer's
        identity, never by ids (they go back when the table is created again or its
        sequence reset); it reads the table (no index on the origin: every insert would
        pay for one), which is bounded by the retention and happens only after a
        session broke with a batch in flight.
        """
        return sql.SQL(
            "SELECT EXISTS (SELECT FROM {t} WHERE origin = %s AND origin_seq = %s)"
        ).format(t=table)

    def purge(self) -> sql.Composed:
        """Delete up to a limit of rows older than the retention; advance the watermark.

        Parameters: retention seconds, row limit. Returns ``(deleted, purged_through)``
        or no row when nothing was old enough. Times are the server's.
        """
        return sql.SQL(
            "WITH d AS (DELETE FROM {t} WHERE id IN ("
            "  SELECT id FROM {t} WHERE created_at < clock_timestamp() - make_interval(secs => %s)"
            "  ORDER BY created_at LIMIT %s) RETURNING id),"
            " m AS (SELECT count(*) AS n, max(id) AS top FROM d)"
            " UPDATE {s} SET purged_through = greatest(purged_through, m.top),"
            "  purged_at = clock_timestamp()"
            " FROM m WHERE m.n > 0"
            " RETURNING m.n, {s}.purged_through"
        ).format(t=self.ident, s=self.state_ident)
