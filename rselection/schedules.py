"""When scheduled tasks fire: fixed intervals aligned to the epoch, and cron expressions.

A schedule is a pure function of aware datetimes: :meth:`Schedule.next_fire` never
reads the clock, so every node of a fleet computes the same fire instants and tests
can pin them down exactly. Each fire is named by :func:`format_fire_key`, which is
what claims and checkpoints key on.
"""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Protocol, runtime_checkable
from zoneinfo import ZoneInfo

from croniter import CroniterBadDateError, CroniterError, croniter

from rselection.errors import ConfigError

__all__ = [
    "CronSchedule",
    "IntervalSchedule",
    "Schedule",
    "as_timedelta",
    "fire_series",
    "format_fire_key",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NS_PER_US = 1_000
_NS_PER_S = 1_000_000_000
_US_PER_DAY = 86_400_000_000
_MAX_TIMEDELTA_NS = (
    timedelta.max.days * 86_400 + timedelta.max.seconds
) * _NS_PER_S + timedelta.max.microseconds * _NS_PER_US
# croniter only searches this many years ahead for a match; its year field spans
# 1970-2099, so this covers every expression that can still match at all.
_CRON_MAX_YEARS = 150
# Candidates croniter may propose that do not exist as local times (DST gaps) are
# skipped; a handful per call is the most that can happen, this bound is a backstop.
_CRON_MAX_CANDIDATES = 1_000


@runtime_checkable
class Schedule(Protocol):
    """When a scheduled task fires: a pure function from an instant to the next fire.

    Implementations also carry ``aligned: bool``: true when every node computes the
    same instants whenever it was started (read it with ``getattr(s, "aligned",
    False)`` for schedules written elsewhere).
    """

    def next_fire(self, after: datetime) -> datetime | None:
        """The first fire instant strictly after ``after``, or ``None`` when no fire is left.

        ``after``: an aware datetime (naive ones raise
        :class:`~rselection.errors.ConfigError`). The result is an aware UTC datetime.
        The result never depends on the wall clock.
        """
        ...


def _describe(value: object) -> str:
    """``repr`` of a bad value with its type, for error messages."""
    return f"{value!r} ({type(value).__name__})"


def _to_nanos(value: object, what: str, *, allow_zero: bool) -> int:
    """Convert seconds (int/float) or a timedelta into an exact number of nanoseconds."""
    kind = "a non-negative" if allow_zero else "a positive"
    expected = f"{what} must be {kind} number of seconds (int or float) or a timedelta"
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise ConfigError(f"{expected}, got {_describe(value)}")
    if isinstance(value, timedelta):
        nanos = (value.days * 86_400 + value.seconds) * _NS_PER_S + value.microseconds * _NS_PER_US
    elif isinstance(value, int):
        nanos = value * _NS_PER_S
    else:
        scaled = value * _NS_PER_S
        if not math.isfinite(scaled):
            raise ConfigError(f"{expected}, got {value!r}")
        nanos = round(scaled)
    if nanos < 0 or (nanos == 0 and not allow_zero):
        raise ConfigError(f"{expected}, got {value!r}")
    if nanos > _MAX_TIMEDELTA_NS:
        raise ConfigError(f"{expected} no larger than timedelta.max, got {value!r}")
    return nanos


def as_timedelta(value: object, what: str) -> timedelta:
    """Convert a positive duration given as seconds or a timedelta into a timedelta.

    ``value``: an ``int`` or ``float`` number of seconds, or a ``timedelta``; ``bool``,
    zero, negative, NaN and infinite values raise
    :class:`~rselection.errors.ConfigError`, as does a value that rounds to zero
    microseconds. ``what``: the setting's name, used in the error message (for
    example ``"ttl"``). Floats are rounded to the nearest microsecond.
    """
    nanos = _to_nanos(value, what, allow_zero=False)
    if isinstance(value, timedelta):
        return value
    # Floats round to the nearest microsecond, as timedelta(seconds=...) does.
    result = (
        timedelta(seconds=value)
        if isinstance(value, float)
        else timedelta(seconds=nanos // _NS_PER_S)
    )
    if result <= timedelta(0):
        raise ConfigError(f"{what} must be at least 1 microsecond, got {value!r}")
    return result


def aware_utc(value: object, what: str) -> datetime:
    """Check that ``value`` is an aware datetime and return it in UTC.

    Args:
        value: the datetime to check.
        what: names it in the :class:`~rselection.ConfigError` a bad one raises.
    """
    if not isinstance(value, datetime):
        raise ConfigError(f"{what} must be a timezone-aware datetime, got {_describe(value)}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ConfigError(
            f"{what} must be a timezone-aware datetime (for example "
            f"datetime.now(timezone.utc)), got naive {value.isoformat()}"
        )
    return value.astimezone(UTC)


def _epoch_micros(value: datetime) -> int:
    """Exact number of microseconds from the Unix epoch to an aware datetime."""
    delta = value - _EPOCH
    return delta.days * _US_PER_DAY + delta.seconds * 1_000_000 + delta.microseconds


def _from_epoch_micros(micros: int) -> datetime | None:
    """The aware UTC datetime ``micros`` after the epoch, or ``None`` out of range."""
    try:
        return _EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        return None


class IntervalSchedule:
    """Fire every ``every``: fire n is at exactly ``t0 + n * every`` (no drift).

    ``every``: seconds (``int`` or ``float``) or a ``timedelta``, at least 1
    microsecond. It is kept as an integer number of nanoseconds and every fire is
    computed by one multiplication from ``t0``, so rounding never accumulates; a fire
    instant that falls between microseconds is truncated to the microsecond.

    ``align``: when true (the default), ``t0`` is the Unix epoch
    (1970-01-01T00:00:00Z), so every node computes the same instants: ``every=30``
    fires at :00 and :30 of each minute. Any integer n counts, before the epoch too.

    ``start``: with ``align=False``, the aware datetime of fire 0; no fire comes
    before it. Nodes configured with the same ``start`` agree on every instant, so
    ``aligned`` stays true. Without ``start``, ``align=False`` uses the moment of
    construction, and ``aligned`` is false. Passing ``start`` with ``align=True`` is
    an error.

    ``jitter``: seconds or a ``timedelta``, ``0 <= jitter < every`` (default 0).
    Each fire is delayed by a pseudo-random offset in ``[0, jitter)`` (whole
    microseconds) taken from a hash of the undelayed fire instant and ``seed``, so
    every node computes the same delay and fires stay strictly increasing.

    ``seed``: mixed into the jitter hash; give schedules with the same ``every`` and
    ``jitter`` different seeds (such as the task name) to spread their fires apart.
    """

    def __init__(
        self,
        every: float | timedelta,
        *,
        align: bool = True,
        jitter: float | timedelta = 0,
        start: datetime | None = None,
        seed: str = "",
    ) -> None:
        self._every_ns = _to_nanos(every, "every", allow_zero=False)
        if self._every_ns < _NS_PER_US:
            raise ConfigError(f"every must be at least 1 microsecond, got {every!r}")
        self._jitter_ns = _to_nanos(jitter, "jitter", allow_zero=True)
        if self._jitter_ns >= self._every_ns:
            raise ConfigError(
                f"jitter must be smaller than every, got jitter={jitter!r} >= every={every!r}; "
                "lower the jitter or lengthen the interval"
            )
        if not isinstance(align, bool):
            raise ConfigError(f"align must be a bool, got {_describe(align)}")
        if not isinstance(seed, str):
            raise ConfigError(f"seed must be a str, got {_describe(seed)}")
        if align:
            if start is not None:
                raise ConfigError(
                    "start is only used with align=False; pass align=False to anchor "
                    f"the schedule at {start!r}, or drop start to align to the Unix epoch"
                )
            t0 = _EPOCH
            self._aligned = True
            self._bounded = False
        elif start is not None:
            t0 = aware_utc(start, "start")
            self._aligned = True
            self._bounded = True
        else:
            t0 = datetime.now(UTC)
            self._aligned = False
            self._bounded = True
        self._start = t0
        self._t0_ns = _epoch_micros(t0) * _NS_PER_US
        self._jitter_us = self._jitter_ns // _NS_PER_US
        seed_bytes = seed.encode()
        self._seed = seed
        self._hasher = hashlib.blake2b(digest_size=8, person=b"rs-jitter")
        self._hasher.update(len(seed_bytes).to_bytes(8, "big") + seed_bytes)

    @property
    def every(self) -> timedelta:
        """The interval, as a timedelta (rounded down to the microsecond)."""
        return timedelta(microseconds=self._every_ns // _NS_PER_US)

    @property
    def every_ns(self) -> int:
        """The interval, in exact nanoseconds."""
        return self._every_ns

    @property
    def jitter(self) -> timedelta:
        """The upper bound (exclusive) of the per-fire delay; zero means no jitter."""
        return timedelta(microseconds=self._jitter_us)

    @property
    def start(self) -> datetime:
        """Fire 0 (``t0``): the Unix epoch when aligned to it, else the anchor (UTC)."""
        return self._start

    @property
    def aligned(self) -> bool:
        """True when every node computes the same instants, whenever it was started."""
        return self._aligned

    def _base_micros(self, n: int) -> int:
        """Fire ``n`` without jitter, in microseconds since the epoch (truncated)."""
        return (self._t0_ns + n * self._every_ns) // _NS_PER_US

    def _fire_micros(self, n: int) -> int:
        """Fire ``n`` with its jitter, in microseconds since the epoch."""
        base = self._base_micros(n)
        if self._jitter_us == 0:
            return base
        instant_ns = self._t0_ns + n * self._every_ns
        hasher = self._hasher.copy()
        hasher.update(str(instant_ns).encode())
        digest = hasher.digest()
        return base + int.from_bytes(digest, "big") % self._jitter_us

    def next_fire(self, after: datetime) -> datetime | None:
        """The first fire instant strictly after ``after``, as an aware UTC datetime.

        ``after``: an aware datetime; naive ones raise
        :class:`~rselection.errors.ConfigError`. Returns ``None`` only when the next
        fire is beyond ``datetime.max``.
        """
        after_us = _epoch_micros(aware_utc(after, "after"))
        # Smallest n whose truncated instant is > after_us, i.e. whose nanosecond
        # instant is >= (after_us + 1) microseconds.
        n = -((self._t0_ns - (after_us + 1) * _NS_PER_US) // self._every_ns)
        if self._bounded and n < 0:
            n = 0
        # With jitter, fire n - 1 may still land after `after`; fire n - 2 cannot,
        # because jitter < every keeps fire n - 2 below fire n - 1's base instant.
        if self._jitter_us and not (self._bounded and n == 0):
            earlier = self._fire_micros(n - 1)
            if earlier > after_us:
                return _from_epoch_micros(earlier)
        return _from_epoch_micros(self._fire_micros(n))

    def __repr__(self) -> str:
        """Constructor-like representation."""
        parts = [f"every={self.every!r}"]
        if self._jitter_us:
            parts.append(f"jitter={self.jitter!r}")
        if self._bounded:
            parts.append(f"align=False, start={self._start.isoformat()!r}")
        return f"IntervalSchedule({', '.join(parts)})"


class CronSchedule:
    """Fire whenever the local time in ``tz`` matches a cron expression.

    ``expr``: croniter syntax: five fields (minute hour day month weekday), an
    optional sixth for seconds and seventh for the year, or an alias such as
    ``@daily``. An invalid expression, or one that can never match (such as
    ``"0 0 30 2 *"``), raises :class:`~rselection.errors.ConfigError`.

    ``tz``: an IANA time zone name (default ``"UTC"``) or a
    :class:`zoneinfo.ZoneInfo`; an unknown zone raises ``ConfigError``.

    Daylight saving time: a fire is every instant whose local wall time in ``tz``
    matches the expression, so

    * a local time skipped by a spring-forward change does not exist and does not
      fire: ``"30 2 * * *"`` in Europe/Berlin does not run on the spring-forward day
      (croniter itself would fire at 03:00 local, which matches neither field; that
      instant is discarded);
    * a local time repeated by a fall-back change fires at both occurrences:
      ``"0 * * * *"`` keeps firing every real hour, and ``"30 2 * * *"`` in
      Europe/Berlin runs twice that night (02:30 CEST, then 02:30 CET).

    For a job that must run exactly once every day, pick a local time outside the
    change window (in most zones 02:00-03:00) or use ``tz="UTC"``.
    """

    def __init__(self, expr: str, tz: str | ZoneInfo = "UTC") -> None:
        if not isinstance(expr, str):
            raise ConfigError(f"cron expression must be a str, got {_describe(expr)}")
        self._tz = self._zone(tz)
        try:
            # A naive reference keeps validation independent of DST; the year field
            # starts in 1970, so searching from just before it finds any match.
            probe = croniter(
                expr, datetime(1969, 12, 31, 23, 59), max_years_between_matches=_CRON_MAX_YEARS
            )
            probe.get_next(datetime)
        except CroniterBadDateError as exc:
            raise ConfigError(
                f"cron expression {expr!r} never matches any date ({exc}); "
                "check the day-of-month and month fields"
            ) from exc
        except (CroniterError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"invalid cron expression {expr!r}: {exc}") from exc
        self._expr = expr

    @staticmethod
    def _zone(tz: object) -> ZoneInfo:
        """Resolve ``tz`` to a ZoneInfo or raise ConfigError."""
        if isinstance(tz, ZoneInfo):
            return tz
        if not isinstance(tz, str):
            raise ConfigError(
                f"tz must be an IANA time zone name or a ZoneInfo, got {_describe(tz)}"
            )
        try:
            return ZoneInfo(tz)
        except (KeyError, ValueError, OSError) as exc:
            raise ConfigError(
                f"unknown time zone {tz!r}: use an IANA name such as 'UTC' or "
                "'Europe/Berlin' (install the tzdata package if the system has no zone "
                "database)"
            ) from exc

    @property
    def expr(self) -> str:
        """The cron expression, as given."""
        return self._expr

    @property
    def tz(self) -> ZoneInfo:
        """The time zone whose local time the expression is matched against."""
        return self._tz

    @property
    def aligned(self) -> bool:
        """Always true: cron instants do not depend on when a node started."""
        return True

    def _matches_local(self, instant: datetime) -> bool:
        """True when ``instant``'s local wall time in ``tz`` matches every field."""
        wall = instant.astimezone(self._tz).replace(tzinfo=None, fold=0)
        probe = croniter(self._expr, wall - timedelta(seconds=1))
        return probe.get_next(datetime) == wall

    def next_fire(self, after: datetime) -> datetime | None:
        """The first instant strictly after ``after`` whose local time matches, in UTC.

        ``after``: an aware datetime; naive ones raise
        :class:`~rselection.errors.ConfigError`. Returns ``None`` when the expression
        has no match left (a year field in the past, or beyond ``datetime.max``).
        """
        after_utc = aware_utc(after, "after")
        cursor = after_utc
        tz: tzinfo = self._tz
        for _ in range(_CRON_MAX_CANDIDATES):
            try:
                it = croniter(
                    self._expr, cursor.astimezone(tz), max_years_between_matches=_CRON_MAX_YEARS
                )
                candidate = it.get_next(datetime).astimezone(UTC)
            except (CroniterBadDateError, OverflowError):
                return None
            if candidate > after_utc and self._matches_local(candidate):
                return candidate
            # Not a real match (croniter moved a skipped local time past the gap):
            # search on from there, always forward.
            cursor = max(candidate, cursor + timedelta(microseconds=1))
        raise RuntimeError(  # pragma: no cover - croniter would have to loop forever
            f"no valid fire found for cron expression {self._expr!r} in {self._tz.key} "
            f"after {after_utc.isoformat()}"
        )

    def __repr__(self) -> str:
        """Constructor-like representation."""
        return f"CronSchedule({self._expr!r}, tz={self._tz.key!r})"


def fire_series(task_name: str) -> str:
    """What every fire key of a task starts with: ``"<task>@"`` (see
    :func:`format_fire_key`; :func:`rselection.claiming.series_of` goes back)."""
    if not isinstance(task_name, str) or not task_name:
        raise ConfigError(f"task_name must be a non-empty str, got {_describe(task_name)}")
    return f"{task_name}@"


def format_fire_key(task_name: str, scheduled_at: datetime) -> str:
    """The key that names one fire of a task: ``"<task>@<UTC RFC 3339, 9 digits>Z"``.

    ``task_name``: the task's name (non-empty). ``scheduled_at``: the fire's
    scheduled instant, an aware datetime (naive ones raise
    :class:`~rselection.errors.ConfigError`); it is converted to UTC and its
    microseconds are padded to nanoseconds, for example
    ``"purge@2026-11-30T02:40:00.000000000Z"``.
    """
    if not isinstance(task_name, str) or not task_name:
        raise ConfigError(f"task_name must be a non-empty str, got {_describe(task_name)}")
    at = aware_utc(scheduled_at, "scheduled_at")
    return (
        f"{task_name}@{at.year:04d}-{at.month:02d}-{at.day:02d}"
        f"T{at.hour:02d}:{at.minute:02d}:{at.second:02d}.{at.microsecond:06d}000Z"
    )
