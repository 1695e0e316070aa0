"""Passwords never shown: the redaction of connection strings and of messages about them.

No server: what the drivers make of a string is asked of their parsers only.
"""

from __future__ import annotations

import string
from urllib.parse import quote

import psycopg
import pytest
import redis
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict

from rselection.errors import ConfigError
from rselection.postgres._conn import check_conninfo, describe_conninfo, unavailable
from rselection.redaction import (
    MASK,
    check_userinfo,
    has_password,
    misread,
    parser_message,
    redact,
    redact_dsn,
)
from rselection.redis._conn import check_client
from rselection.redis._conn import describe as describe_redis

# Any printable character, ASCII or not (no control characters, no lone surrogates).
PRINTABLE = st.characters(blacklist_categories=("Cc", "Cs"))
PASSWORDS = st.text(PRINTABLE, min_size=1, max_size=30)
ASCII = string.ascii_letters + string.digits + string.punctuation + " "
ASCII_PASSWORDS = st.text(st.sampled_from(ASCII), min_size=1, max_size=30)
USERS = st.text(st.sampled_from(string.ascii_letters + string.digits + "._-"), max_size=10)

# The spellings of the reported defect: the drivers misread each of them.
PG_MISREAD = {
    "postgresql://u:hunter2/sekrit@127.0.0.1:5432/test": ("hunter2", "sekrit"),
    "postgresql://u:p@ss@127.0.0.1:5432/test": ("ss@",),
}
REDIS_MISREAD = {
    "redis://:S3cr3t/pw@127.0.0.1:6379/0": ("S3cr3t", "pw"),
    "redis://:S3cr3t?pw@127.0.0.1:6379/0": ("S3cr3t", "pw"),
    "redis://:S3cr3t#pw@127.0.0.1:6379/0": ("S3cr3t", "pw"),
}


def kv_quoted(value: str) -> str:
    """``value`` as a quoted libpq ``key=value`` value."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# -- the string itself ----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(user=USERS, password=PASSWORDS)
def test_a_uri_shows_nothing_of_its_user_info_whatever_the_password_holds(
    user: str, password: str
) -> None:
    for scheme, rest in (("postgresql", "db.example:5432/app"), ("redis", "10.0.0.1:6379/0")):
        skeleton = f"{scheme}://{MASK}@{rest}"
        assert redact_dsn(f"{scheme}://{user}:{password}@{rest}") == skeleton
        assert redact_dsn(f"{scheme}://{user}:{quote(password, safe='')}@{rest}") == skeleton


@settings(max_examples=300, deadline=None)
@given(password=PASSWORDS)
def test_a_key_value_string_shows_no_password_quoted_or_not(password: str) -> None:
    quoted = kv_quoted(password)
    shown = redact_dsn(f"host=db.example password={quoted} dbname=app")
    assert shown == f"host=db.example password={MASK} dbname=app"
    assert redact_dsn(f"host=h sslpassword = {quoted}") == f"host=h sslpassword = {MASK}"
    if not any(c.isspace() or c in "'\\" for c in password):
        assert redact_dsn(f"password={password} host=h") == f"password={MASK} host=h"


@settings(max_examples=300, deadline=None)
@given(password=PASSWORDS)
def test_a_password_in_a_uri_query_is_not_shown(password: str) -> None:
    uri = f"postgresql://db.example/app?sslmode=disable&password={quote(password, safe='')}&x=1"
    assert redact_dsn(uri) == f"postgresql://db.example/app?sslmode=disable&password={MASK}&x=1"
    # libpq decodes keys too; a raw '&' in the password is kept out as well.
    assert redact_dsn("redis://h/0?pass%77ord=ab&cd&db=1") == f"redis://h/0?pass%77ord={MASK}&db=1"


def test_a_string_without_a_password_is_shown_as_it_is() -> None:
    for dsn in ("host=h dbname=app user=u", "postgresql://db.example:5432/app", "redis://h:1/0"):
        assert redact_dsn(dsn) == dsn
    # The user name is part of the user-info: never shown as part of a URI.
    assert redact_dsn("postgresql://alice@db.example/app") == f"postgresql://{MASK}@db.example/app"


def test_an_unterminated_quoted_password_is_hidden_to_the_end() -> None:
    assert redact_dsn("host=h password='se cret port=1") == f"host=h password={MASK}"


@pytest.mark.parametrize("dsn", [*PG_MISREAD, *REDIS_MISREAD])
def test_the_misread_spellings_are_shown_without_their_user_info(dsn: str) -> None:
    scheme, rest = dsn.split("://", 1)
    assert redact_dsn(dsn) == f"{scheme}://{MASK}{rest[rest.rindex('@') :]}"


# -- messages -------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(password=PASSWORDS)
def test_a_message_quoting_a_well_read_password_shows_none_of_it(password: str) -> None:
    assume("*" not in password)  # the mask itself would otherwise "show" it
    uri = f"postgresql://u:{quote(password, safe='')}@db.example/app"
    for conninfo in (uri, f"host=h password={kv_quoted(password)}"):
        message = f'FATAL: "{password}" in {conninfo} ({quote(password, safe="")})'
        assert password not in redact(message, conninfo)


def test_a_message_about_a_misread_string_is_not_shown_at_all() -> None:
    for dsn, fragments in [*PG_MISREAD.items(), *REDIS_MISREAD.items()]:
        text = redact(f'invalid integer value "{fragments[0]}" for connection option "port"', dsn)
        assert not any(f in text for f in fragments)
        assert "%2F" in text and "%40" in text  # says what to do instead


def test_uris_and_password_pairs_quoted_in_a_message_are_redacted_without_a_conninfo() -> None:
    text = "seen postgresql://u:p@ss@h/db and redis://:x/y@h:1/0, host=h password=s3 x=1"
    assert redact(text) == (
        f"seen postgresql://{MASK}@h/db and redis://{MASK}@h:1/0, host=h password={MASK} x=1"
    )


def test_pgpassword_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGPASSWORD", "hunter2")
    assert "hunter2" not in redact("auth hunter2 failed", "host=h")


# -- what the drivers make of a string: refused when they would misread it ---------------


@pytest.mark.parametrize("dsn", PG_MISREAD)
def test_libpq_misreads_these_uris_and_they_are_refused_with_what_to_do(dsn: str) -> None:
    assert conninfo_to_dict(dsn).get("password") in (None, "p")  # libpq's own reading
    assert misread(dsn) and has_password(dsn)
    with pytest.raises(ConfigError) as refused:
        check_conninfo(dsn)
    message = str(refused.value)
    assert not any(f in message for f in PG_MISREAD[dsn])
    assert redact_dsn(dsn) in message
    assert "%2F" in message and "%40" in message and "percent-encode" in message


@pytest.mark.parametrize("url", REDIS_MISREAD)
def test_redis_py_misreads_these_urls_and_they_are_refused_with_what_to_do(url: str) -> None:
    with pytest.raises(ValueError, match="S3cr3t"):  # redis-py's own reading quotes it
        redis.Redis.from_url(url)
    assert misread(url) and has_password(url)
    with pytest.raises(ConfigError) as refused:
        check_client(url, "RedisLeader")
    message = str(refused.value)
    assert not any(f in message for f in REDIS_MISREAD[url])
    assert message.startswith("RedisLeader: ") and redact_dsn(url) in message
    assert "%2F" in message and "%3F" in message and "%23" in message and "%5B" in message
    assert not any(f in describe_redis(url) for f in REDIS_MISREAD[url])


def test_an_at_sign_in_a_redis_password_is_read_right_and_accepted() -> None:
    # urllib splits the user-info at the last '@': redis-py reads this one as written.
    url = "redis://:p@ss@127.0.0.1:6379/0"
    assert not misread(url)
    client, owned = check_client(url, "RedisLeader")
    assert owned and client.connection_pool.connection_kwargs["password"] == "p@ss"
    assert describe_redis(url) == "127.0.0.1:6379/0"
    client.close()


@settings(max_examples=500, deadline=None)
@given(password=st.one_of(ASCII_PASSWORDS, PASSWORDS))
@example(password="%80")  # not UTF-8 once decoded: psycopg raised UnicodeDecodeError
def test_a_uri_is_either_read_as_written_or_refused_with_the_same_message(
    password: str,
) -> None:
    """Whatever a raw password holds, libpq either reads the URI as written, or the URI is
    refused with a message that does not depend on the password at all."""
    dsn = f"postgresql://u:{password}@127.0.0.1:5432/test"
    try:
        check_conninfo(dsn)
    except ConfigError as exc:
        reference = "postgresql://u:a/b@127.0.0.1:5432/test"
        with pytest.raises(ConfigError) as same:
            check_conninfo(reference if misread(dsn) else "postgresql://u:%zz@127.0.0.1/test")
        assert str(exc) == str(same.value)
    else:
        params = conninfo_to_dict(dsn)
        assert (params["user"], params["host"], params["port"], params["dbname"]) == (
            "u",
            "127.0.0.1",
            "5432",
            "test",
        )
        assert describe_conninfo(dsn) == "host=127.0.0.1 port=5432 dbname=test user=u"


@settings(max_examples=500, deadline=None)
@given(password=st.one_of(ASCII_PASSWORDS, PASSWORDS))
def test_a_redis_url_is_either_read_as_written_or_refused_without_its_password(
    password: str,
) -> None:
    url = f"redis://:{password}@127.0.0.1:6379/0"
    try:
        client, _ = check_client(url, "RedisLeader")
    except ConfigError as exc:
        # Misread, or refused by urllib (here: a character that NFKC turns into a '/').
        reference = "/" if misread(url) else "\uff0f"
        with pytest.raises(ConfigError) as same:
            check_client(f"redis://:a{reference}b@127.0.0.1:6379/0", "RedisLeader")
        assert str(exc) == str(same.value)
    else:
        kwargs = client.connection_pool.connection_kwargs
        client.close()
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 6379, 0)


def test_driver_errors_about_a_string_go_through_redaction() -> None:
    dsn = "postgresql://u:hunter2@127.0.0.1:1/test"
    error = unavailable("connect", dsn, psycopg.OperationalError("auth hunter2 refused"))
    assert "hunter2" not in str(error) and "host=127.0.0.1 port=1" in str(error)


# -- passwords on a command line ------------------------------------------------------


@pytest.mark.parametrize(
    "dsn, expected",
    [
        ("postgresql://u:pw@h/db", True),
        ("postgresql://u:@h/db", False),
        ("postgresql://u@h/db", False),
        ("postgresql://h/db?password=x", True),
        ("host=h password='a b'", True),
        ("host=h user=u", False),
        ("redis://:S3cr3t/pw@127.0.0.1:6379/0", True),
        ("redis://127.0.0.1:6379/0", False),
        ("", False),
    ],
)
def test_has_password(dsn: str, expected: bool) -> None:
    assert has_password(dsn) is expected


def test_check_userinfo_names_what_was_given() -> None:
    with pytest.raises(ConfigError, match=r"^the connection string of --dsn, postgresql://\*\*\*"):
        check_userinfo("postgresql://u:a/b@h/db", "the connection string of --dsn")
    check_userinfo("host=h password=a/b@c", "x")  # not a URI: libpq reads it as written


@pytest.mark.parametrize("password", ["[x]", "a\uff0fb", "x]y"])
def test_a_parser_message_quoting_the_user_info_is_not_shown(password: str) -> None:
    url = f"redis://:{password}@127.0.0.1:6379/0"
    with pytest.raises(ValueError) as parser:
        redis.Redis.from_url(url)
    assert parser_message(str(parser.value), url) == parser_message("anything", url)
    assert "percent-encode" in parser_message(str(parser.value), url)
    # Without user-info nothing can leak: the parser's own words help more.
    bad_db = "redis://127.0.0.1:6379/x"
    assert parser_message("invalid literal for int(): 'x'", bad_db) == (
        "invalid literal for int(): 'x'"
    )


@pytest.mark.parametrize("dsn", PG_MISREAD)
def test_a_demo_node_refuses_a_misread_uri_before_connecting(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rselection.commands import demo_fleet

    with pytest.raises(SystemExit) as refused:
        demo_fleet.main(["--dsn", dsn])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "postgresql://***@127.0.0.1:5432/test" in err
    assert not any(piece in err for piece in PG_MISREAD[dsn])


def test_a_pool_is_held_to_the_same_rules_as_a_connection_string() -> None:
    from rselection.postgres.connections import Connections

    class Pool:
        conninfo = "host=db.example password=hunter2"

        def connection(self) -> None:
            raise AssertionError("not used")

    conns = Connections(Pool(), owner="PostgresClaimer", application_name="test")
    error = conns.wrap("claim", psycopg.OperationalError("refused: hunter2"))
    assert "hunter2" not in str(error) and "db.example" in str(error)
    Pool.conninfo = next(iter(PG_MISREAD))
    with pytest.raises(ConfigError) as refused:
        Connections(Pool(), owner="PostgresClaimer", application_name="test")
    assert str(refused.value).startswith("PostgresClaimer: the pool's connection string")
    assert not any(f in str(refused.value) for f in PG_MISREAD[Pool.conninfo])
