"""Passwords are never shown: connection strings and messages made fit to print.

Whatever rselection prints, logs or raises that may quote a connection string goes
through :func:`redact` (a message) or :func:`redact_dsn` (the string itself); everything
between ``://`` and the *last* ``@`` of a URI is user-info, never shown, and a string
its driver would misread is refused where it is given (:func:`check_userinfo`). See
``docs/how-to/install.md`` for percent-encoding a password.

Not public API; the names are stable enough for the backends and the command line.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote

from .errors import ConfigError

__all__ = [
    "LIBPQ_ENDS",
    "MASK",
    "URL_ENDS",
    "check_userinfo",
    "has_password",
    "misread",
    "parser_message",
    "redact",
    "redact_dsn",
]

MASK = "***"
"""What stands for a password, or a URI's whole user-info, in everything shown."""

LIBPQ_ENDS = "/@"
"""Characters at which libpq ends a URI's user-info (it takes the first ``@`` or ``/``)."""

URL_ENDS = "/?#[]"
"""Characters urllib, and so redis-py, misreads in a URL's user-info: it ends the
user-info and host at ``/``, ``?`` or ``#``, and reads ``[...]`` as an IPv6 address."""

# Where a URI starts, and which characters end its user-info for the driver that reads
# it; a scheme not listed is judged by every one of them.
_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*)://")
_ENDS = {
    "postgresql": LIBPQ_ENDS,
    "postgres": LIBPQ_ENDS,
    "redis": URL_ENDS,
    "rediss": URL_ENDS,
    "unix": URL_ENDS,
}

# A libpq key=value pair whose key names a password (password, sslpassword): a quoted
# value (to its closing quote, or to the end when it has none: libpq refuses the string,
# and all of it may be the password) or an unquoted one (to the next blank; a backslash
# escapes the next character). libpq skips blanks after '=', so they are taken too.
_PAIR = re.compile(
    r"(\b\w*password\s*=\s*)('(?:[^'\\]|\\.?)*'?|(?:[^\s\\]|\\.?)+)",
    re.IGNORECASE | re.DOTALL,
)

# A URI quoted in a message: from its scheme to the last '@' before a blank.
_URI_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)\S*@")

_MISREAD_TEXT = (
    "(the message is not shown: it may quote pieces of the password, because the "
    "connection string's user-info holds an unescaped '/', '?', '#' or '@' that the "
    "driver reads as the end of the password; percent-encode them in the password: "
    "'/' as %2F, '?' as %3F, '#' as %23, '@' as %40, '%' as %25)"
)

_PARSER_TEXT = (
    "the parser's message is not shown, as it may quote the password; percent-encode "
    "every character of the user name and password other than letters, digits and "
    "'-._~' (urllib.parse.quote(password, safe='') does it)"
)


def _uri_parts(conninfo: str) -> tuple[str, str | None, str] | None:
    """``(head, userinfo, rest)`` of a string that starts as a URI, else ``None``.

    ``head`` ends with ``://``; ``userinfo`` is everything up to the last ``@`` (``None``
    without one); ``rest`` is what follows that ``@``.
    """
    found = _SCHEME.match(conninfo)
    if found is None:
        return None
    head, tail = conninfo[: found.end()], conninfo[found.end() :]
    at = tail.rfind("@")
    if at < 0:
        return head, None, tail
    return head, tail[:at], tail[at + 1 :]


def _is_password_key(key: str) -> bool:
    return unquote(key).strip().lower().endswith("password")


def _redact_query(rest: str) -> str:
    """``rest`` of a URI with the value of each ``password`` query parameter masked.

    A piece without ``=`` after a password is taken as part of it (a raw ``&`` in the
    password).
    """
    path, mark, query = rest.partition("?")
    if not mark:
        return rest
    pieces: list[str] = []
    in_password = False
    for piece in query.split("&"):
        key, equals, _ = piece.partition("=")
        if equals and _is_password_key(key):
            pieces.append(f"{key}={MASK}")
            in_password = True
        elif in_password and not equals:
            continue  # the rest of a password holding a raw '&'
        else:
            pieces.append(piece)
            in_password = False
    return f"{path}?{'&'.join(pieces)}"


def _mask_pair(match: re.Match[str]) -> str:
    return match.group(1) + MASK


def redact_dsn(conninfo: str) -> str:
    """``conninfo`` fit to show: a URI's user-info and every password value masked.

    For a URI (``scheme://...``), everything between ``://`` and the last ``@`` becomes
    ``***`` (the user name too: it is part of the user-info), as do the values of
    ``password`` query parameters; in a ``key=value`` string, the value of every key
    that names a password (``password``, ``sslpassword``), quoted or not.

    Args:
        conninfo: a libpq connection string or URI, or a Redis URL.
    """
    parts = _uri_parts(conninfo)
    if parts is None:
        return _URI_IN_TEXT.sub(rf"\1{MASK}@", _PAIR.sub(_mask_pair, conninfo))
    head, userinfo, rest = parts
    return head + (f"{MASK}@" if userinfo is not None else "") + _redact_query(rest)


def _unescaped(value: str) -> str:
    """A libpq ``key=value`` value as libpq reads it: unquoted, backslashes undone."""
    if value.startswith("'"):
        value = value[1:-1] if len(value) > 1 and value.endswith("'") else value[1:]
    return re.sub(r"\\(.)", r"\1", value, flags=re.DOTALL)


def _secrets(conninfo: str) -> set[str]:
    """The password of ``conninfo`` in every spelling a message may quote it in."""
    found: set[str] = set()
    parts = _uri_parts(conninfo)
    if parts is not None:
        _, userinfo, rest = parts
        if userinfo is not None and ":" in userinfo:
            password = userinfo.split(":", 1)[1]
            found |= {userinfo, password, unquote(userinfo), unquote(password)}
        _, _, query = rest.partition("?")
        for piece in query.split("&"):
            key, equals, value = piece.partition("=")
            if equals and _is_password_key(key):
                found |= {value, unquote(value)}
    for match in _PAIR.finditer(conninfo):
        value = match.group(2)
        found |= {value, _unescaped(value), unquote(_unescaped(value))}
    return {s for s in found if s}


def misread(conninfo: str) -> bool:
    """Whether the driver of ``conninfo`` reads its user-info other than as written.

    True for a URI whose user-info (up to its last ``@``) holds a character the driver
    misreads there: ``/`` or ``@`` for libpq (``postgresql://``), ``/``, ``?``, ``#``,
    ``[`` or ``]`` for redis-py (``redis://``, ``rediss://``, ``unix://``), any of them
    for another scheme. The driver then takes pieces of the password for a host, a port
    or a database name, and its messages quote them.

    Args:
        conninfo: a libpq connection string or URI, or a Redis URL.
    """
    parts = _uri_parts(conninfo)
    if parts is None or parts[1] is None:
        return False
    scheme = _SCHEME.match(conninfo)
    assert scheme is not None
    ends = _ENDS.get(scheme.group(1).lower(), LIBPQ_ENDS + URL_ENDS)
    return any(c in parts[1] for c in ends)


def check_userinfo(conninfo: str, what: str = "the connection string") -> None:
    """Refuse a connection string its driver would misread (see :func:`misread`).

    The message names the string redacted and says how to write it; it is the same
    whatever the password holds.

    Args:
        conninfo: a libpq connection string or URI, or a Redis URL.
        what: how the message names it (``"RedisLeader: the Redis URL"``).

    Raises:
        ConfigError: the driver would read pieces of the password as something else.
    """
    if misread(conninfo):
        raise ConfigError(
            f"{what}, {redact_dsn(conninfo)}, would be misread: all up to its last '@' "
            "is its user name and password, but a '/', '?', '#', '@', '[' or ']' in them "
            "ends them early, and pieces of the password would be read as the host, port "
            "or database; percent-encode these characters ('/' as %2F, '?' as %3F, '#' "
            "as %23, '@' as %40, '[' as %5B, ']' as %5D, '%' as %25: "
            "urllib.parse.quote(password, safe='') does it), and an '@' after the host "
            "too"
        )


def parser_message(text: str, conninfo: str) -> str:
    """A parser's message about ``conninfo`` (it could not parse it), fit to show.

    urllib quotes a URL's whole network location, user-info included, in some of its
    messages (a character that changes under NFKC normalization), and a piece of it in
    others (``'x' does not appear to be an IPv4 or IPv6 address``). So the message is
    shown, redacted, only when ``conninfo`` holds neither user-info nor a password;
    otherwise a fixed text says what to do.

    Args:
        text: the parser's message.
        conninfo: the string it could not parse.
    """
    parts = _uri_parts(conninfo)
    if (parts is not None and parts[1] is not None) or has_password(conninfo):
        return _PARSER_TEXT
    return redact(text, conninfo)


def has_password(conninfo: str) -> bool:
    """Whether ``conninfo`` carries a (non-empty) password.

    Args:
        conninfo: a libpq connection string or URI, or a Redis URL.
    """
    parts = _uri_parts(conninfo)
    if parts is not None:
        _, userinfo, rest = parts
        if userinfo is not None and userinfo.partition(":")[2]:
            return True
        for piece in rest.partition("?")[2].split("&"):
            key, equals, value = piece.partition("=")
            if equals and value and _is_password_key(key):
                return True
    return any(_unescaped(m.group(2)) for m in _PAIR.finditer(conninfo))


def redact(text: str, *conninfos: str) -> str:
    """``text`` without any password: a message that may quote connection strings.

    The password of each of ``conninfos`` (as written, percent-decoded, unquoted) and
    libpq's ``$PGPASSWORD`` are masked, then any URI's user-info and any
    ``password=...`` pair still in ``text``. A message about a string that its driver
    misreads (:func:`misread`) may quote any piece of the password: it is replaced as
    a whole by one that says how to write the string.

    Args:
        text: a message, typically a driver's error.
        conninfos: the connection strings the message may be about.
    """
    if any(misread(c) for c in conninfos):
        return _MISREAD_TEXT
    secrets: set[str] = set()
    for conninfo in conninfos:
        secrets |= _secrets(conninfo)
    if env_password := os.environ.get("PGPASSWORD"):
        secrets.add(env_password)
    # Longest first: a password is never left half replaced by a shorter spelling.
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return _PAIR.sub(_mask_pair, _URI_IN_TEXT.sub(rf"\1{MASK}@", text))
