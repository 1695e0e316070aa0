"""Task controls and run history on Redis: hashes and lists in the lease's hash slot.

The lease's ``:paused`` hash holds its paused tasks, ``:triggers`` the fires operators
asked for, ``:tasks`` the tasks its leader published and ``:next_fires`` their next
fires; ``:runs:<task>`` lists a task's newest runs as JSON, newest first (see
:func:`~rselection.redis.keys.task_keys`). A pause, a resume or a trigger is one script
that also publishes ``tasks:0`` on the lease's events channel: the leader reads the
controls again, whoever sent it. A batch of runs is one pipeline (``LPUSH`` and
``LTRIM`` per task, ``HSET`` of next fires). Times are the server's (``TIME``) for
controls, the node's for runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import redis

from ..abc import NextFires, TaskStoreBase
from ..task_runs import RunRecord, TaskControls, TaskEntry, TaskInfo, Trigger
from ._conn import describe, unavailable
from .keys import lease_keys, task_keys, task_runs_key

__all__ = ["RedisTaskStore"]

#: Pause (ARGV[2] "1") or resume task ARGV[1] in the paused hash (KEYS[1]); publish
#: ``tasks:0`` on the lease's channel (ARGV[3]), also when nothing changed (a leader
#: that missed the first message reads the controls again). Returns 1 when changed.
_PAUSE = """
local changed
if ARGV[2] == '1' then
  local t = redis.call('TIME')
  changed = redis.call('HSETNX', KEYS[1], ARGV[1], tostring(t[1] * 1000 + math.floor(t[2] / 1000)))
else
  changed = redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', ARGV[3], 'tasks:0')
return changed
"""

#: Record trigger ARGV[1] (a fire key) of task ARGV[2] in the triggers hash (KEYS[1])
#: with the server's time, and publish ``tasks:0`` on the lease's channel (ARGV[3]).
#: Returns the time (seconds, microseconds).
# Publish a term's list of tasks (KEYS: tasks, next fires; ARGV: term, the list, the next
# fires, as JSON objects), unless a newer term published one: a leader that lost its
# term late never overwrites its successor's list.
_PUBLISH = """
local term = tonumber(ARGV[1])
for _, raw in ipairs(redis.call('HVALS', KEYS[1])) do
  local ok, item = pcall(cjson.decode, raw)
  if ok and type(item) == 'table' and tonumber(item['term']) ~= nil
      and tonumber(item['term']) > term then
    return 0
  end
end
redis.call('DEL', KEYS[1])
for task, value in pairs(cjson.decode(ARGV[2])) do
  redis.call('HSET', KEYS[1], task, value)
end
for task, at in pairs(cjson.decode(ARGV[3])) do
  redis.call('HSET', KEYS[2], task, at)
end
return 1
"""

_TRIGGER = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode({task = ARGV[2], s = t[1], us = t[2]}))
redis.call('PUBLISH', ARGV[3], 'tasks:0')
return t
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: A lease's task controls (KEYS: its paused hash, its triggers hash) and the server's
#: time: ``{HGETALL paused, HGETALL triggers, TIME}``.
_READ_CONTROLS = """
return {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]), redis.call('TIME')}
"""


def _pairs(flat: Any) -> list[tuple[Any, Any]]:
    """A script's ``HGETALL`` reply (field, value, field, value, ...) as pairs."""
    items = list(flat)
    return list(zip(items[0::2], items[1::2], strict=True))


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat()


def _time(value: Any) -> datetime | None:
    return None if not isinstance(value, str) else datetime.fromisoformat(value)


def _ms(value: Any) -> datetime:
    return datetime.fromtimestamp(int(_text(value)) / 1000, UTC)


def _encode(run: RunRecord) -> str:
    return json.dumps(
        {
            "scheduled_at": _iso(run.scheduled_at),
            "started_at": _iso(run.started_at),
            "ended_at": _iso(run.ended_at),
            "outcome": run.outcome,
            "reason": run.reason,
            "node_id": run.node_id,
            "term": run.term,
            "error": run.error,
            "by": run.by,
        },
        separators=(",", ":"),
    )


def _decode(name: str, task: str, raw: Any) -> RunRecord | None:
    """The run record ``raw`` holds, or ``None`` when it does not parse."""
    try:
        item = json.loads(_text(raw))
        return RunRecord(
            lease=name,
            task=task,
            scheduled_at=_time(item.get("scheduled_at")),
            started_at=_time(item.get("started_at")),
            ended_at=_time(item.get("ended_at")),
            outcome=str(item["outcome"]),
            reason=item.get("reason"),
            node_id=str(item["node_id"]),
            term=int(item["term"]),
            error=item.get("error"),
            by=item.get("by"),
        )
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None


class RedisTaskStore(TaskStoreBase):
    """The :class:`~rselection.abc.TaskStore` of the leases of one key prefix.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster`` (a lease's keys share a slot).
        key_prefix: the leaders' key prefix.
    """

    def __init__(self, client: Any, *, key_prefix: str) -> None:
        self.client = client
        self.key_prefix = key_prefix

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key_prefix={self.key_prefix!r}, {describe(self.client)})"

    def _failed(self, what: str, exc: redis.RedisError) -> Exception:
        return unavailable(what, describe(self.client), exc)

    # -- a leader's ----------------------------------------------------------------------

    def read_controls(self, name: str) -> TaskControls:
        """See :meth:`~rselection.abc.TaskStore.read_controls`."""
        _, paused_key, triggers_key, _ = task_keys(name, self.key_prefix)
        try:
            # One script, with the server's clock that stamps the triggers: a cluster
            # client runs no TIME in a pipeline, and a script runs on the keys' node.
            paused_raw, triggers_raw, now = self.client.eval(
                _READ_CONTROLS, 2, paused_key, triggers_key
            )
        except redis.RedisError as exc:
            raise self._failed(f"read the task controls of {name!r}", exc) from exc
        paused = {_text(task): _ms(at) for task, at in _pairs(paused_raw)}
        triggers = []
        for key, raw in _pairs(triggers_raw):
            try:
                item = json.loads(_text(raw))
                at = datetime.fromtimestamp(int(item["s"]) + int(item["us"]) / 1e6, UTC)
                triggers.append(Trigger(name, str(item["task"]), _text(key), at))
            except (ValueError, KeyError, TypeError):
                continue  # not one of ours: never run
        triggers.sort(key=lambda trigger: trigger.requested_at)
        read_at = datetime.fromtimestamp(int(now[0]) + int(now[1]) / 1e6, UTC)
        return TaskControls(paused, tuple(triggers), read_at)

    def publish_tasks(self, name: str, node_id: str, term: int, tasks: Sequence[TaskEntry]) -> None:
        """See :meth:`~rselection.abc.TaskStore.publish_tasks`."""
        tasks_key, _, _, next_key = task_keys(name, self.key_prefix)
        listed = {
            entry.task: json.dumps(
                {"kind": entry.kind, "schedule": entry.schedule, "node_id": node_id, "term": term}
            )
            for entry in tasks
        }
        fires = {
            entry.task: round(entry.next_fire.timestamp() * 1000)
            for entry in tasks
            if entry.next_fire is not None
        }
        try:
            self.client.eval(
                _PUBLISH,
                2,
                tasks_key,
                next_key,
                term,
                json.dumps(listed),
                json.dumps({task: str(at) for task, at in fires.items()}),
            )
        except redis.RedisError as exc:
            raise self._failed(f"publish the tasks of {name!r}", exc) from exc

    def write_runs(self, runs: Sequence[RunRecord], *, next_fires: NextFires, limit: int) -> None:
        """See :meth:`~rselection.abc.TaskStore.write_runs`: one pipeline."""
        by_task: dict[tuple[str, str], list[str]] = {}
        for run in runs:
            by_task.setdefault((run.lease, run.task), []).append(_encode(run))
        try:
            pipe = self.client.pipeline(transaction=False)
            for (name, task), encoded in sorted(by_task.items()):
                key = task_runs_key(name, task, self.key_prefix)
                pipe.lpush(key, *encoded[-limit:])  # oldest first: the newest ends at the head
                pipe.ltrim(key, 0, limit - 1)
            for (name, task), at in next_fires.items():
                next_key = task_keys(name, self.key_prefix)[3]
                if at is None:
                    pipe.hdel(next_key, task)
                else:
                    pipe.hset(next_key, task, round(at.timestamp() * 1000))
            pipe.execute()
        except redis.RedisError as exc:
            raise self._failed(f"write {len(runs)} task runs", exc) from exc

    def drop_triggers(self, name: str, fire_keys: Sequence[str]) -> None:
        """See :meth:`~rselection.abc.TaskStore.drop_triggers`."""
        if not fire_keys:
            return
        try:
            self.client.hdel(task_keys(name, self.key_prefix)[2], *fire_keys)
        except redis.RedisError as exc:
            raise self._failed(f"drop triggers of {name!r}", exc) from exc

    # -- an operator's -------------------------------------------------------------------

    def read_tasks(self, name: str, *, last_run: bool = True) -> list[TaskInfo]:
        """See :meth:`~rselection.abc.TaskStore.read_tasks` (two round trips)."""
        tasks_key, paused_key, _, next_key = task_keys(name, self.key_prefix)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(tasks_key)
            pipe.hgetall(paused_key)
            pipe.hgetall(next_key)
            listed_raw, paused_raw, next_raw = pipe.execute()
            listed = {_text(task): raw for task, raw in listed_raw.items()}
            order = sorted(listed)
            pipe = self.client.pipeline(transaction=False)
            for task in order:
                pipe.lindex(task_runs_key(name, task, self.key_prefix), 0)
            newest = pipe.execute() if order else []
        except redis.RedisError as exc:
            raise self._failed(f"read the tasks of {name!r}", exc) from exc
        paused = {_text(task): _ms(at) for task, at in paused_raw.items()}
        fires = {_text(task): _ms(at) for task, at in next_raw.items()}
        found = []
        for task, last in zip(order, newest, strict=True):
            try:
                item = json.loads(_text(listed[task]))
                kind, schedule = str(item["kind"]), item.get("schedule")
                node_id, term = item.get("node_id"), item.get("term")
            except (ValueError, KeyError, TypeError):
                continue
            found.append(
                TaskInfo(
                    lease=name,
                    task=task,
                    kind=kind,
                    schedule=schedule,
                    next_fire=fires.get(task) if kind != "persistent" else None,
                    paused=task in paused,
                    paused_at=paused.get(task),
                    last_run=None if last is None else _decode(name, task, last),
                    node_id=node_id,
                    term=None if term is None else int(term),
                )
            )
        return found

    def read_runs(self, name: str, task: str, limit: int) -> list[RunRecord]:
        """See :meth:`~rselection.abc.TaskStore.read_runs`."""
        try:
            raw = self.client.lrange(task_runs_key(name, task, self.key_prefix), 0, limit - 1)
        except redis.RedisError as exc:
            raise self._failed(f"read the runs of {task!r}", exc) from exc
        return [run for run in (_decode(name, task, item) for item in raw) if run is not None]

    def _change_paused(self, name: str, task: str, paused: bool) -> bool:
        """One script."""
        paused_key = task_keys(name, self.key_prefix)[1]
        channel = lease_keys(name, self.key_prefix)[2]
        try:
            reply = self.client.eval(_PAUSE, 1, paused_key, task, "1" if paused else "0", channel)
        except redis.RedisError as exc:
            what = f"{'pause' if paused else 'resume'} task {task!r}"
            raise self._failed(what, exc) from exc
        return int(reply) == 1

    def _record_trigger(self, name: str, task: str, fire_key: str) -> datetime:
        """One script."""
        triggers_key = task_keys(name, self.key_prefix)[2]
        channel = lease_keys(name, self.key_prefix)[2]
        try:
            reply = self.client.eval(_TRIGGER, 1, triggers_key, fire_key, task, channel)
        except redis.RedisError as exc:
            raise self._failed(f"trigger task {task!r}", exc) from exc
        return datetime.fromtimestamp(int(_text(reply[0])) + int(_text(reply[1])) / 1e6, UTC)
