"""The console's parts that need no server: its URLs, its credentials, its timeline's
layout and the ``rselection web`` command line's checks."""

from __future__ import annotations

import asyncio
import itertools
import threading
from datetime import UTC, datetime, timedelta
from urllib.parse import unquote

import pytest

pytest.importorskip("starlette")

from rselection.admin import Refused
from rselection.commands.output import UsageError
from rselection.commands.web import is_loopback, parse_bind, read_token
from rselection.errors import ConfigError
from rselection.history import TermRecord
from rselection.task_runs import RunRecord
from rselection.web import create_app
from rselection.web.auth import (
    FREE_FAILURES,
    IDLE_SECONDS,
    LONGEST_WAIT,
    MAX_SESSIONS,
    SAID_CHARS,
    SESSION_SECONDS,
    Guard,
    Throttle,
    Throttled,
    check_token,
    cookie_name,
    same_origin,
)
from rselection.web.calls import Calls, NotAnswering
from rselection.web.hosts import AllowedHosts, split_host
from rselection.web.paths import href, segments
from rselection.web.timeline import LABEL_WIDTH, PLOT_WIDTH, layout

NAMES = ["a/b", "with space", "<script>alert(1)</script>", "ünï/cödé ✓", "100%", "x?y#z", "a\\b"]


@pytest.mark.parametrize("name", NAMES)
def test_a_name_is_one_segment_of_a_url_and_comes_back_whole(name: str) -> None:
    url = href("", "leases", name, "tasks", name)
    raw = url.encode("ascii")  # the URL is ASCII: every other character is escaped
    decoded = "/leases/" + name + "/tasks/" + name
    scope = {"path": decoded, "raw_path": raw, "root_path": ""}
    assert segments(scope) == ["leases", name, "tasks", name]


@pytest.mark.parametrize("name", [".", "..", "!.", "!..", "...", "%2E", ".%2e"])
def test_a_name_of_dots_is_no_dot_segment_and_comes_back_whole(name: str) -> None:
    url = href("/ops", "leases", name, "tasks", name)
    # what a browser takes for "." or "..", and folds away (WHATWG URL standard)
    dots = {".", "..", "%2e", ".%2e", "%2e.", "%2e%2e"}
    assert not any(part.lower() in dots for part in url.split("/"))
    scope = {"path": unquote(url), "raw_path": url.encode("ascii"), "root_path": "/ops"}
    assert segments(scope) == ["leases", name, "tasks", name]


def test_segments_below_a_mount_point_leave_the_mount_point_out() -> None:
    url = href("/ops/rselection", "leases", "pollers/3")
    assert url == "/ops/rselection/leases/pollers%2F3"
    scope = {
        "path": "/ops/rselection/leases/pollers/3",
        "raw_path": url.encode(),
        "root_path": "/ops/rselection",
    }
    assert segments(scope) == ["leases", "pollers/3"]


def test_without_a_raw_path_the_decoded_path_is_split() -> None:
    assert segments({"path": "/leases/x", "root_path": ""}) == ["leases", "x"]


def test_the_token_is_stripped_and_a_blank_one_refused() -> None:
    assert check_token("  s3cret\n") == "s3cret"
    assert check_token("\ufeffs3cret\r\n") == "s3cret"  # a byte order mark is no token
    assert check_token(None) is None
    for bad in ("", "  \n", "\ufeff", 42):
        with pytest.raises(ConfigError):
            check_token(bad)


def test_a_token_that_is_not_printable_ascii_is_refused() -> None:
    for bad in ("tökén", "s3cret\x00", "a\tb", "\uff53\uff13cret"):
        with pytest.raises(ConfigError, match="printable ASCII"):
            check_token(bad)
    assert check_token("a b~!") == "a b~!"
    with pytest.raises(ConfigError, match="printable ASCII"):
        create_app(conninfo="postgresql://x", token="tökén")


def test_a_bearer_token_is_compared_whole() -> None:
    guard = Guard("s3cret")
    assert guard.bearer_ok("Bearer s3cret") and guard.bearer_ok("bearer  s3cret ")
    for wrong in (None, "", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret"):
        assert not guard.bearer_ok(wrong)
    assert not Guard(None).bearer_ok("Bearer anything")


def test_a_session_is_a_random_id_kept_by_the_console_until_it_ends() -> None:
    guard = Guard("s3cret")
    now = 1_000.0
    session = guard.new_session(now)
    assert "s3cret" not in session and len(session) >= 40
    assert guard.new_session(now) != session
    assert guard.session_ok(session, now + IDLE_SECONDS - 1)  # used: idle again from here
    assert guard.session_ok(session, now + 2 * IDLE_SECONDS - 2)
    assert not guard.session_ok(session, now + 3 * IDLE_SECONDS)  # an hour unused
    assert not Guard("s3cret").session_ok(guard.new_session(now), now)  # another process's
    assert not guard.session_ok("garbage", now) and not guard.session_ok(None, now)


def test_a_session_ends_at_log_out_and_after_its_lifetime_however_used() -> None:
    guard = Guard("s3cret")
    session = guard.new_session(0.0)
    used = 0.0
    while used + IDLE_SECONDS / 2 <= SESSION_SECONDS:
        used += IDLE_SECONDS / 2
        assert guard.session_ok(session, used)
    assert not guard.session_ok(session, SESSION_SECONDS + 1)
    other = guard.new_session(0.0)
    guard.end_session(other)
    assert not guard.session_ok(other, 1.0)
    guard.end_session("never-issued")  # ignored


def test_the_oldest_sessions_end_when_too_many_are_kept() -> None:
    guard = Guard("s3cret")
    sessions = [guard.new_session(float(n)) for n in range(MAX_SESSIONS + 1)]
    assert not guard.session_ok(sessions[0], MAX_SESSIONS + 1.0)
    assert guard.session_ok(sessions[-1], MAX_SESSIONS + 1.0)


def test_a_session_keeps_its_last_result_message_once_and_cut() -> None:
    guard = Guard("s3cret")
    mine, theirs = guard.new_session(), guard.new_session()
    guard.tell(mine, "ok", "x" * (SAID_CHARS * 3))
    assert guard.told(theirs) is None
    said = guard.told(mine)
    assert said is not None and said[0] == "ok" and len(said[1]) == SAID_CHARS
    assert guard.told(mine) is None  # said once
    guard.tell("never-issued", "ok", "lost")  # ignored


def test_the_login_cookie_is_named_for_the_port() -> None:
    assert cookie_name("127.0.0.1:8780") == "rselection_console_8780"
    assert cookie_name("[::1]:8781") == "rselection_console_8781"
    assert cookie_name("ops.example.com") == cookie_name(None) == "rselection_console"


def test_a_form_carries_the_csrf_value_of_its_session() -> None:
    guard = Guard("s3cret")
    mine, theirs = guard.new_session(1.0), guard.new_session(2.0)
    assert guard.csrf_ok(mine, guard.csrf_for(mine))
    assert not guard.csrf_ok(mine, guard.csrf_for(theirs))
    assert not guard.csrf_ok(mine, None) and not guard.csrf_ok(mine, "")


def test_only_requests_from_the_consoles_own_host_pass_the_origin_check() -> None:
    host = {"host": "127.0.0.1:8780"}
    assert same_origin({**host, "origin": "http://127.0.0.1:8780"})
    assert same_origin({**host, "referer": "http://127.0.0.1:8780/leases/x"})
    assert same_origin({**host, "origin": "https://127.0.0.1:8780"})  # TLS ended by a proxy
    assert not same_origin({**host, "origin": "http://evil.example"})
    assert not same_origin({**host, "origin": "http://127.0.0.1:8781"})
    assert not same_origin({**host, "origin": "null"})
    assert not same_origin(host)  # neither header


def test_the_origin_may_be_a_host_the_console_was_told() -> None:
    proxied = {"host": "127.0.0.1:8780", "origin": "https://ops.example.com"}
    assert not same_origin(proxied)
    assert same_origin(proxied, AllowedHosts(["ops.example.com"]))
    assert not same_origin(proxied, AllowedHosts(["ops.example.com:8443"]))
    assert not same_origin(proxied, AllowedHosts(["*"]))  # any Host, not any Origin


def test_host_headers_are_split_into_name_and_port() -> None:
    assert split_host("127.0.0.1:8780") == ("127.0.0.1", "8780")
    assert split_host("[::1]:8780") == ("::1", "8780")
    assert split_host("[0:0::1]") == ("::1", None)
    assert split_host("LocalHost.") == ("localhost", None)
    assert split_host("::1") == ("::1", None)


def test_the_console_answers_to_loopback_its_own_address_and_the_hosts_told() -> None:
    default = AllowedHosts()
    for host in ("127.0.0.1:8780", "localhost", "[::1]:1", None):
        assert default.allows(host), host
    assert default.allows("10.0.0.5:8780", ("10.0.0.5", 8780))  # the address it came in on
    for host in ("rebound.example", "rebound.example:8780", "127.0.0.1.rebound.example"):
        assert not default.allows(host, ("127.0.0.1", 8780)), host
    told = AllowedHosts(["ops.example.com", "other.example:8443"])
    assert told.allows("ops.example.com") and told.allows("OPS.example.com:443")
    assert told.allows("other.example:8443") and not told.allows("other.example:80")
    assert AllowedHosts(["*"]).allows("anything.example")
    for bad in (["  "], [42], "ops.example.com"):
        with pytest.raises(ConfigError):
            AllowedHosts(bad)  # type: ignore[arg-type]


def test_wrong_tokens_make_every_try_wait_longer() -> None:
    throttle = Throttle()
    for n in range(FREE_FAILURES - 1):
        throttle.failed(float(n))
        throttle.check(float(n))
    waits = []
    now = 100.0
    for _ in range(10):
        throttle.failed(now)
        with pytest.raises(Throttled) as caught:
            throttle.check(now)
        waits.append(caught.value.retry_after)
        now += caught.value.retry_after
        throttle.check(now)  # the wait is over
    assert waits[:3] == [1.0, 2.0, 4.0] and waits[-1] == LONGEST_WAIT
    throttle.succeeded()
    throttle.failed(now)
    throttle.check(now)  # the right token came: failures start again


def test_the_guard_counts_wrong_bearer_tokens_as_wrong_logins() -> None:
    guard = Guard("s3cret")
    for _ in range(FREE_FAILURES):
        assert not guard.bearer_ok("Bearer wrong", now=1.0)
    with pytest.raises(Throttled):
        guard.log_in("s3cret", now=1.5)
    assert guard.log_in("s3cret", now=2.5)


def test_admin_calls_run_a_few_at_a_time_and_are_waited_for_only_so_long() -> None:
    calls = Calls(slots=2)
    release = threading.Event()

    def stuck() -> str:
        release.wait(10)
        return "late"

    def fails() -> None:
        raise Refused("no such lease")

    async def scenario() -> None:
        assert await calls.run(lambda: 42, timeout=5) == 42
        with pytest.raises(Refused):
            await calls.run(fails, timeout=5)
        for _ in range(2):
            with pytest.raises(NotAnswering, match="no answer within"):
                await calls.run(stuck, timeout=0.05)
        with pytest.raises(NotAnswering, match="2 calls to it are still waiting"):
            await calls.run(lambda: 42, timeout=5)  # refused at once: no slot is free
        release.set()  # the stuck calls return, and free their slots
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            try:
                assert await calls.run(lambda: 42, timeout=5) == 42
                return
            except NotAnswering:
                assert asyncio.get_running_loop().time() < deadline, "the slots stay taken"
                await asyncio.sleep(0.01)

    asyncio.run(scenario())


NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def term(n: int, node: str, began: float, ended: float | None, end: str | None) -> TermRecord:
    """Term ``n`` of ``node``, from ``began`` to ``ended`` minutes before NOW."""
    return TermRecord(
        name="lease",
        term=n,
        node_id=node,
        version=None,
        hostname="h",
        pid=1,
        began_at=NOW - timedelta(minutes=began),
        ended_at=None if ended is None else NOW - timedelta(minutes=ended),
        end_reason=end,
        handed_to=None,
        by=None,
    )


def test_the_timeline_places_each_term_of_the_window_on_its_nodes_row() -> None:
    terms = [
        term(1, "a", 90, 70, "expired"),  # before the window: left out
        term(2, "a", 70, 30, "handed_over"),  # began before the window: cut at its start
        term(3, "b", 30, 15, "deadline"),
        term(4, "a", 15, None, None),  # leading: runs to now
    ]
    picture = layout(terms, NOW, nodes=["a", "b", "c"])
    assert [row.name for row in picture.nodes] == ["a", "b", "c"]
    bars = {bar.term: bar for bar in picture.bars}
    assert sorted(bars) == [2, 3, 4]
    assert bars[2].x == LABEL_WIDTH and bars[2].width == pytest.approx(PLOT_WIDTH / 2)
    assert bars[3].x == pytest.approx(LABEL_WIDTH + PLOT_WIDTH / 2)
    assert bars[3].width == pytest.approx(PLOT_WIDTH / 4)
    assert bars[4].end == "leading" and bars[4].ended_at is None
    assert bars[4].x + bars[4].width == pytest.approx(LABEL_WIDTH + PLOT_WIDTH)
    assert picture.ends == ("leading", "handed_over", "deadline")
    assert [tick.label for tick in picture.ticks] == [
        "11:10",
        "11:20",
        "11:30",
        "11:40",
        "11:50",
        "12:00",
    ]


def test_no_two_bars_of_a_timeline_overlap() -> None:
    terms = [term(n, "ab"[n % 2], 60 - n, 59 - n, "released") for n in range(1, 50)]
    bars = sorted(layout(terms, NOW).bars, key=lambda b: b.x)
    for before, after in itertools.pairwise(bars):
        assert before.x + before.width <= after.x + 1e-6 or before.width == 2.0


def test_task_runs_go_beneath_the_terms() -> None:
    run = RunRecord(
        lease="lease",
        task="purge",
        scheduled_at=NOW - timedelta(minutes=5),
        started_at=NOW - timedelta(minutes=5),
        ended_at=NOW - timedelta(minutes=4),
        outcome="failed",
        reason=None,
        node_id="a",
        term=4,
        error="ValueError: boom",
        by=None,
    )
    picture = layout([term(4, "a", 15, None, None)], NOW, runs={"purge": [run]})
    (row,) = picture.tasks
    assert row.y > picture.nodes[-1].y
    (mark,) = row.marks
    assert "ValueError: boom" in mark.title and picture.outcomes == ("failed",)


def test_bind_addresses_and_loopback() -> None:
    assert parse_bind("127.0.0.1:8780") == ("127.0.0.1", 8780)
    assert parse_bind("[::1]:0") == ("::1", 0)
    for bad in ("8780", "host:", "host:port", "h:70000", ":80"):
        with pytest.raises(UsageError):
            parse_bind(bad)
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")


def test_the_token_file_is_stripped_and_an_empty_one_refused(tmp_path: object) -> None:
    from pathlib import Path

    folder = Path(str(tmp_path))
    (folder / "token").write_text("  s3cret \n")
    assert read_token(str(folder / "token")) == "s3cret"
    (folder / "bom").write_bytes("\ufeffs3cret\n".encode())
    assert read_token(str(folder / "bom")) == "s3cret"
    (folder / "accented").write_text("tökén", encoding="utf-8")
    with pytest.raises(UsageError, match="printable ASCII"):
        read_token(str(folder / "accented"))
    (folder / "empty").write_text(" \n\t")
    with pytest.raises(UsageError, match="is empty"):
        read_token(str(folder / "empty"))
    with pytest.raises(UsageError, match="cannot read"):
        read_token(str(folder / "missing"))


def test_create_app_needs_exactly_one_place_to_read() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        create_app()
    with pytest.raises(ConfigError, match="exactly one"):
        create_app(conninfo="postgresql://x", client="redis://y")
    with pytest.raises(ConfigError, match="blank"):
        create_app(conninfo="postgresql://x", token="  ")
