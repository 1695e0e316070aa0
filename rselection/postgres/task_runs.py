"""Task controls and run history on Postgres: three tables beside the lease table.

``<table>_tasks`` has a row per task a leader published (its kind, schedule and next
fire) or an operator paused (``paused_at``), and numbers the task's runs
(``run_seq``); ``<table>_task_runs`` keeps the newest runs of each task by that number;
``<table>_task_triggers`` the fires operators asked for (see
:func:`~rselection.postgres.schema.task_table_names`). They are companions of the lease
table: created with it, and by ``rselection migrate``, with no schema version of their
own. A pause, a resume or a trigger notifies the lease's channel in its transaction
(``{"event": "tasks"}``): the leader reads the controls again, whoever sent it. A batch
of runs is one statement: it numbers the runs, inserts them and deletes the ones they
push past the limit. A missing table reads as nothing stored.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from ..abc import NextFires, TaskStoreBase
from ..errors import BackendUnavailable, first_line
from ..task_runs import RunRecord, TaskControls, TaskEntry, TaskInfo, Trigger
from ._lease_sql import lease_channel, resolve_lease_table
from .connections import Connections
from .schema import create_tables, table_exists, table_identifier, task_table_names

if TYPE_CHECKING:
    from .keeper import SharedKeeper

__all__ = ["TASK_STATEMENT_TIMEOUT", "PostgresTaskStore"]

TASK_STATEMENT_TIMEOUT = 2.0
"""Seconds a leader's statement of task controls or run history may take on the server
(lock waits included): a locked task table fails the call soon, and the leader tries
again, rather than hold a pooled session its fire claims need."""

_RUN_COLUMNS = "scheduled_at, started_at, ended_at, outcome, reason, node_id, term, error, acted_by"

_NOTIFY = "SELECT pg_notify(%s, json_build_object('event', 'tasks', 'name', %s::text)::text)"


class StoreTurn:
    """The turn of the task stores of one process on its pooled sessions: one call at a
    time, so that they hold at most one of the pool's two sessions and the fire claims
    (and the rest) always find the other, however long a call waits on a locked table.

    Args:
        wait: seconds a call waits at most for the turn.
    """

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self._slot = threading.Lock()

    @contextlib.contextmanager
    def taken(self, what: str) -> Iterator[None]:
        """Hold the turn for one call.

        Raises:
            BackendUnavailable: it stayed taken for :attr:`wait` seconds.
        """
        if not self._slot.acquire(timeout=self.wait):
            raise BackendUnavailable(
                f"{what}: the task store's pooled session stayed busy for {self.wait:g}s"
            )
        try:
            yield
        finally:
            self._slot.release()


_turns_lock = threading.Lock()
_turns: dict[tuple[int, str], StoreTurn] = {}


def store_turn(conninfo: str, wait: float, lane: str = "history") -> StoreTurn:
    """The turn of this process's task stores on the pooled sessions of ``conninfo``:
    lane ``"history"`` for every call but the reads of the controls, which take lane
    ``"controls"`` (a pause is never read behind a run history write)."""
    import os

    with _turns_lock:
        key = (os.getpid(), f"{lane}:{conninfo}")  # a forked child's turn is its own
        found = _turns.get(key)
        if found is None:
            found = _turns[key] = StoreTurn(wait)
        return found


def _epoch(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _utc(value: datetime | None) -> datetime | None:
    return None if value is None else value.astimezone(UTC)


def _run(name: str, task: str, row: Sequence[Any]) -> RunRecord:
    """A run record from the run columns of ``row`` (in :data:`_RUN_COLUMNS` order)."""
    return RunRecord(
        lease=name,
        task=task,
        scheduled_at=_utc(row[0]),
        started_at=_utc(row[1]),
        ended_at=_utc(row[2]),
        outcome=row[3],
        reason=row[4],
        node_id=row[5],
        term=int(row[6]),
        error=row[7],
        by=row[8],
    )


class PostgresTaskStore(TaskStoreBase):
    """The :class:`~rselection.abc.TaskStore` of the leases of one lease table.

    Each call is one short transaction on a connection of ``conns`` (a leader's are the
    process's pooled sessions, an admin's its own).

    Args:
        conns: where each call gets its connection.
        table: the lease table, optionally schema-qualified.
        create_tables: create the task tables when an operator's change finds them
            missing (a leader creates them with its lease table).
    """

    def __init__(
        self,
        conns: Connections,
        *,
        table: str,
        create_tables: bool = True,
        keeper: Callable[[], SharedKeeper | None] | None = None,
        turn: StoreTurn | None = None,
        controls_turn: StoreTurn | None = None,
    ) -> None:
        self._conns = conns
        self._turn = turn
        self._controls_turn = controls_turn
        self.table = table
        self.create_tables = create_tables
        self._keeper = keeper
        tasks, runs, triggers = (table_identifier(t) for t in task_table_names(table))
        self._tasks, self._runs, self._triggers = tasks, runs, triggers
        # One statement per batch: number each task's new runs (an upsert of its row,
        # which also keeps its next fire unless a newer term wrote one), insert them,
        # and delete the runs they push past the limit (the new ones are not visible to
        # the delete: they are all newer than what it deletes).
        self._write_sql = sql.SQL(
            "WITH n AS ("
            " SELECT * FROM json_to_recordset(%(tasks)s::json)"
            " AS n(n text, t text, c bigint, f float8, m bigint)"
            "), seq AS ("
            " INSERT INTO {tasks} AS t (name, task, run_seq, next_fire, fire_term)"
            " SELECT n, t, c, to_timestamp(f), m FROM n ORDER BY n, t"
            " ON CONFLICT (name, task) DO UPDATE SET run_seq = t.run_seq + EXCLUDED.run_seq,"
            " next_fire = CASE WHEN t.fire_term IS NULL OR EXCLUDED.fire_term >= t.fire_term"
            " THEN EXCLUDED.next_fire ELSE t.next_fire END,"
            " fire_term = greatest(t.fire_term, EXCLUDED.fire_term)"
            " RETURNING t.name, t.task, t.run_seq"
            "), ins AS ("
            " INSERT INTO {runs} (name, task, seq, " + _RUN_COLUMNS + ")"
            " SELECT r.n, r.t, seq.run_seq - n.c + r.o, to_timestamp(r.s), to_timestamp(r.b),"
            " to_timestamp(r.e), r.x, r.r, r.d, r.m, r.err, r.by"
            " FROM json_to_recordset(%(runs)s::json) AS r(n text, t text, o bigint,"
            " s float8, b float8, e float8, x text, r text, d text, m bigint, err text, by text)"
            " JOIN seq ON seq.name = r.n AND seq.task = r.t"
            " JOIN n ON n.n = r.n AND n.t = r.t"
            ")"
            " DELETE FROM {runs} d USING seq WHERE d.name = seq.name AND d.task = seq.task"
            " AND d.seq <= seq.run_seq - %(limit)s"
        ).format(tasks=tasks, runs=runs)
        self._publish_sql = sql.SQL(
            "WITH p AS ("
            " SELECT * FROM unnest(%(task)s::text[], %(kind)s::text[], %(schedule)s::text[],"
            " %(next_fire)s::timestamptz[]) AS p(task, kind, schedule, next_fire)"
            "), up AS ("
            " INSERT INTO {tasks} AS t (name, task, kind, schedule, next_fire, fire_term,"
            " node_id, term, published_at)"
            " SELECT %(name)s, task, kind, schedule, next_fire, %(term)s, %(node_id)s,"
            " %(term)s, clock_timestamp() FROM p"
            # A newer term's list stands: a leader that lost its term late adds nothing.
            " WHERE NOT EXISTS (SELECT 1 FROM {tasks} WHERE name = %(name)s"
            " AND term > %(term)s) ORDER BY task"
            " ON CONFLICT (name, task) DO UPDATE SET kind = EXCLUDED.kind,"
            " schedule = EXCLUDED.schedule, next_fire = EXCLUDED.next_fire,"
            " fire_term = EXCLUDED.fire_term, node_id = EXCLUDED.node_id,"
            " term = EXCLUDED.term, published_at = EXCLUDED.published_at"
            " WHERE t.term IS NULL OR t.term <= EXCLUDED.term"
            ")"
            # The tasks this term does not have are listed no more (their controls and
            # runs stay, should a later release bring them back).
            " UPDATE {tasks} SET kind = NULL, schedule = NULL, next_fire = NULL,"
            " node_id = %(node_id)s, term = %(term)s, published_at = clock_timestamp()"
            " WHERE name = %(name)s AND kind IS NOT NULL AND task <> ALL(%(task)s::text[])"
            " AND (term IS NULL OR term <= %(term)s)"
        ).format(tasks=tasks)
        # A lease's listed tasks, with the columns of each one's newest run; or NULL in
        # their place, for a read that needs no run (it never waits on the runs table).
        listed = sql.SQL(
            "SELECT t.task, t.kind, t.schedule, t.next_fire, t.paused_at, t.node_id, t.term,"
            " {run} FROM {tasks} t {newest} WHERE t.name = %s AND t.kind IS NOT NULL"
        )
        newest = sql.SQL(
            "LEFT JOIN LATERAL (SELECT " + _RUN_COLUMNS + " FROM {runs} WHERE name = t.name"
            " AND task = t.task ORDER BY seq DESC LIMIT 1) r ON true"
        ).format(runs=runs)
        self._tasks_sql = listed.format(run=sql.SQL("r.*"), tasks=tasks, newest=newest)
        nulls = sql.SQL(", ".join("NULL" for _ in _RUN_COLUMNS.split(",")))
        self._kinds_sql = listed.format(run=nulls, tasks=tasks, newest=sql.SQL(""))
        self._runs_sql = sql.SQL(
            "SELECT " + _RUN_COLUMNS + " FROM {runs} WHERE name = %s AND task = %s"
            " ORDER BY seq DESC LIMIT %s"
        ).format(runs=runs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(table={self.table!r}, {self._conns.where})"

    def close(self) -> None:
        """Close the connections of ``conns`` (a leader's: the process's pooled sessions
        are let go of; a pool or connection passed in stays open)."""
        self._conns.close()

    # -- a call ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _connection(
        self, what: str, turn: StoreTurn | None = None
    ) -> Iterator[psycopg.Connection[Any]]:
        """A connection of ``conns`` for one call, in the process's turn (``turn``,
        default the history lane's) if shared."""
        turn = turn or self._turn
        if turn is None:
            with self._conns.connection() as conn:
                yield conn
            return
        with turn.taken(what), self._conns.connection() as conn:
            yield conn

    def _read(
        self, what: str, query: sql.Composed, params: Any, turn: StoreTurn | None = None
    ) -> list[tuple[Any, ...]]:
        """The rows of ``query``; none when the task tables do not exist (yet)."""
        try:
            with self._connection(what, turn) as conn:
                try:
                    return conn.execute(query, params).fetchall()
                except psycopg.errors.UndefinedTable:
                    return []
        except psycopg.Error as exc:
            raise self._conns.wrap(what, exc) from exc

    def _change(self, what: str, name: str, query: sql.Composed, params: Any) -> Any:
        """Run ``query`` and notify the lease's channel, in one transaction; its row,
        or the number of rows it changed. Creates the task tables when missing."""
        try:
            with self._connection(what) as conn:
                found = resolve_lease_table(conn, self.table)
                tasks_table = task_table_names(self.table)[0]
                if self.create_tables and found is not None and not table_exists(conn, tasks_table):
                    create_tables(conn, leases=self.table)  # a table migrated before them
                with conn.transaction():
                    cur = conn.execute(query, params)
                    result = cur.fetchone() if cur.description is not None else cur.rowcount
                    if found is not None:
                        # Sent on commit, also when nothing changed: a leader that missed
                        # the first notification reads the controls again.
                        conn.execute(_NOTIFY, (lease_channel(found[1], name), name))
                return result
        except psycopg.errors.UndefinedTable as exc:
            raise self._conns.wrap(
                f"{what}: {first_line(exc)} (run `rselection migrate`)", exc
            ) from exc
        except psycopg.Error as exc:
            raise self._conns.wrap(what, exc) from exc

    def _write(self, what: str, query: sql.Composed, params: Any) -> None:
        """Run ``query``, one statement (atomic by itself: no BEGIN and COMMIT around it,
        which would make a batch three round trips)."""
        try:
            with self._connection(what) as conn:
                if conn.autocommit:
                    conn.execute(query, params)
                else:  # a user's pool's connection: commit it
                    with conn.transaction():
                        conn.execute(query, params)
        except psycopg.Error as exc:
            raise self._conns.wrap(what, exc) from exc

    # -- a leader's ----------------------------------------------------------------------

    def _controls_sql(self, name: sql.Composable) -> sql.Composed:
        """The read of a lease's controls, its name given as ``name`` (a placeholder, or
        a literal for the keeper session, which takes no parameters)."""
        return sql.SQL(
            "SELECT task, paused_at, NULL, clock_timestamp() FROM {tasks} WHERE name = {name}"
            " AND paused_at IS NOT NULL"
            " UNION ALL SELECT task, requested_at, fire_key, clock_timestamp() FROM {triggers}"
            " WHERE name = {name} ORDER BY 2"
        ).format(tasks=self._tasks, triggers=self._triggers, name=name)

    def read_controls(self, name: str) -> TaskControls:
        """See :meth:`~rselection.abc.TaskStore.read_controls`: on the keeper session
        while the process only follows (every lease of it reads them as it connects:
        one after another there, not on pooled sessions it would keep), else pooled."""
        what = f"read the task controls of {name!r}"
        keeper = None if self._keeper is None else self._keeper()
        rows = None
        if keeper is not None:
            try:
                rows = keeper.read(self._controls_sql(sql.Literal(name)), what)
            except psycopg.errors.UndefinedTable:
                rows = []
            except psycopg.Error as exc:
                raise self._conns.wrap(what, exc) from exc
        if rows is None:
            rows = self._read(
                what,
                self._controls_sql(sql.Placeholder("name")),
                {"name": name},
                self._controls_turn,
            )
        paused = {row[0]: _utc(row[1]) for row in rows if row[2] is None}
        triggers = tuple(
            Trigger(name, row[0], row[2], row[1].astimezone(UTC)) for row in rows if row[2]
        )
        # The server's clock (that stamps the triggers), when any row was read.
        read_at = max((row[3] for row in rows), default=None)
        return TaskControls(
            {task: at for task, at in paused.items() if at is not None},
            triggers,
            None if read_at is None else read_at.astimezone(UTC),
        )

    def publish_tasks(self, name: str, node_id: str, term: int, tasks: Sequence[TaskEntry]) -> None:
        """See :meth:`~rselection.abc.TaskStore.publish_tasks`."""
        params = {
            "name": name,
            "node_id": node_id,
            "term": term,
            "task": [t.task for t in tasks],
            "kind": [t.kind for t in tasks],
            "schedule": [t.schedule for t in tasks],
            "next_fire": [t.next_fire for t in tasks],
        }
        self._write(f"publish the tasks of {name!r}", self._publish_sql, params)

    def write_runs(self, runs: Sequence[RunRecord], *, next_fires: NextFires, limit: int) -> None:
        """See :meth:`~rselection.abc.TaskStore.write_runs`: one statement."""
        if not runs:
            return
        by_task: dict[tuple[str, str], list[RunRecord]] = {}
        for run in runs:
            by_task.setdefault((run.lease, run.task), []).append(run)
        # Two JSON documents, not arrays of each column: a batch of 500 runs costs the
        # node a tenth of the CPU (times go as epoch seconds, read with to_timestamp).
        rows: list[dict[str, Any]] = []
        tasks: list[dict[str, Any]] = []
        for (name, task), kept in sorted(by_task.items()):
            kept = kept[-limit:]  # a batch's older runs past the limit would be deleted
            rows.extend(
                {"n": name, "t": task, "o": number, "s": _epoch(r.scheduled_at),
                 "b": _epoch(r.started_at), "e": _epoch(r.ended_at), "x": r.outcome,
                 "r": r.reason, "d": r.node_id, "m": r.term, "err": r.error, "by": r.by}
                for number, r in enumerate(kept, 1)
            )  # fmt: skip
            newest = max(r.term for r in kept)
            next_fire = _epoch(next_fires.get((name, task)))
            tasks.append({"n": name, "t": task, "c": len(kept), "f": next_fire, "m": newest})
        params = {"runs": json.dumps(rows), "tasks": json.dumps(tasks), "limit": limit}
        self._write(f"write {len(runs)} task runs", self._write_sql, params)

    def drop_triggers(self, name: str, fire_keys: Sequence[str]) -> None:
        """See :meth:`~rselection.abc.TaskStore.drop_triggers`."""
        query = sql.SQL("DELETE FROM {} WHERE name = %s AND fire_key = ANY(%s::text[])").format(
            self._triggers
        )
        self._write(f"drop triggers of {name!r}", query, (name, list(fire_keys)))

    # -- an operator's -------------------------------------------------------------------

    def read_tasks(self, name: str, *, last_run: bool = True) -> list[TaskInfo]:
        """See :meth:`~rselection.abc.TaskStore.read_tasks`."""
        query = self._tasks_sql if last_run else self._kinds_sql
        rows = self._read(f"read the tasks of {name!r}", query, (name,))
        found = [
            TaskInfo(
                lease=name,
                task=row[0],
                kind=row[1],
                schedule=row[2],
                next_fire=_utc(row[3]),
                paused=row[4] is not None,
                paused_at=_utc(row[4]),
                last_run=None if row[10] is None else _run(name, row[0], row[7:]),
                node_id=row[5],
                term=None if row[6] is None else int(row[6]),
            )
            for row in rows
        ]
        return sorted(found, key=lambda info: info.task)

    def read_runs(self, name: str, task: str, limit: int) -> list[RunRecord]:
        """See :meth:`~rselection.abc.TaskStore.read_runs`."""
        rows = self._read(f"read the runs of {task!r}", self._runs_sql, (name, task, limit))
        return [_run(name, task, row) for row in rows]

    def _change_paused(self, name: str, task: str, paused: bool) -> bool:
        if paused:
            query = sql.SQL(
                "INSERT INTO {} AS t (name, task, paused_at) VALUES (%s, %s, clock_timestamp())"
                " ON CONFLICT (name, task) DO UPDATE SET paused_at = clock_timestamp()"
                " WHERE t.paused_at IS NULL RETURNING 1"
            ).format(self._tasks)
        else:
            query = sql.SQL(
                "UPDATE {} SET paused_at = NULL WHERE name = %s AND task = %s"
                " AND paused_at IS NOT NULL"
            ).format(self._tasks)
        what = f"{'pause' if paused else 'resume'} task {task!r}"
        result = self._change(what, name, query, (name, task))
        return result is not None if paused else bool(result)

    def _record_trigger(self, name: str, task: str, fire_key: str) -> datetime:
        # The time is read in a CTE, not RETURNING: an operator needs only INSERT here.
        query = sql.SQL(
            "WITH at AS (SELECT clock_timestamp() AS v), ins AS ("
            " INSERT INTO {} (name, fire_key, task, requested_at) SELECT %s, %s, %s, v FROM at"
            ") SELECT v FROM at"
        ).format(self._triggers)
        row = self._change(f"trigger task {task!r}", name, query, (name, fire_key, task))
        at: datetime = row[0].astimezone(UTC)
        return at
