"""Connection helpers shared by the Redis backends (not public API).

A user hands us a URL, a ``redis.Redis`` or a ``redis.cluster.RedisCluster``. The
electors, claimers and fenced writes use that client as it is (its pool, its retries).
The lease keeper does not: it needs raw connections of its own that never reconnect or
retry behind its back, because its connection's id is what followers check to learn
that a leader died. :class:`ConnectionFactory` builds those from the user's settings.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import ConnectionPool
from redis.retry import Retry

from ..closeable import Closeable
from ..errors import BackendUnavailable, ConfigError, first_line
from ..redaction import check_userinfo, misread, parser_message, redact, redact_dsn

__all__ = [
    "MIN_TTL",
    "ClientUser",
    "ConnectionFactory",
    "check_client",
    "client_name",
    "describe",
    "hash_slot_key",
    "unavailable",
]

logger = logging.getLogger(__name__)

MIN_TTL = 0.001
"""The shortest ttl accepted, seconds (1 ms: Redis expiries are whole milliseconds).

Pass it as ``minimum`` to :func:`rselection.validation.check_seconds`.
"""


def client_name(name: str) -> str:
    """The ``CLIENT SETNAME`` of a lease's keeper: ``rselection:<name>``, made acceptable.

    Redis refuses client names with spaces, control or non-ASCII characters; each of
    those becomes ``_``, and the whole is cut to 64 characters (it only helps operators
    read ``CLIENT LIST``).

    Args:
        name: the lease name.
    """
    text = f"rselection:{name}"[:64]
    return "".join(c if "!" <= c <= "~" else "_" for c in text)


def hash_slot_key(key: str, suffix: str) -> str:
    """A key that lands in the same cluster hash slot as ``key``: ``key`` + ``suffix``.

    A key with a hash tag (``{...}``) keeps it; one without is wrapped in braces,
    because Redis hashes ``{k}x`` exactly like ``k``.

    Args:
        key: the existing key.
        suffix: appended to make the new key (e.g. ``":term"``).
    """
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key + suffix
    return "{" + key + "}" + suffix


def describe(client: object) -> str:
    """Where a client (or a URL) points, for messages: ``host:port/db``, never a password.

    A URL that redis-py misreads (:func:`~rselection.redaction.misread`), whose host or
    port may be pieces of its password, is named by the URL redacted instead.

    Args:
        client: a ``redis://`` URL, a ``redis.Redis`` (sync or asyncio) or a
            ``RedisCluster``.
    """
    try:
        if isinstance(client, str) and misread(client):
            return redact_dsn(client)
        if isinstance(client, str):
            kw = ConnectionPool.from_url(client).connection_kwargs
        elif isinstance(client, RedisCluster):
            node: Any = client.get_default_node()  # type: ignore[no-untyped-call]
            return f"Redis Cluster via {node.host}:{node.port}"
        elif isinstance(client, redis.Redis | redis.asyncio.Redis):
            kw = client.connection_pool.connection_kwargs
        else:
            return type(client).__name__
    except Exception:  # a description must never raise
        return "Redis"
    if kw.get("path"):
        return f"unix:{kw['path']}/{kw.get('db', 0)}"
    return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def unavailable(what: str, where: str, exc: BaseException) -> BackendUnavailable:
    """Build the :class:`BackendUnavailable` for a failed ``what`` against ``where``.

    Args:
        what: what was attempted, e.g. ``"connect to the lease server"``.
        where: :func:`describe` of the server.
        exc: the driver error; chain it with ``raise ... from exc``.
    """
    return BackendUnavailable(f"cannot {what} ({where}): {redact(first_line(exc))}")


class ClientUser(Closeable):
    """Base of the Redis objects that make their calls on one client: the one passed in,
    or one made from a URL, which :meth:`close` closes. A subclass calls
    :meth:`_use_client` from its constructor."""

    _client: Any

    def _use_client(self, client: object, owner: str) -> None:
        """Check ``client`` (see :func:`check_client`) and keep it."""
        self._client, self._owned = check_client(client, owner)

    def close(self) -> None:
        """Close the client if it was made from a URL; a client passed in is left open."""
        if self._owned:
            try:
                self._client.close()
            except Exception as exc:  # best effort: nothing is lost with it
                logger.debug("%r: error closing the client: %s", self, exc)


def check_client(client: object, owner: str) -> tuple[Any, bool]:
    """Return ``(client, owned)`` for a URL, a ``redis.Redis`` or a ``RedisCluster``.

    A URL makes a client of our own (``owned``: closed by the owner's ``close()``).

    Args:
        client: what the user passed as ``client``.
        owner: the class or function that got it, for the message.

    Raises:
        ConfigError: anything else, a URL redis-py cannot parse, or one it would misread
            (a password with an unescaped ``/``, ``?`` or ``#``); the message shows the
            URL redacted, never its password.
    """
    if isinstance(client, str):
        if not client.strip():
            raise ConfigError(f"{owner} needs a Redis URL (redis://host:port/0), got ''")
        check_userinfo(client, f"{owner}: the Redis URL")
        try:
            return redis.Redis.from_url(client), True
        except ValueError as exc:
            # redis-py's message may quote pieces of the password.
            raise ConfigError(
                f"{owner}: bad Redis URL {redact_dsn(client)}: {parser_message(str(exc), client)}"
            ) from None
    if isinstance(client, redis.Redis | RedisCluster):
        return client, False
    raise ConfigError(
        f"{owner} needs a redis.Redis, a redis.cluster.RedisCluster or a redis:// URL, "
        f"got {type(client).__name__}"
    )


class ConnectionFactory:
    """Makes raw keeper connections with a client's settings, without retries.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster`` (its settings are copied).
        key: for a cluster, the key whose hash slot's master the connections go to.
        socket_timeout: bound of one round trip, seconds.
        connect_timeout: bound of opening a connection, seconds.
        client_name: ``CLIENT SETNAME`` of the connections (shows in ``CLIENT LIST``).
    """

    def __init__(
        self,
        client: Any,
        *,
        key: str,
        socket_timeout: float,
        connect_timeout: float,
        client_name: str,
    ) -> None:
        self._client = client
        self._key = key
        self._overrides: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            # Never retry or reconnect silently: a reconnected keeper is a new client
            # id, and the lease must not be renewed through it.
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
            "client_name": client_name,
            "socket_keepalive": True,
            # RESP2: channel messages arrive as plain replies on the listener, which
            # the keeper reads itself (RESP3 would hand them to push handlers).
            "protocol": 2,
            # Raw bytes, whatever the user's client decodes: a message on a channel is
            # anyone's bytes, and decoding one that is not UTF-8 would raise.
            "decode_responses": False,
        }
        self.where = describe(client)
        self._no_setname = False

    def _target(self) -> tuple[Any, dict[str, Any]]:
        client: Any = self._client
        if isinstance(self._client, RedisCluster):
            # Routes through the cluster client once so that its slot map is fresh (it
            # follows MOVED), then talks to the slot's master directly.
            client.exists(self._key)
            node = client.get_node_from_key(self._key)
            pool = node.redis_connection.connection_pool
            self.where = f"{node.host}:{node.port} (cluster)"
        else:
            pool = client.connection_pool
        kwargs = {**pool.connection_kwargs, **self._overrides}
        for name in list(kwargs):
            # Retries, and server push features that need RESP3, stay off the keeper.
            if name.startswith(("retry_on_", "maint_notifications", "oss_cluster_maint")):
                del kwargs[name]
        return pool.connection_class, kwargs

    def connect(self) -> Any:
        """Open one connection (AUTH, SELECT and SETNAME done); raise on failure."""
        cls, kwargs = self._target()
        if self._no_setname:
            kwargs.pop("client_name", None)
        conn: Any = cls(**kwargs)
        try:
            conn.connect()
        except redis.ResponseError as exc:
            # An ACL may forbid CLIENT SETNAME; the name only helps operators.
            if "setname" not in str(exc).lower() or self._no_setname:
                raise
            self._no_setname = True
            conn.disconnect()
            kwargs.pop("client_name", None)
            conn = cls(**kwargs)
            conn.connect()
        return conn
