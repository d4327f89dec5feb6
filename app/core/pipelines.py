"""Pipelines of Redis commands for the api's per-request hot path (the key check, a snapshot
query's parts and answers), sent on plain connections and parsed by hiredis.

redis-py's asyncio client spends about 80 µs of Python per call and 170 µs per pipeline of
three commands on this machine, against about 25 µs for the same round trip on a bare
connection (`bench` profiles of snapshot queries: a third of the api's time per query was
redis-py). `RawPipelines` does only what those calls need: a pipeline of commands in, their
replies out, with redis-py's exceptions and the api client's retries (`app.core.redis.
async_client`). `ClientPipelines` runs the same pipelines through a redis-py client, for the
URLs the raw connections do not serve (a Redis Cluster, TLS, a Unix socket)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import random
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import hiredis
import redis.exceptions
from redis._parsers import BaseParser  # its error table: LOADING, OOM, NOSCRIPT...

from app.core.redis import is_cluster

Command = Sequence[Any]

CONNECT_TIMEOUT_S = 2.0
TIMEOUT_S = 10.0  # a reply's wait, past the block of a blocking command
ATTEMPTS = 3  # on a broken connection or a timeout, as the api's redis-py client
IDLE = 64  # connections kept between calls; more are opened while calls overlap
MAX_CONNECTIONS = 512  # open at once, as the api's redis-py pool; further calls wait


class Pipelines(Protocol):
    # whether a `Rider` set for the calling context goes with its next pipeline
    rides: bool

    async def execute(self, commands: Sequence[Command], block_s: float = 0.0,
                      raise_on_error: bool = True) -> list[Any]:
        """The replies of `commands`, sent as one pipeline. An error reply raises (the first,
        once every reply is read), or with `raise_on_error=False` is returned in its place as
        a `redis.exceptions.ResponseError`. `block_s`: how long a blocking command among
        them may block."""

    async def aclose(self) -> None: ...


class Batch:
    """Commands queued for one `Pipelines.execute`, queued as on a redis-py pipeline (so that
    `app.core.redis.run_script` queues a script's EVAL on it)."""

    def __init__(self) -> None:
        self.command_stack: list[Command] = []

    def __len__(self) -> int:
        return len(self.command_stack)

    def execute_command(self, *args: Any) -> None:
        self.command_stack.append(args)

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> None:
        self.execute_command("EVAL", script, numkeys, *keys_and_args)


@functools.cache
def script_sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


async def eval_script(pipelines: Pipelines, text: str, keys: Sequence[Any],
                     args: Sequence[Any]) -> Any:
    """A Lua script's reply: EVALSHA, and EVAL with its text if Redis does not have it (a new
    or restarted Redis), which caches it again."""
    [reply] = await pipelines.execute(
        [("EVALSHA", script_sha(text), len(keys), *keys, *args)], raise_on_error=False)
    if isinstance(reply, redis.exceptions.NoScriptError) or (
            isinstance(reply, redis.exceptions.ResponseError)
            and str(reply).startswith("NOSCRIPT")):
        [reply] = await pipelines.execute([("EVAL", text, len(keys), *keys, *args)])
    elif isinstance(reply, Exception):
        raise reply
    return reply


class Rider:
    """Commands that go with the next pipeline sent in the context that set them (`RIDER`),
    so that a check of a request that needs Redis costs no round trip of its own: the key
    check of a read-only request rides on its query's first round trip, which is sent before
    the key is confirmed (`app.api.deps.ride_key_check`). `replies` gives their replies (the
    pipeline's error if it failed), sending them itself if no pipeline took them."""

    def __init__(self, commands: Sequence[Command]) -> None:
        self.commands = list(commands)
        self.taken = False
        self._replies: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()

    @staticmethod
    def board() -> Rider | None:
        """The context's rider not yet taken, taken now (a pipelines' `execute`)."""
        rider = RIDER.get()
        if rider is None or rider.taken:
            return None
        rider.taken = True
        return rider

    def arrived(self, replies: list[Any]) -> None:
        if not self._replies.done():
            self._replies.set_result(replies)

    def failed(self, exc: BaseException) -> None:
        if not self._replies.done():
            self._replies.set_exception(
                exc if isinstance(exc, Exception) else ConnectionError("cancelled"))

    async def replies(self, pipelines: Pipelines) -> list[Any]:
        """The commands' replies (errors in their place), once the pipeline that took them
        is back; sent on `pipelines` now if none did."""
        if not self.taken:
            self.taken = True
            try:
                self.arrived(await pipelines.execute(self.commands, raise_on_error=False))
            except Exception as exc:
                self.failed(exc)
        return await self._replies


# The rider of the request being served (set around its endpoint; the tasks it starts copy it)
RIDER: contextvars.ContextVar[Rider | None] = contextvars.ContextVar("rider", default=None)


def raise_first(replies: list[Any]) -> list[Any]:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def pipelines_for(url: str, client: Any) -> Pipelines:
    """Raw connections where `url` is a plain TCP Redis, else `client`'s pipelines."""
    raw = RawPipelines.from_url(url)
    return raw if raw is not None else ClientPipelines(client)


class ClientPipelines:
    rides = False  # (a cluster's pipelines are split by node: a rider would be its own trip)

    def __init__(self, client: Any) -> None:
        self.client = client

    async def execute(self, commands: Sequence[Command], block_s: float = 0.0,
                      raise_on_error: bool = True) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=raise_on_error))

    async def aclose(self) -> None:
        pass  # the client is closed by its owner


def pack(commands: Sequence[Command]) -> bytes:
    """`commands` in RESP: each an array of bulk strings (str as UTF-8, numbers as their
    `repr`), packed by hiredis (a command of thousands of arguments, an HMGET of a read's
    records, costs a fraction of a loop in Python)."""
    try:
        return b"".join([hiredis.pack_command(c if isinstance(c, tuple) else tuple(c))
                         for c in commands])
    except TypeError:
        for command in commands:
            for arg in command:
                if not isinstance(arg, bytes | str | int | float) or isinstance(arg, bool):
                    raise redis.exceptions.DataError(
                        f"invalid argument of type {type(arg).__name__}: bytes, str, int or "
                        "float") from None
        raise


def _error(message: str) -> Exception:
    """The exception redis-py raises for an error reply of this message."""
    error: Exception = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
    return error


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.parser = hiredis.Reader(replyError=redis.exceptions.ResponseError)

    async def replies(self, n: int) -> list[Any]:
        """The next `n` replies; an error reply as redis-py's exception for it (LOADING is
        a BusyLoadingError, OOM an OutOfMemoryError, NOSCRIPT a NoScriptError...)."""
        out: list[Any] = []
        while len(out) < n:
            reply = self.parser.gets()
            if reply is False:
                data = await self.reader.read(65536)
                if not data:
                    raise redis.exceptions.ConnectionError("Redis closed the connection")
                self.parser.feed(data)
                continue
            if isinstance(reply, redis.exceptions.ResponseError):
                reply = _error(str(reply))
            out.append(reply)
        return out

    def close(self) -> None:
        self.writer.close()


async def _backoff(attempt: int) -> None:
    """As the api client's ExponentialWithJitterBackoff(base=0.02, cap=0.5)."""
    await asyncio.sleep(random.uniform(0, min(0.5, 0.02 * 2 ** attempt)))


class RawPipelines:
    """Pipelines on connections of our own to one Redis (TCP, no TLS): each call takes an idle
    connection (or opens one), writes its commands, reads their replies, and gives the
    connection back. A connection that breaks, times out or is cancelled mid-call is closed,
    never reused (its next reply would be this call's); the call is made again on a new one,
    up to ATTEMPTS times, as the api's redis-py client does (every write of the hot path is
    idempotent: see `app.core.redis.async_client`)."""

    rides = True

    def __init__(self, host: str, port: int, db: int = 0, username: str | None = None,
                 password: str | None = None) -> None:
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> RawPipelines | None:
        """For a `redis://host:port/db` URL (with a user and password if any); None for
        anything else (TLS, a Unix socket, a cluster, query options)."""
        parts = urlparse(url)
        if parts.scheme != "redis" or parts.query or is_cluster(url) or not parts.hostname:
            return None
        path = parts.path.strip("/")
        if path and not path.isdigit():
            return None
        return cls(parts.hostname, parts.port or 6379, int(path or 0),
                   unquote(parts.username) if parts.username else None,
                   unquote(parts.password) if parts.password else None)

    async def execute(self, commands: Sequence[Command], block_s: float = 0.0,
                      raise_on_error: bool = True) -> list[Any]:
        if not commands:
            return []
        rider = Rider.board()
        if rider is not None:
            commands = [*rider.commands, *commands]
        try:
            payload = pack(commands)
            async with self._slots:
                replies = await self._execute(payload, len(commands), block_s)
        except BaseException as exc:
            if rider is not None:
                rider.failed(exc)
            raise
        if rider is not None:
            rider.arrived(replies[:len(rider.commands)])
            replies = replies[len(rider.commands):]
        return raise_first(replies) if raise_on_error else replies

    async def _execute(self, payload: bytes, n: int, block_s: float) -> list[Any]:
        for attempt in range(ATTEMPTS + 1):
            conn = self._idle.pop() if self._idle else None
            try:
                if conn is None:
                    conn = await self._connect()
                conn.writer.write(payload)
                async with asyncio.timeout(TIMEOUT_S + block_s):
                    replies = await conn.replies(n)
            except (redis.exceptions.ConnectionError, OSError, TimeoutError) as exc:
                if conn is not None:
                    conn.close()
                if isinstance(exc, redis.exceptions.AuthenticationError):
                    raise  # refused, not broken: asking again changes nothing
                if attempt == ATTEMPTS:
                    if isinstance(exc, TimeoutError):
                        raise redis.exceptions.TimeoutError(
                            f"no reply from Redis at {self.host}:{self.port} within "
                            f"{TIMEOUT_S + block_s:g} s") from exc
                    raise redis.exceptions.ConnectionError(
                        f"Redis at {self.host}:{self.port}: {exc}") from exc
                await _backoff(attempt)
                continue
            except BaseException:
                if conn is not None:
                    conn.close()  # cancelled mid-call: its replies would be the next call's
                raise
            if len(self._idle) < IDLE and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()
            if attempt < ATTEMPTS and any(
                    isinstance(r, redis.exceptions.BusyLoadingError) for r in replies):
                # Redis is loading its data (just restarted): asked again shortly, as
                # redis-py's retries do (the connection is sound)
                await _backoff(attempt)
                continue
            return replies
        raise AssertionError("unreachable")

    async def _connect(self) -> _Connection:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = _Connection(reader, writer)
        hello: list[Command] = []
        if self.password is not None:
            hello.append(("AUTH", self.username, self.password) if self.username
                         else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
        if not hello:
            return conn
        try:  # (closed on any failure here: the caller never holds it)
            writer.write(pack(hello))
            async with asyncio.timeout(TIMEOUT_S):
                refused = [r for r in await conn.replies(len(hello)) if isinstance(r, Exception)]
        except BaseException:
            conn.close()
            raise
        if refused:
            conn.close()
            raise redis.exceptions.AuthenticationError(f"Redis refused the connection: "
                                                       f"{refused[0]}")
        return conn

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
