"""Who may act on the console: the operator token, the login cookie, and cross-site checks.

Without a token the console is read-only: it shows no action forms and refuses every
action (403). With one, an action is allowed to

* a request that carries ``Authorization: Bearer <token>`` (scripts; no cookie is
  involved, so no cross-site check is needed), or
* a browser logged in on the console's form: its cookie holds a session id, random and
  kept by the console in memory (never the token, nothing derived from it),
  ``HttpOnly`` and ``SameSite=Strict``; each form it posts carries a CSRF value derived
  from that id, and its ``Origin`` (else ``Referer``) must be the console's own.

Every token comparison runs in constant time (:func:`hmac.compare_digest`). A session
ends after :data:`SESSION_SECONDS`, after :data:`IDLE_SECONDS` without a request, or at
log-out: a copy of its cookie is worth nothing then. Sessions live in the process: a
restart ends them all, and so does changing the token. Wrong tokens are slowed
down (:class:`Throttle`): after :data:`FREE_FAILURES` of them, no token is tried for a
while, a while that doubles with each further failure.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import ConfigError
from .hosts import AllowedHosts, split_host

__all__ = [
    "COOKIE",
    "FREE_FAILURES",
    "IDLE_SECONDS",
    "MAX_SESSIONS",
    "SAID_CHARS",
    "SESSION_SECONDS",
    "Guard",
    "Session",
    "Throttle",
    "Throttled",
    "check_token",
    "cookie_name",
    "same_origin",
]

COOKIE = "rselection_console"
"""The login cookie's name, followed by ``_PORT`` when the console is reached on a port
of its own (see :func:`cookie_name`)."""

SESSION_SECONDS = 8 * 3600
"""How long a login lasts at most."""

IDLE_SECONDS = 3600
"""How long a login lasts without a request (an open page refreshes every few seconds)."""

MAX_SESSIONS = 100
"""Sessions kept at most: one more ends the oldest."""

SAID_CHARS = 2000
"""A result message is cut to this many characters (names can be long)."""

FREE_FAILURES = 5
"""Wrong tokens tried without a wait; each further one makes the next try wait."""

FIRST_WAIT = 1.0
"""Seconds the next try waits after the first failure past :data:`FREE_FAILURES`; it
doubles with each further failure, up to :data:`LONGEST_WAIT`."""

LONGEST_WAIT = 60.0
"""The longest wait between two tries of a token."""

FORGET_AFTER = 15 * 60.0
"""Seconds without a wrong token after which the failures are forgotten."""


class Throttled(Exception):
    """No token is tried now: too many wrong ones came lately.

    Attributes:
        retry_after: seconds until the next try.
    """

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"too many wrong tokens: try again in {retry_after:.0f} s")
        self.retry_after = retry_after


class Throttle:
    """Slows down guessing: after :data:`FREE_FAILURES` wrong tokens, each one makes every
    try wait, first :data:`FIRST_WAIT`, then twice as long each time, up to
    :data:`LONGEST_WAIT`. One throttle for the whole console (a guesser has many
    addresses), for the login form and bearer tokens alike; a right token resets it."""

    def __init__(self) -> None:
        self._failures = 0
        self._last = 0.0
        self._until = 0.0

    def check(self, now: float | None = None) -> None:
        """Raise :class:`Throttled` while tries must wait."""
        now = time.monotonic() if now is None else now
        if now < self._until:
            raise Throttled(self._until - now)

    def failed(self, now: float | None = None) -> None:
        """Count a wrong token."""
        now = time.monotonic() if now is None else now
        if now - self._last > FORGET_AFTER:
            self._failures = 0
        self._failures += 1
        self._last = now
        beyond = self._failures - FREE_FAILURES
        if beyond >= 0:
            self._until = now + min(FIRST_WAIT * 2**beyond, LONGEST_WAIT)

    def succeeded(self) -> None:
        """Forget the failures: the right token came."""
        self._failures = 0
        self._until = 0.0


def check_token(token: object) -> str | None:
    """The operator ``token`` with its surrounding whitespace (and a byte order mark)
    stripped; ``None`` (a read-only console) stays ``None``.

    Raises:
        ConfigError: not a string, blank, or not printable ASCII.
    """
    if token is None:
        return None
    if not isinstance(token, str):
        raise ConfigError(f"token must be a str or None, got {type(token).__name__}")
    # A byte order mark (some editors begin a file with one) is no part of the token.
    stripped = token.strip().lstrip("\ufeff").strip()
    if not stripped:
        raise ConfigError(
            "token is blank: give the operator token, or None for a read-only console"
        )
    if not all(" " <= c <= "~" for c in stripped):
        # An HTTP header carries ASCII only: such a token would work in the login form
        # and never as a bearer token.
        raise ConfigError(
            "token must be printable ASCII (letters, digits, punctuation, spaces), such "
            "as the output of `openssl rand -hex 24`"
        )
    return stripped


def cookie_name(host: str | None) -> str:
    """The login cookie's name for requests sent to ``Host: host``.

    Browsers send a host's cookies to every port of it: two consoles on two ports of one
    host would each overwrite the other's cookie under one name, so the port is part of
    the name (``rselection_console_8780``).
    """
    port = split_host(host)[1] if host else None
    return f"{COOKIE}_{port}" if port and port.isdigit() else COOKIE


@dataclass
class Session:
    """A browser logged in.

    Attributes:
        started: when it logged in (``time.monotonic()``).
        used: when it last sent a request.
        said: what its last form did, ``(level, message)``, until a page shows it.
    """

    started: float
    used: float
    said: tuple[str, str] | None = None


class Guard:
    """Checks the credentials of the console's actions.

    Args:
        token: the operator token (see :func:`check_token`); ``None``: read-only.
    """

    def __init__(self, token: str | None) -> None:
        self._token = check_token(token)
        self._key = secrets.token_bytes(32)  # the CSRF values': this process's own
        self._throttle = Throttle()
        # By a hash of the id: a lookup's timing says nothing of the ids kept.
        self._sessions: dict[str, Session] = {}

    @property
    def read_only(self) -> bool:
        """Whether no token was given: every action is refused."""
        return self._token is None

    def _mac(self, purpose: str, value: str) -> str:
        message = f"{purpose}:{value}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def token_matches(self, given: str) -> bool:
        """Whether ``given`` (surrounding whitespace stripped) is the token."""
        if self._token is None:
            return False
        return hmac.compare_digest(given.strip().encode(), self._token.encode())

    def log_in(self, given: str, now: float | None = None) -> bool:
        """Whether ``given`` is the token; a wrong one is counted (see :class:`Throttle`).

        Raises:
            Throttled: no token is tried now.
        """
        self._throttle.check(now)
        if self.token_matches(given):
            self._throttle.succeeded()
            return True
        self._throttle.failed(now)
        return False

    def bearer_ok(self, authorization: str | None, now: float | None = None) -> bool:
        """Whether an ``Authorization`` header carries the token as a bearer token; a
        wrong one is counted as a wrong login.

        Raises:
            Throttled: no token is tried now.
        """
        if self._token is None or not authorization:
            return False
        scheme, _, credentials = authorization.partition(" ")
        return scheme.lower() == "bearer" and self.log_in(credentials, now)

    def new_session(self, now: float | None = None) -> str:
        """A new session: its id, the login cookie's value."""
        now = time.monotonic() if now is None else now
        for key, session in list(self._sessions.items()):
            if not _live(session, now):
                del self._sessions[key]
        while len(self._sessions) >= MAX_SESSIONS:
            oldest = min(self._sessions, key=lambda key: self._sessions[key].started)
            del self._sessions[oldest]
        cookie = secrets.token_urlsafe(32)
        self._sessions[_hashed(cookie)] = Session(started=now, used=now)
        return cookie

    def session_ok(self, cookie: str | None, now: float | None = None) -> bool:
        """Whether ``cookie`` is the id of a live session (which this request uses)."""
        if self._token is None or not cookie:
            return False
        now = time.monotonic() if now is None else now
        key = _hashed(cookie)
        session = self._sessions.get(key)
        if session is None:
            return False
        if not _live(session, now):
            del self._sessions[key]
            return False
        session.used = now
        return True

    def tell(self, cookie: str, level: str, message: str) -> None:
        """Keep what a form of session ``cookie`` did (``level``: ``"ok"`` or ``"danger"``;
        ``message`` cut to :data:`SAID_CHARS`), for its next page to say once."""
        session = self._sessions.get(_hashed(cookie))
        if session is not None:
            cut = message if len(message) <= SAID_CHARS else message[: SAID_CHARS - 1] + "…"
            session.said = (level, cut)

    def told(self, cookie: str) -> tuple[str, str] | None:
        """What a form of session ``cookie`` did, once: ``(level, message)`` or ``None``."""
        session = self._sessions.get(_hashed(cookie))
        if session is None:
            return None
        said, session.said = session.said, None
        return said

    def end_session(self, cookie: str | None) -> None:
        """End the session ``cookie`` (log-out); an unknown one is ignored."""
        if cookie:
            self._sessions.pop(_hashed(cookie), None)

    def csrf_for(self, cookie: str) -> str:
        """The CSRF value the forms of a page carry for the session ``cookie``."""
        return self._mac("csrf", cookie)

    def csrf_ok(self, cookie: str, given: str | None) -> bool:
        """Whether a form's CSRF value belongs to the session ``cookie``."""
        return given is not None and hmac.compare_digest(
            given.encode(), self.csrf_for(cookie).encode()
        )


def _hashed(cookie: str) -> str:
    return hashlib.sha256(cookie.encode("utf-8", "replace")).hexdigest()


def _live(session: Session, now: float) -> bool:
    return now - session.started <= SESSION_SECONDS and now - session.used <= IDLE_SECONDS


def same_origin(headers: Mapping[str, str], hosts: AllowedHosts | None = None) -> bool:
    """Whether a browser's request comes from the console's own pages: the host of its
    ``Origin`` (else of its ``Referer``) is the one it was sent to, or one of the hosts
    the console was told (``hosts``: a proxy in front may send its own ``Host``).

    The scheme is not compared: behind a proxy that ends TLS the console sees ``http``
    where the browser sent ``https``. A request with neither header is refused: browsers
    send ``Origin`` with every form post. ``headers`` have lower-case names.
    """
    host = headers.get("host")
    source = headers.get("origin") or headers.get("referer")
    if not host or not source or source == "null":
        return False
    parts = urlsplit(source)
    if not parts.scheme or not parts.netloc:
        return False
    if parts.netloc.lower() == host.lower():
        return True
    return hosts is not None and hosts.told(*split_host(parts.netloc))
