"""A Redis URL naming a database the server does not have (past its `databases` setting, 16 by
default): a configuration error, whenever the server says so.

The server refuses the SELECT on every connection to such a database. Services ask as they
start (``check_redis_database``), before their model loads; one started while Redis did not
answer met the refusal only once Redis answered, took it for an outage, and retried for good
(never routed to, nor routing). So every client the registry makes watches its connections'
SELECT (``DatabaseWatch``), and a service that meets the refusal after its start stops as the
start-up check would have refused it (``DatabaseRefusal``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from urllib.parse import urlparse

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError
from redis.utils import str_if_bytes

from router.redis_bound import REDIS_TIMEOUT_S

logger = logging.getLogger(__name__)

# How the server answers the SELECT of a database past its `databases` setting.
_DB_OUT_OF_RANGE = "DB index is out of range"


class DatabaseMissing(ResponseError):
    """The server has no database of the URL's; the message names the URL and the server's
    count. A ResponseError, as the refusal it replaces: redis-py does not retry it, and the
    callers that took it for Redis failing still do."""


class DatabaseWatch:
    """A client's connect step (redis-py's ``redis_connect_func``: pass ``connect``): the
    usual handshake, with a SELECT refused for a database past the server's count raised as
    DatabaseMissing, and ``on_missing`` called with its message the first time."""

    def __init__(self, url: str, on_missing: Callable[[str], None] | None = None) -> None:
        self.url = url
        self.on_missing = on_missing
        self.missing: str | None = None  # the message, once the server refused the database

    async def connect(self, conn) -> None:
        # A method, not __call__: redis-py awaits only what iscoroutinefunction says is async.
        try:
            await conn.on_connect()
            return
        except ResponseError as e:
            if _DB_OUT_OF_RANGE not in str(e):
                raise
        message = _missing_message(self.url, conn.db, await _databases(conn))
        if self.missing is None:
            self.missing = message
            if self.on_missing is not None:
                self.on_missing(message)
        raise DatabaseMissing(message)


async def _databases(conn) -> int | None:
    """The server's `databases` setting, asked on the connection whose SELECT it refused (it
    stays on database 0); None if it does not say (CONFIG renamed away, or refused to this
    user)."""
    try:
        await conn.send_command("CONFIG", "GET", "databases")
        reply = await conn.read_response()
    except ResponseError:
        return None
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])
    for key, value in pairs:
        if str_if_bytes(key) == "databases":
            with contextlib.suppress(ValueError, TypeError):
                return int(value)
    return None


def _missing_message(url: str, db: int, count: int | None) -> str:
    has = (f"it has {count} (0 to {count - 1}: its `databases` setting)" if count
           else "past its `databases` setting")
    return f"redis_url {redacted(url)!r}: the Redis server has no database {db}: {has}"


async def check_redis_database(url: str) -> None:
    """ValueError if the server at ``url`` has no such database (past its `databases`
    setting): redis-py selects it on each connection, the server refuses it each time, and a
    worker or router retried registering for good. Asked as a service starts, before its
    model loads. A server that does not answer is no error here: services start without
    Redis, register once it answers, and meet the refusal then (``DatabaseRefusal``)."""
    client = aioredis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S,
                               redis_connect_func=DatabaseWatch(url).connect)
    try:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await client.ping()
    except DatabaseMissing as e:
        raise ValueError(str(e)) from None
    # Not answering: the services' retries wait. Another refusal is not this check's to
    # judge: the service's own calls report it.
    except (RedisError, OSError, TimeoutError):
        return
    finally:
        await client.aclose()


class DatabaseRefusal:
    """A service's answer to its registry's DatabaseWatch (``on_missing``): Redis, answering
    after the service started, refuses its database. One error logged, the service stopped
    (``stop_with``), and its exit that of the start-up check (``raise_if_refused``: the
    ValueError that `pdserve` reports as `pdserve: error: ...` with status 2) rather than
    retries for good. A supervisor that starts it again has its start-up check refuse it."""

    def __init__(self) -> None:
        self.message: str | None = None
        self._stop: Callable[[], None] | None = None

    def __call__(self, message: str) -> None:
        if self.message is not None:
            return
        self.message = message
        logger.error("%s; stopping: a configuration error, not an outage (Redis refuses that "
                     "database on every connection)", message)
        if self._stop is not None:
            self._stop()

    def stop_with(self, stop: Callable[[], None]) -> None:
        """How the service stops (its server's stop), now if the refusal came before."""
        self._stop = stop
        if self.message is not None:
            stop()

    def raise_if_refused(self) -> None:
        """After the service stopped: the refusal, as the start-up check raises it."""
        if self.message is not None:
            raise ValueError(self.message)


def redacted(url) -> object:
    """``url`` with any password as ***."""
    if not isinstance(url, str):
        return url
    try:
        parsed = urlparse(url)
        if parsed.password is None:
            return url
        netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
        return parsed._replace(netloc=netloc).geturl()
    except ValueError:
        return "<a URL that does not parse>"
