"""Tests for schedules: epoch-aligned intervals without drift, cron with DST, fire keys."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from freezegun import freeze_time
from hypothesis import given, settings
from hypothesis import strategies as st

from rselection.errors import ConfigError
from rselection.schedules import (
    CronSchedule,
    IntervalSchedule,
    Schedule,
    as_timedelta,
    format_fire_key,
)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    """An aware UTC datetime."""
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


def fires(schedule: Schedule, after: datetime, count: int) -> list[datetime]:
    """The next ``count`` fires after ``after``, each computed from the previous one."""
    out: list[datetime] = []
    for _ in range(count):
        nxt = schedule.next_fire(after)
        assert nxt is not None
        out.append(nxt)
        after = nxt
    return out


def local_matches(expr: str, instant: datetime, tz: ZoneInfo) -> bool:
    """True when the local wall time of ``instant`` in ``tz`` matches ``expr``."""
    wall = instant.astimezone(tz).replace(tzinfo=None)
    return bool(croniter.match(expr, wall))


# --------------------------------------------------------------------------- protocol


def test_implementations_satisfy_the_protocol() -> None:
    assert isinstance(IntervalSchedule(1), Schedule)
    assert isinstance(CronSchedule("* * * * *"), Schedule)
    assert not isinstance(object(), Schedule)


# --------------------------------------------------------------------------- wall clock


def sample_results() -> list[datetime | None]:
    """Fires of a few schedules for fixed inputs; must not depend on the wall clock."""
    afters = [utc(2026, 3, 29, 0, 59, 59), utc(2026, 10, 25, 0, 30), utc(1999, 12, 31, 23, 59)]
    schedules: list[Schedule] = [
        IntervalSchedule(30),
        IntervalSchedule(timedelta(minutes=7), jitter=90),
        IntervalSchedule(5, align=False, start=utc(2020, 1, 1, 0, 0, 1)),
        CronSchedule("*/15 * * * *"),
        CronSchedule("30 2 * * *", tz="Europe/Berlin"),
        CronSchedule("0 * * * *", tz="America/New_York"),
    ]
    return [s.next_fire(a) for s in schedules for a in afters]


def test_next_fire_does_not_depend_on_the_wall_clock() -> None:
    baseline = sample_results()
    for frozen in ["2001-02-03 04:05:06", "2026-10-25 01:30:00", "2040-07-01 12:00:00"]:
        with freeze_time(frozen):
            assert datetime.now(UTC).year in (2001, 2026, 2040)
            assert sample_results() == baseline


def test_aligned_intervals_built_at_different_times_agree() -> None:
    with freeze_time("2026-01-01 00:00:07.123"):
        first = IntervalSchedule(0.05, jitter=0.01)
    with freeze_time("2031-06-15 13:14:15.987"):
        second = IntervalSchedule(0.05, jitter=0.01)
    assert first.aligned and second.aligned
    after = utc(2026, 5, 17, 13, 7, 42, 123456)
    assert fires(first, after, 500) == fires(second, after, 500)


def test_unaligned_interval_starts_at_construction() -> None:
    with freeze_time("2026-01-01 00:00:07.250"):
        schedule = IntervalSchedule(10, align=False)
    assert not schedule.aligned
    assert schedule.start == utc(2026, 1, 1, 0, 0, 7, 250000)
    assert schedule.next_fire(utc(2000, 1, 1)) == utc(2026, 1, 1, 0, 0, 7, 250000)
    assert schedule.next_fire(utc(2026, 1, 1, 0, 0, 7, 250000)) == utc(2026, 1, 1, 0, 0, 17, 250000)
    with freeze_time("2026-01-01 00:00:09"):
        later = IntervalSchedule(10, align=False)
    assert later.next_fire(utc(2026, 1, 1, 0, 0, 10)) == utc(2026, 1, 1, 0, 0, 19)


# --------------------------------------------------------------------------- intervals


def test_interval_is_aligned_to_the_epoch() -> None:
    schedule = IntervalSchedule(30)
    assert schedule.aligned
    assert schedule.start == EPOCH
    assert schedule.every == timedelta(seconds=30)
    assert schedule.every_ns == 30_000_000_000
    assert schedule.jitter == timedelta(0)
    assert schedule.next_fire(utc(2026, 1, 1, 0, 0, 10)) == utc(2026, 1, 1, 0, 0, 30)
    assert schedule.next_fire(utc(2026, 1, 1, 0, 0, 29, 999999)) == utc(2026, 1, 1, 0, 0, 30)
    # Strictly after: a fire instant itself is not returned.
    assert schedule.next_fire(utc(2026, 1, 1, 0, 0, 30)) == utc(2026, 1, 1, 0, 1)
    assert IntervalSchedule(timedelta(hours=1)).next_fire(utc(2026, 1, 1, 5, 59)) == utc(
        2026, 1, 1, 6
    )


def test_interval_accepts_any_aware_timezone() -> None:
    schedule = IntervalSchedule(3600)
    berlin = datetime(2026, 7, 1, 12, 30, tzinfo=BERLIN)  # 10:30 UTC
    result = schedule.next_fire(berlin)
    assert result == utc(2026, 7, 1, 11)
    assert result is not None and result.tzinfo is UTC


@pytest.mark.parametrize(
    "every",
    [0.05, timedelta(seconds=1) / 3, 1, timedelta(milliseconds=7)],
    ids=["0.05s", "third-timedelta", "1s", "7ms"],
)
def test_ten_thousand_fires_do_not_drift(every: float | timedelta) -> None:
    step = every if isinstance(every, timedelta) else timedelta(seconds=every)
    schedule = IntervalSchedule(every)
    after = utc(2026, 5, 17, 13, 7, 42, 123457)
    got = fires(schedule, after, 10_000)
    n0 = (after - EPOCH) // step + 1
    assert got == [EPOCH + (n0 + i) * step for i in range(10_000)]


def test_float_third_of_a_second_is_exact_in_nanoseconds() -> None:
    # 1/3 s as a float is 333_333_333 ns; instants are truncated to microseconds
    # but computed from the epoch by one multiplication each, so nothing accumulates.
    schedule = IntervalSchedule(1 / 3)
    assert schedule.every_ns == 333_333_333
    after = utc(2026, 5, 17, 13, 7, 42, 123457)
    got = fires(schedule, after, 10_000)
    after_ns = ((after - EPOCH) // timedelta(microseconds=1)) * 1000
    n0 = after_ns // 333_333_333 + 1
    expected = [
        EPOCH + timedelta(microseconds=((n0 + i) * 333_333_333) // 1000) for i in range(10_000)
    ]
    assert got == expected


def test_interval_with_start_counts_from_start() -> None:
    start = utc(2026, 2, 3, 4, 5, 6, 789000)
    schedule = IntervalSchedule(timedelta(seconds=1) / 3, align=False, start=start)
    assert schedule.aligned  # every node given this start agrees
    assert schedule.next_fire(utc(2020, 1, 1)) == start
    got = fires(schedule, start, 10_000)
    assert got == [start + n * (timedelta(seconds=1) / 3) for n in range(1, 10_001)]
    berlin_start = start.astimezone(BERLIN)
    same = IntervalSchedule(timedelta(seconds=1) / 3, align=False, start=berlin_start)
    assert same.start == start
    assert fires(same, start, 100) == got[:100]


def test_interval_beyond_datetime_max_has_no_fire() -> None:
    late = datetime.max.replace(tzinfo=UTC) - timedelta(seconds=1)
    assert IntervalSchedule(3600).next_fire(late) is None


def test_jitter_stays_in_range_and_agrees_across_instances() -> None:
    every, jitter = timedelta(seconds=10), timedelta(seconds=4)
    first = IntervalSchedule(every, jitter=jitter)
    second = IntervalSchedule(10, jitter=4.0)
    assert first.jitter == jitter
    after = utc(2026, 5, 17, 13, 7, 42, 123456)
    got = fires(first, after, 2_000)
    assert got == fires(second, after, 2_000)
    offsets = [(t - EPOCH) % every for t in got]
    assert all(timedelta(0) <= off < jitter for off in offsets)
    # Offsets actually vary, and every 10 s slot fires exactly once.
    assert len(set(offsets)) > 1000
    slots = [(t - EPOCH) // every for t in got]
    assert slots == list(range(slots[0], slots[0] + 2_000))


def test_jitter_is_strictly_after_and_monotone_at_boundaries() -> None:
    schedule = IntervalSchedule(1, jitter=0.999999)
    after = utc(2026, 1, 1)
    for fire in fires(schedule, after, 200):
        before = fire - timedelta(microseconds=1)
        assert schedule.next_fire(before) == fire
        nxt = schedule.next_fire(fire)
        assert nxt is not None and nxt > fire


def test_jitter_seed_spreads_schedules_apart() -> None:
    after = utc(2026, 1, 1)
    plain = fires(IntervalSchedule(60, jitter=30), after, 50)
    seeded = fires(IntervalSchedule(60, jitter=30, seed="purge"), after, 50)
    again = fires(IntervalSchedule(60, jitter=30, seed="purge"), after, 50)
    assert seeded == again
    assert seeded != plain


def test_interval_repr() -> None:
    assert repr(IntervalSchedule(30)) == "IntervalSchedule(every=datetime.timedelta(seconds=30))"
    assert "jitter=" in repr(IntervalSchedule(30, jitter=1))
    assert "align=False" in repr(IntervalSchedule(30, align=False, start=utc(2026, 1, 1)))


# --------------------------------------------------------------------------- cron


def test_cron_basic_expressions() -> None:
    every5 = CronSchedule("*/5 * * * *")
    assert every5.expr == "*/5 * * * *"
    assert every5.tz == ZoneInfo("UTC")
    assert every5.aligned
    assert fires(every5, utc(2026, 1, 1, 12, 3, 10), 3) == [
        utc(2026, 1, 1, 12, 5),
        utc(2026, 1, 1, 12, 10),
        utc(2026, 1, 1, 12, 15),
    ]
    # Strictly after: a matching instant is not returned again.
    assert every5.next_fire(utc(2026, 1, 1, 12, 5)) == utc(2026, 1, 1, 12, 10)
    assert every5.next_fire(utc(2026, 1, 1, 12, 4, 59, 999999)) == utc(2026, 1, 1, 12, 5)
    daily = CronSchedule("@daily")
    assert daily.next_fire(utc(2026, 2, 28, 0, 0, 1)) == utc(2026, 3, 1)
    weekdays = CronSchedule("0 9 * * 1-5")
    # 2026-01-02 is a Friday; the next weekday 09:00 is Monday the 5th.
    assert weekdays.next_fire(utc(2026, 1, 2, 9)) == utc(2026, 1, 5, 9)
    seconds = CronSchedule("* * * * * */20")  # croniter's sixth field is seconds
    assert fires(seconds, utc(2026, 1, 1, 0, 0, 5), 3) == [
        utc(2026, 1, 1, 0, 0, 20),
        utc(2026, 1, 1, 0, 0, 40),
        utc(2026, 1, 1, 0, 1, 0),
    ]


def test_cron_results_are_aware_utc() -> None:
    result = CronSchedule("0 9 * * *", tz="Asia/Tokyo").next_fire(utc(2025, 12, 31, 12))
    assert result == utc(2026, 1, 1, 0)  # 09:00 JST
    assert result is not None and result.tzinfo is UTC


def test_cron_converts_time_zones() -> None:
    schedule = CronSchedule("0 9 * * *", tz=NEW_YORK)
    assert schedule.tz is NEW_YORK
    assert schedule.next_fire(utc(2026, 1, 15)) == utc(2026, 1, 15, 14)  # EST, -5
    assert schedule.next_fire(utc(2026, 7, 15)) == utc(2026, 7, 15, 13)  # EDT, -4
    # `after` in any aware zone means the same instant.
    tokyo_after = datetime(2026, 1, 15, 9, tzinfo=ZoneInfo("Asia/Tokyo"))  # 00:00 UTC
    assert schedule.next_fire(tokyo_after) == utc(2026, 1, 15, 14)
    assert repr(schedule) == "CronSchedule('0 9 * * *', tz='America/New_York')"


def test_cron_with_year_field_runs_out() -> None:
    schedule = CronSchedule("0 0 1 1 * 0 2090")
    assert schedule.next_fire(utc(2026, 6, 1)) == utc(2090, 1, 1)
    assert schedule.next_fire(utc(2090, 1, 1)) is None


def test_berlin_spring_forward_skips_the_missing_time() -> None:
    # 2026-03-29: 02:00 CET jumps to 03:00 CEST (01:00 UTC); 02:30 does not exist.
    schedule = CronSchedule("30 2 * * *", tz="Europe/Berlin")
    assert fires(schedule, utc(2026, 3, 27, 12), 3) == [
        utc(2026, 3, 28, 1, 30),  # 02:30 CET
        utc(2026, 3, 30, 0, 30),  # 02:30 CEST; nothing on the 29th
        utc(2026, 3, 31, 0, 30),
    ]


def test_berlin_spring_forward_hourly_stays_hourly() -> None:
    schedule = CronSchedule("0 * * * *", tz="Europe/Berlin")
    assert fires(schedule, utc(2026, 3, 28, 23), 4) == [
        utc(2026, 3, 29, 0),  # 01:00 CET
        utc(2026, 3, 29, 1),  # 03:00 CEST (02:00 never happened)
        utc(2026, 3, 29, 2),  # 04:00 CEST
        utc(2026, 3, 29, 3),
    ]


def test_berlin_fall_back_fires_in_both_repeated_hours() -> None:
    # 2026-10-25: 03:00 CEST falls back to 02:00 CET (01:00 UTC); 02:xx happens twice.
    hourly = CronSchedule("0 * * * *", tz="Europe/Berlin")
    got = fires(hourly, utc(2026, 10, 24, 22), 5)
    assert got == [
        utc(2026, 10, 24, 23),  # 01:00 CEST
        utc(2026, 10, 25, 0),  # 02:00 CEST
        utc(2026, 10, 25, 1),  # 02:00 CET
        utc(2026, 10, 25, 2),  # 03:00 CET
        utc(2026, 10, 25, 3),
    ]
    assert [t.astimezone(BERLIN).hour for t in got] == [1, 2, 2, 3, 4]
    daily = CronSchedule("30 2 * * *", tz="Europe/Berlin")
    assert fires(daily, utc(2026, 10, 24, 12), 3) == [
        utc(2026, 10, 25, 0, 30),  # 02:30 CEST
        utc(2026, 10, 25, 1, 30),  # 02:30 CET
        utc(2026, 10, 26, 1, 30),
    ]
    # Starting inside the second pass of the repeated hour.
    quarter = CronSchedule("*/15 2 * * *", tz="Europe/Berlin")
    assert fires(quarter, utc(2026, 10, 25, 1, 20), 3) == [
        utc(2026, 10, 25, 1, 30),  # 02:30 CET
        utc(2026, 10, 25, 1, 45),  # 02:45 CET
        utc(2026, 10, 26, 1, 0),  # 02:00 CET next day
    ]


def test_new_york_spring_forward() -> None:
    # 2026-03-08: 02:00 EST jumps to 03:00 EDT (07:00 UTC).
    daily = CronSchedule("30 2 * * *", tz="America/New_York")
    assert fires(daily, utc(2026, 3, 7, 12), 2) == [
        utc(2026, 3, 9, 6, 30),  # 02:30 EDT; nothing on the 8th
        utc(2026, 3, 10, 6, 30),
    ]
    hourly = CronSchedule("0 * * * *", tz="America/New_York")
    assert fires(hourly, utc(2026, 3, 8, 5, 30), 3) == [
        utc(2026, 3, 8, 6),  # 01:00 EST
        utc(2026, 3, 8, 7),  # 03:00 EDT
        utc(2026, 3, 8, 8),  # 04:00 EDT
    ]


def test_new_york_fall_back() -> None:
    # 2026-11-01: 02:00 EDT falls back to 01:00 EST (06:00 UTC); 01:xx happens twice.
    hourly = CronSchedule("0 * * * *", tz="America/New_York")
    got = fires(hourly, utc(2026, 11, 1, 3, 30), 4)
    assert got == [
        utc(2026, 11, 1, 4),  # 00:00 EDT
        utc(2026, 11, 1, 5),  # 01:00 EDT
        utc(2026, 11, 1, 6),  # 01:00 EST
        utc(2026, 11, 1, 7),  # 02:00 EST
    ]
    assert [t.astimezone(NEW_YORK).hour for t in got] == [0, 1, 1, 2]
    daily = CronSchedule("30 1 * * *", tz="America/New_York")
    assert fires(daily, utc(2026, 10, 31, 12), 3) == [
        utc(2026, 11, 1, 5, 30),  # 01:30 EDT
        utc(2026, 11, 1, 6, 30),  # 01:30 EST
        utc(2026, 11, 2, 6, 30),
    ]


DST_WINDOWS = [
    ("Europe/Berlin", utc(2026, 3, 28, 20)),
    ("Europe/Berlin", utc(2026, 10, 24, 20)),
    ("America/New_York", utc(2026, 3, 8, 2)),
    ("America/New_York", utc(2026, 10, 31, 23)),
    ("Australia/Lord_Howe", utc(2026, 4, 4, 12)),  # 30-minute DST shift
    ("Australia/Lord_Howe", utc(2026, 10, 3, 12)),
]
DST_EXPRESSIONS = [
    "30 2 * * *",
    "0 2 * * *",
    "0 * * * *",
    "*/15 * * * *",
    "*/7 2 * * *",
    "15 1-3 * * *",
    "0 1,2,3 * * *",
    "59 * * * *",
]


@pytest.mark.parametrize(("zone", "start"), DST_WINDOWS)
def test_cron_matches_minute_by_minute_reference_across_dst(zone: str, start: datetime) -> None:
    tz = ZoneInfo(zone)
    end = start + timedelta(hours=12)
    for expr in DST_EXPRESSIONS:
        expected = []
        t = start + timedelta(minutes=1)
        while t < end:
            if local_matches(expr, t, tz):
                expected.append(t)
            t += timedelta(minutes=1)
        schedule = CronSchedule(expr, tz=tz)
        got = []
        t = start
        while (nxt := schedule.next_fire(t)) is not None and nxt < end:
            got.append(nxt)
            t = nxt
        assert got == expected, (zone, expr)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("every", "fragment"),
    [
        (0, "got 0"),
        (-1, "got -1"),
        (math.nan, "got nan"),
        (math.inf, "got inf"),
        ("5", "got '5' (str)"),
        (True, "got True (bool)"),
        (None, "got None"),
        (timedelta(0), "got datetime.timedelta(0)"),
        (timedelta(seconds=-5), "got datetime.timedelta(days=-1"),
        (1e-7, "at least 1 microsecond"),
    ],
)
def test_interval_rejects_bad_every(every: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match="every") as info:
        IntervalSchedule(every)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("jitter", "fragment"),
    [
        (10, "smaller than every"),
        (11.5, "smaller than every"),
        (timedelta(seconds=10), "smaller than every"),
        (-1, "non-negative"),
        (math.nan, "got nan"),
        ("1", "got '1' (str)"),
        (False, "got False (bool)"),
    ],
)
def test_interval_rejects_bad_jitter(jitter: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match="jitter") as info:
        IntervalSchedule(10, jitter=jitter)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_interval_rejects_bad_start_and_align() -> None:
    with pytest.raises(ConfigError, match="only used with align=False"):
        IntervalSchedule(10, start=utc(2026, 1, 1))
    with pytest.raises(ConfigError, match="start must be a timezone-aware datetime"):
        IntervalSchedule(10, align=False, start=datetime(2026, 1, 1))
    with pytest.raises(ConfigError, match="align must be a bool"):
        IntervalSchedule(10, align=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("* * *", "Exactly 5, 6 or 7 columns"),
        ("61 * * * *", "out of range"),
        ("", "invalid cron expression ''"),
        ("not a cron", "invalid cron expression 'not a cron'"),
        ("0 0 30 2 *", "never matches"),
    ],
)
def test_cron_rejects_bad_expressions(expr: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="cron expression") as info:
        CronSchedule(expr)
    assert fragment in str(info.value)
    assert repr(expr) in str(info.value)


def test_cron_rejects_bad_types_and_zones() -> None:
    with pytest.raises(ConfigError, match=r"must be a str, got 5 \(int\)"):
        CronSchedule(5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown time zone 'Mars/Olympus_Mons'"):
        CronSchedule("* * * * *", tz="Mars/Olympus_Mons")
    with pytest.raises(ConfigError, match="unknown time zone ''"):
        CronSchedule("* * * * *", tz="")
    with pytest.raises(ConfigError, match="IANA time zone name"):
        CronSchedule("* * * * *", tz=UTC)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "schedule",
    [IntervalSchedule(10), CronSchedule("* * * * *")],
    ids=["interval", "cron"],
)
def test_naive_after_is_rejected(schedule: Schedule) -> None:
    with pytest.raises(ConfigError, match="after must be a timezone-aware datetime") as info:
        schedule.next_fire(datetime(2026, 1, 1, 12))
    assert "2026-01-01T12:00:00" in str(info.value)
    with pytest.raises(ConfigError, match="after must be a timezone-aware datetime"):
        schedule.next_fire("2026-01-01T12:00:00Z")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- fire keys


def test_format_fire_key() -> None:
    assert format_fire_key("purge", utc(2026, 11, 30, 2, 40)) == (
        "purge@2026-11-30T02:40:00.000000000Z"
    )
    assert format_fire_key("report", utc(2026, 1, 2, 3, 4, 5, 678901)) == (
        "report@2026-01-02T03:04:05.678901000Z"
    )
    berlin = datetime(2026, 7, 1, 2, 0, tzinfo=BERLIN)  # CEST, 00:00 UTC
    assert format_fire_key("a@b", berlin) == "a@b@2026-07-01T00:00:00.000000000Z"
    assert format_fire_key("old", utc(1, 1, 1)) == "old@0001-01-01T00:00:00.000000000Z"


def test_format_fire_key_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="scheduled_at must be a timezone-aware datetime"):
        format_fire_key("purge", datetime(2026, 11, 30, 2, 40))
    with pytest.raises(ConfigError, match="task_name must be a non-empty str"):
        format_fire_key("", utc(2026, 1, 1))


# --------------------------------------------------------------------------- as_timedelta


def test_as_timedelta_converts() -> None:
    assert as_timedelta(2, "ttl") == timedelta(seconds=2)
    assert as_timedelta(0.25, "ttl") == timedelta(milliseconds=250)
    assert as_timedelta(timedelta(minutes=1), "ttl") == timedelta(minutes=1)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (True, "got True (bool)"),
        (0, "got 0"),
        (-1.5, "got -1.5"),
        (math.nan, "got nan"),
        (-math.inf, "got -inf"),
        ("5", "got '5' (str)"),
        (timedelta(0), "got datetime.timedelta(0)"),
        (1e-9, "got 1e-09"),
    ],
)
def test_as_timedelta_rejects(value: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match="renew_interval") as info:
        as_timedelta(value, "renew_interval")
    assert fragment in str(info.value)


# --------------------------------------------------------------------------- properties

aware_instants = st.datetimes(
    min_value=datetime(1960, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)


@settings(max_examples=300, deadline=None)
@given(
    every_us=st.integers(min_value=1, max_value=10**11),
    extra_ns=st.integers(min_value=0, max_value=999),
    jitter_fraction=st.sampled_from([0.0, 0.0, 0.3, 0.999]),
    after=aware_instants,
    step=st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=3)),
    between=st.floats(min_value=0.0, max_value=1.0),
)
def test_interval_property_strictly_after_and_monotone(
    every_us: int,
    extra_ns: int,
    jitter_fraction: float,
    after: datetime,
    step: timedelta,
    between: float,
) -> None:
    every = every_us / 1e6 + extra_ns / 1e9 if extra_ns else timedelta(microseconds=every_us)
    jitter = timedelta(microseconds=int(every_us * jitter_fraction))
    schedule = IntervalSchedule(every, jitter=jitter)
    first = schedule.next_fire(after)
    assert first is not None and first > after and first.tzinfo is UTC
    # Monotone: a later `after` never yields an earlier fire.
    later = schedule.next_fire(after + step)
    assert later is not None and later >= first
    # No fire is skipped: every instant in [after, first) leads to `first`.
    middle = after + (first - after) * between
    if middle < first:
        assert schedule.next_fire(middle) == first
    assert schedule.next_fire(first - timedelta(microseconds=1)) == first
    second = schedule.next_fire(first)
    assert second is not None and second > first


@settings(max_examples=200, deadline=None)
@given(
    expr=st.sampled_from(
        ["*/5 * * * *", "30 2 * * *", "0 * * * *", "15 1-3 * * 0", "0 0 1 * *", "*/7 2 * * *"]
    ),
    zone=st.sampled_from(["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]),
    after=st.datetimes(
        min_value=datetime(2024, 1, 1), max_value=datetime(2028, 1, 1), timezones=st.just(UTC)
    ),
    step=st.timedeltas(min_value=timedelta(0), max_value=timedelta(hours=6)),
)
def test_cron_property_strictly_after_monotone_and_matching(
    expr: str, zone: str, after: datetime, step: timedelta
) -> None:
    schedule = CronSchedule(expr, tz=zone)
    first = schedule.next_fire(after)
    assert first is not None and first > after and first.tzinfo is UTC
    assert local_matches(expr, first, schedule.tz)
    later = schedule.next_fire(after + step)
    assert later is not None and later >= first
    if after + step < first:
        assert later == first
    second = schedule.next_fire(first)
    assert second is not None and second > first
    assert local_matches(expr, second, schedule.tz)
